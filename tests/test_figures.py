"""The figures a user reads, held to counts made outside the code that logs them: tokens_seen
from the trace's samples looked up in the table, tok/s from the samples of each log interval
and the wall clock between two log lines as they reached this process, MFU from those and
the parameter count the run prints, data_wait from a stall of the loader this test makes
(its worker processes stopped for a while), on two ranks with --grad-accum 2; and the log
line, the metrics file and TensorBoard saying the same."""

import hashlib
import json
import os
import re
import signal
import statistics
import threading
import time

import lancedb
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common import load_tokenizer, synthetic_corpus
from conftest import kill_tree, process_tree, read_trace, start_train
from test_fault_tolerance import rank_pids

pytestmark = pytest.mark.slow  # trains in processes of its own: `-m "not slow"` leaves it out

STEPS, LOG_EVERY, SEQ_LEN = 15, 3, 64
PEAK_TFLOPS = 0.05  # --peak-tflops: a CPU has no datasheet peak, so the test gives one
STALL_AFTER, STALL_S = 6, 3.0  # rank 0's loader worker is stopped once step 6's line is in, for 3 s
LOG = re.compile(r"^epoch \d+ step (\d+)/\d+ \| loss ([\d.]+) \| ([\d,]+) tok/s \| mfu (\S+) .*"
                 r"\| data_wait ([\d.]+)% \|")
CLOCK_NOISE = 0.3  # a log line's print against its arrival here, over ~0.5 s, on a busy 2-core CI machine (17% seen)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-rank run, each line of its stdout stamped as it arrives."""
    root = tmp_path_factory.mktemp("figures")
    db = str(root / "db")
    synthetic_corpus(db, 4000, 10, 120, seed=5)  # some documents longer than SEQ_LEN: cut, all real
    proc = start_train(2, "--db", db, "--model", "tiny", "--seq-len", SEQ_LEN, "--batch-size", 4,
                       "--grad-accum", 2, "--num-splits", 4, "--steps", STEPS, "--log-every", LOG_EVERY,
                       "--ckpt-every", 1000, "--warmup-steps", 2, "--metrics-file", root / "metrics.jsonl",
                       "--tensorboard", root / "tb", "--trace-samples", root / "trace", "--ckpt-dir", root / "ck",
                       "--num-workers", 1, "--peak-tflops", PEAK_TFLOPS, cwd=root)
    lines, stall_line = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if (m := LOG.match(line)) and int(m[1]) == STALL_AFTER:
                stall_line.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stall_line.wait(timeout=240), "\n".join(line for _, line in lines)
        (rank0,) = [pid for pid in rank_pids(proc.pid)[0] if b"train.py" in open(f"/proc/{pid}/cmdline", "rb").read()]
        loader = process_tree(rank0)[1:]  # its forkserver, resource tracker and worker
        assert len(loader) >= 2, "no loader worker under rank 0"
        for pid in loader:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(STALL_S)
        for pid in loader:
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=300)
        reader.join(timeout=10)
        err = proc.stderr.read()
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, "\n".join(line for _, line in lines) + err
    return {"db": db, "root": root, "lines": lines}


def real_tokens_by_sample(db):
    """Each training row as the loader makes its sample (cut or padded to SEQ_LEN), named as
    the trace names it -> its real tokens."""
    pad = load_tokenizer("byte").pad_token_id
    table = lancedb.connect(db).open_table("corpus").to_arrow()
    found = {}
    for ids in table.column("input_ids").to_pylist():
        row = np.full(SEQ_LEN, pad, dtype="<i4")
        n = min(len(ids), SEQ_LEN)
        row[:n] = ids[:n]
        found[hashlib.blake2b(row.tobytes()).hexdigest()[:16]] = n
    return found


def steps_of(root):
    """step -> the samples all ranks trained on in it."""
    found = {}
    for records in read_trace(root / "trace").values():
        for r in records:
            found.setdefault(r["step"], []).extend(r["samples"])
    return found


def logged(run):
    """step -> (arrival time, tok/s, mfu text, data_wait) of its log line."""
    return {int(m[1]): (t, float(m[3].replace(",", "")), m[4], float(m[5]) / 100)
            for t, line in run["lines"] if (m := LOG.match(line))}


