"""GPU check: the CUDA-only paths verified, then train.py's throughput, in one command.

Usage:
    python bench/gpu_check.py [--steps 100] [--batch-size 16] [--seq-len 1024] [--model small]
        [--db DIR] [--workdir DIR] [--out FILE.json] [--budget-s S] [--limit STAGE=S ...]
        [--sweep] [--dry-run] [-- TRAIN.PY FLAGS...]

The check is a list of stages, each with a time limit, run in this order:

1. correctness: `pytest tests/test_cuda.py --durations=0` (FlexAttention's loss and
   gradients against the SDPA mask and each document alone, under bf16, eager and compiled;
   fused AdamW; a compiled run that learns without recompiling; bit-exact resume with
   --deterministic). Its counts, `measured:` lines, each test's duration and its log land in
   the JSON; a failure fails the check (exit 1) after the throughput runs.
2. corpus: the demo corpus, built into --workdir if it is not there yet (`prepare_data.py
   --demo`), reused by every run; skipped with --db.
3. The train.py runs, `--model small --compile --pack` (bf16 autocast on CUDA) for --steps
   optimizer steps, each variant on one GPU: plain, with --doc-mask (FlexAttention), and with
   --deterministic (what bit-exact resume costs). Plain and --doc-mask also run with no loader
   (`train.py --loader-free 8`): the same compiled model, optimizer, autocast and --doc-mask,
   cycling over 8 real micro-batches drawn once and kept on the GPU. That is the ceiling the
   loader is measured against: vs_ceiling is a fed run's tok/s per GPU over its variant's
   ceiling (1.00: the loader costs the step nothing). Right after the plain ceiling, the
   ceiling of GPT-2 124M as published (gpt2-124m): 12 layers, 768 wide, a 50,304-id
   vocabulary, no tokenizer (`--loader-free 8 --random-ids 50304`: random ids drawn on the GPU).
4. Where there are several GPUs, plain and --doc-mask again on all of them under torchrun.

Flags after `--` go to every train.py run as they are (`-- --num-workers 2`, `-- --table web
--tokenizer hf:gpt2` with --db). Each run's log and metrics file stay in --workdir; its
checkpoint is deleted once read.

Time: each stage's limit is its share below (STAGE_LIMITS_S), never more than what is left of
--budget-s (default 420 s on one GPU; each of the two torchrun runs adds 90 s where there are
more). --limit STAGE=S sets one stage's limit. A stage that runs past its limit is killed and
recorded as unfinished, with why, and the check goes on; once the budget is spent, the stages
left are recorded as unfinished without starting. A train.py run that fails ends the check
with the tail of its log. The JSON is written (atomically) before each stage, naming it as
running, and after it: a check killed in any way leaves every figure it finished and says
which stage did not finish; SIGTERM and SIGINT also kill the running stage and exit 1.
Not timed on a GPU yet: on one H200, test_cuda.py is sized to about 150 s and each compiled
run to 30-45 s (start-up and torch.compile; 100 steps of 16 x 1024 are ~4 s of it).

--sweep runs, instead of the check, the corpus stage and a search for the settings that give
the best MFU on the ceiling of --model (default small) at GPT-2's 50,304-id vocabulary
(`--loader-free 8 --random-ids 50304`, no loader, so only the step is measured): micro-batch
16, 32 and 64 under the default --compile-mode (a batch that runs out of memory is recorded
as oom, and the bigger ones are not tried), then, at the fastest of them, reduce-overhead
(CUDA graphs) and max-autotune-no-cudagraphs (limit 240 s: its compile benchmarks kernels). A
mode that fails with this training step is recorded as failed with the last line of its log
(why it does not work). It prints a table and the fastest settings, under the same 420 s
budget: estimated (not yet timed on a GPU) at 5 runs of 30-45 s plus max-autotune's 2-4
minutes, so about 6 minutes; where max-autotune does not finish, it says so, and
`--budget-s 900 --limit sweep-b<N>-max-autotune-no-cudagraphs=600` gives it room.

Figures come from the runs' --metrics-file train records (one per --log-every steps,
rank 0): the median over all records but the first two, whose intervals hold the
loader's start-up and torch.compile. Per run:

- tok/s: positions per second over all GPUs (pads included: with --pack nearly none);
  tok/s/gpu divides it by the GPU count, and scaling compares that with the 1-GPU run
  (1.00 = perfectly linear).
- MFU: model FLOPs per second over the device's dense bf16 peak (train.PEAK_BF16_FLOPS);
  n/a for a device not listed. MFU counts FLOPs as this project does (train.flops_per_token:
  6N + 12·L·C·T, N without the position embeddings), the figure train.py logs and the README
  quotes; MFU_llmc as llm.c does (6N + 6·L·C·T, N every parameter), to compare with its
  published runs. Both JSON keys hold the FLOPs per token used.
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

--dry-run checks the plumbing anywhere, on the CPU: every stage (the correctness section
skips there, with its reason), the tiny model, no --compile, 6 steps of 4 x 64 tokens,
each variant (--doc-mask through the SDPA mask) on 1 rank and the first two on 2 gloo
ranks; gpt2-124m is the tiny model at the real 50,304-id vocabulary; --sweep tries
micro-batches 2 and 4 (--compile-mode is inert without --compile). Its figures mean nothing.

Output: a table on stdout, progress on stderr, JSON at --out ({"machine", "settings",
"budget_s", "running" (the stage in progress; null once none is), "stages": [{"name",
"status" (done, failed or unfinished), "limit_s", "wall_s", "reason"}], "unfinished" (the
stages that did not finish), "correctness": {"passed", "failed", "skipped", "measured",
"durations": [{"test", "when", "s"}], "exit_code", "log"}, "results": [{"variant", "loader"
("fed" or "none"), "devices", "tokens_per_s", "tokens_per_s_per_device", "scaling",
"vs_ceiling", "mfu", "mfu_llmc", "flops_per_token", "flops_per_token_llmc", "data_wait",
"loader_thread_ms_per_step", "peak_mem_gib", "compile_s", "epochs", "steps", "final_loss",
"wall_s", "log"}], "sweep": [{"batch_size", "compile_mode", "status" (ok, oom, failed,
unfinished), "reason", and a result's figures}], "best" (the sweep's fastest), "total_s"}).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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
GPU = {"model": "small", "steps": 100, "batch_size": 16, "seq_len": 1024, "log_every": 10}
DRY = {"model": "tiny", "steps": 6, "batch_size": 4, "seq_len": 64, "log_every": 1}
DRY_RANKS = 2  # the dry run's "all local devices": gloo ranks on the CPU
SKIP_RECORDS = 2  # the first log intervals hold loader start-up and torch.compile
# name -> train.py flags; the last runs on one device only (its cost, not its scaling)
VARIANTS = {"plain": [], "doc-mask": ["--doc-mask"], "deterministic": ["--deterministic"]}
ONE_DEVICE_ONLY = {"deterministic"}
# The ceiling of a variant: the same step on CEILING_POOL micro-batches kept on the device
# (train.py --loader-free), one device. Several batches, so no step sees the same data twice
# in a row; a few, so drawing them is over before the first record.
CEILING_POOL = 8
CEILING_VARIANTS = ("plain", "doc-mask")
GPT2_VOCAB = 50304  # GPT-2's 50,257 ids padded to a multiple of 64, as llm.c and nanoGPT train it
GPT2_MODEL = "small"  # 12 layers, 768 wide: GPT-2 124M
# The stages' time limits (seconds) on one H100/H200, sized to the 420 s budget with room for
# a slow start: "run" is any train.py stage; "autotune" the sweep's max-autotune run, whose
# compile benchmarks kernels for every matmul shape.
STAGE_LIMITS_S = {"correctness": 150, "corpus": 40, "run": 60, "autotune": 240}
BUDGET_S = 420
MULTI_GPU_RUN_S = 90  # what each torchrun run adds to the default budget on several GPUs
SWEEP_BATCHES = {"gpu": (16, 32, 64), "cpu": (2, 4)}
SWEEP_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # the slowest to compile last
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")


class TrainFailed(Exception):
    """A train.py run (or the correctness section) that failed; its log says why."""


class StageTimeout(Exception):
    """A stage that ran past its limit; it was killed."""


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: the running stage is killed and the JSON says so."""


