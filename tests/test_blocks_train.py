"""train.py --blocks-mode: every loader of the A/B harness feeds the one training loop, on one
rank and under torchrun, with blocks that are the builder's (checked by their hashes)."""

import collections
import functools
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import train
from blocks_loaders import MODE_FORMAT, read_manifest
from common import block_hashes
from conftest import BLOCKS_SEQ_LEN, read_trace, run_trains

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

MODES = MODE_FORMAT
STEPS = 6
TOPOLOGIES = [(mode, 1) for mode in MODES] + [(mode, 2) for mode in MODES if mode != "parquet-seq"]
FAST = ["--model", "tiny", "--seq-len", str(BLOCKS_SEQ_LEN), "--log-every", "2", "--warmup-steps", "2",
        "--steps", str(STEPS)]


@functools.lru_cache(maxsize=None)
def built_block_names(blocks_dir):
    """The hash name of every block the builder wrote, read from its Parquet files."""
    path = blocks_dir / "parquet-seq"
    names = []
    for f in read_manifest(str(path))["files"]:
        column = pq.read_table(path / f["path"]).column("input_ids").combine_chunks()
        names += block_hashes(column.flatten().to_numpy().reshape(len(column), -1))
    return collections.Counter(names)


def blocks_flags(blocks_dir, mode, nproc, tmp, name):
    """Global batch 8 on `nproc` ranks; checkpoints and sample traces under tmp, by run name."""
    return [*FAST, "--blocks-mode", mode, "--blocks-path", blocks_dir / MODES[mode],
            "--batch-size", 8 // nproc, "--num-splits", 8, "--ckpt-dir", tmp / f"ck-{name}",
            "--trace-samples", tmp / f"trace-{name}",
            "--num-workers", 0 if mode == "lance" else 1]  # lance: in-process, its threads suffice


@pytest.fixture(scope="module")
def blocks_runs(blocks_dir, tmp_path_factory):
    """Each mode for STEPS steps on 1 rank, and on 2 ranks (global batch 8) all but
    parquet-seq, whose rank split test_blocks_loaders covers; side by side."""
    tmp = tmp_path_factory.mktemp("blocks-train")
    jobs = {(mode, nproc): (nproc, blocks_flags(blocks_dir, mode, nproc, tmp, f"{mode}-{nproc}"))
            for mode, nproc in TOPOLOGIES}
    procs = {}
    for nproc in (1, 2):  # one world size at a time: eight runs at once overload two cores
        batch = {key: job for key, job in jobs.items() if key[1] == nproc}
        procs.update(zip(batch, run_trains(list(batch.values()), cwd=tmp, timeout=400)))
    return tmp, procs


@pytest.mark.parametrize("mode,nproc", TOPOLOGIES)
def test_every_blocks_mode_trains_on_the_built_blocks(blocks_runs, blocks_dir, mode, nproc):
    tmp, procs = blocks_runs
    proc = procs[mode, nproc]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith(f"[{mode}] final: opt_step={STEPS} tokens_seen={STEPS * 8 * BLOCKS_SEQ_LEN:,} ")
    logged = [line for line in lines if line.startswith(f"[{mode}] epoch 0 step ")]
    assert len(logged) == STEPS // 2 and all("| loss " in line for line in logged)
    assert ("| q " in logged[0]) == (mode == "lance")  # lancedb's queue stats, where there are some

    traces = read_trace(tmp / f"trace-{mode}-{nproc}")
    assert sorted(traces) == list(range(nproc))
    names = collections.Counter(h for records in traces.values() for r in records for h in r["samples"])
    assert sum(names.values()) == STEPS * 8
    assert max(names.values()) == 1  # no block twice within the epoch, across ranks too
    assert set(names) <= set(built_block_names(blocks_dir))


