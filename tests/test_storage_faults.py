"""Storage faults under a run end in one line and exit 3 (common.StorageFault), with nothing lost.

Real faults: a small tmpfs fills up at a checkpoint (rank 0's file, or rank 1's loader
state), at the --metrics-file, at a --trace-samples file and at the --ckpt-dir lock;
--ckpt-dir is removed, or made read-only (a remount, which binds root too), mid-run.
Each run leaves whole files only, no temp file and no lock, and where a checkpoint
exists, `--resume auto` (once there is room) goes on to the bits of a straight run.
One rank in this process, two under real torchrun (gloo).
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import train
from checkpoint import load_checkpoint
from common import LEGACY_SCHEMA
from conftest import (frames_of_ours, is_alive, kill_tree, pids_mentioning, run_train, run_trains, start_train,
                      state_equal, wait_gone)

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

MB = 1 << 20
# A tiny model's checkpoint with its optimizer state is about 10 MB: a 25 MB --ckpt-dir
# takes two, and the third finds about 5.6 MB free.
TWO_CHECKPOINTS = 25 * MB
ROOMY = 64 * MB
PAGE = 4096  # tmpfs hands out whole pages: a 1-page one holds 4096 bytes of files
COMMON = ["--model", "tiny", "--seq-len", 64, "--epochs", 10, "--eval-batches", 1, "--log-every", 2, "--warmup-steps", 2,
          "--lr-total-steps", 12, "--ckpt-every", 2]
BATCH = {1: ["--batch-size", 4], 2: ["--batch-size", 2]}  # the same global batch of 4 documents


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """24 training documents of 20-180 random byte ids and 4 validation ones: 6 steps an epoch."""
    rng = np.random.default_rng(5)
    n = 28
    docs = [rng.integers(0, 256, rng.integers(20, 180)).tolist() for _ in range(n)]
    table = pa.table({
        "id": pa.array(range(n), pa.int64()), "text": [""] * n,
        "input_ids": pa.array(docs, pa.list_(pa.int32())), "n_tokens": pa.array(map(len, docs), pa.int32()),
        "score": pa.array([2.0] * n, pa.float32()), "is_dup": [False] * n,
        "split": ["train"] * 24 + ["val"] * 4}, schema=LEGACY_SCHEMA)
    path = tmp_path_factory.mktemp("faults") / "db"
    lancedb.connect(str(path)).create_table("corpus", table)
    return str(path)


def flags(db, ranks, ckpt_dir, *extra):
    return [str(a) for a in ("--db", db, *COMMON, *BATCH[ranks], "--ckpt-dir", ckpt_dir, *extra)]


@pytest.fixture(scope="module")
def straight(db, tmp_path_factory):
    """ranks -> the --ckpt-dir of an uninterrupted 12-step run (a checkpoint every 2 steps)."""
    root = tmp_path_factory.mktemp("straight")
    dirs = {ranks: root / f"ck-{ranks}" for ranks in (1, 2)}
    for proc in run_trains([(ranks, flags(db, ranks, d, "--steps", 12)) for ranks, d in dirs.items()], cwd=root):
        assert proc.returncode == 0 and "final: opt_step=12 " in proc.stdout, proc.stdout + proc.stderr
    return dirs


def ckpt(directory, step):
    return directory / f"step_{step:08d}.pt"


def assert_same_training(path, reference):
    """The checkpoint at `path` holds the bits of the straight run's, and the same loader
    state merged over its ranks (a rank's own file knows only lower bounds for the others')."""
    (a, a_loader), (b, b_loader) = (load_checkpoint(str(p)) for p in (path, reference))
    assert state_equal(a_loader, b_loader)
    for key in ("model", "optimizer", "tokens_seen", "epoch", "opt_step"):
        assert state_equal(a[key], b[key]), key


def run_here(capsys, *args):
    """train.main in this process: (exit code, stdout, stderr)."""
    code = 0
    try:
        train.main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_storage_fault(code, stderr, *fragments, ranks=1):
    """A storage fault: every rank prints the same one `error:` line, with no traceback of
    ours, and exits 3 (under torchrun its own failure report follows and names that code).
    Returns the line."""
    # ranks share torchrun's stderr, and a line's text and its newline are two writes
    errors = [e.strip() for e in re.findall(r"error: (?:(?!error: ).)*", stderr)]
    assert len(errors) == ranks and len(set(errors)) == 1, stderr
    assert not frames_of_ours(stderr), stderr
    if ranks == 1:
        assert code == 3 and [line for line in stderr.splitlines() if line.strip()] == errors, stderr
    else:
        assert code != 0 and re.search(r"exitcode\s*:\s*3 ", stderr), stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def left_in(directory):
    """The names in `directory`, none of them a temp file or the lock."""
    names = sorted(os.listdir(directory))
    assert not [n for n in names if ".tmp" in n or n.startswith("train.lock")], names
    return names


def pids_inheriting(marker):
    """Live processes whose environment holds `marker` ("NAME=value"): a run's ranks and
    whatever they started, which torchrun puts in sessions of their own, orphans included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0") and is_alive(int(pid)):
                    found.append(int(pid))
    return found