def on_signal(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


class Check:
    """The stages' record and the JSON, written before and after each stage."""

    def __init__(self, opts, budget_s: float):
        self.opts, self.budget_s, self.started = opts, budget_s, time.perf_counter()
        self.stopped_during = "no stage (between two)"
        self.report = {"machine": {}, "settings": {}, "budget_s": budget_s, "running": None, "stages": [],
                       "unfinished": [], "correctness": None, "results": [], "sweep": [], "best": None}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def stage(self, name: str, kind: str, work) -> bool:
        """Run `work(limit_s)` as stage `name`; whether it finished. A TrainFailed is recorded
        and raised: the runs after it would fail alike."""
        limit = min(self.opts.limits.get(name, STAGE_LIMITS_S[kind]), self.left_s())
        record = {"name": name, "status": "unfinished", "limit_s": round(limit, 1), "wall_s": 0.0, "reason": None}
        self.report["stages"].append(record)
        if limit <= 0:
            record["reason"] = f"not started: the budget of {self.budget_s:.0f} s was spent"
            self.report["unfinished"].append(name)
            self.write()
            return False
        self.report["running"] = name
        self.write()
        started = time.perf_counter()
        try:
            work(limit)
            record["status"] = "done"
        except StageTimeout as e:
            record["reason"] = str(e)
        except TrainFailed as e:
            record["status"], record["reason"] = "failed", str(e)
            raise
        except Stopped as e:
            record["reason"] = f"stopped by {e}"
            self.stopped_during = name
            raise
        finally:
            record["wall_s"] = round(time.perf_counter() - started, 1)
            if record["status"] == "unfinished":
                self.report["unfinished"].append(name)
                print(f"{name}: unfinished ({record['reason']})", file=sys.stderr, flush=True)
            self.report["running"] = None
            self.write()
        return record["status"] == "done"

    def write(self) -> None:
        from loaders import write_json

        derive(self.report["results"])
        self.report["total_s"] = round(time.perf_counter() - self.started, 1)
        write_json(self.opts.out, self.report)


def run_logged(cmd: list[str], log: str, env: dict, limit: float, what: str) -> int:
    """Run `cmd` with its output in `log`; past `limit` seconds (or on a signal) kill it and
    everything it started (torchrun's workers too: their sessions are their own)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise StageTimeout(f"{what} did not finish within {limit:.0f} s; its log: {log}") from None
        except BaseException:
            kill_tree(proc)
            raise


def kill_tree(proc: subprocess.Popen) -> None:
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux); none found elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def child_env(opts) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if opts.dry_run:  # the CPU only, one thread per rank as torchrun sets it: both runs alike
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


# ── Stages ───────────────────────────────────────────────────────────────────────────

def check_correctness(opts, check: Check, limit: float) -> None:
    """tests/test_cuda.py: its counts, its `measured:` lines, each test's duration and its log,
    in the report as far as they got when the limit kills it."""
    log = os.path.join(opts.workdir, "correctness.log")
    print(f"correctness: pytest tests/test_cuda.py (log: {log})", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-s", "-p", "no:cacheprovider", "--durations=0",
           "--durations-min=0", os.path.join(REPO, "tests", "test_cuda.py")]
    try:
        code = run_logged(cmd, log, {**os.environ, "PYTHONUNBUFFERED": "1"}, limit, "pytest tests/test_cuda.py")
    except StageTimeout:
        check.report["correctness"] = correctness_figures(log, None)
        raise
    check.report["correctness"] = result = correctness_figures(log, code)
    with open(log) as f:
        skipped = re.search(r"SKIPPED \[\d+\] \S+: (.+)", f.read())
    print(f"correctness: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
          + (f" ({skipped.group(1)})" if skipped and not result["passed"] else ""), file=sys.stderr, flush=True)


def correctness_figures(log: str, code: int | None) -> dict:
    """The counts from pytest's summary line, or, where it never came (`code` None: killed),
    from the verbose lines of the tests that finished."""
    with open(log) as f:
        text = f.read()
    if "No module named pytest" in text:
        raise UserError("the correctness section needs pytest: pip install -e '.[test]'")
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)
               and line.startswith("=")]
    if summary:
        counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1])}
    else:
        outcomes = re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR)\b[^\n]*\[\s*\d+%\]", text)
        counts = {kind: outcomes.count(kind.upper()) for kind in ("passed", "failed", "skipped", "error")}
    result = {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
              + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "exit_code": code,
              "measured": re.findall(r"measured: (.*)", text),  # the progress lines may precede them
              "durations": [{"test": test, "when": when, "s": float(s)}
                            for s, when, test in re.findall(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)", text, re.M)],
              "log": log}
    if code not in (None, 0, 5) and not result["failed"]:
        result["failed"] = 1  # pytest itself failed (collection, usage): count it
    return result


def build_corpus(opts, db: str, limit: float) -> None:
    import prepare_data

    if prepare_data.open_existing(db, DEFAULT_TABLE) is not None:
        return
    log = os.path.join(opts.workdir, "corpus.log")
    print(f"building the demo corpus in {db} (log: {log})", file=sys.stderr, flush=True)
    code = run_logged([sys.executable, os.path.join(REPO, "prepare_data.py"), "--demo", "--db", db, "--table",
                       DEFAULT_TABLE], log, child_env(opts), limit, "the demo corpus")
    if code != 0:
        raise TrainFailed(f"prepare_data.py --demo exited with {code}; its log: {log}")


def train_argv(opts, db: str, run_dir: str, batch_size: int) -> list[str]:
    return ["--db", db, "--pack", "--steps", str(opts.steps),
            "--epochs", "1000000",  # --steps ends the run, however small the corpus
            "--batch-size", str(batch_size), "--seq-len", str(opts.seq_len),
            "--log-every", str(opts.log_every), "--warmup-steps", str(max(1, opts.steps // 10)),
            "--eval-batches", "1", "--ckpt-every", str(opts.steps),
            "--ckpt-dir", os.path.join(run_dir, "ckpt"), "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
            *(["--compile"] if not opts.dry_run else []), *opts.train_args]


def run_train(opts, limit: float, devices: int, db: str, name: str, flags: list[str], *, model: str,
              batch_size: int, ceiling: bool = False, gpt2: bool = False) -> dict:
    """One train.py run on `devices` ranks (`ceiling`: with no loader, --loader-free; `gpt2`:
    at GPT-2's vocabulary on random ids); its figures, summarized from its metrics file."""
    run_dir = os.path.join(opts.workdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    launch = [sys.executable, TRAIN] if devices == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices), TRAIN]
    log = os.path.join(run_dir, "train.log")
    loader = ["--loader-free", str(CEILING_POOL)] if ceiling else []
    vocab = ["--random-ids", str(GPT2_VOCAB)] if gpt2 else []
    what = f"train.py on {devices} {opts.device}(s) ({name})"
    print(f"{devices} {opts.device}(s), {name}: {opts.steps} steps of {model}, {batch_size} x {opts.seq_len}"
          f" (log: {log})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    code = run_logged(launch + ["--model", model] + train_argv(opts, db, run_dir, batch_size) + flags + loader
                      + vocab, log, child_env(opts), limit, what)
    wall = time.perf_counter() - started
    if code != 0:
        with open(log) as f:
            tail = f.readlines()[-20:]
        oom = next((line.strip() for line in tail if OOM.search(line)), None)
        if oom:
            return {"status": "oom", "reason": oom[:300], "wall_s": round(wall, 1), "log": log}
        print("".join(tail), end="", file=sys.stderr)
        raise TrainFailed(f"{what} exited with {code}; its log: {log}")
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
    ours, llmc = flops_per_token(model, start["params"], opts.seq_len)
    mfu = median("mfu")
    return {"status": "ok", "loader": "none" if ceiling else "fed", "devices": devices, "model": model,
            "vocab": GPT2_VOCAB if gpt2 else None, "batch_size": batch_size,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
            "mfu": mfu, "mfu_llmc": mfu * llmc / ours if mfu is not None else None,
            "flops_per_token": ours, "flops_per_token_llmc": llmc,
            "data_wait": median("data_wait"), "peak_mem_gib": max(mems) if mems else None,
            "compile_s": round(max(compile_s, 0.0), 1),
            "epochs": records[-1]["epoch"] + 1, "steps": records[-1]["step"], "records_used": len(steady),
            "final_loss": records[-1]["loss"], "wall_s": round(wall, 1),
            "loader_thread_ms_per_step": median_of(steady, lambda r: (r.get("loader") or {}).get("thread_ms_per_step")),
            "log": log}


def flops_per_token(model: str, params: int, seq_len: int) -> tuple[float, float]:
    """FLOPs per token as this project counts them (train.flops_per_token: 6N + 12·L·C·T, N
    without the position embeddings, which train.py's `params` is) and as llm.c does
    (6N + 6·L·C·T, N every parameter: the position embeddings, seq_len x C, added back)."""
    n_layer, _, d_model = MODEL_SIZES[model]
    return (6 * params + 12 * n_layer * d_model * seq_len,
            6 * (params + seq_len * d_model) + 6 * n_layer * d_model * seq_len)


def median_of(records: list[dict], value) -> float | None:
    values = [v for v in map(value, records) if v is not None]
    return statistics.median(values) if values else None


def derive(results: list[dict]) -> None:
    """scaling and vs_ceiling, from the runs finished so far (None where the one to compare
    with is not there)."""
    for r in results:
        one = next((x for x in results if (x["variant"], x["loader"], x["devices"])
                    == (r["variant"], r["loader"], 1)), None)
        ceiling = next((x for x in results if (x["variant"], x["loader"]) == (r["variant"], "none")), None)
        r["scaling"] = r["tokens_per_s_per_device"] / one["tokens_per_s_per_device"] if one else None
        r["vs_ceiling"] = r["tokens_per_s_per_device"] / ceiling["tokens_per_s_per_device"] \
            if ceiling and r["loader"] == "fed" else None


def pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def print_table(results: list[dict], device: str) -> None:
    print(f"{'variant':<14}{'loader':>7}{device + 's':>5} {'tok/s':>12} {'tok/s/' + device:>12} {'scaling':>8} "
          f"{'vs_ceiling':>10} {'MFU':>7} {'MFU_llmc':>9} {'data_wait':>10} {'loader_ms':>10} {'peak mem':>10} "
          f"{'compile s':>10} {'epochs':>7} {'wall s':>7}")
    for r in results:
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f} GiB"
        vs = "n/a" if r["vs_ceiling"] is None else f"{r['vs_ceiling']:.3f}"
        scaling = "n/a" if r["scaling"] is None else f"{r['scaling']:.2f}"
        ms = "n/a" if r["loader_thread_ms_per_step"] is None else f"{r['loader_thread_ms_per_step']:.2f}"
        print(f"{r['variant']:<14}{r['loader']:>7}{r['devices']:>5} {r['tokens_per_s']:>12,.0f} "
              f"{r['tokens_per_s_per_device']:>12,.0f} {scaling:>8} {vs:>10} {pct(r['mfu']):>7} "
              f"{pct(r['mfu_llmc']):>9} {pct(r['data_wait']):>10} {ms:>10} {mem:>10} {r['compile_s']:>10.1f} "
              f"{r['epochs']:>7} {r['wall_s']:>7.0f}")