def test_lance_blocks_steps_are_the_same_on_any_world_size(blocks_runs):
    """The lance blocks table goes through lancedb's StreamingDataset: each global step
    trains on the same blocks on one rank as on two."""
    tmp, procs = blocks_runs
    for nproc in (1, 2):  # two failed runs would compare two empty traces
        proc = procs["lance", nproc]
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def per_step(name):
        steps = collections.defaultdict(collections.Counter)
        for records in read_trace(tmp / name).values():
            for r in records:
                steps[r["step"]].update(r["samples"])
        return dict(steps)

    one_rank = per_step("trace-lance-1")
    assert sorted(one_rank) == list(range(1, STEPS + 1))
    assert all(sum(blocks.values()) == 8 for blocks in one_rank.values())
    assert per_step("trace-lance-2") == one_rank


def test_lance_blocks_resume_exactly(blocks_dir, tmp_path, capsys):
    """Half the steps, --resume auto, the rest: the same blocks in the same steps as straight."""
    def run(name, *extra):
        train.main([*map(str, blocks_flags(blocks_dir, "lance", 1, tmp_path, name)), *map(str, extra)])
        return capsys.readouterr().out

    assert f"[lance] final: opt_step={STEPS} " in run("straight")
    run("cut", "--steps", STEPS // 2)
    out = run("cut", "--resume", "auto")
    assert f"opt step {STEPS // 2})" in out and f"[lance] final: opt_step={STEPS} " in out
    straight, cut = read_trace(tmp_path / "trace-straight")[0], read_trace(tmp_path / "trace-cut")[0]
    assert [r["step"] for r in straight] == [r["step"] for r in cut] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in cut] == [r["samples"] for r in straight]


def run_main(args, capsys):
    """train.main in-process, without loader workers (with them it leaves by os._exit)."""
    with pytest.raises(SystemExit) as exit_info:
        train.main([*map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("flags,fragment", [
    (["--blocks-mode", "lance"], "needs --blocks-path"),
    (["--blocks-mode", "lance", "--blocks-path", "{blocks}/lance", "--pack"], "pass one of them"),
    (["--blocks-mode", "mosaic", "--blocks-path", "{blocks}/mds", "--resume", "auto"], "cannot --resume"),
    (["--blocks-mode", "parquet-seq", "--blocks-path", "{blocks}/lance"], "holds 'lance' blocks"),
    (["--blocks-mode", "lance", "--blocks-path", "{blocks}/nowhere"], "no blocks at"),
    (["--blocks-mode", "parquet-random", "--blocks-path", "{blocks}/parquet-random", "--seq-len", "32"],
     f"pass --seq-len {BLOCKS_SEQ_LEN}"),
])
def test_blocks_mode_mistakes_are_one_line_errors(blocks_dir, tmp_path, capsys, flags, fragment):
    line = run_main([*FAST, *(f.format(blocks=blocks_dir) for f in flags),
                     "--ckpt-dir", tmp_path / "ck"], capsys)
    assert line.startswith("error: ") and fragment in line, line
    assert not (tmp_path / "ck").exists()


def test_blocks_of_another_tokenizer_are_refused(blocks_dir, tmp_path, capsys):
    copy = tmp_path / "parquet-seq"
    shutil.copytree(blocks_dir / "parquet-seq", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(tokenizer="hf:gpt2", vocab_size=50258, eos_id=50256, pad_id=50257)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    line = run_main([*FAST, "--blocks-mode", "parquet-seq", "--blocks-path", copy], capsys)
    assert "tokenized with 'hf:gpt2'" in line and "pass --tokenizer hf:gpt2" in line, line


def test_blocks_to_samples_respects_slices():
    """The lance transform must honour a sliced batch's offset (arrow's .values would not)."""
    import pyarrow as pa

    from blocks_loaders import blocks_to_samples

    blocks = np.arange(5 * 4, dtype=np.int32).reshape(5, 4)
    column = pa.FixedSizeListArray.from_arrays(pa.array(blocks.reshape(-1)), 4)
    batch = pa.record_batch([column], names=["input_ids"]).slice(2, 2)
    samples = blocks_to_samples(batch, seq_len=4)
    assert [s["input_ids"].tolist() for s in samples] == blocks[2:4].tolist()
    assert samples[0]["input_ids"].dtype == torch.int64
