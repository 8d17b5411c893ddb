"""train.py end to end on real LanceDB tables: smoke run, packing, exact resume, errors."""

import argparse
import dataclasses
import json
import re

import lancedb
import pyarrow as pa
import pytest
import torch

import data
import train
from common import LEGACY_SCHEMA, TRAIN_FILTER, load_tokenizer
from conftest import assert_user_error, run_script, state_equal
from model import make_model

LOSS = re.compile(r"^epoch \d+ step \d+/\d+ \| loss ([0-9.]+) \|", re.M)
FAST = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--log-every", "2",
        "--warmup-steps", "3", "--lr-total-steps", "8", "--eval-batches", "1"]


def test_readme_smoke_run_builds_demo_and_learns(smoke_run):
    proc, cwd = smoke_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "building the demo corpus" in out
    assert (cwd / "data" / "lancedb").is_dir()
    losses = [float(x) for x in LOSS.findall(out)]
    assert len(losses) == 4  # --log-every 10 over 40 steps
    assert losses[-1] < losses[0]
    final = out.strip().splitlines()[-1]
    assert final.startswith("final: opt_step=40 ")
    assert re.search(r"val_loss=\d+\.\d{4}$", final), final
    assert "mfu n/a" in out  # the CPU has no peak-FLOPs figure: no made-up percentage
    assert (cwd / "checkpoints" / "step_00000040.pt").is_file()


# The reference's log line, field for field (../shared/seed/train.py); new fields may only follow it.
REFERENCE_LINE = re.compile(r"^epoch \d+ step \d+/\d+ \| loss \d+\.\d{4} \| [\d,]+ tok/s \| mfu (n/a|\d+\.\d%) "
                            r"\| q \d+/\d+/\d+/\d+ \| fetch \d+\.\ds tx \d+\.\ds(?P<rest>.*)$")


def test_log_line_starts_with_the_reference_fields_in_order(smoke_run):
    proc, _ = smoke_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 4, proc.stdout
    for line in lines:
        found = REFERENCE_LINE.match(line)
        assert found, line
        assert re.fullmatch(r" budget \d+\.\ds \| data_wait \d+\.\d% \| loader \d+\.\dms", found["rest"]), line  # no mem on the CPU


def test_log_line_puts_new_fields_after_the_reference_ones():
    stats = dict(unscanned_rows=1, raw_queue_depth=2, prefetch_queue_depth=3, consumed_rows=4,
                 fetch_s=1.25, transform_s=0.5, budget_wait_s=150.25)
    line = train.log_line("", 2, 30, 100, 3.14159, 12345.6, 0.4321, 0.05, 0.125, 7.25, stats)
    assert line == ("epoch 2 step 30/100 | loss 3.1416 | 12,346 tok/s | mfu 43.2% | q 1/2/3/4 | "
                    "fetch 1.2s tx 0.5s budget 150.2s | data_wait 5.0% | loader 0.1ms | mem 7.2 GiB")
    baseline = train.log_line("[mosaic] ", 0, 5, 9, 1.0, 10.0, None, 0.5, 2.0, None, None)  # no lance counters
    assert baseline == "[mosaic] epoch 0 step 5/9 | loss 1.0000 | 10 tok/s | mfu n/a | data_wait 50.0% | loader 2.0ms"