def print_sweep(rows: list[dict], best: dict | None) -> None:
    print(f"{'batch':>6} {'compile mode':<28}{'status':>11} {'tok/s':>12} {'MFU':>7} {'MFU_llmc':>9} "
          f"{'peak mem':>10} {'compile s':>10}")
    for r in rows:
        if r["status"] == "ok":
            mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f} GiB"
            figures = (f"{r['tokens_per_s']:>12,.0f} {pct(r['mfu']):>7} {pct(r['mfu_llmc']):>9} {mem:>10} "
                       f"{r['compile_s']:>10.1f}")
        else:  # why not, in place of the figures
            figures = f"  {(r['reason'] or '')[:90]}"
        print(f"{r['batch_size']:>6} {r['compile_mode']:<28}{r['status']:>11} {figures}")
    if best:
        print(f"\nfastest: --batch-size {best['batch_size']} --compile-mode {best['compile_mode']}: "
              f"{best['tokens_per_s']:,.0f} tok/s, MFU {pct(best['mfu'])} (llm.c's count: {pct(best['mfu_llmc'])})")
    else:
        print("\nfastest: none (no setting finished)")


# ── The check and the sweep ──────────────────────────────────────────────────────────

def gpu_check(opts, check: Check, counts: list[int], db: str) -> None:
    results = check.report["results"]

    def train_stage(variant: str, devices: int, ceiling: bool = False, gpt2: bool = False) -> None:
        name = "gpt2-124m" if gpt2 else variant
        stage = f"{devices}dev-{name}" + ("-ceiling" if ceiling else "")

        def work(limit):
            r = run_train(opts, limit, devices, db, stage, VARIANTS[variant], model=GPT2_MODEL if gpt2 and not
                          opts.dry_run else opts.model, batch_size=opts.batch_size, ceiling=ceiling, gpt2=gpt2)
            if r["status"] == "oom":
                raise TrainFailed(f"{stage} ran out of memory ({r['reason']}); its log: {r['log']}")
            results.append({"variant": name, **r})

        check.stage(stage, "run", work)

    for variant in VARIANTS:  # each ceiling right after its fed 1-device run: the same machine state
        train_stage(variant, 1)
        if variant in CEILING_VARIANTS:
            train_stage(variant, 1, ceiling=True)
        if variant == "plain":
            train_stage("plain", 1, ceiling=True, gpt2=True)
    for devices in counts[1:]:
        for variant in VARIANTS:
            if variant not in ONE_DEVICE_ONLY:
                train_stage(variant, devices)
    for r in results:
        if r["epochs"] > 1:
            print(f"note: the {r['devices']}-{opts.device} {r['variant']} run made {r['epochs']} passes over the "
                  f"corpus; each restarts the loader, which data_wait counts (--db a bigger corpus for the "
                  f"steady state)", file=sys.stderr)
    print_table(results, opts.device)


