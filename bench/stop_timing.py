"""How long a stop signal takes to become a checkpoint on disk, and the process to be gone,
stopping train.py at random moments of a run.

Usage:
    python bench/stop_timing.py [--cases mid-epoch,epoch-end,epoch-start-workers,store-retrying]
        [--trials 5] [--seed 0] [--out bench/results/stop_timing.json] [--quick]

Each trial starts `train.py --model tiny` in a session of its own on a synthetic table
(common.synthetic_corpus), waits for its first logged step, waits a random while more, and
sends SIGTERM, the signal SLURM, Kubernetes and spot VMs give before SIGKILL. Timed from
outside, from the signal:

- saved: until the stop's checkpoint is committed (rank 0's `step_XXXXXXXX.pt` exists:
  `--ckpt-every` is beyond the run, so it is the only one);
- exit: until the process has exited;
- left: processes of its session still alive once it has (loader workers, forkserver), and
  again 2 s later (what outlives the run, not what is finishing its exit).

The bound the run promises (issue 38) is one training step, its batch included, plus the
save plus 1 s: `step_s` is the median time between logged steps (`--log-every 1`), `save_s`
what the stop's "saved" line says.

Cases, on one process unless named for ranks:
- mid-epoch: 100,000 rows, epochs of thousands of steps, no loader workers;
- epoch-end: 8-step epochs, no workers (every moment is near an epoch's end);
- epoch-start-workers: 8-step epochs with `--num-workers 2`: each epoch's workers start
  while the last one drains, and half the moments land in a start;
- store-retrying: the table on a local S3 server (moto) that is frozen (SIGSTOP) for a
  random while before the signal, so the loader's reads hang and retry (`--loader-buffer-mb
  1`, so little is read ahead). Needs moto (the `test` extra).
- store-retrying-2-ranks: the same under torchrun with 2 ranks (2 rows each), SIGTERM sent to
  torchrun, which passes it to both: the ranks must agree that the step neither holds its
  batches for is not begun (preemption.StepGate).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ArgumentParser, UserError, synthetic_corpus  # noqa: E402
from loader_memory import kill_all, name_list  # noqa: E402
from loaders import machine_info, options_or_exit, write_json  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "stop_timing.json")
BATCH, SPLITS, SEQ_LEN = 4, 4, 64
DOC_TOKENS = (10, 60)
EPOCH_STEPS = 8
CASES = {  # name -> (rows, extra train.py flags, on S3, ranks)
    "mid-epoch": (100_000, [], False, 1),
    "epoch-end": (EPOCH_STEPS * BATCH, ["--epochs", "100000"], False, 1),
    "epoch-start-workers": (EPOCH_STEPS * BATCH, ["--epochs", "100000", "--num-workers", "2"], False, 1),
    "store-retrying": (100_000, ["--loader-buffer-mb", "1"], True, 1),
    "store-retrying-2-ranks": (100_000, ["--loader-buffer-mb", "1"], True, 2),
}
MOMENT_S = (0.0, 3.0)  # the random wait after the first logged step
FREEZE_S = (1.0, 4.0)  # store-retrying: how long the store is frozen before the signal
TIMEOUT_S = 300
LINGER_S = 2.0  # then the session is looked at again: what is still there has outlived the run
SAVED = re.compile(r"^\s*saved (\S+) \(([\d.]+) s", re.M)
STEP_LINE = re.compile(r"^epoch \d+ step (\d+)/")
CKPT = re.compile(r"^step_\d{8}\.pt$")


def live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            found[int(name)] = (int(fields[1]), int(fields[3]))
    return found


def session_processes(sid: int, known: set[int] = frozenset()) -> list[int]:
    """The live processes of session `sid` (train.py started with start_new_session), its
    descendants (torchrun starts each worker in a session of its own), and those of `known`."""
    live = live_processes()
    found = {pid for pid, (_, session) in live.items() if session == sid} | (known & live.keys())
    grown = True
    while grown:
        more = {pid for pid, (parent, _) in live.items() if parent in found} - found
        found |= more
        grown = bool(more)
    return sorted(found)


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or str(pid)
    except OSError:
        return str(pid)


class Lines:
    """A process's stdout and stderr lines, each with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.first_step = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if STEP_LINE.match(line):
                self.first_step.set()

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(line for _, line in self.lines)

    def step_s(self) -> float | None:
        """The median time between consecutive logged steps."""
        times = [t for t, line in self.lines if STEP_LINE.match(line)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else None


def train_command(db: str, ckpt: str, extra: list[str], ranks: int) -> list[str]:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [sys.executable, *launch, os.path.join(REPO, "train.py"), "--db", db, "--model", "tiny",
            "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH // ranks), "--num-splits", str(SPLITS),
            "--steps", "1000000", "--lr-total-steps", "1000", "--warmup-steps", "10",
            "--ckpt-every", "1000000", "--log-every", "1", "--ckpt-dir", ckpt, *extra]


def one_trial(db: str, work: str, case: str, rng: random.Random, env: dict, store: subprocess.Popen | None) -> dict:
    _, extra, _, ranks = CASES[case]
    ckpt = tempfile.mkdtemp(prefix="ck-", dir=work)
    proc = subprocess.Popen(train_command(db, ckpt, extra, ranks), cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = Lines(proc)
    frozen, tree = False, set()
    try:
        if not lines.first_step.wait(TIMEOUT_S):
            raise RuntimeError(f"{case}: no step logged within {TIMEOUT_S} s:\n{lines.text()}")
        moment = rng.uniform(*MOMENT_S)
        time.sleep(moment)
        if store is not None:
            store.send_signal(signal.SIGSTOP)
            frozen = True
            time.sleep(rng.uniform(*FREEZE_S))
        tree = set(session_processes(proc.pid))
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        saved = None
        while proc.poll() is None and time.monotonic() - signalled < TIMEOUT_S:
            if saved is None and any(CKPT.match(n) for n in os.listdir(ckpt)):
                saved = time.monotonic()
            time.sleep(0.005)
        if proc.poll() is None:
            raise RuntimeError(f"{case}: still running {TIMEOUT_S} s after SIGTERM:\n{lines.text()}")
        exited = time.monotonic()
        left = [process_name(pid) for pid in session_processes(proc.pid, tree)]
        time.sleep(LINGER_S)
        lingering = [process_name(pid) for pid in session_processes(proc.pid, tree)]
        if saved is None and any(CKPT.match(n) for n in os.listdir(ckpt)):
            saved = exited
    finally:
        if frozen:
            store.send_signal(signal.SIGCONT)
        kill_all(session_processes(proc.pid, tree))
        proc.wait()
    text = lines.text()
    save_s = float(SAVED.findall(text)[-1][1]) if SAVED.search(text) else None
    step_s = lines.step_s()
    result = {"case": case, "moment_s": round(moment, 3), "exit_code": proc.returncode,
              "saved_s": None if saved is None else round(saved - signalled, 3),
              "exit_s": round(exited - signalled, 3), "after_save_s": None if saved is None else round(exited - saved, 3),
              "left": left, "left_after_linger": lingering, "step_s": None if step_s is None else round(step_s, 4), "save_s": save_s}
    result["bound_s"] = round(step_s + save_s + 1.0, 3) if step_s is not None and save_s is not None else None
    result["within"] = result["saved_s"] is not None and result["bound_s"] is not None \
        and result["saved_s"] <= result["bound_s"]
    if saved is None:
        result["log_tail"] = text.splitlines()[-15:]
    shutil.rmtree(ckpt, ignore_errors=True)
    return result


def start_store(work: str) -> tuple[subprocess.Popen, dict]:
    """A moto S3 server on a free local port, and the environment that points lancedb at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ALLOW_HTTP": "true"}
    return proc, env


def print_table(rows: list[dict]) -> None:
    print(f"{'case':>20} {'trials':>6} {'saved s (min/med/max)':>22} {'exit s (med/max)':>17} "
          f"{'bound s':>8} {'within':>7} {'left':>5} {'after 2 s':>9}")
    for r in rows:
        print(f"{r['case']:>20} {r['trials']:>6} {r['saved_min_s']:>6.2f} {r['saved_median_s']:>6.2f} "
              f"{r['saved_max_s']:>8.2f} {r['exit_median_s']:>7.2f} {r['exit_max_s']:>9.2f} "
              f"{r['bound_median_s']:>8.2f} {r['within']:>7} {r['left']:>5} {r['lingering']:>9}", flush=True)


def summary(case: str, trials: list[dict]) -> dict:
    saved = [t["saved_s"] if t["saved_s"] is not None else float("inf") for t in trials]
    exits = [t["exit_s"] for t in trials]
    bounds = [t["bound_s"] for t in trials if t["bound_s"] is not None] or [float("nan")]
    return {"case": case, "trials": len(trials), "saved_min_s": min(saved), "saved_median_s": statistics.median(saved),
            "saved_max_s": max(saved), "exit_median_s": statistics.median(exits), "exit_max_s": max(exits),
            "bound_median_s": statistics.median(bounds), "within": f"{sum(t['within'] for t in trials)}/{len(trials)}",
            "left": sum(len(t["left"]) for t in trials), "lingering": sum(len(t["left_after_linger"]) for t in trials),
            "runs": trials}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--trials", type=int, default=5, help="stops per case, each at a random moment")
    p.add_argument("--seed", type=int, default=0, help="seed of the random moments")
    p.add_argument("--quick", action="store_true", help="one trial of epoch-end (a smoke run)")
    p.add_argument("--out", default=DEFAULT_OUT, help="results JSON")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.cases, opts.trials = "epoch-end", 1
    opts.cases = name_list("--cases", opts.cases, CASES)
    if opts.trials < 1:
        raise UserError(f"--trials must be at least 1 (got {opts.trials})")
    return opts


def main(argv=None) -> None:
    opts = options_or_exit(parse_args, argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped bench kills its runs on the way out
    work = tempfile.mkdtemp(prefix="stop-bench-")
    rng = random.Random(opts.seed)
    store, results = None, []
    try:
        for case in opts.cases:
            rows, _, on_s3, _ = CASES[case]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if on_s3:
                if store is None:
                    store, store_env = start_store(work)
                    os.environ.update(store_env)
                    import boto3

                    boto3.client("s3").create_bucket(Bucket="stop-bench")
                env.update(store_env)
                db = "s3://stop-bench/db"
            else:
                db = os.path.join(work, f"rows_{rows}")
            if on_s3 or not os.path.exists(db):
                synthetic_corpus(db, rows, *DOC_TOKENS, seed=0)
            trials = [one_trial(db, work, case, rng, env, store if on_s3 else None) for _ in range(opts.trials)]
            results.append(summary(case, trials))
            print_table(results[-1:])
    finally:
        if store is not None:
            store.kill()
            store.wait()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(results)
    settings = {"model": "tiny", "batch_size": BATCH, "num_splits": SPLITS, "seq_len": SEQ_LEN,
                "epoch_steps": EPOCH_STEPS, "moment_s": MOMENT_S, "freeze_s": FREEZE_S, "seed": opts.seed,
                "cases": {c: {"rows": CASES[c][0], "flags": CASES[c][1], "s3": CASES[c][2], "ranks": CASES[c][3]}
                          for c in opts.cases}}
    write_json(opts.out, {"machine": machine_info(), "settings": settings, "results": results})
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