def test_compiled_run_does_not_recompile_for_checkpoints_or_evals(demo_db, tmp_path):
    """--compile (inductor's C++ kernels on the CPU): the checkpoint's no-grad probe and the
    evals run on the uncompiled module, so after the first step nothing compiles again and
    the next log interval's tok/s holds training only. (Before, each triggered a full
    recompile: "GLOBAL_STATE changed: grad_mode".)"""
    proc = run_script("train.py", "--db", demo_db, *FAST, "--compile", "--steps", "6", "--ckpt-every", "2",
                      "--eval-every", "3", "--ckpt-dir", tmp_path / "ck", cwd=tmp_path,
                      env={"TORCH_LOGS": "recompiles"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("saved ") == 3 and proc.stdout.count("val loss @ step") == 2, proc.stdout
    assert "not in tok/s" in proc.stdout
    assert not [line for line in proc.stderr.splitlines() if "Recompiling" in line], proc.stderr


def test_missing_non_default_db_is_an_error(tmp_path):
    proc = run_script("train.py", "--db", tmp_path / "nowhere", "--steps", "2", cwd=tmp_path)
    assert_user_error(proc, "no LanceDB database")
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "checkpoints").exists()


def test_pack_trains(demo_db, tmp_path):
    proc = run_script("train.py", "--db", demo_db, "--pack", *FAST, "--steps", "6",
                      "--ckpt-dir", tmp_path / "ck", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "blocks_per_epoch: " in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("final: opt_step=6 ")


def loader_args(db, **overrides):
    args = train.parse_args(["--db", db])
    return argparse.Namespace(**{**vars(args), **overrides})


def test_pad_positions_contribute_nothing_to_the_loss(tmp_path):
    """Packed blocks padded by the loader: the loss equals the loss of the real prefixes alone."""
    tok = load_tokenizer("byte")
    docs = ["short doc one.", "a second, slightly longer document.", "three", "four is here"]
    ids = tok.encode(docs)
    table = pa.table({
        "id": pa.array(range(len(docs)), pa.int64()), "text": docs,
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "n_tokens": pa.array([len(x) for x in ids], pa.int32()),
        "score": pa.array([2.0] * len(docs), pa.float32()),
        "is_dup": [False] * len(docs), "split": ["train"] * len(docs)}, schema=LEGACY_SCHEMA)
    tbl = lancedb.connect(str(tmp_path)).create_table("corpus", table)
    # 2 splits of 2 docs each, 3 blocks per split of 32 tokens: the splits run dry -> pads
    args = loader_args(str(tmp_path), seq_len=32, min_score=1.0, pack=True)
    ds = data.make_dataset(args, tbl, 0, 1, epoch=0, shuffle=True, num_splits=2,
                            **data.corpus_source(args, tok, TRAIN_FILTER, packed=True, blocks_per_epoch=6))
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=6)))
    input_ids = batch["input_ids"]
    is_pad = input_ids == tok.pad_token_id
    assert is_pad.any() and (~is_pad).any()

    torch.manual_seed(0)
    model = make_model("tiny", tok.vocab_size, 32)
    loss, real = train.batch_loss(model, batch, torch.device("cpu"), tok)
    assert real == (~is_pad).sum()

    total, count = 0.0, 0
    for row, pad in zip(input_ids, is_pad):
        n = int((~pad).sum())
        assert not pad[:n].any()  # the loader pads only at the end of a block
        if n < 2:
            continue
        prefix = row[:n].unsqueeze(0)
        logits = model.logits(prefix)[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, prefix[0, 1:], reduction="sum")
        count += n - 1
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)

    changed = input_ids.masked_fill(is_pad, 7)  # whatever sits at a pad position is ignored
    loss_changed, _ = train.batch_loss(model, {"input_ids": changed, "doc_ids": batch["doc_ids"]},
                                       torch.device("cpu"), dataclasses.replace(tok, pad_token_id=7))
    torch.testing.assert_close(loss_changed, loss, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["row", "pack"])
def test_exact_resume_matches_uninterrupted_run(demo_db, tmp_path, capsys, path):
    extra = ["--pack"] if path == "pack" else []
    common = ["--db", demo_db, *FAST, *extra, "--grad-accum", "2"]

    def run(ckpt_dir, *args):  # in-process: the interpreter start-up is most of a short run
        train.main([*map(str, common), "--ckpt-dir", str(ckpt_dir), *args])
        return capsys.readouterr().out

    run(tmp_path / "straight", "--steps", "8")
    tiny = ["--loader-buffer-mb", "0.01"]  # a read-ahead budget that binds: it changes nothing
    run(tmp_path / "split", "--steps", "4", "--ckpt-every", "4", *tiny)
    out = run(tmp_path / "split", "--steps", "8", "--resume", "auto", *tiny)
    assert "resumed from" in out and "(epoch 0, opt step 4)" in out

    straight = torch.load(tmp_path / "straight" / "step_00000008.pt", weights_only=True)
    resumed = torch.load(tmp_path / "split" / "step_00000008.pt", weights_only=True)
    assert state_equal(straight["model"], resumed["model"])
    assert state_equal(straight["optimizer"], resumed["optimizer"])
    assert straight["dataset"] == resumed["dataset"]
    assert straight["tokens_seen"] == resumed["tokens_seen"]
    # and the interrupted run really did diverge in time: it committed step 4 first
    assert (tmp_path / "split" / "step_00000004.pt").is_file()