def sweep(opts, check: Check, db: str) -> None:
    """Micro-batches under the default compile mode (smallest first; none past an OOM), then
    the other modes at the fastest batch."""
    rows = check.report["sweep"]

    def try_setting(batch: int, mode: str) -> dict:
        row = {"batch_size": batch, "compile_mode": mode, "status": "unfinished", "reason": None}
        rows.append(row)
        stage = f"sweep-b{batch}-{mode}"

        def work(limit):
            row.update(run_train(opts, limit, 1, db, stage, ["--compile-mode", mode], model=opts.model,
                                 batch_size=batch, ceiling=True, gpt2=True))

        try:
            check.stage(stage, "autotune" if "autotune" in mode else "run", work)
        except TrainFailed as e:  # this setting fails with this step: say why, try the next
            row["status"], row["reason"] = "failed", last_error(e)
        if row["status"] == "unfinished":
            row["reason"] = next(s["reason"] for s in reversed(check.report["stages"]) if s["name"] == stage)
        return row

    for batch in SWEEP_BATCHES[opts.device]:
        if try_setting(batch, SWEEP_MODES[0])["status"] == "oom":
            break
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        fastest = max(ok, key=lambda r: r["tokens_per_s"])["batch_size"]
        for mode in SWEEP_MODES[1:]:
            try_setting(fastest, mode)
    ok = [r for r in rows if r["status"] == "ok"]
    check.report["best"] = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    check.write()
    print_sweep(rows, check.report["best"])


