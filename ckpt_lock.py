"""One writer per checkpoint directory: a lock file in --ckpt-dir.

Two runs writing the same step_*.pt files would interleave checkpoints and prune
each other's, so rank 0 takes `<ckpt-dir>/train.lock` before writing anything and
the other ranks of its run rely on it. The file names its holder (host, boot id,
pid, the kernel's start time of that pid) so a lock left by a crashed run on this
host is recognised as stale and taken over, while a lock held from another host,
whose processes cannot be checked from here, needs --force-unlock, unless it is an
earlier worker group of the same torchrun run: torchrun's agents stop a group on every
node before they form the next, so that holder is gone, on whatever host it ran.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import uuid

from common import UserError, out_of_space


def _boot_id() -> str | None:
    """Changes on every boot: a lock recorded before a reboot is stale whatever its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime in clock ticks) from /proc/<pid>/stat; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def _started_utc(starttime: int | None) -> str:
    """The process start as UTC ISO text, from the boot time plus its starttime ticks."""
    when = None
    if starttime is not None:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            with open("/proc/stat") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            when = btime + starttime / os.sysconf("SC_CLK_TCK")
    if when is None:
        when = datetime.datetime.now(datetime.timezone.utc).timestamp()
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(timespec="seconds")


def _is_alive(pid: int, starttime: int | None) -> bool:
    """Whether `pid` on this host is still the process that wrote the lock.

    The start time tells a reused pid from the original; a zombie no longer runs.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: the signal check is all there is
    state, ticks = stat
    return state not in ("Z", "X") and (starttime is None or ticks == starttime)


# A lock is this very process's when all of these match (a pid alone may have been reused).
_IDENTITY = ("host", "boot_id", "pid", "starttime")


def _describe(holder: dict) -> str:
    started = holder.get("started") or "at an unknown time"
    return f"pid {holder['pid']} on host {holder['host']} (started {started})"


class CheckpointDirLock:
    """An exclusive lock on a checkpoint directory, held by rank 0 of one run.

    The lock file appears whole or not at all (a complete temp file hard-linked to
    its name, which fails if the name exists, also on NFS). Checking a held lock and
    taking it over happen under an flock on a guard file, so two runs restarting on
    this host cannot both take over the same stale lock.
    """

    FILE = "train.lock"

    def __init__(self, ckpt_dir: str, force_unlock: bool = False, attempt=None):
        """`attempt`: this process's torchrun attempt (distributed.elastic_attempt), or None."""
        self.ckpt_dir = ckpt_dir
        self.force_unlock = force_unlock
        self.attempt = attempt
        self.path = os.path.join(ckpt_dir, self.FILE)
        self.warning: str | None = None  # set by acquire (for the context-manager use)
        self._content: bytes | None = None  # what we wrote: release removes only that
        self._owner_pid: int | None = None  # a forked child must not release its parent's lock
        self._created: list[str] = []  # directories acquire made, outermost first

    def acquire(self) -> str | None:
        """Take the lock (creating ckpt_dir if missing).

        Returns a warning line to print when a stale lock was taken over (or
        force-unlocked), else None. Raises UserError when another live run holds it or the
        directory cannot be written, a StorageFault when its disk or quota is full.
        """
        if self._content is not None:
            return None
        try:
            self.warning = self._acquire()
            return self.warning
        except OSError as e:
            self._remove_created_dirs()
            full = out_of_space(e, self.ckpt_dir, f"the --ckpt-dir lock file {self.path}",
                                "free space there or pass another --ckpt-dir")
            raise full or UserError(f"cannot lock --ckpt-dir {self.ckpt_dir}: {e.strerror or e}") from None
        except UserError:
            self._remove_created_dirs()
            raise

    def release(self) -> None:
        """Remove the lock if it is still ours, and the directories acquire created if
        they are empty now (a refused or finished run leaves nothing of its own behind).
        Idempotent."""
        if self._owner_pid != os.getpid():
            return
        if self._content is not None:
            # OSError: the directory was removed, replaced or made read-only under the run,
            # which then ended with that line; a lock left on a read-only one is stale.
            with contextlib.suppress(OSError), self._guard(create=False):
                if self._read() == self._content:
                    os.unlink(self.path)
            self._content = None
        self._remove_created_dirs()

    def __enter__(self) -> CheckpointDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ── internals ──────────────────────────────────────────────────────────────────

    def _acquire(self) -> str | None:
        me = self._identity()
        mine = json.dumps(me).encode()
        with self._guard(create=True):
            while not self._link(mine):
                content = self._read()
                if content is None:  # released between our link and our read
                    continue
                holder = self._parse(content)
                if holder is not None and all(holder.get(k) == me[k] for k in _IDENTITY):
                    self._own(content)
                    return None
                warning = self._judge(holder, me)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                if self._link(mine):
                    self._own(mine)
                    return warning
                # Taken again in between (from another host): judge the new holder.
            self._own(mine)
            return None

    def _judge(self, holder: dict | None, me: dict) -> str:
        """The warning for taking over the lock of `holder` (None: unreadable); raises if we may not."""
        if holder is None:
            if not self.force_unlock:
                raise UserError(f"--ckpt-dir {self.ckpt_dir} has a lock file {self.path} that cannot be read "
                                f"as a lock; if no run uses this directory, delete it or pass --force-unlock")
            return f"warning: --force-unlock: replacing the unreadable lock file {self.path}"
        in_use = f"--ckpt-dir {self.ckpt_dir} is in use by {_describe(holder)}, lock {self.path}"
        earlier_group = me["run_id"] is not None and holder.get("run_id") == me["run_id"]
        if earlier_group and holder["host"] != me["host"]:
            return (f"warning: taking over the lock {self.path} of {_describe(holder)}, a worker group of "
                    f"this torchrun run (run id {me['run_id']}, attempt {holder.get('restart_count')} on its "
                    f"node) that torchrun's agents stopped before forming this one (attempt "
                    f"{me['restart_count']} here)")
        if holder["host"] == me["host"]:
            boots = (holder.get("boot_id"), me["boot_id"])
            rebooted = None not in boots and boots[0] != boots[1]
            if not rebooted and _is_alive(holder["pid"], holder.get("starttime")):
                if self.force_unlock:
                    raise UserError(f"{in_use}; it is still running: stop it first "
                                    f"(--force-unlock only clears a lock left on another host)")
                raise UserError(f"{in_use}; wait for that run to finish or use another --ckpt-dir")
            why = "the host has rebooted since" if rebooted else "which no longer runs"
            if earlier_group:
                why += f" (an earlier worker group of this torchrun run, attempt {holder.get('restart_count')})"
            return f"warning: taking over the stale lock {self.path} of {_describe(holder)}, {why}"
        if not self.force_unlock:
            raise UserError(f"{in_use}; wait for that run to finish, use another --ckpt-dir, "
                            f"or pass --force-unlock if that run is gone")
        return (f"warning: --force-unlock: taking over the lock {self.path} of {_describe(holder)}; "
                f"if that run still writes there, the two runs will overwrite each other's checkpoints")

    def _identity(self) -> dict:
        pid = os.getpid()
        stat = _proc_stat(pid)
        starttime = stat[1] if stat else None
        return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "starttime": starttime,
                "started": _started_utc(starttime), "argv": sys.argv,
                "run_id": self.attempt.run_id if self.attempt else None,
                "restart_count": self.attempt.restart_count if self.attempt else None}

    @staticmethod
    def _parse(content: bytes) -> dict | None:
        """The holder record, or None for a file this module did not write."""
        try:
            holder = json.loads(content)
        except ValueError:
            return None
        ok = (isinstance(holder, dict) and isinstance(holder.get("host"), str)
              and type(holder.get("pid")) is int and 0 < holder["pid"] < 2**31
              and type(holder.get("starttime")) in (int, type(None)))
        return holder if ok else None

    def _own(self, content: bytes) -> None:
        self._content = content
        self._owner_pid = os.getpid()

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _link(self, content: bytes) -> bool:
        """Publish `content` as the lock file unless one exists; the temp file never stays."""
        tmp = os.path.join(self.ckpt_dir, f"{self.FILE}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "xb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def _guard(self, create: bool):
        """An exclusive flock on `<ckpt-dir>/train.lock.guard` (`create`: make ckpt_dir if missing).

        The guard file is unlinked before it is unlocked, so it does not outlive the
        acquire; whoever locked a file that has since been unlinked tries again.
        """
        guard = self.path + ".guard"
        while True:
            if create:
                self._make_dirs()
            try:
                fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                if create:  # the directory was removed under us: make it again
                    continue
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(guard))
                except FileNotFoundError:
                    same = False
                if same:
                    try:
                        yield
                    finally:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(guard)
                    return
            finally:
                os.close(fd)

    def _make_dirs(self) -> None:
        """Create the missing directories of ckpt_dir, remembering those we made."""
        missing, d = [], os.path.abspath(self.ckpt_dir)
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
                self._created.append(d)
            except FileExistsError:
                pass

    def _remove_created_dirs(self) -> None:
        while self._created:
            with contextlib.suppress(OSError):  # not empty (or gone): leave it
                os.rmdir(self._created[-1])
            self._created.pop()
