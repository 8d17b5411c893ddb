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
is deleted once read. Compiling the model once per run is most of the time, and the
ceilings below add three such runs to the three (one GPU) or five before them (not yet timed on a GPU;
issue 29 sizes the check to its 7 minutes).

Each variant also runs on one GPU with no loader (`train.py --loader-free 8`): the same
compiled model, optimizer, autocast and --doc-mask, cycling over 8 real micro-batches drawn
once and kept on the GPU. That is the ceiling the loader is measured against: vs_ceiling is
a fed run's tok/s per GPU over its variant's ceiling, side by side in one check (1.00: the
loader costs the step nothing).

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
- loader_ms: the training thread's CPU ms per optimizer step spent getting its batches
  (the metrics' loader.thread_ms_per_step): time the GPU's kernels are not launched.
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
[{"variant", "loader" ("fed" or "none"), "devices", "tokens_per_s", "tokens_per_s_per_device",
"scaling", "vs_ceiling", "mfu", "data_wait", "loader_thread_ms_per_step", "peak_mem_gib",
"compile_s", "epochs", "steps", "final_loss", "wall_s", "log"}]}).
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
# The ceiling of each variant: the same step on CEILING_POOL micro-batches kept on the device
# (train.py --loader-free), one device. Several batches, so no step sees the same data twice
# in a row; a few, so drawing them is over before the first record.
CEILING_POOL = 8


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


def run_train(opts, devices: int, db: str, variant: str, ceiling: bool = False) -> dict:
    """One train.py run on `devices` ranks (`ceiling`: with no loader, --loader-free); its
    figures, summarized from its metrics file."""
    run_dir = os.path.join(opts.workdir, f"{devices}dev-{variant}" + ("-ceiling" if ceiling else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    launch = [sys.executable, TRAIN] if devices == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices), TRAIN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if opts.dry_run:  # the CPU only, one thread per rank as torchrun sets it: both runs alike
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    log = os.path.join(run_dir, "train.log")
    loader = ["--loader-free", str(CEILING_POOL)] if ceiling else []
    print(f"{devices} {opts.device}(s), {variant}{', no loader' if ceiling else ''}: {opts.steps} steps of "
          f"{opts.model} (log: {log})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(launch + train_argv(opts, db, run_dir) + VARIANTS[variant] + loader, stdout=f,
                              stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - started
    if code != 0:
        with open(log) as f:
            print("".join(f.readlines()[-20:]), end="", file=sys.stderr)
        raise TrainFailed(f"train.py on {devices} {opts.device}(s) ({variant}{', no loader' if ceiling else ''}) "
                          f"exited with {code}; its log: {log}")
    shutil.rmtree(os.path.join(run_dir, "ckpt"), ignore_errors=True)  # ~1 GB for small; the ceiling writes none
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    start = next(r for r in lines if r["kind"] == "start")
    records = [r for r in lines if r["kind"] == "train"]
    steady = records[SKIP_RECORDS:]

    def median(key):
        return median_of(steady, lambda r: r[key])

    mems = [r["max_mem_gib"] for r in records if r["max_mem_gib"] is not None]
    tps = median("tokens_per_s")
    interval_tokens = opts.log_every * start["tokens_per_step"]  # every record's interval is --log-every steps
    compile_s = interval_tokens / records[0]["tokens_per_s"] - interval_tokens / tps
    return {"variant": variant, "loader": "none" if ceiling else "fed", "devices": devices,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
            "mfu": median("mfu"), "data_wait": median("data_wait"), "peak_mem_gib": max(mems) if mems else None,
            "compile_s": round(max(compile_s, 0.0), 1),
            "epochs": records[-1]["epoch"] + 1, "steps": records[-1]["step"], "records_used": len(steady),
            "final_loss": records[-1]["loss"], "wall_s": round(wall, 1),
            "loader_thread_ms_per_step": median_of(steady, lambda r: (r.get("loader") or {}).get("thread_ms_per_step")),
            "log": log}


def median_of(records: list[dict], value) -> float | None:
    values = [v for v in map(value, records) if v is not None]
    return statistics.median(values) if values else None


def print_table(results: list[dict], device: str) -> None:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    print(f"{'variant':<14}{'loader':>7}{device + 's':>5} {'tok/s':>12} {'tok/s/' + device:>12} {'scaling':>8} "
          f"{'vs_ceiling':>10} {'MFU':>7} {'data_wait':>10} {'loader_ms':>10} {'peak mem':>10} {'compile s':>10} "
          f"{'epochs':>7} {'wall s':>7}")
    for r in results:
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f} GiB"
        vs = "n/a" if r.get("vs_ceiling") is None else f"{r['vs_ceiling']:.3f}"
        ms = "n/a" if r["loader_thread_ms_per_step"] is None else f"{r['loader_thread_ms_per_step']:.2f}"
        print(f"{r['variant']:<14}{r['loader']:>7}{r['devices']:>5} {r['tokens_per_s']:>12,.0f} "
              f"{r['tokens_per_s_per_device']:>12,.0f} {r['scaling']:>8.2f} {vs:>10} {pct(r['mfu']):>7} "
              f"{pct(r['data_wait']):>10} {ms:>10} {mem:>10} {r['compile_s']:>10.1f} {r['epochs']:>7} {r['wall_s']:>7.0f}")


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
    results = []
    for variant in VARIANTS:  # each variant's ceiling right after its fed 1-device run: the same machine state
        for devices in counts:
            if devices == 1 or variant not in ONE_DEVICE_ONLY:
                results.append(run_train(opts, devices, db, variant))
            if devices == 1:
                results.append(run_train(opts, 1, db, variant, ceiling=True))
    for r in results:
        one = next(x for x in results if (x["variant"], x["loader"], x["devices"]) == (r["variant"], r["loader"], 1))
        ceiling = next(x for x in results if (x["variant"], x["loader"]) == (r["variant"], "none"))
        r["scaling"] = r["tokens_per_s_per_device"] / one["tokens_per_s_per_device"]
        r["vs_ceiling"] = r["tokens_per_s_per_device"] / ceiling["tokens_per_s_per_device"] \
            if r["loader"] == "fed" else None
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