def last_error(e: TrainFailed) -> str:
    """A failed run's reason: the last error line of its log (why the setting cannot work)."""
    log = str(e).rsplit("its log: ", 1)[-1]
    try:
        with open(log) as f:
            lines = [line.strip() for line in f if re.match(r"\s*(\w+\.)*\w*(Error|Exception)\b", line)]
    except OSError:
        lines = []
    return (lines[-1] if lines else str(e))[:300]


# ── Main ─────────────────────────────────────────────────────────────────────────────

def limit_flag(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STAGE=SECONDS, got {text!r}") from None


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
    p.add_argument("--budget-s", type=float,
                   help=f"the whole check's time (default {BUDGET_S}; +{MULTI_GPU_RUN_S} per torchrun run)")
    p.add_argument("--limit", type=limit_flag, action="append", default=[], metavar="STAGE=SECONDS",
                   help="one stage's time limit (default: " + ", ".join(f"{k} {v}" for k, v in
                                                                      STAGE_LIMITS_S.items()) + ")")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the check: the fastest micro-batch and --compile-mode on the ceiling of "
                   "--model at GPT-2's vocabulary")
    p.add_argument("--dry-run", action="store_true",
                   help="the plumbing on the CPU: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DRY.items())
                   + f", no --compile, 1 then {DRY_RANKS} ranks")
    opts = p.parse_args(argv[:cut])
    opts.train_args = argv[cut + 1:]
    opts.limits = dict(opts.limit)
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
    if opts.budget_s is not None and opts.budget_s <= 0:
        raise UserError(f"--budget-s must be positive (got {opts.budget_s:g})")
    check_out_dir("--out", opts.out)
    if opts.dry_run:
        return [1, DRY_RANKS]
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise UserError("no CUDA device here; `python bench/gpu_check.py --dry-run` checks the plumbing on the CPU")
    return [1] if gpus == 1 else [1, gpus]


