"""Resume in any epoch: a run cut inside epoch 1 or 2 goes on with the samples and, on one
rank, the exact bits of a straight run, on the row and the packed paths, with the same or
another number of ranks (real torchrun, gloo). The table is small enough that the runs pass
several epochs, and each epoch's order differs from the one before: a resume that rebuilt
the dataset with another epoch's order would train on other samples.
"""

import collections
import shutil

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import torch

from common import LEGACY_SCHEMA
from conftest import docs_table, read_trace, run_trains, state_equal

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

TRAIN_DOCS, GLOBAL_BATCH = 24, 4
# Steps per epoch: the row path takes every training document once (24 / 4); the packed
# path a budget of 32 blocks per epoch (--blocks-per-epoch) out of the ~37 the table packs into.
STEPS_PER_EPOCH = {"row": TRAIN_DOCS // GLOBAL_BATCH, "pack": 32 // GLOBAL_BATCH}
COMMON = ["--model", "tiny", "--seq-len", 64, "--epochs", 10, "--log-every", 4, "--eval-batches", 1,
          "--warmup-steps", 2]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """24 training documents of 20-180 random byte ids (some longer than a row or a block)
    and 4 validation ones."""
    rng = np.random.default_rng(3)
    n = TRAIN_DOCS + 4
    docs = [rng.integers(0, 256, rng.integers(20, 180)).tolist() for _ in range(n)]
    table = pa.table({
        "id": pa.array(range(n), pa.int64()), "text": [""] * n,
        "input_ids": pa.array(docs, pa.list_(pa.int32())), "n_tokens": pa.array(map(len, docs), pa.int32()),
        "score": pa.array([2.0] * n, pa.float32()), "is_dup": [False] * n,
        "split": ["train"] * TRAIN_DOCS + ["val"] * 4}, schema=LEGACY_SCHEMA)
    path = tmp_path_factory.mktemp("epochs") / "db"
    lancedb.connect(str(path)).create_table("corpus", table)
    return str(path)


def by_step(trace_dir):
    """step -> (epoch, Counter of the samples all ranks trained on); each step once per rank."""
    steps = {}
    for rank, records in read_trace(trace_dir).items():
        seen = [r["step"] for r in records]
        assert len(seen) == len(set(seen)), f"rank {rank} traced a step twice: {seen}"
        for r in records:
            epoch, counts = steps.setdefault(r["step"], (r["epoch"], collections.Counter()))
            assert r["epoch"] == epoch and r["samples"], r
            counts.update(r["samples"])
    return steps


def ok(proc):
    assert proc.returncode == 0, f"$ {' '.join(proc.args)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("path", ["row", "pack"])
def test_resume_inside_a_later_epoch(db, tmp_path, path):
    spe = STEPS_PER_EPOCH[path]
    elastic_cut, exact_cut, end = spe + spe // 2, 2 * spe + spe // 2, 3 * spe + spe // 2  # epochs 1, 2, 3

    def flags(name, ranks, *extra):
        return ["--db", db, *COMMON, "--batch-size", GLOBAL_BATCH // ranks, "--lr-total-steps", end,
                "--ckpt-dir", tmp_path / f"ck-{name}", "--trace-samples", tmp_path / f"trace-{name}",
                *(["--pack", "--blocks-per-epoch", 32] if path == "pack" else []), *map(str, extra)]

    def ckpt(name, step):
        return tmp_path / f"ck-{name}" / f"step_{step:08d}.pt"

    # straight: 1 rank to the end; one: 1 rank to the exact cut, saving at the elastic cut
    # on the way; two: 2 ranks to the elastic cut
    ok_all = [ok(p) for p in run_trains([
        (1, flags("straight", 1, "--steps", end)),
        (1, flags("one", 1, "--steps", exact_cut, "--ckpt-every", spe // 2)),
        (2, flags("two", 2, "--steps", elastic_cut)),
    ], cwd=tmp_path)]
    assert all(f"final: opt_step={s} " in out for out, s in zip(ok_all, (end, exact_cut, elastic_cut)))
    (tmp_path / "ck-one-to-two").mkdir()
    for f in ckpt("one", elastic_cut).parent.glob(f"step_{elastic_cut:08d}*.pt"):
        shutil.copy(f, tmp_path / "ck-one-to-two")

    exact, one_to_two, two_to_one = (ok(p) for p in run_trains([
        (1, flags("one", 1, "--steps", end, "--resume", "auto")),
        (2, flags("one-to-two", 2, "--steps", end, "--resume", "auto")),
        (1, flags("two", 1, "--steps", end, "--resume", "auto")),
    ], cwd=tmp_path))
    assert f"(epoch 2, opt step {exact_cut})" in exact
    assert f"(epoch 1, opt step {elastic_cut})" in one_to_two and f"(epoch 1, opt step {elastic_cut})" in two_to_one

    straight = by_step(tmp_path / "trace-straight")
    assert sorted(straight) == list(range(1, end + 1))
    assert [straight[s][0] for s in straight] == [(s - 1) // spe for s in straight]  # the epochs as planned
    # the cuts fall inside an epoch, not at its edge
    for cut in (elastic_cut, exact_cut):
        assert straight[cut][0] == straight[cut + 1][0] == straight[cut - 1][0] >= 1

    # each epoch's order differs from the previous one's (the row path: the same documents)
    epochs = [[straight[s][1] for s in range(e * spe + 1, (e + 1) * spe + 1)] for e in range(3)]
    for before, after in zip(epochs, epochs[1:]):
        assert before != after
        if path == "row":
            assert sum(before, collections.Counter()) == sum(after, collections.Counter())

    # per step, the same samples: resumed on 1 rank (exact), 1 -> 2 ranks, 2 -> 1 rank
    for name, first in (("one", 1), ("one-to-two", elastic_cut + 1), ("two", 1)):
        traced = by_step(tmp_path / f"trace-{name}")
        assert sorted(traced) == list(range(first, end + 1)), name
        assert {s: traced[s] for s in traced} == {s: straight[s] for s in traced}, name

    # and on 1 rank the resumed run is the straight run, bit for bit
    a, b = (torch.load(ckpt(name, end), weights_only=True) for name in ("straight", "one"))
    for key in ("model", "optimizer", "dataset", "tokens_seen", "epoch"):
        assert state_equal(a[key], b[key]), key


@pytest.mark.parametrize("path", ["row", "pack"])
def test_a_global_batch_size_step_holds_the_same_samples_on_any_world_size_across_epochs(tmp_path, path):
    """--global-batch-size 8 --batch-size 4 on 1 rank (2 micro-steps a step) and on 2 ranks (1
    each): 28 documents make 7 loader cycles of 4 splits an epoch, so a
    2-rank micro-step (2 cycles) would end each epoch in a partial one and the steps after
    it would differ from 1 rank's. Epochs end on a whole step instead (3 of 2 cycles, the 7th
    cycle left out), and every step holds the same samples on both. --grad-accum, which
    keeps the reference's accumulation across epochs, shows the difference."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 256, 63).tolist() for _ in range(28)]  # with EOS one 64-token block each
    db = docs_table(tmp_path / "db", docs)
    common = ["--db", db, "--model", "tiny", "--seq-len", 64, "--epochs", 3, "--log-every", 100,
              "--eval-batches", 1, "--warmup-steps", 2, "--num-splits", 4, "--batch-size", 4, "--lr-total-steps", 9,
              *(["--pack"] if path == "pack" else [])]

    def run(name, ranks, *extra):
        return ranks, [*common, "--ckpt-dir", tmp_path / f"ck-{name}", "--trace-samples", tmp_path / f"trace-{name}",
                       *map(str, extra)]

    accum = [run("one-accum", 1, "--grad-accum", 2), run("two-accum", 2)] if path == "row" else []
    outs = [ok(p) for p in run_trains([run("one", 1, "--global-batch-size", 8), run("two", 2, "--global-batch-size", 8),
                                       *accum], cwd=tmp_path)]
    one, two = by_step(tmp_path / "trace-one"), by_step(tmp_path / "trace-two")
    epochs = 3
    steps_per_epoch = len(one) // epochs
    assert steps_per_epoch >= 2 and len(one) == epochs * steps_per_epoch
    assert [one[s][0] for s in sorted(one)] == [(s - 1) // steps_per_epoch for s in sorted(one)]
    assert one == two and all(sum(c.values()) == 8 for _, c in one.values())
    assert f"final: opt_step={epochs * steps_per_epoch} " in outs[0] and "grad_accum=2 (--global-batch-size 8 / 4)" in outs[0]
    assert "grad_accum=1 (--global-batch-size 8 / 8)" in outs[1]
    if path == "pack":  # 28 blocks (7 cycles) pack from the table, 24 make whole steps
        assert "blocks_per_epoch: 24" in outs[0] and steps_per_epoch == 3
        return
    # the reference's accumulation across epochs: the same first epoch, then other steps
    one_accum, two_accum = by_step(tmp_path / "trace-one-accum"), by_step(tmp_path / "trace-two-accum")
    assert {s: one_accum[s] for s in range(1, steps_per_epoch + 1)} == {s: one[s] for s in range(1, steps_per_epoch + 1)}
    assert one_accum != two_accum
