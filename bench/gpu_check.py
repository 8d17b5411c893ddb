"""GPU check: the CUDA-only paths verified, then train.py's throughput, in one command.

Usage:
    python bench/gpu_check.py [--steps 300] [--batch-size 16] [--seq-len 1024] [--model small]
        [--db DIR] [--workdir DIR] [--out FILE.json] [--dry-run] [-- TRAIN.PY FLAGS...]

First the correctness section: `pytest tests/test_cuda.py` (FlexAttention's loss and
gradients against the SDPA mask and each document alone, under bf16, eager and compiled;
fused AdamW; a compiled run that learns without recompiling; bit-exact resume with
--deterministic). Its log and measured lines land in --workdir and the JSON; a failure
fails the check (exit 1) after the throughput runs.

Then it builds the demo corpus into --workdir if it is not there yet (once, reused by
every run) and runs `train.py --model small --compile --pack` (bf16 autocast on CUDA)
for --steps optimizer steps in each variant: plain, with --doc-mask (FlexAttention),
and, on one GPU only, with --deterministic (what bit-exact resume costs). Each runs on
one GPU and, where there are more, on all local GPUs under torchrun. Flags after `--`
go to every train.py run as they are (`-- --num-workers 2`, `-- --table web --tokenizer
hf:gpt2` with --db). Each run's log and metrics file stay in --workdir; its checkpoint
is deleted once read. Meant to take about 10 minutes on one H100/H200 node (compiling
the model once per run is most of it).

Figures come from the runs' --metrics-file train records (one per --log-every steps,
rank 0): the median over all records but the first two, whose intervals hold the
loader's start-up and torch.compile. Per run:

- tok/s: positions per second over all GPUs (pads included: with --pack nearly none);
  tok/s/gpu divides it by the GPU count, and scaling compares that with the 1-GPU run
  (1.00 = perfectly linear).
- MFU: model FLOPs (6N + attention, train.flops_per_token) per second over the
  device's dense bf16 peak (train.PEAK_BF16_FLOPS); n/a for a device not listed.
- data_wait: the share of wall time the slowest rank spent waiting for its next batch.
  Near 0% the loader keeps up; a few percent or more means the GPUs wait on data.
- peak mem: torch.cuda.max_memory_allocated on rank 0 (the allocator's cache and
  fragmentation come on top).
- compile s: how much longer the first log interval took than a steady one: torch.compile
  and the loader's start-up, kept out of tok/s and MFU.
- epochs: how many passes over the corpus the run made. The demo corpus (1.7M byte
  tokens) is an epoch every ~100 steps on one GPU, every ~13 on eight: each epoch
  restarts the loader, which data_wait counts. Pass --db with a bigger corpus to see
  the steady state.

--dry-run checks the plumbing anywhere, on the CPU: the correctness section (skipped
there, with its reason), then the tiny model, no --compile, 6 steps of 4 x 64 tokens,
each variant (--doc-mask through the SDPA mask) on 1 rank and the first two on 2 gloo
ranks. Its figures mean nothing.

Output: a table on stdout, progress on stderr, JSON at --out ({"machine", "settings",
"correctness": {"passed", "failed", "skipped", "measured", "log"}, "results":
[{"variant", "devices", "tokens_per_s", "tokens_per_s_per_device", "scaling", "mfu",
"data_wait", "peak_mem_gib", "compile_s", "epochs", "steps", "final_loss", "wall_s",
"log"}]}).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # and loaders.machine_info

import torch  # noqa: E402

from common import DEFAULT_TABLE, ArgumentParser, UserError, check_out_dir  # noqa: E402
from model import MODEL_SIZES  # noqa: E402

TRAIN = os.path.join(REPO, "train.py")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "gpu_check.json")
GPU = {"model": "small", "steps": 300, "batch_size": 16, "seq_len": 1024, "log_every": 10}
DRY = {"model": "tiny", "steps": 6, "batch_size": 4, "seq_len": 64, "log_every": 1}
DRY_RANKS = 2  # the dry run's "all local devices": gloo ranks on the CPU
SKIP_RECORDS = 2  # the first log intervals hold loader start-up and torch.compile
# name -> train.py flags; the last runs on one device only (its cost, not its scaling)
VARIANTS = {"plain": [], "doc-mask": ["--doc-mask"], "deterministic": ["--deterministic"]}
ONE_DEVICE_ONLY = {"deterministic"}


class TrainFailed(Exception):
    """A train.py run (or the correctness section) that failed; its log says why."""


def check_correctness(opts) -> dict:
    """tests/test_cuda.py, run first: its counts, its `measured:` lines and its log."""
    log = os.path.join(opts.workdir, "correctness.log")
    print(f"correctness: pytest tests/test_cuda.py (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider",
                               os.path.join(REPO, "tests", "test_cuda.py")], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    with open(log) as f:
        text = f.read()
    if "No module named pytest" in text:
        raise UserError("the correctness section needs pytest: pip install -e '.[test]'")
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1])} \
        if summary else {}
    result = {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
              + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "exit_code": code,
              "measured": re.findall(r"measured: (.*)", text),  # -q's progress dots may precede them
              "log": log}
    skipped = re.search(r"SKIPPED \[\d+\] \S+: (.+)", text)
    print(f"correctness: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
          + (f" ({skipped.group(1)})" if skipped and not result["passed"] else ""), file=sys.stderr, flush=True)
    if code not in (0, 5) and not result["failed"]:
        result["failed"] = 1  # pytest itself failed (collection, usage): count it
    return result


def train_argv(opts, db: str, run_dir: str) -> list[str]:
    return ["--db", db, "--model", opts.model, "--pack", "--steps", str(opts.steps),
            "--epochs", "1000000",  # --steps ends the run, however small the corpus
            "--batch-size", str(opts.batch_size), "--seq-len", str(opts.seq_len),
            "--log-every", str(opts.log_every), "--warmup-steps", str(max(1, opts.steps // 10)),
            "--eval-batches", "1", "--ckpt-every", str(opts.steps),
            "--ckpt-dir", os.path.join(run_dir, "ckpt"), "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
            *(["--compile"] if not opts.dry_run else []), *opts.train_args]


def run_train(opts, devices: int, db: str, variant: str) -> dict:
    """One train.py run on `devices` ranks; its figures, summarized from its metrics file."""
    run_dir = os.path.join(opts.workdir, f"{devices}dev-{variant}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    launch = [sys.executable, TRAIN] if devices == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices), TRAIN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if opts.dry_run:  # the CPU only, one thread per rank as torchrun sets it: both runs alike
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    log = os.path.join(run_dir, "train.log")
    print(f"{devices} {opts.device}(s), {variant}: {opts.steps} steps of {opts.model} (log: {log})",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(launch + train_argv(opts, db, run_dir) + VARIANTS[variant], stdout=f,
                              stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - started
    if code != 0:
        with open(log) as f:
            print("".join(f.readlines()[-20:]), end="", file=sys.stderr)
        raise TrainFailed(f"train.py on {devices} {opts.device}(s) ({variant}) exited with {code}; its log: {log}")
    shutil.rmtree(os.path.join(run_dir, "ckpt"))  # ~1 GB for small, and nothing resumes it
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    start = next(r for r in lines if r["kind"] == "start")
    records = [r for r in lines if r["kind"] == "train"]
    steady = records[SKIP_RECORDS:]

    def median(key):
        values = [r[key] for r in steady if r[key] is not None]
        return statistics.median(values) if values else None

    mems = [r["max_mem_gib"] for r in records if r["max_mem_gib"] is not None]
    tps = median("tokens_per_s")
    interval_tokens = opts.log_every * start["tokens_per_step"]  # every record's interval is --log-every steps
    compile_s = interval_tokens / records[0]["tokens_per_s"] - interval_tokens / tps
    return {"variant": variant, "devices": devices, "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
            "mfu": median("mfu"), "data_wait": median("data_wait"), "peak_mem_gib": max(mems) if mems else None,
            "compile_s": round(max(compile_s, 0.0), 1),
            "epochs": records[-1]["epoch"] + 1, "steps": records[-1]["step"], "records_used": len(steady),
            "final_loss": records[-1]["loss"], "wall_s": round(wall, 1), "log": log}


def print_table(results: list[dict], device: str) -> None:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    print(f"{'variant':<14}{device + 's':>5} {'tok/s':>12} {'tok/s/' + device:>12} {'scaling':>8} {'MFU':>7} "
          f"{'data_wait':>10} {'peak mem':>10} {'compile s':>10} {'epochs':>7} {'wall s':>7}")
    for r in results:
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f} GiB"
        print(f"{r['variant']:<14}{r['devices']:>5} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s_per_device']:>12,.0f} "
              f"{r['scaling']:>8.2f} {pct(r['mfu']):>7} {pct(r['data_wait']):>10} {mem:>10} "
              f"{r['compile_s']:>10.1f} {r['epochs']:>7} {r['wall_s']:>7.0f}")


# ── Main ─────────────────────────────────────────────────────────────────────────────

def parse_args(argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {GPU['steps']})")
    p.add_argument("--batch-size", type=int, help=f"blocks per GPU per step (default {GPU['batch_size']})")
    p.add_argument("--seq-len", type=int, help=f"default {GPU['seq_len']}")
    p.add_argument("--model", choices=list(MODEL_SIZES), help=f"default {GPU['model']}")
    p.add_argument("--log-every", type=int, help=f"steps per train record (default {GPU['log_every']})")
    p.add_argument("--db", default="", help="the corpus (default: the demo corpus, built in --workdir)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpu_check"),
                   help="the demo corpus, each run's log and metrics (default: TMPDIR/gpu_check)")
    p.add_argument("--out", default=DEFAULT_OUT, help="results JSON (default: bench/results/gpu_check.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="the plumbing on the CPU: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DRY.items())
                   + f", no --compile, 1 then {DRY_RANKS} ranks")
    opts = p.parse_args(argv[:cut])
    opts.train_args = argv[cut + 1:]
    opts.workdir = os.path.abspath(opts.workdir)  # train.py is handed absolute paths only
    opts.db = os.path.abspath(opts.db) if opts.db and "://" not in opts.db else opts.db
    for key, value in (DRY if opts.dry_run else GPU).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.device = "cpu" if opts.dry_run else "gpu"
    return opts


def check_opts(opts) -> list[int]:
    """Refuse what could only fail minutes in; returns the device counts to run on."""
    for flag, value, low in (("--batch-size", opts.batch_size, 1), ("--seq-len", opts.seq_len, 2),
                             ("--log-every", opts.log_every, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low} (got {value})")
    if opts.steps < (SKIP_RECORDS + 1) * opts.log_every:
        raise UserError(f"--steps {opts.steps} leaves no train record to measure: the first {SKIP_RECORDS} "
                        f"(one per --log-every {opts.log_every} steps) are warm-up; pass at least "
                        f"{(SKIP_RECORDS + 1) * opts.log_every}")
    check_out_dir("--out", opts.out)
    if opts.dry_run:
        return [1, DRY_RANKS]
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise UserError("no CUDA device here; `python bench/gpu_check.py --dry-run` checks the plumbing on the CPU")
    return [1] if gpus == 1 else [1, gpus]


def gpu_check(opts) -> None:
    started = time.perf_counter()
    counts = check_opts(opts)
    os.makedirs(opts.workdir, exist_ok=True)
    correctness = check_correctness(opts)
    db = opts.db or os.path.join(opts.workdir, "data", "lancedb")
    if not opts.db:
        import prepare_data

        if prepare_data.open_existing(db, DEFAULT_TABLE) is None:
            print(f"building the demo corpus in {db}", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(sys.stderr):  # stdout is for the table
                prepare_data.build_demo(db, DEFAULT_TABLE)
    results = [run_train(opts, devices, db, variant) for variant in VARIANTS for devices in counts
               if devices == 1 or variant not in ONE_DEVICE_ONLY]
    for r in results:
        one = next(x for x in results if x["variant"] == r["variant"] and x["devices"] == 1)
        r["scaling"] = r["tokens_per_s_per_device"] / one["tokens_per_s_per_device"]
        if r["epochs"] > 1:
            print(f"note: the {r['devices']}-{opts.device} run made {r['epochs']} passes over the corpus; each "
                  f"restarts the loader, which data_wait counts (--db a bigger corpus for the steady state)",
                  file=sys.stderr)

    from loaders import machine_info, write_json  # after the runs: it opens a CUDA context on GPU 0
    from train import peak_bf16_flops

    machine = {**machine_info(), "gpu_count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    peak = peak_bf16_flops(machine["gpu"])
    machine["gpu_bf16_peak_tflops"] = peak / 1e12 if peak else None
    settings = {key: getattr(opts, key) for key in (*GPU, "dry_run", "train_args")}
    settings.update(device=opts.device, compile=not opts.dry_run, pack=True, db=db,
                    measured=f"median of the train records after the first {SKIP_RECORDS}")
    print_table(results, opts.device)

    write_json(opts.out, {"machine": machine, "settings": settings, "correctness": correctness,
                          "results": results, "total_s": round(time.perf_counter() - started, 1)})
    print(f"\nwrote {opts.out} in {time.perf_counter() - started:.0f} s")
    if correctness["failed"]:
        raise TrainFailed(f"the correctness section failed ({correctness['failed']} of tests/test_cuda.py); "
                          f"its log: {correctness['log']}")


def main(argv=None) -> None:
    try:
        gpu_check(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