def machine_figures() -> dict:
    """loaders.machine_info, from a process of its own: it opens a CUDA context on GPU 0 for the
    GPU's name, which this process, alive through every run, must not hold (its memory; a GPU
    in exclusive-process mode would refuse the runs)."""
    code = "import json, sys; sys.path[:0] = sys.argv[1:]; from loaders import machine_info; " \
           "print(json.dumps(machine_info()))"
    out = subprocess.run([sys.executable, "-c", code, REPO, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def run_check(opts) -> Check:
    counts = check_opts(opts)
    multi_runs = 0 if opts.sweep or len(counts) == 1 else len(VARIANTS) - len(ONE_DEVICE_ONLY)
    check = Check(opts, opts.budget_s or BUDGET_S + MULTI_GPU_RUN_S * multi_runs)
    os.makedirs(opts.workdir, exist_ok=True)
    from train import peak_bf16_flops

    machine = {**machine_figures(), "gpu_count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    peak = peak_bf16_flops(machine["gpu"])
    machine["gpu_bf16_peak_tflops"] = peak / 1e12 if peak else None
    db = opts.db or os.path.join(opts.workdir, "data", "lancedb")
    settings = {key: getattr(opts, key) for key in (*GPU, "dry_run", "sweep", "train_args")}
    settings.update(device=opts.device, compile=not opts.dry_run, pack=True, db=db, limits=opts.limits,
                    gpt2_124m={"model": GPT2_MODEL if not opts.dry_run else opts.model, "vocab": GPT2_VOCAB},
                    measured=f"median of the train records after the first {SKIP_RECORDS}")
    check.report.update(machine=machine, settings=settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if not opts.sweep:
            check.stage("correctness", "correctness", lambda limit: check_correctness(opts, check, limit))
        if not opts.db:
            check.stage("corpus", "corpus", lambda limit: build_corpus(opts, db, limit))
        if opts.sweep:
            sweep(opts, check, db)
        else:
            gpu_check(opts, check, counts, db)
    except Stopped as e:
        raise TrainFailed(f"stopped by {e} during {check.stopped_during}; the figures finished "
                          f"before it are in {opts.out}") from None
    print(f"\nwrote {opts.out} in {time.perf_counter() - check.started:.0f} s")
    return check


def main(argv=None) -> None:
    try:
        check = run_check(parse_args(argv))
        unfinished, correctness = check.report["unfinished"], check.report["correctness"]
        if unfinished:
            raise TrainFailed(f"{len(unfinished)} stage(s) did not finish: {', '.join(unfinished)}; the figures "
                              f"that did are in {check.opts.out}")
        if correctness and correctness["failed"]:
            raise TrainFailed(f"the correctness section failed ({correctness['failed']} of tests/test_cuda.py); "
                              f"its log: {correctness['log']}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
