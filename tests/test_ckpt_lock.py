"""ckpt_lock.CheckpointDirLock with real processes: refusal, stale and forced takeover, races."""

import json
import os
import socket
import subprocess
import sys

import pytest

from ckpt_lock import CheckpointDirLock, _boot_id, _proc_stat
from common import UserError
from conftest import REPO, wait_gone
from distributed import ElasticAttempt

HOST = socket.gethostname()

# A run's rank 0: waits for a line on stdin, tries the lock once, reports, holds it until stdin closes.
CHILD = f"""
import json, os, sys
sys.path.insert(0, {str(REPO)!r})
from ckpt_lock import CheckpointDirLock
from common import UserError
lock = CheckpointDirLock(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
try:
    print(json.dumps({{"pid": os.getpid(), "won": True, "line": lock.acquire()}}), flush=True)
except UserError as e:
    print(json.dumps({{"pid": os.getpid(), "won": False, "line": str(e)}}), flush=True)
sys.stdin.read()
lock.release()
"""


def start_children(ckpt_dir, n):
    """n processes racing for the lock on `ckpt_dir`, released together once all are ready."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(ckpt_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs, [json.loads(p.stdout.readline()) for p in procs]


def finish(procs):
    for p in procs:
        p.stdin.close()
    for p in procs:
        assert p.wait(timeout=30) == 0


def write_lock(ckpt_dir, **fields):
    os.makedirs(ckpt_dir, exist_ok=True)
    holder = {"host": HOST, "boot_id": _boot_id(), "pid": os.getppid(),
              "starttime": _proc_stat(os.getppid())[1], "started": "2020-01-02T03:04:05+00:00", **fields}
    (ckpt_dir / CheckpointDirLock.FILE).write_text(json.dumps(holder))


def assert_ours(ckpt_dir):
    """The lock names this process, and nothing else (no temp or guard file) is left in the dir."""
    assert os.listdir(ckpt_dir) == [CheckpointDirLock.FILE]
    holder = json.loads((ckpt_dir / CheckpointDirLock.FILE).read_text())
    assert (holder["host"], holder["pid"]) == (HOST, os.getpid())


def refused(lock, *fragments):
    with pytest.raises(UserError) as e:
        lock.acquire()
    line = str(e.value)
    assert "\n" not in line
    for fragment in fragments:
        assert fragment in line, line
    return line


def test_roundtrip_removes_the_directories_it_created(tmp_path):
    d = tmp_path / "a" / "ckpt"
    lock = CheckpointDirLock(str(d))
    assert lock.acquire() is None
    assert_ours(d)
    holder = json.loads((d / "train.lock").read_text())
    assert holder["boot_id"] == _boot_id() and holder["starttime"] == _proc_stat(os.getpid())[1]
    assert holder["argv"] == sys.argv and holder["started"].endswith("+00:00")
    assert lock.acquire() is None  # already ours
    lock.release()
    lock.release()
    assert os.listdir(tmp_path) == []


def test_roundtrip_keeps_an_existing_directory(tmp_path):
    (tmp_path / "step_00000010.pt").write_text("x")
    with CheckpointDirLock(str(tmp_path)) as lock:
        assert lock.warning is None
        assert (tmp_path / "train.lock").exists()
    assert os.listdir(tmp_path) == ["step_00000010.pt"]
    lock.release()  # idempotent, also with the lock file already gone


def test_the_same_process_may_lock_again(tmp_path):
    first = CheckpointDirLock(str(tmp_path))
    first.acquire()
    assert CheckpointDirLock(str(tmp_path)).acquire() is None
    first.release()
    assert os.listdir(tmp_path) == []


def test_live_holder_refused_then_stale_after_kill(tmp_path):
    d = tmp_path / "ckpt"
    procs, (report,) = start_children(d, 1)
    (holder,) = procs
    assert report == {"pid": holder.pid, "won": True, "line": None}
    line = refused(CheckpointDirLock(str(d)), f"pid {holder.pid} on host {HOST}", str(d / "train.lock"),
                   "wait for that run to finish or use another --ckpt-dir")
    assert "--force-unlock" not in line
    refused(CheckpointDirLock(str(d), force_unlock=True), f"pid {holder.pid}", "still running: stop it first")
    assert os.listdir(d) == ["train.lock"]  # the refused runs left nothing behind

    holder.kill()  # not reaped yet: a zombie no longer runs either
    assert not wait_gone([holder.pid])
    lock = CheckpointDirLock(str(d))
    warning = lock.acquire()
    assert warning.startswith(f"warning: taking over the stale lock {d / 'train.lock'} of pid {holder.pid} "
                              f"on host {HOST} (started "), warning
    assert warning.endswith("which no longer runs")
    assert_ours(d)
    holder.wait()
    lock.release()


def test_a_pid_that_is_gone_is_stale(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(tmp_path, pid=gone.pid, starttime=None)
    warning = CheckpointDirLock(str(tmp_path)).acquire()
    assert f"stale lock {tmp_path / 'train.lock'} of pid {gone.pid} on host {HOST} (started 2020-01-02T03:04:05+00:00)" in warning
    assert_ours(tmp_path)


@pytest.mark.parametrize("pid", ["parent", "self"])
def test_a_reused_pid_is_stale(tmp_path, pid):
    pid = os.getppid() if pid == "parent" else os.getpid()
    write_lock(tmp_path, pid=pid, starttime=_proc_stat(pid)[1] + 1)
    assert f"of pid {pid} on host {HOST}" in CheckpointDirLock(str(tmp_path)).acquire()
    assert_ours(tmp_path)


@pytest.mark.skipif(_boot_id() is None, reason="no boot id on this system")
def test_a_lock_from_before_a_reboot_is_stale(tmp_path):
    write_lock(tmp_path, boot_id="another-boot")  # names the live parent process
    assert CheckpointDirLock(str(tmp_path)).acquire().endswith("the host has rebooted since")
    assert_ours(tmp_path)


def test_a_live_same_host_holder_is_refused(tmp_path):
    write_lock(tmp_path)
    refused(CheckpointDirLock(str(tmp_path)), f"in use by pid {os.getppid()} on host {HOST} "
            "(started 2020-01-02T03:04:05+00:00), lock ")


def test_another_host_needs_force_unlock(tmp_path):
    write_lock(tmp_path, host="node-7", pid=4242, boot_id="x")
    refused(CheckpointDirLock(str(tmp_path)), f"--ckpt-dir {tmp_path} is in use by pid 4242 on host node-7 "
            f"(started 2020-01-02T03:04:05+00:00), lock {tmp_path / 'train.lock'}; wait for that run to finish, "
            "use another --ckpt-dir, or pass --force-unlock if that run is gone")
    assert "node-7" in (tmp_path / "train.lock").read_text()
    warning = CheckpointDirLock(str(tmp_path), force_unlock=True).acquire()
    assert warning.startswith(f"warning: --force-unlock: taking over the lock {tmp_path / 'train.lock'} "
                              "of pid 4242 on host node-7"), warning
    assert_ours(tmp_path)


# ── Across the attempts of one torchrun run (--max-restarts, --nnodes MIN:MAX) ──────────────

RUN = ElasticAttempt(run_id="pretrain-42", restart_count=1, max_restarts=3)


@pytest.mark.parametrize("holder_attempt", [0, 1, 2])  # a node that joined later counts from 0
def test_an_earlier_worker_group_of_the_run_on_another_host_is_taken_over(tmp_path, holder_attempt):
    write_lock(tmp_path, host="node-7", pid=4242, boot_id="x", run_id=RUN.run_id, restart_count=holder_attempt)
    warning = CheckpointDirLock(str(tmp_path), attempt=RUN).acquire()
    assert warning.startswith(f"warning: taking over the lock {tmp_path / 'train.lock'} of pid 4242 on host "
                              f"node-7 (started 2020-01-02T03:04:05+00:00), a worker group of this torchrun run "
                              f"(run id pretrain-42, attempt {holder_attempt} on its node)"), warning
    assert_ours(tmp_path)
    holder = json.loads((tmp_path / CheckpointDirLock.FILE).read_text())
    assert (holder["run_id"], holder["restart_count"]) == ("pretrain-42", 1)


@pytest.mark.parametrize("holder_run", ["pretrain-41", None])
def test_another_run_on_another_host_still_needs_force_unlock(tmp_path, holder_run):
    write_lock(tmp_path, host="node-7", pid=4242, boot_id="x", run_id=holder_run, restart_count=0)
    refused(CheckpointDirLock(str(tmp_path), attempt=RUN), "in use by pid 4242 on host node-7",
            "or pass --force-unlock if that run is gone")
    assert "node-7" in (tmp_path / "train.lock").read_text()


def test_a_live_holder_of_the_same_run_on_this_host_is_refused(tmp_path):
    """torchrun's agent stops a group before it starts the next: a holder of the same run id
    still running here is not an earlier group, and nothing may take its lock."""
    write_lock(tmp_path, run_id=RUN.run_id, restart_count=0)  # names the live parent process
    refused(CheckpointDirLock(str(tmp_path), attempt=RUN), f"in use by pid {os.getppid()} on host {HOST}")


def test_a_dead_holder_of_the_same_run_on_this_host_is_named_as_an_earlier_group(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(tmp_path, pid=gone.pid, starttime=None, run_id=RUN.run_id, restart_count=0)
    warning = CheckpointDirLock(str(tmp_path), attempt=RUN).acquire()
    assert warning.endswith("which no longer runs (an earlier worker group of this torchrun run, attempt 0)"), warning
    assert_ours(tmp_path)


@pytest.mark.parametrize("content", ["", "garbage", "[1]", '{"host": "h", "pid": -1}'])
def test_an_unreadable_lock_file(tmp_path, content):
    (tmp_path / "train.lock").write_text(content)
    refused(CheckpointDirLock(str(tmp_path)), "cannot be read as a lock", "delete it or pass --force-unlock")
    assert (tmp_path / "train.lock").read_text() == content
    warning = CheckpointDirLock(str(tmp_path), force_unlock=True).acquire()
    assert warning == f"warning: --force-unlock: replacing the unreadable lock file {tmp_path / 'train.lock'}"
    assert_ours(tmp_path)


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = CheckpointDirLock(str(tmp_path / "ckpt"))
    lock.acquire()
    (tmp_path / "ckpt" / "train.lock").write_text('{"host": "node-7", "pid": 1}')
    lock.release()
    assert (tmp_path / "ckpt" / "train.lock").read_text() == '{"host": "node-7", "pid": 1}'


def test_a_forked_child_does_not_release(tmp_path):
    lock = CheckpointDirLock(str(tmp_path))
    lock.acquire()
    pid = os.fork()
    if pid == 0:
        lock.release()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert_ours(tmp_path)
    lock.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("start", ["no directory", "stale lock"])
def test_racing_runs_exactly_one_wins(tmp_path, start):
    d = tmp_path / "new" / "ckpt"
    if start == "stale lock":  # left by a crashed run: only one of the restarts may take it over
        gone = subprocess.Popen(["true"])
        gone.wait()
        write_lock(d, pid=gone.pid)
    procs, reports = start_children(d, 4)
    winners = [r for r in reports if r["won"]]
    assert len(winners) == 1, reports
    assert (winners[0]["line"] is None) == (start == "no directory"), reports
    for r in reports:
        if not r["won"]:
            assert f"in use by pid {winners[0]['pid']} on host {HOST}" in r["line"], r
    assert os.listdir(d) == ["train.lock"]
    finish(procs)
    assert not d.exists() or os.listdir(d) == []


def test_filesystem_errors_are_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    refused(CheckpointDirLock(str(tmp_path / "file" / "ckpt")),
            f"cannot lock --ckpt-dir {tmp_path / 'file' / 'ckpt'}: Not a directory")


def too_deep_for_its_lock_file(base):
    """A path under `base` short enough to make, but too long (PATH_MAX) for the lock's
    files in it: "/train.lock.guard" takes it past the limit."""
    target, path = os.pathconf(base, "PC_PATH_MAX") - 8, str(base)
    while target - len(path) > 251:
        path = os.path.join(path, "d" * 250)
    return os.path.join(path, "d" * (target - len(path) - 1)) if target - len(path) > 1 else path


def test_a_ckpt_dir_no_user_can_lock_is_one_line_and_leaves_nothing(tmp_path):
    """The read-only directory below, in ways that stop root as well: a directory /proc
    will not make, and directories made before their lock file proves impossible (which
    acquire removes again)."""
    if os.path.isdir("/proc/self"):
        refused(CheckpointDirLock("/proc/self/ckpt"), "cannot lock --ckpt-dir /proc/self/ckpt: ")
    deep = too_deep_for_its_lock_file(tmp_path / "new")
    refused(CheckpointDirLock(deep), f"cannot lock --ckpt-dir {deep}: File name too long")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    tmp_path.chmod(0o555)
    try:
        refused(CheckpointDirLock(str(tmp_path / "ckpt")), "cannot lock --ckpt-dir", "Permission denied")
    finally:
        tmp_path.chmod(0o755)
