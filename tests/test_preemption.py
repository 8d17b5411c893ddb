"""Preemption under real signals: a stop signal checkpoints every rank at one agreed step and
exits 0, the resume loses and repeats no step; ranks and loader workers never outlive a
killed torchrun agent; a rank whose peer died or hung ends with one line.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import checkpoint
from conftest import (REPO, free_port, is_alive, kill_tree, process_tree, read_trace, run_train,
                      start_train, wait_gone)

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

STEPS = 16
FAST = ["--model", "tiny", "--seq-len", 64, "--log-every", 4, "--eval-batches", 1, "--warmup-steps", 2,
        "--lr-total-steps", STEPS, "--num-splits", 4]
GRACE = 30  # seconds: a typical preemption grace period, and torchrun's shutdown timeout
STOPPED = re.compile(r"stopped by (\w+) at step (\d+): saved (\S+); continue with --resume auto")
AGENT_LOST = re.compile(r"stopped at step (\d+): torchrun's agent on a node died, so that node leaves the run; "
                        r"saved (\S+); the agents left start the run again from it without that node")


def flags(db, nproc, *extra):
    return ["--db", db, *FAST, "--batch-size", 8 // nproc, *extra]


def wait_for_steps(trace_dir, steps, proc, timeout=180):
    """Block until rank 0 has traced `steps` optimizer steps (the run is mid-training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        records = read_trace(trace_dir).get(0, []) if os.path.isdir(trace_dir) else []
        if len(records) >= steps:
            return
        time.sleep(0.1)
    pytest.fail(f"no {steps} steps within {timeout}s")


def steps_per_rank(trace_dir):
    return {rank: [r["step"] for r in records] for rank, records in read_trace(trace_dir).items()}


def samples_per_step(trace_dir):
    found = {}
    for records in read_trace(trace_dir).values():
        for r in records:
            found.setdefault(r["step"], []).extend(r["samples"])
    return {step: sorted(samples) for step, samples in found.items()}


def newest_step(ck):
    path, ckpt, _ = checkpoint.load_resume("auto", str(ck))
    return ckpt["opt_step"]


def test_sigterm_to_torchrun_checkpoints_at_one_step_and_the_resume_loses_none(demo_db, tmp_path):
    straight = run_train(2, *flags(demo_db, 2, "--steps", STEPS, "--ckpt-dir", tmp_path / "ck-straight",
                                   "--trace-samples", tmp_path / "t-straight"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    ck, trace = tmp_path / "ck", tmp_path / "t-cut"
    first = start_train(2, *flags(demo_db, 2, "--steps", STEPS, "--ckpt-every", 100, "--ckpt-dir", ck,
                                  "--trace-samples", trace), cwd=tmp_path,
                        torchrun=["--standalone", "--max-restarts", 1])  # a stop is not retried
    try:
        wait_for_steps(trace, 3, first)
        sent = time.monotonic()
        first.send_signal(signal.SIGTERM)  # to torchrun's agent, as a scheduler does; it forwards it
        out, err = first.communicate(timeout=GRACE)
        took = time.monotonic() - sent
    finally:
        kill_tree(first.pid)
    stopped = STOPPED.search(out)
    # One attempt: a restart would have been refused in this --ckpt-dir, which now holds a
    # checkpoint, with an error line. (The agent itself exits 1, with torchrun's SignalException.)
    assert stopped and stopped[1] == "SIGTERM" and len(STOPPED.findall(out)) == 1, out + err
    step = int(stopped[2])
    assert 3 <= step < STEPS and took < GRACE
    assert newest_step(ck) == step and stopped[3] == str(ck / f"step_{step:08d}.pt")
    assert "error:" not in err and "lost contact" not in err, err
    assert steps_per_rank(trace) == {0: list(range(1, step + 1)), 1: list(range(1, step + 1))}

    resumed = run_train(2, *flags(demo_db, 2, "--steps", STEPS, "--ckpt-dir", ck, "--resume", "auto",
                                  "--trace-samples", trace), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"(epoch 0, opt step {step})" in resumed.stdout
    every_step = list(range(1, STEPS + 1))
    assert steps_per_rank(trace) == {0: every_step, 1: every_step}  # none lost, none repeated
    assert samples_per_step(trace) == samples_per_step(tmp_path / "t-straight")


@pytest.mark.parametrize("how", ["SIGUSR1", "Ctrl-C"])
def test_a_stop_signal_ends_a_single_process_run_with_exit_0(demo_db, tmp_path, how):
    """SIGUSR1 to the process; Ctrl-C as a terminal sends it, to the whole process group,
    loader workers included (they must ignore it and keep feeding the last step)."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    proc = start_train(1, *flags(demo_db, 1, "--epochs", 100, "--ckpt-every", 1000, "--ckpt-dir", ck,
                                 "--trace-samples", trace, "--num-workers", 2), cwd=tmp_path)
    try:
        wait_for_steps(trace, 2, proc)
        if how == "SIGUSR1":
            proc.send_signal(signal.SIGUSR1)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=GRACE)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out + err
    stopped = STOPPED.search(out)
    assert stopped and stopped[1] == ("SIGINT" if how == "Ctrl-C" else how), out + err
    assert newest_step(ck) == int(stopped[2]) and not (ck / "train.lock").exists()


def test_a_second_ctrl_c_exits_at_once(demo_db, tmp_path):
    """Steps of ~0.5 s and a stop one step after the signal: the second Ctrl-C, 0.3 s after the
    first, lands before a graceful stop. Not sooner: two signals that arrive while the main
    thread is inside one torch op reach Python's handler as one (a busy machine did that at 50 ms)."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    proc = start_train(1, *flags(demo_db, 1, "--epochs", 100, "--ckpt-every", 1000, "--ckpt-dir", ck,
                                 "--trace-samples", trace, "--seq-len", 256, "--batch-size", 16),
                       cwd=tmp_path)
    try:
        wait_for_steps(trace, 2, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=GRACE)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 130 and "Traceback" not in err, out + err
    assert err.strip().splitlines()[-1].startswith("interrupted by a second Ctrl-C")
    assert not STOPPED.search(out) and not (ck / "train.lock").exists()


def test_ranks_and_loader_workers_never_outlive_a_killed_agent(demo_db, tmp_path):
    """The agent SIGKILLed alone (an OOM kill): its ranks get SIGTERM from the kernel, checkpoint
    together and exit 1 (for the agents of other nodes: a failed group, to restart without
    this node), and their loader workers follow; the checkpoint left is complete."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    agent = start_train(2, *flags(demo_db, 2, "--epochs", 100, "--ckpt-every", 1000, "--ckpt-dir", ck,
                                  "--trace-samples", trace, "--num-workers", 1), cwd=tmp_path)
    try:
        wait_for_steps(trace, 2, agent)
        tree = process_tree(agent.pid)
        assert len(tree) >= 1 + 2 + 2, tree  # the agent, 2 ranks, and their loader processes
        os.kill(agent.pid, signal.SIGKILL)
        survivors = wait_gone(tree, timeout=GRACE)
        out, err = agent.communicate(timeout=10)
    finally:
        kill_tree(agent.pid)
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]
    stopped = AGENT_LOST.search(out)
    assert stopped and not STOPPED.search(out), out + err
    assert newest_step(ck) == int(stopped[1]) and stopped[2] == str(ck / f"step_{int(stopped[1]):08d}.pt")
    assert not (ck / "train.lock").exists() and "Traceback" not in err


@pytest.mark.parametrize("fate", ["killed", "hung"])
def test_a_rank_whose_peer_is_gone_ends_with_one_line(demo_db, tmp_path, fate):
    """Two ranks started by hand (no agent to clean up after them): rank 1 is SIGKILLed, or
    SIGSTOPped as a hung peer; rank 0 leaves within --dist-timeout with one clear line."""
    timeout = 10
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    trace = tmp_path / "trace"
    args = flags(demo_db, 2, "--epochs", 100, "--ckpt-every", 1000, "--ckpt-dir", tmp_path / "ck",
                 "--trace-samples", trace, "--dist-timeout", timeout)
    ranks = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *map(str, args)], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for r in (0, 1)]
    try:
        wait_for_steps(trace, 2, ranks[0])
        os.kill(ranks[1].pid, signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        sent = time.monotonic()
        out, err = ranks[0].communicate(timeout=timeout + GRACE)
        took = time.monotonic() - sent
    finally:
        for proc in ranks:
            kill_tree(proc.pid)
            proc.communicate()
    assert ranks[0].returncode == 1, out + err
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost contact with the other ranks"), err
    assert f"--dist-timeout {timeout} s" in errors[0]
    assert took < timeout + GRACE
    assert not (tmp_path / "ck" / "train.lock").exists()


@pytest.fixture(scope="module")
def short_epochs(tmp_path_factory):
    """A table of 32 documents: 8-step epochs at --batch-size 4, so a run keeps starting
    the next epoch's loader (its worker processes) while the last one drains."""
    from common import synthetic_corpus

    db = str(tmp_path_factory.mktemp("short-epochs") / "db")
    synthetic_corpus(db, 32, 10, 60)
    return db


SHORT_EPOCHS = ["--model", "tiny", "--seq-len", 64, "--batch-size", 4, "--num-splits", 4, "--epochs", 100000,
                "--steps", 1000000, "--lr-total-steps", 1000, "--warmup-steps", 10, "--ckpt-every", 1000000,
                "--log-every", 1, "--num-workers", 2]


def test_a_stop_while_the_next_epochs_workers_start_is_saved_within_a_step(short_epochs, tmp_path):
    """SIGTERM the moment a new loader worker appears (the next epoch starting): the stop's
    checkpoint is on disk within one step plus the save plus 1 s, not after the loader's
    shutdown (which waits for that start), and the process is gone within 10 s after it,
    leaving no worker, forkserver or resource tracker behind."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    proc = start_train(1, "--db", short_epochs, *SHORT_EPOCHS, "--ckpt-dir", ck, "--trace-samples", trace,
                       cwd=tmp_path)
    try:
        steps_at = []  # when each optimizer step was first seen traced: the step time
        deadline = time.monotonic() + 180
        while len(steps_at) < 7:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            traced = len(read_trace(trace).get(0, [])) if trace.is_dir() else 0
            steps_at += [time.monotonic()] * (traced - len(steps_at))
            time.sleep(0.01)
        known = set(process_tree(proc.pid))
        while not set(process_tree(proc.pid)) - known:  # a new epoch's worker is being started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        tree = process_tree(proc.pid)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        saved = None
        while proc.poll() is None and time.monotonic() - sent < GRACE:
            if saved is None and list(ck.glob("step_*[0-9].pt")):
                saved = time.monotonic()
            time.sleep(0.005)
        exited = time.monotonic()
        out, err = proc.communicate(timeout=GRACE)
        survivors = wait_gone(tree, timeout=2)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0 and STOPPED.search(out), out + err
    # One step: the longest of those seen, as the step cut short may be on a busy machine.
    step_s = max(b - a for a, b in zip(steps_at, steps_at[1:]) if b > a)
    save_s = float(re.search(r"saved \S+ \(([\d.]+) s", out)[1])
    assert saved is not None and saved - sent <= step_s + save_s + 1.0, (saved and saved - sent, step_s, save_s)
    assert exited - saved <= 10, exited - saved
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]


def test_an_unexpected_error_inside_the_step_tears_the_loaders_down(short_epochs, tmp_path):
    """A bug (here an exception raised by the loss at step 5; a CUDA OOM is the same) ends the
    run with its traceback and exit 1, within the teardown's bound, and leaves no loader
    worker or thread of the pipeline: before, the next epoch's start and the workers ran on
    into interpreter teardown."""
    ck = tmp_path / "ck"
    code = ("import sys, train\n"
            "calls = [0]\n"
            "real = train.batch_loss\n"
            "def failing(*a, **k):\n"
            "    calls[0] += 1\n"
            "    if calls[0] == 5:\n"
            "        raise RuntimeError('a bug inside the step')\n"
            "    return real(*a, **k)\n"
            "train.batch_loss = failing\n"
            "train.main(sys.argv[1:])\n")
    args = ["--db", short_epochs, *SHORT_EPOCHS, "--ckpt-dir", ck]
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        tree = set()
        while proc.poll() is None:  # every process it ever had: the workers of each epoch
            tree.update(process_tree(proc.pid))
            time.sleep(0.01)
        out, err = proc.communicate(timeout=GRACE)
        survivors = wait_gone(sorted(tree), timeout=2)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 1, out + err
    assert "RuntimeError: a bug inside the step" in err and "Traceback" in err, err
    assert len(tree) >= 1 + 2, tree  # the run and its loader workers
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]


STARTUP_MOMENTS = {  # when to press Ctrl-C: a condition on the run's age, process tree and trace
    "importing": lambda age, tree, steps: age >= 0.5,  # past the interpreter's own start: importing torch
    "forkserver importing": lambda age, tree, steps: any(forkserver_age(pid) >= 0.3 for pid in tree),
    "workers starting": lambda age, tree, steps: len(tree) >= 4,  # the tracker, the forkserver, a worker
}  # once training: test_a_stop_signal_ends_a_single_process_run_with_exit_0[Ctrl-C]


def forkserver_age(pid):
    """Seconds since `pid` started if it is a forkserver (past its interpreter's own start, in
    its preload: torch), else -1."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" not in f.read():
                return -1
        with open(f"/proc/{pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError):
        return -1


@pytest.mark.parametrize("moment", STARTUP_MOMENTS)
def test_ctrl_c_at_any_moment_of_start_up_is_one_line(short_epochs, tmp_path, moment):
    """A terminal's Ctrl-C (SIGINT to the whole process group) while train.py --num-workers 2
    starts: no traceback from the run or any child, whichever is importing; exit 130 with one
    line before the run's own handling is in place, a stop (exit 0) after; nothing left."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    proc = start_train(1, "--db", short_epochs, *SHORT_EPOCHS, "--ckpt-dir", ck, "--trace-samples", trace,
                       cwd=tmp_path)
    seen, started = set(), time.monotonic()
    try:
        deadline = started + 120
        while True:
            tree = process_tree(proc.pid)
            seen.update(tree)
            steps = len(read_trace(trace).get(0, [])) if trace.is_dir() else 0
            if STARTUP_MOMENTS[moment](time.monotonic() - started, tree, steps):
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=GRACE)
        survivors = wait_gone(sorted(seen | set(tree)), timeout=5)
    finally:
        kill_tree(proc.pid)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if proc.returncode == 130:
        assert err.strip().splitlines() == ["interrupted while starting: nothing was written"], err
    else:
        assert proc.returncode == 0 and re.search(r"stopped by SIGINT (at step \d+: saved|before the first step)",
                                                  out), out + err
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]
