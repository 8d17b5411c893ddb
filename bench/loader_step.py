"""What the loader costs the training step: train.py's own data path feeding a stand-in step.

Usage:
    python bench/loader_step.py [--db DIR --table NAME --tokenizer SPEC] [--paths rows,pack]
        [--workers 0,1,2] [--batch-size 16] [--seq-len 1024] [--step-ms 30] [--epochs 3]
        [--inline] [--out FILE.json]

Each run iterates `data.train_batches` exactly as train.py does (the corpus table, rows or
--pack, --num-workers worker processes), made ahead on prefetch.Prefetcher's thread, or with
--inline on the training thread itself, as train.py did before it. The training thread runs
a stand-in step between batches: --step-ms of pure Python work, which holds the GIL and a
core as launching a GPU step's kernels does, so whatever the loader takes from that thread
(the GIL, a core, the batch itself) slows it. Per path and worker count:

- thread_ms: the training thread's CPU ms per batch inside next() (time.thread_time);
- others_ms: the CPU ms per batch of the training process's other threads (the prefetch
  thread, lancedb's I/O and transform threads: time.process_time less the training
  thread's). Much of it is Python holding the GIL, which the training thread then waits
  for: what in-process loading costs a GPU step even off the training thread;
- step_slowdown: the median step's wall time over the same step's with no loader running
  (measured in the same process just before each run, so both see the machine alike);
- data_wait: the share of wall time blocked in next();
- boundary_s / neighbours_s: the wait for the first batch of each epoch after the first,
  and the median wait of the 10 batches before each boundary;
- worker_threads: threads in each loader worker process (lance's runtime, arrow, torch),
  read from /proc mid-run;
- peak_rss_mib: the peak RSS of the whole process tree, sampled every 50 ms.

Output: a table on stdout and JSON at --out. Default corpus: the demo corpus (built on
first use, as train.py does).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import data  # noqa: E402
import train  # noqa: E402
from common import DEFAULT_DB, DEFAULT_TABLE, ArgumentParser, UserError, load_tokenizer  # noqa: E402
from loader_memory import process_tree, tree_memory  # noqa: E402
from loaders import machine_info, write_json  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "loader_step.json")
NEIGHBOURS = 10  # batches before a boundary whose waits it is compared with
CALIBRATION_STEPS = 20


def python_work(iterations: int) -> int:
    """The stand-in step: pure Python, so it needs the GIL and a core the whole time."""
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


def calibrate(step_ms: float) -> int:
    """Iterations of python_work that take about `step_ms` alone."""
    iterations = 10_000
    while True:
        start = time.perf_counter()
        python_work(iterations)
        took = (time.perf_counter() - start) * 1000
        if took > 5:
            return max(1, int(iterations * step_ms / took))
        iterations *= 2


def alone_ms(iterations: int) -> float:
    """The stand-in step's median wall ms with no loader running."""
    walls = []
    for _ in range(CALIBRATION_STEPS):
        start = time.perf_counter()
        python_work(iterations)
        walls.append((time.perf_counter() - start) * 1000)
    return statistics.median(walls)


def read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone since the walk
        return b""