def remount(where, options):
    """Change a tmpfs mount of small_fs (size=..., ro, rw); EBUSY (a file open for writing) is retried."""
    for _ in range(100):
        proc = subprocess.run(["mount", "-o", f"remount,{options}", str(where)], capture_output=True, text=True)
        if proc.returncode == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"mount -o remount,{options} {where}: {proc.stderr}")


def fill(directory, leave=0):
    """A filler file taking all the free space of `directory`'s filesystem but `leave` bytes."""
    fs = os.statvfs(directory)
    with open(directory / "filler", "wb") as f:
        f.write(b"\0" * (fs.f_bavail * fs.f_frsize - leave))


def run_acting_once(args, after, act, *, cwd, timeout=240):
    """train.py on one rank; once it prints a line holding `after`, it is stopped (SIGSTOP)
    while `act()` changes its storage, then goes on: the change falls between two of its
    steps, not inside a save. Returns (exit code, stderr)."""
    proc = start_train(1, *args, cwd=cwd)
    killed = []
    watchdog = threading.Timer(timeout, lambda: killed.append(kill_tree(proc.pid)))
    watchdog.start()
    acted = False
    try:
        for line in proc.stdout:
            if after in line and not acted:
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    act()
                    acted = True
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
        err = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
    assert acted and not killed, f"{'killed after {timeout} s' if killed else 'the fault was never injected'}\n{err}"
    return code, err


def test_a_full_ckpt_dir_on_one_rank(db, straight, small_fs, capsys):
    ck = small_fs("ck", TWO_CHECKPOINTS)
    code, out, err = run_here(capsys, *flags(db, 1, ck, "--steps", 8))
    line = assert_storage_fault(
        code, err, f"no space left on the device (ENOSPC) writing the checkpoint of step 6, {ckpt(ck, 6)}; "
                   f"it needs at least 9.6 MiB; 5.6 MiB free of 25.0 MiB",
        f"step 6 is not saved and the newest complete checkpoint is {ckpt(ck, 4)}: free space there or pass "
        f"another --ckpt-dir, then --resume auto")
    assert line.startswith("error: no space left") and "saved " + str(ckpt(ck, 4)) in out
    assert left_in(ck) == ["step_00000002.pt", "step_00000004.pt"]
    assert_same_training(ckpt(ck, 4), ckpt(straight[1], 4))

    remount(ck, f"size={ROOMY}")
    code, out, err = run_here(capsys, *flags(db, 1, ck, "--steps", 8, "--resume", "auto"))
    assert code == 0 and f"resumed from {ckpt(ck, 4)}" in out and not err, err
    assert left_in(ck) == [f"step_{s:08d}.pt" for s in (2, 4, 6, 8)]
    assert_same_training(ckpt(ck, 8), ckpt(straight[1], 8))


