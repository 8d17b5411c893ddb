"""What a lost node costs a run under torchrun's agent: the seconds from its death to the
first optimizer step trained after it, in parts, against the rendezvous settings and the
table's size.

Usage:
    python bench/fault_tolerance.py [--rows 20000,200000,2000000] [--settings defaults,fast]
        [--repeats 2] [--pack] [--out bench/results/fault_tolerance.json] [--quick]

Two torchrun "nodes" of one process each (`--nnodes 1:2 --max-restarts 1`, c10d rendezvous on
127.0.0.1) train train.py with one command line for every attempt (`--resume if-any
--global-batch-size`) on a synthetic table of --rows documents (common.synthetic_corpus).
Once the first checkpoint is committed, node b's whole process tree is SIGKILLed, as when a
machine goes. Node a is timed from outside:

- detection: until its rank has exited (its next collective fails: gloo sees the peer's
  socket close at once; NCCL waits for --dist-timeout unless its watchdog sees it sooner);
- re-rendezvous: until its agent has started the next rank: the dead node's heartbeats
  must be missed (`keep_alive_interval` x `keep_alive_max_attempt`) and a rendezvous that
  has its minimum of nodes waits `last_call_timeout` for more;
- resume: until the new rank prints "resumed from" (imports, the process group, the
  checkpoint, the table opened and the epoch planned);
- first step: until the new rank traces the first step after the checkpoint (the loader
  started at the checkpoint's position, one step of 4 micro-batches).

Settings: `defaults` is torchrun's (heartbeat 5 s x 3, last call 30 s); `fast` is the README's
(`--rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5`). Each
scenario also records the peak RSS of node a's process tree (agent and rank) while it
recovers. Output: a table on stdout and JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import os
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
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ArgumentParser, UserError, synthetic_corpus  # noqa: E402
from loader_memory import int_list, kill_tree, name_list, process_tree, tree_memory  # noqa: E402
from loaders import machine_info, options_or_exit, write_json  # noqa: E402
from preemption import is_running  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "fault_tolerance.json")
SETTINGS = {
    "defaults": "",
    "fast": "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5",
}
# The README's agents: torch 2.14's shared rendezvous store fails a node that joins.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DOC_TOKENS = (10, 60)  # loader_memory.py's start-up corpus
BATCH, GLOBAL_BATCH, SPLITS, SEQ_LEN = 4, 16, 4, 64
TIMEOUT_S = 300
POLL_S = 0.01
RESUMED = re.compile(r"^resumed from \S+ \(epoch \d+, opt step (\d+)\)", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(db: str, work: str, port: int, run_id: str, is_host: bool, conf: str, pack: bool) -> list[str]:
    rdzv_conf = ",".join(filter(None, [f"is_host={int(is_host)}", conf]))
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", rdzv_conf,
            os.path.join(REPO, "train.py"), "--db", db, "--model", "tiny", "--seq-len", str(SEQ_LEN),
            "--batch-size", str(BATCH), "--global-batch-size", str(GLOBAL_BATCH), "--num-splits", str(SPLITS),
            "--steps", "1000000", "--lr-total-steps", "1000", "--ckpt-every", "5", "--log-every", "1000",
            "--resume", "if-any", "--ckpt-dir", os.path.join(work, "ck"),
            "--trace-samples", os.path.join(work, "trace"), *(["--pack"] if pack else [])]


def rank_of(agent: int) -> int | None:
    """The pid of the rank the torchrun agent `agent` runs now (its child with RANK set)."""
    for pid in process_tree(agent)[1:]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"\0RANK=" in b"\0" + f.read():
                    return pid
        except OSError:
            continue
    return None


def traced_step(trace_dir: str, step: int, samples: int) -> bool:
    """Whether some rank has traced `step` with `samples` samples (the survivor alone: all of them)."""
    for name in os.listdir(trace_dir) if os.path.isdir(trace_dir) else []:
        with open(os.path.join(trace_dir, name), "rb") as f:
            for line in f.read().split(b"\n")[:-1]:
                record = json.loads(line)
                if record["step"] == step and len(record["samples"]) == samples:
                    return True
    return False


class PeakRss:
    """The peak summed RSS of a process tree, sampled on a thread every 50 ms."""

    def __init__(self, root: int):
        self.root, self.peak_mib = root, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak_mib = max(self.peak_mib, tree_memory(self.root)["rss_mib"])

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mib


def wait_until(what: str, condition, logs) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {TIMEOUT_S} s:\n" + logs())
        time.sleep(POLL_S)
    return time.monotonic()


def one_loss(db: str, conf: str, pack: bool) -> dict:
    """Start both nodes, kill node b after the first checkpoint, time node a's recovery."""
    work = tempfile.mkdtemp(prefix="ft-bench-")
    port, run_id = free_port(), f"ft-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **AGENT_ENV}
    logs = {name: open(os.path.join(work, f"{name}.log"), "w+") for name in "ab"}
    nodes = {}
    try:
        for name, is_host in (("b", False), ("a", True)):  # b first: the lower pid, so rank 0
            nodes[name] = subprocess.Popen(node_command(db, work, port, run_id, is_host, conf, pack), cwd=work,
                                           env=env, stdout=logs[name], stderr=subprocess.STDOUT,
                                           start_new_session=True)

        def text(name="a"):
            logs[name].flush()
            with open(logs[name].name) as f:
                return f.read()

        def all_logs():
            return "\n".join(f"--- node {n}\n{text(n)[-3000:]}" for n in "ab")

        ck = os.path.join(work, "ck")
        wait_until("first checkpoint", lambda: os.path.exists(os.path.join(ck, "step_00000005.pt")), all_logs)
        survivor = rank_of(nodes["a"].pid)
        memory = PeakRss(nodes["a"].pid)
        steps = sorted(int(n[5:13]) for n in os.listdir(ck) if re.match(r"^step_\d{8}\.pt$", n))
        killed = time.monotonic()
        kill_tree(nodes["b"].pid)
        detected = wait_until("exit of the survivor's rank", lambda: not is_running(survivor), all_logs)
        reformed = wait_until("new rank", lambda: rank_of(nodes["a"].pid) not in (None, survivor), all_logs)
        resumed = wait_until("resume", lambda: RESUMED.search(text()) is not None, all_logs)
        step = int(RESUMED.search(text())[1])
        first = wait_until("first step after the loss",
                           lambda: traced_step(os.path.join(work, "trace"), step + 1, GLOBAL_BATCH), all_logs)
        peak = memory.stop()
        return {"detection_s": detected - killed, "rerendezvous_s": reformed - detected,
                "resume_s": resumed - reformed, "first_step_s": first - resumed, "total_s": first - killed,
                "checkpoint_at_loss": steps[-1], "resumed_step": step, "survivor_peak_rss_mib": round(peak, 1)}
    finally:
        for proc in nodes.values():
            kill_tree(proc.pid)
            proc.wait()
        for f in logs.values():
            f.close()
        shutil.rmtree(work, ignore_errors=True)