class TreeSampler:
    """The peak RSS of this process tree, and each worker's thread count, on a thread."""

    def __init__(self):
        self.peak_rss = 0.0
        self.worker_threads: list[int] = []
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        me = os.getpid()
        try:
            self._sample(me)
        finally:
            self.cpu_s = time.thread_time()  # its own CPU, which others_ms leaves out

    def _sample(self, me: int):
        while not self._stop.wait(0.05):
            self.peak_rss = max(self.peak_rss, tree_memory(me)["rss_mib"])
            tree = process_tree(me)
            servers = {pid for pid in tree if b"forkserver" in read(f"/proc/{pid}/cmdline")}
            threads = []
            for pid in tree:  # a loader worker: a child of the forkserver
                stat = read(f"/proc/{pid}/stat")
                if stat and int(stat[stat.rindex(b")") + 2:].split()[1]) in servers:
                    threads.append(len(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else 0)
            if threads:
                self.worker_threads = max(self.worker_threads, sorted(threads), key=sum)

    def stop(self):
        self._stop.set()
        self._thread.join()


def one_run(opts, path: str, workers: int, iterations: int) -> dict:
    argv = ["--db", opts.db, "--table", opts.table, "--tokenizer", opts.tokenizer,
            "--batch-size", str(opts.batch_size), "--seq-len", str(opts.seq_len),
            "--num-workers", str(workers), "--epochs", str(opts.epochs)] + (["--pack"] if path == "pack" else [])
    args = train.parse_args(argv)
    num_splits = train.check_args(args, 1)
    cpu = torch.device("cpu")
    training = data.open_training_data(args, load_tokenizer(opts.tokenizer), 0, 1, cpu, num_splits,
                                       args.batch_size)
    items = data.train_batches(args, training, 0, 1, cpu, num_splits, 0, None)
    step_alone_ms = alone_ms(iterations)
    batches = items if opts.inline else data.prefetched(items, cpu)
    sampler = TreeSampler()
    thread, waits, steps, epochs = [], [], [], []
    started, process_cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    it = iter(batches)
    try:
        while True:
            wall, cpu_time = time.perf_counter(), time.thread_time()
            try:
                epoch, _, batch = next(it)
            except StopIteration:
                break
            thread.append(time.thread_time() - cpu_time)
            waits.append(time.perf_counter() - wall)
            epochs.append(epoch)
            batch["input_ids"].sum()
            step = time.perf_counter()
            python_work(iterations)
            steps.append(time.perf_counter() - step)
    finally:
        batches.close()
        sampler.stop()
    wall = time.perf_counter() - started
    others = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu) - sampler.cpu_s
    boundaries = [i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]]
    skip = min(5, len(thread) - 1)  # the first batches hold the loader's start
    return {"path": path, "workers": workers, "inline": opts.inline, "batches": len(thread),
            "thread_ms": 1000 * statistics.median(thread[skip:]),
            "thread_ms_mean": 1000 * statistics.fmean(thread[skip:]),
            "others_ms": 1000 * others / len(thread),
            "step_alone_ms": round(step_alone_ms, 2),
            "step_slowdown": 1000 * statistics.median(steps[skip:]) / step_alone_ms,
            "data_wait": sum(waits[skip:]) / (wall - sum(waits[:skip])),
            "boundary_s": [round(waits[i], 4) for i in boundaries],
            "neighbours_s": [round(statistics.median(waits[max(skip, i - NEIGHBOURS):i]), 4) for i in boundaries],
            "first_batch_s": round(waits[0], 3), "worker_threads": sampler.worker_threads,
            "peak_rss_mib": round(sampler.peak_rss, 1), "wall_s": round(wall, 2)}


def print_table(results: list[dict]) -> None:
    print(f"{'path':<6}{'workers':>8}{'loader':>8}{'thread ms':>10}{'others ms':>10}{'step x':>8}{'data_wait':>10}"
          f"{'boundary s':>12}{'neighbours s':>13}{'threads/worker':>15}{'peak RSS MiB':>13}")
    for r in results:
        boundary = "/".join(f"{s:.3f}" for s in r["boundary_s"]) or "-"
        neighbours = "/".join(f"{s:.3f}" for s in r["neighbours_s"]) or "-"
        threads = ",".join(map(str, r["worker_threads"])) or "-"
        print(f"{r['path']:<6}{r['workers']:>8}{'inline' if r['inline'] else 'thread':>8}{r['thread_ms']:>10.3f}"
              f"{r['others_ms']:>10.2f}"
              f"{r['step_slowdown']:>8.3f}{r['data_wait']:>10.1%}{boundary:>12}{neighbours:>13}{threads:>15}"
              f"{r['peak_rss_mib']:>13,.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB, help="the corpus (default: the demo corpus, built on first use)")
    p.add_argument("--table", default=DEFAULT_TABLE)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--paths", default="rows,pack", help="comma-separated: rows, pack")
    p.add_argument("--workers", default="0,1,2", help="comma-separated --num-workers values")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--step-ms", type=float, default=30.0, help="the stand-in step's length alone")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--inline", action="store_true",
                   help="make batches on the training thread (train.py before prefetch.py)")
    p.add_argument("--out", default=DEFAULT_OUT)
    opts = p.parse_args(argv)
    opts.paths = opts.paths.split(",")
    if set(opts.paths) - {"rows", "pack"}:
        raise UserError(f"--paths: rows and pack only (got {','.join(opts.paths)})")
    try:
        opts.workers = [int(w) for w in opts.workers.split(",")]
    except ValueError:
        raise UserError(f"--workers: comma-separated integers (got {opts.workers!r})") from None
    return opts


def main(argv=None) -> None:
    try:
        opts = parse_args(argv)
        mp.set_forkserver_preload(train.FORKSERVER_PRELOAD)  # as train.main
        train.project_on_workers_path()
        mp.set_start_method("forkserver", force=True)
        data.ensure_demo_corpus(opts, 0, 1)
        iterations = calibrate(opts.step_ms)
        results = []
        for path in opts.paths:
            for workers in opts.workers:
                results.append(one_run(opts, path, workers, iterations))
                print_table(results[-1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print()
    print_table(results)
    settings = {k: getattr(opts, k) for k in ("db", "table", "tokenizer", "batch_size", "seq_len", "step_ms",
                                              "epochs", "inline")}
    write_json(opts.out, {"machine": machine_info(), "settings": {**settings, "step_iterations": iterations},
                          "results": results})
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