def test_tokens_seen_is_the_real_tokens_of_the_traced_samples(run):
    real = real_tokens_by_sample(run["db"])
    steps = steps_of(run["root"])
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(len(s) == 4 * 2 * 2 for s in steps.values())  # batch x accum x ranks
    cumulative = np.cumsum([sum(real[h] for h in steps[s]) for s in range(1, STEPS + 1)])
    records = [json.loads(line) for line in (run["root"] / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert sorted(train) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for step, r in train.items():
        assert r["tokens_seen"] == cumulative[step - 1], step
    final = next(line for _, line in run["lines"] if line.startswith("final:"))
    assert f"tokens_seen={cumulative[-1]:,}" in final
    assert cumulative[-1] < STEPS * 16 * SEQ_LEN  # the pads are not counted: short documents were padded


def test_tokens_per_s_is_the_samples_over_the_wall_clock(run):
    """Interval by interval (not the first: it holds the start of the loop): the positions
    of the traced samples of its steps, over the time between its log line and the one
    before as they reached this process."""
    steps, lines = steps_of(run["root"]), logged(run)
    marks = sorted(lines)
    checked = 0
    for before, step in zip(marks, marks[1:]):
        positions = sum(len(steps[s]) for s in range(before + 1, step + 1)) * SEQ_LEN
        outside = positions / (lines[step][0] - lines[before][0])
        assert abs(lines[step][1] / outside - 1) < CLOCK_NOISE, (step, lines[step][1], outside)
        checked += 1
    assert checked == STEPS // LOG_EVERY - 1


def test_the_log_line_the_metrics_file_and_tensorboard_agree(run):
    lines = logged(run)
    records = [json.loads(line) for line in (run["root"] / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    acc = EventAccumulator(str(run["root"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    board = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert sorted(lines) == sorted(train)
    for step, (_, tps, mfu, data_wait) in lines.items():
        r = train[step]
        assert round(r["tokens_per_s"]) == tps
        assert board["train/tokens_per_s"][step] == pytest.approx(r["tokens_per_s"], rel=1e-6)
        assert round(r["data_wait"], 3) == pytest.approx(data_wait, abs=5e-4) and 0 <= r["data_wait"] <= 1
        assert board["train/data_wait"][step] == pytest.approx(r["data_wait"], rel=1e-6)
        assert board["train/tokens_seen"][step] == pytest.approx(r["tokens_seen"], rel=1e-6)
        assert float(mfu.rstrip("%")) == pytest.approx(100 * r["mfu"], abs=0.051)
        assert board["train/mfu"][step] == pytest.approx(r["mfu"], rel=1e-6)


def flops_per_token(run):
    """6N + 12 x layers x width x seq_len (nanoGPT's count, the one the README states), N
    without the position table, all from the weights in the run's checkpoint; N is also the
    count the run prints."""
    import torch

    (path,) = (run["root"] / "ck").glob("step_????????.pt")
    weights = torch.load(path, map_location="cpu", weights_only=False)["model"]
    unique = {t.untyped_storage().data_ptr(): t.numel() for t in weights.values()}  # tied weights once
    params = sum(unique.values()) - weights["transformer.wpe.weight"].numel()
    printed = re.search(r"params=([\d,]+)", "\n".join(line for _, line in run["lines"]))[1]
    assert int(printed.replace(",", "")) == params
    layers = len({key.split(".")[2] for key in weights if key.startswith("transformer.h.")})
    width = weights["transformer.wte.weight"].shape[1]
    return 6 * params + 12 * layers * width * SEQ_LEN


def test_mfu_is_the_model_flops_at_the_outside_pace_over_the_given_peak(run):
    """Each interval's MFU: the flops per token times the outside tok/s, over two ranks'
    --peak-tflops; and exactly the logged tok/s's share of that peak."""
    steps, lines, per_token = steps_of(run["root"]), logged(run), flops_per_token(run)
    marks = sorted(lines)
    for before, step in zip(marks, marks[1:]):
        outside = sum(len(steps[s]) for s in range(before + 1, step + 1)) * SEQ_LEN / (lines[step][0] - lines[before][0])
        mfu = float(lines[step][2].rstrip("%")) / 100
        assert abs(mfu / (per_token * outside / (2 * PEAK_TFLOPS * 1e12)) - 1) < CLOCK_NOISE, (step, mfu, outside)
        assert mfu == pytest.approx(per_token * lines[step][1] / (2 * PEAK_TFLOPS * 1e12), abs=6e-4)


def test_data_wait_is_the_loader_stall_seen_from_outside(run):
    """The interval the stall fell in took `gap` s between its log lines where the others
    took `usual`: its data_wait share of that interval is the excess, to the clock's noise;
    every other interval waited less."""
    lines = logged(run)
    marks = sorted(lines)
    gaps = {step: lines[step][0] - lines[before][0] for before, step in zip(marks, marks[1:])}
    stalled = max(gaps, key=gaps.get)
    usual = statistics.median(g for s, g in gaps.items() if s != stalled)
    excess = gaps[stalled] - usual
    assert excess > 1.0, gaps  # the stall outlasted what was read ahead
    waited = lines[stalled][3] * gaps[stalled]
    assert abs(waited - excess) < CLOCK_NOISE * excess + usual, (stalled, lines[stalled][3], gaps)
    assert all(lines[s][3] < lines[stalled][3] for s in gaps if s != stalled), {s: lines[s][3] for s in lines}
