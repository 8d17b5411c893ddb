"""Fault tolerance under torchrun's own agent (gloo on the CPU), with one command line for every
attempt (`--resume if-any --global-batch-size`):

- one node, `--max-restarts 1`, rank 0 (the --ckpt-dir lock's holder) SIGKILLed after a
  checkpoint: the agent restarts the group, which takes the dead attempt's lock over and
  resumes from the newest complete checkpoint; every step trains on the straight run's
  samples and the final weights are the straight run's, bit for bit: no step counts twice;
- two torchrun "nodes" of one process each, `--nnodes 1:2`, c10d rendezvous on 127.0.0.1, one
  node's whole process tree killed after a checkpoint: the survivor re-forms alone at world
  size 1, keeps 16 samples a step (4 micro-steps instead of 2), and finishes with the straight
  two-rank run's samples at every step and its weights within WEIGHTS_RTOL of that run's;
- a node that joins a group running alone: the agents re-form it at world size 2 after its rank
  checkpointed the step it was at (SIGTERM from its agent), and no step is lost;
- another run on the same --ckpt-dir while the first is alive is refused in one line;
- a user error, which the agent retries like a crash, names each attempt on its line.

Nothing is left behind: no process, no lock, no temp or loose loader file.
"""

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import (assert_user_error, free_port, kill_tree, pids_mentioning, process_tree, read_trace,
                      run_train, start_train, wait_gone, warm_run_of)

pytestmark = pytest.mark.slow  # trains in processes of its own: `-m "not slow"` leaves it out

STEPS, CKPT_EVERY, GLOBAL_BATCH, BATCH = 20, 5, 16, 4
FLAGS = ["--model", "tiny", "--seq-len", 64, "--log-every", 5, "--eval-batches", 1, "--warmup-steps", 5,
         "--lr-total-steps", STEPS, "--steps", STEPS, "--ckpt-every", CKPT_EVERY, "--num-splits", 4,
         "--global-batch-size", GLOBAL_BATCH, "--batch-size", BATCH, "--resume", "if-any"]
TIMEOUT = 240  # per run: a hang fails the test instead of blocking CI
# Two "nodes" on one machine: a dead node's heartbeats are missed after 1 s x 3, and a
# rendezvous that has its minimum of nodes waits 3 s more for others (torchrun's defaults:
# 5 s x 3 and 30 s, README "Fault-tolerant runs"). Not x 2: a live agent writes its heartbeat
# only once the last is an interval old, so up to 2 intervals apart, and a node that joined
# took the other, alive, for dead and formed a group of its own.
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"
# At world size 1 each step's 16 samples are 4 micro-batches of one cycle on one rank, where the
# straight run all-reduced 2 ranks x 2 micro-batches of two cycles: the same samples, grouped
# otherwise into micro-batches whose losses are each a mean over their own tokens. Measured
# (relative L2 to the straight run's weights at step 20): 1.7e-4 for a node lost at step 5,
# 5.1e-4 for a node that joined at step 5 (the steps before it at world size 1); the 15 steps
# after step 5 moved the weights 5.1e-2. The traces hold the exact check: the same samples in
# every step; the lost rank's run (the same world size throughout) ends bit for bit equal.
WEIGHTS_RTOL = 1e-3
STARTED = re.compile(r"^(started fresh in \S+(?: \([^)]*\))?|resumed from (\S+) \(epoch \d+, opt step (\d+)\))"
                     r", torchrun attempt (\d+) of run (\S+) \(--max-restarts 1\)", re.M)


def flags(db, ck, trace):
    return ["--db", db, *FLAGS, "--ckpt-dir", ck, "--trace-samples", trace]