def test_resume_auto_skips_an_unreadable_newest_checkpoint(demo_db, tmp_path):
    ck = tmp_path / "ck"
    proc = run_script("train.py", "--db", demo_db, *FAST, "--steps", "4", "--ckpt-every", "2",
                      "--ckpt-dir", ck, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (ck / "step_00000004.pt").write_bytes((ck / "step_00000004.pt").read_bytes()[:1000])
    proc = run_script("train.py", "--db", demo_db, *FAST, "--steps", "6", "--ckpt-dir", ck,
                      "--resume", "auto", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipping checkpoint" in proc.stderr and "step_00000004.pt" in proc.stderr
    assert "(epoch 0, opt step 2)" in proc.stdout


def test_resume_with_changed_settings_is_refused(demo_db, tmp_path):
    ck = tmp_path / "ck"
    proc = run_script("train.py", "--db", demo_db, *FAST, "--steps", "2", "--ckpt-dir", ck,
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before = sorted(p.name for p in ck.iterdir())
    proc = run_script("train.py", "--db", demo_db, *FAST, "--steps", "4", "--ckpt-dir", ck,
                      "--resume", "auto", "--shuffle-seed", "7", cwd=tmp_path)
    assert_user_error(proc, "shuffle_seed=42")
    assert sorted(p.name for p in ck.iterdir()) == before


def test_empty_validation_split_is_reported_not_zero(tmp_path):
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(
        f'{{"text": "Document number {i} is an ordinary sentence about the weather in a town. '
        f'It rained on day {i}, and people stayed inside reading books."}}\n' for i in range(40)))
    proc = run_script("prepare_data.py", text, "--db", tmp_path / "db", "--table", "corpus",
                      "--tokenizer", "byte", "--val-fraction", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = run_script("train.py", "--db", tmp_path / "db", *FAST, "--steps", "2",
                      "--ckpt-dir", tmp_path / "ck", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    final = proc.stdout.strip().splitlines()[-1]
    assert "val_loss=n/a (empty validation split)" in final
    assert "0.0000" not in final


@pytest.mark.parametrize("flags,fragment", [
    (["--batch-size", "3", "--num-splits", "2"], "must be a multiple of num_splits"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--tokenizer", "nope"], "unknown tokenizer"),
    (["--resume", "missing.pt"], "does not exist"),
    (["--ckpt-dir", "s3://bucket/ck"], "not to object storage"),
    (["--stop-signals", "SIGTERM,SIGFOO"], "unknown signal 'SIGFOO'"),
    (["--stop-signals", "SIGKILL"], "cannot be caught"),
])
def test_bad_flags_are_one_line_errors(demo_db, tmp_path, flags, fragment):
    proc = run_script("train.py", "--db", demo_db, "--steps", "2", "--ckpt-dir", tmp_path / "ck",
                      *flags, cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert not (tmp_path / "ck").exists()


def test_keep_last_prunes_old_checkpoints_and_torn_files(demo_db, tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step_00000001.pt.tmp4242").write_bytes(b"left by a killed run")
    train.main(["--db", demo_db, *FAST, "--steps", "5", "--ckpt-every", "1", "--keep-last", "2",
                "--ckpt-dir", str(ck)])
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000004.pt", "step_00000005.pt"]
    assert "saved" in capsys.readouterr().out


def test_trace_samples_names_every_sample_of_every_step(demo_db, tmp_path, capsys):
    train.main(["--db", demo_db, *FAST, "--steps", "3", "--grad-accum", "2",
                "--ckpt-dir", str(tmp_path / "ck"), "--trace-samples", str(tmp_path / "trace")])
    lines = [json.loads(x) for x in (tmp_path / "trace" / "rank0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["rank"] == 0 and x["epoch"] == 0 for x in lines)
    assert all(len(x["samples"]) == 4 * 2 for x in lines)  # batch size x grad accum
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for x in lines for h in x["samples"])
    assert len({h for x in lines for h in x["samples"]}) == 24  # distinct documents
    capsys.readouterr()


def test_resume_may_trade_batch_size_for_grad_accum(demo_db, tmp_path, capsys):
    """Same samples per optimizer step (4 x 2 = 8 x 1): accepted, and every step sees the same samples."""
    base = ["--db", demo_db, *FAST, "--num-splits", "4"]

    def run(name, steps, batch, accum, *extra):
        train.main([*base, "--batch-size", batch, "--grad-accum", accum, "--steps", steps,
                    "--ckpt-dir", str(tmp_path / f"ck-{name}"), "--ckpt-every", "2",
                    "--trace-samples", str(tmp_path / f"trace-{name}"), *extra])
        return capsys.readouterr().out

    run("straight", "4", "4", "2")
    run("traded", "2", "4", "2")
    assert "(epoch 0, opt step 2)" in run("traded", "4", "8", "1", "--resume", "auto")

    def per_step(name):
        lines = (tmp_path / f"trace-{name}" / "rank0.jsonl").read_text().splitlines()
        return {x["step"]: sorted(x["samples"]) for x in map(json.loads, lines)}

    straight = per_step("straight")
    assert sorted(straight) == [1, 2, 3, 4] and all(len(samples) == 8 for samples in straight.values())
    assert per_step("traded") == straight


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H20", 148e12),
    ("NVIDIA H800 PCIe", 756e12), ("NVIDIA B200", 2250e12), ("AMD Instinct MI300X", 1307e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA A10", 125e12),
    ("NVIDIA A10G", None), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("Tesla T4", None),
    ("Tesla V100-SXM2-16GB", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_come_from_the_device_table_or_nowhere(name, peak):
    assert train.peak_bf16_flops(name) == peak


def test_mfu_is_not_applicable_on_the_cpu_unless_a_peak_is_given():
    assert train.peak_flops(torch.device("cpu")) == (None, "n/a on cpu")
    assert train.peak_flops(torch.device("cpu"), 0.05) == (0.05e12, "0.05 TFLOPS peak per device (--peak-tflops)")


def test_metrics_file_has_a_record_per_log_step_and_plots(demo_db, tmp_path, capsys):
    import plot_metrics

    metrics, ck = tmp_path / "runs" / "metrics.jsonl", str(tmp_path / "ck")
    run = ["--db", demo_db, *FAST, "--eval-every", "3", "--ckpt-dir", ck, "--metrics-file", str(metrics)]
    train.main([*run, "--steps", "6"])
    train.main([*run, "--steps", "8", "--resume", "auto"])  # appends to the same file
    assert "metrics: " in capsys.readouterr().out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    assert [s["resumed_from_step"] for s in starts] == [0, 6] and records[0]["kind"] == "start"
    assert starts[0]["tokens_per_step"] == 4 * 64 and starts[0]["model"] == "tiny"
    logged = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [2, 4, 6, 8]  # --log-every 2
    for r in logged:
        assert r["mfu"] is None and r["loss"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0
        assert set(r["loader"]) >= {"consumed_rows", "fetch_s", "transform_s", "budget_wait_s"}
        assert 0 <= r["loader"]["thread_ms_per_step"] < 1000
    seen = [r["tokens_seen"] for r in logged]
    assert seen == sorted(seen) and seen[0] > 0
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6, 8]  # --eval-every 3 and the ends of both runs
    assert all(isinstance(r["val_loss"], float) for r in evals)

    png = tmp_path / "runs" / "loss.png"
    plot_metrics.main([str(metrics), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_doc_mask_reaches_the_model_and_is_pinned(demo_db, tmp_path, capsys):
    """--doc-mask changes what the model computes on packed blocks (their documents no
    longer see each other), is recorded in the checkpoint, and a resume may not drop it."""
    def run(name, *flags):
        ck = tmp_path / name
        train.main(["--db", demo_db, *FAST, "--pack", "--steps", "2", "--ckpt-dir", str(ck), *flags])
        return [float(x) for x in LOSS.findall(capsys.readouterr().out)], ck

    masked, ck = run("masked", "--doc-mask")
    plain, _ = run("plain")
    assert len(masked) == len(plain) == 1 and masked != plain  # same blocks, other attention
    assert torch.load(ck / "step_00000002.pt", weights_only=True)["config"]["doc_mask"] is True
    with pytest.raises(SystemExit):
        train.main(["--db", demo_db, *FAST, "--pack", "--steps", "4", "--ckpt-dir", str(ck),
                    "--resume", "auto"])
    assert "doc_mask=True" in capsys.readouterr().err