def test_a_full_ckpt_dir_on_two_ranks_at_rank_0s_file_then_at_rank_1s(db, straight, small_fs, tmp_path,
                                                                        monkeypatch):
    """Every rank ends at once with the failing rank's line (none waits in a barrier), and
    the other rank's file of the step is removed: the step is committed by no one. The
    first run's loader workers (and their forkserver) end with it."""
    ck = small_fs("ck", TWO_CHECKPOINTS)
    saved = ["step_00000002.pt", "step_00000002_dsrank1.pt", "step_00000004.pt", "step_00000004_dsrank1.pt"]
    marker = f"STORAGE_FAULT_RUN={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    # cold, here and below, where the test looks for the run's processes by environment or command line
    proc = run_train(2, *flags(db, 2, ck, "--steps", 8, "--num-workers", 1), cwd=tmp_path, timeout=240, cold=True)
    monkeypatch.undo()
    assert_storage_fault(proc.returncode, proc.stderr, f"writing the checkpoint of step 6, {ckpt(ck, 6)}; it needs "
                         f"at least 9.6 MiB", f"the newest complete checkpoint is {ckpt(ck, 4)}", ranks=2)
    assert left_in(ck) == saved and not wait_gone(pids_inheriting(marker), timeout=10)

    fill(ck, leave=PAGE)  # room for the lock file only
    proc = run_train(2, *flags(db, 2, ck, "--steps", 8, "--resume", "auto"), cwd=tmp_path, timeout=240, cold=True)
    assert_storage_fault(proc.returncode, proc.stderr, "no space left on the device (ENOSPC) writing rank 1's loader "
                         f"state of step 6, {ck / 'step_00000006_dsrank1.pt'}; 0 B free",
                         f"the newest complete checkpoint is {ckpt(ck, 4)}", ranks=2)
    assert left_in(ck) == sorted(saved + ["filler"]) and not pids_mentioning(str(ck))
    assert_same_training(ckpt(ck, 4), ckpt(straight[2], 4))

    os.remove(ck / "filler")
    remount(ck, f"size={ROOMY}")
    proc = run_train(2, *flags(db, 2, ck, "--steps", 8, "--resume", "auto"), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0 and f"resumed from {ckpt(ck, 4)}" in proc.stdout, proc.stdout + proc.stderr
    assert_same_training(ckpt(ck, 8), ckpt(straight[2], 8))


def test_a_full_disk_at_the_ckpt_dir_lock(db, small_fs, capsys):
    fs = small_fs("fs", PAGE)
    fill(fs)
    code, _, err = run_here(capsys, *flags(db, 1, fs / "ck", "--steps", 2))
    assert_storage_fault(code, err, f"no space left on the device (ENOSPC) writing the --ckpt-dir lock file "
                                    f"{fs / 'ck' / 'train.lock'}; 0 B free of 4.0 KiB on '{fs}'; free space there "
                                    f"or pass another --ckpt-dir")
    assert os.listdir(fs) == ["filler"]  # the directory the lock made is gone with it


def test_a_full_metrics_file_stops_the_run_at_a_checkpoint(db, straight, small_fs, tmp_path, capsys):
    """Its records are about 390 bytes: a 1-page filesystem takes nine or ten of them."""
    fs, ck = small_fs("metrics", PAGE), tmp_path / "ck"
    metrics = fs / "metrics.jsonl"
    code, _, err = run_here(capsys, *flags(db, 1, ck, "--steps", 12, "--log-every", 1, "--metrics-file", metrics))
    line = assert_storage_fault(code, err, f"no space left on the device (ENOSPC) writing --metrics-file {metrics}; "
                                           f"0 B free of 4.0 KiB", "it keeps the whole records before; the run "
                                           "stopped at step ", ", which is checkpointed: fix that, then --resume auto")
    stopped = int(re.search(r"stopped at step (\d+)", line).group(1))
    assert kinds_and_steps(metrics) == [("start", None), *(("train", s) for s in range(1, stopped))]
    assert 8 <= stopped <= 11 and left_in(ck)[-1] == f"step_{stopped:08d}.pt"
    if stopped % 2 == 0:  # the straight run's checkpoints are every 2 steps
        assert_same_training(ckpt(ck, stopped), ckpt(straight[1], stopped))

    remount(fs, "size=64k")
    code, out, err = run_here(capsys, *flags(db, 1, ck, "--steps", 12, "--log-every", 1, "--metrics-file", metrics,
                                             "--resume", "auto"))
    assert code == 0 and f"resumed from {ckpt(ck, stopped)}" in out and not err, err
    assert kinds_and_steps(metrics) == [("start", None), *(("train", s) for s in range(1, stopped)), ("start", None),
                                        *(("train", s) for s in range(stopped + 1, 13)), ("eval", 12)]
    assert_same_training(ckpt(ck, 12), ckpt(straight[1], 12))


def kinds_and_steps(metrics_file):
    """(kind, step) of each record, every line parsed whole."""
    return [(r["kind"], r.get("step")) for r in map(json.loads, metrics_file.read_text().splitlines())]


def test_a_full_trace_file_on_one_of_two_ranks_stops_both_at_one_step(db, straight, small_fs, tmp_path):
    """One page is free for the two ranks' trace files: the rank that writes second finds none
    at step 1. The stop vote stops both ranks at step 2, which they checkpoint, then both end."""
    fs, ck = small_fs("trace", 2 * PAGE), tmp_path / "ck"
    fill(fs, leave=PAGE)
    proc = run_train(2, *flags(db, 2, ck, "--steps", 8, "--trace-samples", fs / "trace"), cwd=tmp_path,
                     timeout=240, cold=True)  # found by its command line below
    line = assert_storage_fault(proc.returncode, proc.stderr, "no space left on the device (ENOSPC) writing "
                                f"--trace-samples {fs / 'trace'}/rank", "; 0 B free of 8.0 KiB",
                                "the run stopped at step 2, which is checkpointed", ranks=2)
    failed = int(re.search(r"/rank(\d)\.jsonl", line).group(1))
    traces = {rank: (fs / "trace" / f"rank{rank}.jsonl").read_text() for rank in (0, 1)}
    assert traces[failed] == ""  # its torn record was cut off
    assert [json.loads(r)["step"] for r in traces[1 - failed].splitlines()] == [1, 2]
    assert left_in(ck) == ["step_00000002.pt", "step_00000002_dsrank1.pt"] and not pids_mentioning(str(ck))
    assert_same_training(ckpt(ck, 2), ckpt(straight[2], 2))

    os.remove(fs / "filler")
    proc = run_train(2, *flags(db, 2, ck, "--steps", 4, "--trace-samples", fs / "trace", "--resume", "auto"),
                     cwd=tmp_path, timeout=240)
    assert proc.returncode == 0 and f"resumed from {ckpt(ck, 2)}" in proc.stdout, proc.stdout + proc.stderr
    assert_same_training(ckpt(ck, 4), ckpt(straight[2], 4))


def test_a_ckpt_dir_removed_mid_run(db, tmp_path):
    ck = tmp_path / "ck"
    code, err = run_acting_once(flags(db, 1, ck, "--steps", 12), f"saved {ckpt(ck, 2)}", lambda: shutil.rmtree(ck),
                                cwd=tmp_path)
    assert_storage_fault(code, err, f"--ckpt-dir {ck} was removed or replaced during the run (its lock file "
                                    f"train.lock is gone): step 4 is not saved and there is no complete checkpoint; "
                                    f"restore it or pass another --ckpt-dir, then start the run again")
    assert not ck.exists()  # not made again, with no lock in it


def test_a_ckpt_dir_made_read_only_mid_run(db, straight, small_fs, tmp_path, capsys):
    """A read-only remount stops root too. The lock cannot be removed from a read-only
    filesystem: the next run takes it over as stale (its pid is gone)."""
    ck = small_fs("ck", ROOMY)
    code, err = run_acting_once(flags(db, 1, ck, "--steps", 12), f"saved {ckpt(ck, 2)}", lambda: remount(ck, "ro"),
                                cwd=tmp_path)
    assert_storage_fault(code, err, f"cannot write the checkpoint of step 4, {ckpt(ck, 4)}: Read-only file system; "
                                    f"step 4 is not saved and the newest complete checkpoint is {ckpt(ck, 2)}: check "
                                    f"that --ckpt-dir is there and writable or pass another, then --resume auto")
    assert sorted(os.listdir(ck)) == ["step_00000002.pt", "train.lock"]

    remount(ck, "rw")
    code, out, err = run_here(capsys, *flags(db, 1, ck, "--steps", 4, "--resume", "auto"))
    assert code == 0 and f"resumed from {ckpt(ck, 2)}" in out, err
    assert err.startswith(f"warning: taking over the stale lock {ck / 'train.lock'}") and len(err.splitlines()) == 1
    assert left_in(ck) == ["step_00000002.pt", "step_00000004.pt"]
    assert_same_training(ckpt(ck, 4), ckpt(straight[1], 4))