def rank_pids(agent):
    """rank -> the pids that are that rank under the agent `agent` (its torchrun worker, and
    where it runs warm, the run the warm client stands for)."""
    ranks = collections.defaultdict(list)
    for pid in process_tree(agent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            ranks[int(env[b"RANK"])].append(pid)
            if (run := warm_run_of(pid)) is not None:
                ranks[int(env[b"RANK"])].append(run)
    return dict(ranks)


def signal_all(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_for_checkpoint(ck, procs, step=CKPT_EVERY, timeout=TIMEOUT):
    path = ck / f"step_{step:08d}.pt"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            pytest.fail(f"no {path.name} before a run ended or {timeout} s passed")
        time.sleep(0.02)


def committed(ck):
    return max(int(m[1]) for n in os.listdir(ck) if (m := re.match(r"^step_(\d{8})\.pt$", n)))


def finish(proc, timeout=TIMEOUT):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"did not finish within {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def lost_rank_run(db, root):
    """One node, 2 ranks, --max-restarts 1; once step 5 is committed both ranks are frozen (the
    faults land mid-run), another run tries the --ckpt-dir, and rank 0 is SIGKILLed."""
    ck, trace = root / "ck-rank", root / "trace-rank"
    proc = start_train(2, *flags(db, ck, trace), cwd=root, cold=False,
                       torchrun=["--standalone", "--max-restarts", 1])
    try:
        wait_for_checkpoint(ck, [proc])
        ranks = rank_pids(proc.pid)
        signal_all(ranks[0] + ranks[1], signal.SIGSTOP)
        newest = committed(ck)
        lock = (ck / "train.lock").read_text()
        intruder = run_train(1, *flags(db, ck, root / "trace-intruder"), cwd=root, timeout=TIMEOUT)
        signal_all(ranks[0], signal.SIGKILL)
        signal_all(ranks[1], signal.SIGCONT)
        done = finish(proc)
    finally:
        kill_tree(proc.pid)
    return {"proc": done, "ck": ck, "trace": trace, "newest": newest, "intruder": intruder,
            "killed": ranks[0], "lock": json.loads(lock)}


def node_flags(port, run_id, is_host):
    return ["--nnodes", "1:2", "--max-restarts", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(is_host)},{RDZV_CONF}"]


def lost_node_run(db, root):
    """Two one-process "nodes" under --nnodes 1:2; node b (not the rendezvous host) loses its
    whole process tree once step 5 is committed, node a frozen meanwhile."""
    ck, trace = root / "ck-node", root / "trace-node"
    port, run_id = free_port(), f"ft-{uuid.uuid4().hex[:12]}"
    env = {"OMP_NUM_THREADS": "1"}  # torchrun sets it only for several processes per node
    b = start_train(1, *flags(db, ck, trace), cwd=root, cold=False, env=env,
                    torchrun=node_flags(port, run_id, is_host=False))
    a = start_train(1, *flags(db, ck, trace), cwd=root, cold=False, env=env,
                    torchrun=node_flags(port, run_id, is_host=True))
    try:
        wait_for_checkpoint(ck, [a, b])
        survivor = rank_pids(a.pid)
        frozen = [pid for pids in survivor.values() for pid in pids]
        signal_all(frozen, signal.SIGSTOP)
        newest = committed(ck)
        killed = kill_tree(b.pid)
        signal_all(frozen, signal.SIGCONT)
        done = finish(a)
        lost = finish(b, timeout=30)
    finally:
        kill_tree(a.pid)
        kill_tree(b.pid)
    return {"proc": done, "lost": lost, "ck": ck, "trace": trace, "newest": newest, "killed": killed,
            "lost_rank": 1 - next(iter(survivor))}


def pending(pid, sig):
    """Whether `sig` waits, undelivered, for the (stopped) process `pid`."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return False
    return any(mask & (1 << (sig - 1)) for mask in masks)


def joined_node_run(db, root):
    """Node a alone under --nnodes 1:2 (world size 1) until step 5 is committed; then, with its
    rank frozen, node b starts. a's agent sees b waiting and SIGTERMs its rank, which is then
    let go: it checkpoints the step it is at, and the two re-form at world size 2. The
    agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.14's shared store a
    node that joins waits for a key its new rank 0 never writes (README "Fault-tolerant runs")."""
    ck, trace = root / "ck-join", root / "trace-join"
    port, run_id = free_port(), f"ft-{uuid.uuid4().hex[:12]}"
    env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    a = start_train(1, *flags(db, ck, trace), cwd=root, cold=False, env=env,
                    torchrun=node_flags(port, run_id, is_host=True))
    b = None
    try:
        wait_for_checkpoint(ck, [a])
        alone = [pid for pids in rank_pids(a.pid).values() for pid in pids]
        signal_all(alone, signal.SIGSTOP)
        b = start_train(1, *flags(db, ck, trace), cwd=root, cold=False, env=env,
                        torchrun=node_flags(port, run_id, is_host=False))
        deadline = time.monotonic() + TIMEOUT
        while not any(pending(pid, signal.SIGTERM) for pid in alone) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal_all(alone, signal.SIGCONT)
        done, joined = finish(a), finish(b)
    finally:
        for proc in (a, b):
            if proc is not None:
                kill_tree(proc.pid)
    return {"proc": done, "joined": joined, "ck": ck, "trace": trace, "killed": []}


@pytest.fixture(scope="module")
def runs(demo_db, tmp_path_factory):
    """The straight two-rank run and the faulted ones, side by side."""
    root = tmp_path_factory.mktemp("fault-tolerance")
    with ThreadPoolExecutor(4) as pool:
        straight = pool.submit(run_train, 2, *flags(demo_db, root / "ck-straight", root / "trace-straight"),
                               cwd=root, timeout=TIMEOUT)
        faults = {name: pool.submit(scenario, demo_db, root)
                  for name, scenario in (("rank", lost_rank_run), ("node", lost_node_run), ("join", joined_node_run))}
        straight = straight.result()
        assert straight.returncode == 0, straight.stdout + straight.stderr
        return {"straight": straight, "root": root, **{name: f.result() for name, f in faults.items()}}


def per_step(trace_dir):
    """step -> (Counter of the samples all ranks trained on, the sizes of the ranks' records)."""
    steps = collections.defaultdict(lambda: (collections.Counter(), []))
    for records in read_trace(trace_dir).values():
        for r in records:
            steps[r["step"]][0].update(r["samples"])
            steps[r["step"]][1].append(len(r["samples"]))
    return dict(steps)


def final_weights(ck, step=STEPS):
    return torch.load(ck / f"step_{step:08d}.pt", weights_only=True)["model"]


def distance(a, b):
    """|a - b| / |b| over all weights (L2)."""
    gap = torch.linalg.vector_norm(torch.cat([(a[k] - b[k]).flatten() for k in b]))
    return float(gap / torch.linalg.vector_norm(torch.cat([b[k].flatten() for k in b])))


def assert_left_nothing(run):
    assert wait_gone(run["killed"]) == [], "a process of the killed attempt is still alive"
    assert pids_mentioning(str(run["ck"])) == [], "a process of the run outlived it"
    names = sorted(os.listdir(run["ck"]))
    assert "train.lock" not in names and not [n for n in names if ".tmp" in n], names
    committed_steps = {n[:13] for n in names if re.match(r"^step_\d{8}\.pt$", n)}
    assert all(n[:13] in committed_steps for n in names), f"loader files of uncommitted steps: {names}"


def starts(stdout):
    return STARTED.findall(stdout)


def test_a_lost_rank_restarts_from_the_newest_checkpoint_and_trains_the_straight_run(runs):
    run, straight = runs["rank"], runs["straight"]
    proc, newest = run["proc"], run["newest"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert CKPT_EVERY <= newest < STEPS
    (fresh, *_, attempt0, run_id0), (resumed, path, step, attempt1, run_id1) = starts(proc.stdout)
    assert fresh.startswith("started fresh in ") and attempt0 == "0"
    assert (path, int(step), attempt1) == (str(run["ck"] / f"step_{newest:08d}.pt"), newest, "1")
    assert run_id0 == run_id1 == run["lock"]["run_id"] and run["lock"]["restart_count"] == 0
    assert "grad_accum=2 (--global-batch-size 16 / 8)" in proc.stdout
    assert f"final: opt_step={STEPS} " in proc.stdout
    # the dead rank 0's lock, taken over by the next attempt's rank 0
    assert f"warning: taking over the stale lock {run['ck'] / 'train.lock'} of pid {run['lock']['pid']}" in proc.stderr
    assert "(an earlier worker group of this torchrun run, attempt 0)" in proc.stderr

    got, want = per_step(run["trace"]), per_step(runs["root"] / "trace-straight")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == want[step], f"step {step} differs from the straight run"
    assert sum(want[1][0].values()) == GLOBAL_BATCH and want[1][0] != want[2][0]
    # no step counted twice: the weights are the straight run's, bit for bit
    a, b = final_weights(run["ck"]), final_weights(runs["root"] / "ck-straight")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert_left_nothing(run)


def test_another_run_is_refused_the_ckpt_dir_of_a_live_one(runs):
    run = runs["rank"]
    assert_user_error(run["intruder"], f"--ckpt-dir {run['ck']} is in use by pid {run['lock']['pid']}")
    assert not (runs["root"] / "trace-intruder").exists()


def test_a_lost_node_leaves_the_survivor_to_finish_alone_with_the_same_steps(runs):
    run = runs["node"]
    proc, lost, newest = run["proc"], run["lost"], run["newest"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert CKPT_EVERY <= newest < STEPS
    first_lines = (lost.stdout if run["lost_rank"] == 0 else proc.stdout)
    assert "world_size=2 global_batch=8 num_splits=4" in first_lines and "grad_accum=2" in first_lines
    (resumed, path, step, attempt, _), = [s for s in starts(proc.stdout) if s[1]]
    assert (path, int(step), attempt) == (str(run["ck"] / f"step_{newest:08d}.pt"), newest, "1")
    assert "world_size=1 global_batch=4 num_splits=4 compile=False num_workers=0" in proc.stdout
    assert "grad_accum=4 (--global-batch-size 16 / 4)" in proc.stdout
    assert f"final: opt_step={STEPS} " in proc.stdout

    got, want = per_step(run["trace"]), per_step(runs["root"] / "trace-straight")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step][0] == want[step][0], f"step {step} differs from the straight two-rank run"
        assert got[step][1] == ([8, 8] if step <= newest else [16]), (step, got[step][1])
    survivor, straight = final_weights(run["ck"]), final_weights(runs["root"] / "ck-straight")
    at_loss = final_weights(runs["root"] / "ck-straight", newest)
    gap, moved = distance(survivor, straight), distance(straight, at_loss)
    print(f"\nlost node at step {newest}: the survivor's weights are {gap:.2e} from the straight run's, "
          f"which moved {moved:.2e} after that step (relative L2)")
    assert gap < WEIGHTS_RTOL < moved / 10
    assert_left_nothing(run)


def test_a_node_that_joins_reforms_the_group_at_the_larger_world_size_with_the_same_steps(runs):
    run = runs["join"]
    proc, joined = run["proc"], run["joined"]
    assert proc.returncode == 0 and joined.returncode == 0, proc.stdout + proc.stderr + joined.stdout + joined.stderr
    out = proc.stdout + joined.stdout  # rank 0 prints: a's rank alone, then whichever node is rank 0
    stopped = re.search(r"^stopped by SIGTERM at step (\d+): saved (\S+);", out, re.M)
    assert stopped, out
    step = int(stopped[1])
    assert CKPT_EVERY <= step < STEPS
    starts = STARTED.findall(out)
    assert [(path, s, attempt) for _, path, s, attempt, _ in starts] == [("", "", "0"), (stopped[2], str(step), "0")]
    assert "world_size=1 global_batch=4" in out and "world_size=2 global_batch=8" in out
    assert f"final: opt_step={STEPS} " in out

    got, want = per_step(run["trace"]), per_step(runs["root"] / "trace-straight")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in want:
        assert got[s][0] == want[s][0], f"step {s} differs from the straight two-rank run"
        assert got[s][1] == ([16] if s <= step else [8, 8]), (s, got[s][1])
    gap = distance(final_weights(run["ck"]), final_weights(runs["root"] / "ck-straight"))
    assert gap < WEIGHTS_RTOL, gap
    assert_left_nothing(run)


def test_a_user_error_is_retried_by_the_agent_and_each_attempt_says_which_it_is(demo_db, tmp_path):
    """torchrun retries exit 2 like a crash: every attempt fails alike within seconds, and
    its line names the attempt, so the repeats read as one mistake, not as new ones."""
    missing = tmp_path / "nowhere" / "step_00000005.pt"
    proc = start_train(1, "--db", demo_db, "--model", "tiny", "--resume", missing, cwd=tmp_path, cold=False,
                       torchrun=["--standalone", "--max-restarts", 1])
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode != 0, out + err
    lines = [re.sub(r" of run \S+ ", " of run ID ", line) for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: checkpoint '{missing}' does not exist [torchrun attempt {n} of run ID "
                     f"(--max-restarts 1): the agent retries a user error too, until --max-restarts is spent]"
                     for n in (0, 1)], err
