"""Micro-batches made ahead on a background thread, so the training thread only takes them;
and the one owner of that thread, the loaders under it, and their teardown.

On a GPU the thread that runs the training step also launches every kernel: whatever it
does between steps (lancedb's packer, re-forming worker batches, unpickling, pinning) is
time the GPU waits. `Prefetcher` runs the whole batch pipeline (`data.train_batches`:
loaders, epochs, the next epoch's start) on one thread of its own, pins each batch there,
and hands it over through a queue of `depth` batches: the training thread's part is one
`Queue.get`. Errors raised there (a user error, a storage fault) reach the training thread
at the batch where they happened, in order.

It is a context manager, and every way out of a run leaves through its `close`: bounded
(`TEARDOWN_S`), since the thread may be inside a read that retries an unreachable store or
an epoch start (a permutation, worker processes) that cannot be interrupted; what has not
ended by then has its loader worker processes killed. A stop signal does not wait for it:
the stop's checkpoint is written first (train.py), and a wait for a step's batches gives
way to a stop (`stop_waiting`). With several ranks that takes a `gate`
(preemption.StepGate): the thread hands over a step's micro-batches only once every rank
holds its own, so a step no rank has begun can still be called off.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable

import torch

# Micro-batches made ahead of the one training: enough to hide a slow batch, few enough
# that a stop or a checkpoint leaves little made for nothing (each is batch x seq_len ids).
DEFAULT_DEPTH = 4
# The most a close waits for the thread to end its loaders: the run's exit comes after the
# stop's checkpoint, and within a preemption's grace period (often 30 s) after the signal.
TEARDOWN_S = 5.0
POLL_S = 0.05
THREAD_NAME = "batch-prefetch"
NEXT_EPOCH_THREAD = "next-epoch"  # data.train_batches' thread name prefix
# Steps of StepGate keys kept behind the newest: a training thread reads a step's word
# only while its batch thread is at most a queue's worth of steps ahead of it.
GATE_KEYS_KEPT = DEFAULT_DEPTH + 4
_DONE = object()
_HALTED = object()  # the gate called the next step off


class _Raised:
    """An exception of the producer, to be raised on the training thread."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterate `items` (a generator of (epoch, position, batch)) on a background thread,
    `depth` items ahead, each batch pinned when `device` is CUDA. close() stops it and the
    loaders under it, from any thread, and waits for them (bounded).

    `stop_waiting(step)`: asked while the consumer waits for the first item of step `step`
    (counted from 0; `step_items` micro-batches each); when it says so, iteration ends
    there and `interrupted` is set. `gate` (several ranks): a StepGate each step's items
    pass before they are queued; a HALT ends iteration there too.
    """

    def __init__(self, items, device: torch.device, depth: int = DEFAULT_DEPTH,
                 stop_waiting: Callable[[int], bool] | None = None, step_items: int = 1, gate=None):
        self._items = items
        self._device = device
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._stop_waiting = stop_waiting
        self._step_items = step_items
        self._taken = 0
        self._gate = gate
        self._passed = 0  # steps the gate let through: their items are coming
        self._halted = False  # the gate called step `_passed` off
        self.interrupted = False
        self._thread = threading.Thread(target=self._produce, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        item = self._get()
        if item is _DONE or item is _HALTED:
            self.interrupted = item is _HALTED
            self._finished = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._finished = True
            error, item.error = item.error, None
            raise error
        self._taken += 1
        return item

    def _get(self):
        if self._stop_waiting is None:
            return self._queue.get()
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                step, within = divmod(self._taken, self._step_items)
                if within == 0 and step >= self._passed and self._stop_waiting(step):
                    self.interrupted = self._finished = self._halted = True
                    raise StopIteration from None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(0.0 if kind is KeyboardInterrupt else TEARDOWN_S)  # a second Ctrl-C: at once

    def close(self, timeout: float = TEARDOWN_S) -> bool:
        """Stop making batches and close the pipeline (its worker processes included), waiting
        at most `timeout` s; then kill the loader workers that are left. Returns whether it all
        ended in time. A KeyboardInterrupt (a second Ctrl-C) kills them at once."""
        self._stop.set()
        if self._gate is not None and not self._halted:
            # The next step this rank would begin is called off for every rank, so no peer
            # waits for it (in the gate, or for this rank's batches) once this rank is gone;
            # it also ends this thread's own wait there. Should the thread pass that step
            # first, the word is GO, and it stops at its next gate (the stop is set).
            with contextlib.suppress(RuntimeError):  # the store went with a peer: nothing to end
                self._gate.abandon(self._passed)
        self._finished = True
        deadline = time.monotonic() + timeout
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._drain()
                self._thread.join(timeout=POLL_S)
        except KeyboardInterrupt:
            kill_loader_workers()
            raise
        self._drain()
        if self._thread.is_alive():
            kill_loader_workers()
            return False
        return True

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _put(self, item) -> bool:
        """Queue `item` unless asked to stop first; False once stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _through_gate(self) -> bool:
        """Wait for every rank to hold this step's items (StepGate.ready); False: HALT, or
        the pipeline is closing."""
        if self._stop.is_set():
            return False
        step = self._passed
        if not self._gate.ready(step):
            self._halted = True
            return False
        self._passed += 1
        self._gate.forget(step - GATE_KEYS_KEPT)
        return True

    def _produce(self) -> None:
        # Ctrl-C blocked on this thread, and so on the next-epoch thread it starts and in every
        # loader process started from them (the forkserver, whose forks keep its mask): a
        # terminal's Ctrl-C reaches the whole process group, and a worker still importing
        # would print a KeyboardInterrupt traceback. The main thread still takes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pin = self._device.type == "cuda"
        try:  # set_device too: whatever fails here must reach the consumer, which waits on the queue
            if pin:
                torch.cuda.set_device(self._device)
            step_items = []
            for epoch, position, batch in self._items:
                if pin:
                    batch = {key: value.pin_memory() for key, value in batch.items()}
                step_items.append((epoch, position, batch))
                if self._gate is not None:
                    if len(step_items) < self._step_items:
                        continue
                    if not self._through_gate():
                        self._put(_HALTED)
                        break
                if not all(self._put(item) for item in step_items):
                    break
                step_items.clear()
            else:
                if all(self._put(item) for item in step_items):
                    self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - every error belongs to the training thread
            self._put(_Raised(e))
        finally:
            self._items.close()


def kill_loader_workers() -> None:
    """SIGKILL this process's multiprocessing children (the DataLoader workers of every epoch):
    for a teardown that did not end in time, or was cut short. The thread that drove them may
    still be inside lancedb; the process leaves by os._exit (train.leave)."""
    for child in multiprocessing.active_children():
        child.kill()
    for child in multiprocessing.active_children():
        child.join(timeout=1.0)


def still_running() -> bool:
    """Whether a thread of a pipeline is still alive: its close timed out or was cut short,
    so the process must not wait for it at exit (train.leave)."""
    return any(t.is_alive() and (t.name == THREAD_NAME or t.name.startswith(NEXT_EPOCH_THREAD))
               for t in threading.enumerate())