PARTS = ("detection_s", "rerendezvous_s", "resume_s", "first_step_s", "total_s")


def print_table(results: list[dict]) -> None:
    print(f"{'rows':>10} {'settings':>9} " + " ".join(f"{p[:-2]:>12}" for p in PARTS) + f" {'peak RSS MiB':>13}")
    for r in results:
        print(f"{r['rows']:>10,} {r['settings']:>9} " + " ".join(f"{r[p]:>12.2f}" for p in PARTS)
              + f" {r['survivor_peak_rss_mib']:>13,.0f}", flush=True)


def median_of(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in (*PARTS, "survivor_peak_rss_mib")}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="20000,200000,2000000", help="table sizes, comma-separated")
    p.add_argument("--settings", default="defaults,fast", help=f"rendezvous settings: {', '.join(SETTINGS)}")
    p.add_argument("--repeats", type=int, default=2, help="losses per (rows, settings); the table shows medians")
    p.add_argument("--pack", action="store_true", help="train with --pack (default: rows)")
    p.add_argument("--work", default="", help="where the tables go (default: a temp dir, removed after)")
    p.add_argument("--quick", action="store_true", help="one loss on 20,000 rows with the fast settings")
    p.add_argument("--out", default=DEFAULT_OUT, help="results JSON")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.rows, opts.settings, opts.repeats = "20000", "fast", 1
    opts.rows = int_list("--rows", opts.rows)
    opts.settings = name_list("--settings", opts.settings, SETTINGS)
    if opts.repeats < 1:
        raise UserError(f"--repeats must be at least 1 (got {opts.repeats})")
    return opts


def main(argv=None) -> None:
    opts = options_or_exit(parse_args, argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped bench kills its nodes on the way out
    work = opts.work or tempfile.mkdtemp(prefix="ft-bench-tables-")
    results = []
    try:
        for rows in opts.rows:
            db = os.path.join(work, f"rows_{rows}")
            if not os.path.exists(db):
                started = time.perf_counter()
                synthetic_corpus(db, rows, *DOC_TOKENS, seed=0)
                print(f"table: {rows:,} documents of {DOC_TOKENS[0]}-{DOC_TOKENS[1]} tokens in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
            for name in opts.settings:
                runs = [one_loss(db, SETTINGS[name], opts.pack) for _ in range(opts.repeats)]
                results.append({"rows": rows, "settings": name, "rdzv_conf": SETTINGS[name] or "(torchrun's)",
                                **median_of(runs), "runs": runs})
                print_table(results[-1:])
    finally:
        if not opts.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(results)
    settings = {"nodes": "2 x 1 process, --nnodes 1:2, --max-restarts 1, c10d on 127.0.0.1",
                "batch_size": BATCH, "global_batch_size": GLOBAL_BATCH, "num_splits": SPLITS,
                "seq_len": SEQ_LEN, "model": "tiny", "pack": opts.pack, "repeats": opts.repeats,
                "doc_tokens": list(DOC_TOKENS), "agent_env": AGENT_ENV}
    write_json(opts.out, {"machine": machine_info(), "settings": settings, "results": results})
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
