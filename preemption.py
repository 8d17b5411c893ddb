"""Leaving a run cleanly: stop signals, a dead launcher, and peers that vanish.

Clusters preempt with a signal and a grace period before SIGKILL (SLURM, Kubernetes,
spot instances). `StopSignals` turns SIGTERM / SIGUSR1 (configurable) and a first
Ctrl-C into a request that the training loop honours at an optimizer-step boundary;
`StopVote` makes every rank see the request at the same step, so no rank is left
waiting in a collective for a peer that has gone to write its checkpoint; `StepGate` lets
ranks agree that a step not yet begun will not be, when a stop comes while one of them
waits for its batches.

`exit_with_parent` asks the kernel for a SIGTERM when the process that launched this
one dies (torchrun's agent, killed on its own by the OOM killer say), so ranks never
outlive their launcher; their DataLoader workers follow them (torch's worker watchdog).
Such a stop is voted as AGENT_LOST: every rank checkpoints the step and exits 1, so the
agents that are left see a failed group and restart it without that node (torchrun
--max-restarts, --nnodes MIN:MAX) from that checkpoint, rather than taking a group whose
ranks all exited 0 for a finished run.

`describe_comm_failure` names a collective that failed because a peer died or hung past
the process group's timeout, for a one-line exit instead of a C++ backtrace.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

DEFAULT_STOP_SIGNALS = "SIGTERM,SIGUSR1"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a rank wishes in the StopVote; the largest wish of any rank wins.
STOP = 1  # a stop signal (or a record that could not be written): checkpoint and exit 0
AGENT_LOST = 2  # this rank's torchrun agent died: checkpoint and exit 1, for the agents left to restart


def parse_signals(spec: str) -> list[signal.Signals]:
    """'SIGTERM,SIGUSR1' (or 'TERM,usr1') -> the signals; ValueError names a bad one.
    SIGINT may be listed but need not be: a first Ctrl-C always asks for a stop."""
    found = []
    for name in filter(None, (part.strip().upper() for part in spec.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, name, None)
        if sig is None:
            raise ValueError(f"unknown signal {name!r}")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name} cannot be caught, so it cannot ask for a checkpoint")
        if sig != signal.SIGINT:
            found.append(sig)
    return found


class StopSignals:
    """While entered, records the first stop signal; the training loop polls `wish`.

    A second Ctrl-C raises KeyboardInterrupt at once: the user means it. `agent`: the pid of
    the torchrun agent this rank asked to die with (exit_with_parent); a signal that finds
    it gone is that death.
    """

    def __init__(self, signals: list[signal.Signals], agent: int | None = None):
        self.requested: str | None = None
        self.agent_lost = False  # see `wish`
        self.agent = agent
        self.signals = [*signals, signal.SIGINT]
        self.previous: dict = {}

    @property
    def wish(self) -> int:
        """This rank's StopVote wish: 0, STOP or AGENT_LOST. Asked after the step the signal
        came in: the kernel signals a dying agent's children before the agent is gone."""
        if self.requested and not self.agent_lost and self.agent is not None:
            self.agent_lost = not is_running(self.agent) or os.getppid() != self.agent
        return AGENT_LOST if self.agent_lost else STOP if self.requested else 0

    def __enter__(self) -> StopSignals:
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        """Put the previous handlers back (train.main may run inside another program)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == "SIGINT":
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = signal.Signals(signum).name


class StopVote:
    """All ranks agree on the optimizer step at which to stop, and why.

    Each step every rank contributes its own wish (0, STOP, AGENT_LOST) to an all-reduce
    (MAX) that runs in the background while the next step computes; the result is read one
    step later, so the vote never stalls the device and a run stops at the end of the
    step after the one a signal arrived in. Every rank reads the same result at the
    same step, so all stop together even if only one got the signal; `reason` is then
    the largest wish.
    """

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.cuda = device.type == "cuda"
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.result = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda)
        self.pending = None  # the reduction in flight
        self.copied = None  # on CUDA: an event after its result's copy to the host
        self.reason = 0

    def stop_now(self, wish: int) -> bool:
        if self.world_size == 1:
            self.reason = wish
            return bool(wish)
        if self.pending is not None:
            self.settle()
            if self.result.item():
                self.reason = int(self.result.item())
                return True
        self.flag.fill_(wish)
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        if self.cuda:  # queue the copy behind the reduction; the host waits for it next step only
            self.pending.wait()
            self.result.copy_(self.flag, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        return False

    def agree(self, wish: int) -> int:
        """A blocking vote, called by every rank at the same point (a step the StepGate held
        back): the vote in flight is read, and `reason` is the largest wish of both."""
        if self.world_size == 1:
            self.reason = max(self.reason, wish)
            return self.reason
        self.settle()
        self.flag.fill_(max(wish, int(self.result.item())))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        self.reason = int(self.flag.item())
        return self.reason

    def settle(self) -> None:
        """Wait for the vote in flight, if any (before reading it, and before the run's
        other collectives end it)."""
        if self.pending is None:
            return
        if self.cuda:
            self.copied.synchronize()
        else:
            self.pending.wait()
            self.result.copy_(self.flag)
        self.pending = None


GO, HALT = b"go", b"halt"  # StepGate's words
GATE_POLL_FIRST_S, GATE_POLL_MAX_S = 0.001, 0.01  # StepGate.ready's pauses between looks at the word


class StepGate:
    """Ranks agree, before each optimizer step, whether it begins at all.

    Why: StopVote agrees only after a step, and a step one rank has begun is a collective
    the others must join. So a rank that waits for its batch (an unreachable store inside
    its retries, an epoch's workers starting) held every rank to that wait before a stop
    could be taken, however long it lasted. Now a step begins only once every rank holds
    its micro-batches: each rank's batch thread counts itself in (`ready`) and the last one
    in writes GO; a rank still waiting when a stop comes writes HALT (`gives_way`). The
    first word written wins (the store's compare_set), so every rank reads the same one,
    and after a HALT no rank has begun the step.

    Through the process group's store: one counter and one word per step, the counter and
    the wait on the batch thread's own clone of the store (a store client serves one
    request at a time, and that wait blocks). Keys `forget` removes once no rank can read
    them again.
    """

    def __init__(self, first_step: int, world_size: int, rank: int):
        default = dist.distributed_c10d._get_default_store()
        self.store = default  # the training thread's: gives_way, abandon
        self.batch_store = default.clone()  # the batch thread's: ready, forget
        self.prefix = f"step_gate/{first_step}"
        self.world_size = world_size
        self.rank = rank

    def _key(self, step: int, what: str) -> str:
        return f"{self.prefix}/{step}/{what}"

    def ready(self, step: int) -> bool:
        """This rank holds step `step`'s micro-batches; wait for the word. True: GO.

        The wait polls (`check`) rather than blocking in the store's `get`: a `get` that
        outlives the store's timeout (a hung peer) has c10d print a warning of its own, and
        a lost peer must end in one line. Past the store's timeout (--dist-timeout) it
        raises DistStoreError, which train.main reports as lost contact."""
        word = self._key(step, "word")
        if self.batch_store.add(self._key(step, "ready"), 1) == self.world_size:
            self.batch_store.compare_set(word, "", GO)
        deadline = time.monotonic() + self.batch_store.timeout.total_seconds()
        pause = GATE_POLL_FIRST_S
        while not self.batch_store.check([word]):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out after {self.batch_store.timeout.total_seconds():.0f} s "
                                          f"waiting for every rank to hold step {step}'s batches")
            time.sleep(pause)
            pause = min(2 * pause, GATE_POLL_MAX_S)
        return self.batch_store.get(word) == GO

    def gives_way(self, step: int, wish: int) -> bool:
        """Asked while this rank waits for step `step`'s batches: whether the step is held
        back, by this rank's stop `wish` (HALT is written unless GO was first) or another's."""
        word = self._key(step, "word")
        if wish:
            return self.store.compare_set(word, "", HALT) == HALT
        return self.store.check([word]) and self.store.get(word) == HALT

    def abandon(self, step: int) -> None:
        """This rank leaves before step `step` (its pipeline closes): HALT, unless GO was
        first, which also ends the batch thread's wait in `ready`."""
        self.store.compare_set(self._key(step, "word"), "", HALT)

    def forget(self, step: int) -> None:
        """Remove step `step`'s keys (rank 0, once every rank is past reading them)."""
        if self.rank == 0 and step >= 0:
            for what in ("ready", "word"):
                self.batch_store.delete_key(self._key(step, what))


def is_running(pid: int) -> bool:
    """Whether `pid` is a process that still runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def exit_with_parent() -> int | None:
    """SIGTERM this process when its parent dies (Linux; a no-op elsewhere); returns the
    parent's pid, or None where the kernel takes no such request.

    The kernel delivers it even while the process is blocked in native code; the
    handler then stops the run at the next step like any other stop signal.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return None
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)
    return parent


# What gloo and NCCL say when a peer is gone or a collective outlives the timeout.
_COMM_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed|refused|was likely closed)|timed out|timeout|"
                           r"pair closure|broken pipe|socket|peer", re.I)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


def describe_comm_failure(error: BaseException) -> str | None:
    """The first sentence of a failed collective's error, or None for any other error."""
    if not isinstance(error, (dist.DistError, RuntimeError)) or not _COMM_FAILURE.search(str(error)):
        return None
    text = _SOURCE_PREFIX.sub("", str(error).strip().splitlines()[0])
    return text.split(". ")[0].rstrip(".")[:300]


def ignore_interrupts(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: a terminal's Ctrl-C reaches the loader workers too, and
    the rank, which finishes its step and checkpoints, still needs them to."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
