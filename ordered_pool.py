"""Map a function over a stream of chunks in worker processes, in order, with bounded memory.

prepare_data.py tokenizes and scores in N processes while reading, dedup and writing stay
in order in the main process, so the table it writes is the same whatever N. What this
adds to `concurrent.futures.ProcessPoolExecutor`:

- Results come back in input order, and at most `ahead` chunks are in flight: the input
  is read only as fast as the workers use it (`Pool.imap` reads it all ahead).
- An input error (a file that cannot be read) is raised after the results of every
  chunk before it, as a serial run would: the first error in input order wins.
- Workers never outlive the run: they ignore Ctrl-C (the main process handles it and
  kills them), die with the main process even on SIGKILL (Linux's parent-death signal,
  else a watcher thread), and are killed on any exit from the `with` block.
- `stop` ends a map running in another thread within 0.1 s of a wait (a Ctrl-C that the
  main thread receives while lance consumes the map from a thread of its own).
- `workers=1`, or an input of a single chunk, runs in-process: nothing is spawned, and
  a debugger or a profiler sees the work.

Workers are spawned, never forked: lancedb runs its own threads and is not fork-safe.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, TimeoutError
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerDied(Exception):
    """A worker process ended without a result (killed, out of memory, crashed)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset and cgroups set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _die_with(parent: int) -> None:
    """Make this worker end when `parent` does, without relying on it to say so."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # it died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _start_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _die_with(parent)
    if initializer is not None:
        initializer(*initargs)


class OrderedPool:
    """`with OrderedPool(fn, workers, initializer, initargs) as pool: for r in pool.map(items)`.

    `fn` and `initializer` must be importable module-level functions (they are pickled by
    name); `initializer(*initargs)` runs once in each worker before its first chunk (and
    in this process when the work runs in-process).
    """

    def __init__(self, fn: Callable, workers: int, initializer: Callable | None = None,
                 initargs: tuple = (), ahead: int | None = None):
        self.fn, self.workers = fn, workers
        self.initializer, self.initargs = initializer, initargs
        self.ahead = ahead or 2 * workers
        self.executor: ProcessPoolExecutor | None = None
        self.spawned = False  # whether the work ran in worker processes
        self.stop = threading.Event()  # set from another thread: map raises KeyboardInterrupt
        self.wait_seconds = 0.0  # time the caller spent blocked on a worker's result
        self.read_seconds = 0.0  # time spent pulling the next item from the input

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the workers (not wait for them: a run that ends early has nothing to wait for)."""
        executor, self.executor = self.executor, None
        if executor is None:
            return
        # The executor's own table of its processes (Python 3.14 adds terminate_workers()).
        processes = list(getattr(executor, "_processes", None) or {})
        for pid in processes:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            executor.shutdown(wait=True, cancel_futures=True)
        except RuntimeError:  # a Ctrl-C inside submit() left its manager thread made but not started
            pass

    def _next(self, items: Iterator):
        if self.stop.is_set():
            raise KeyboardInterrupt
        start = time.perf_counter()
        try:
            return next(items)
        finally:
            self.read_seconds += time.perf_counter() - start

    def _run_here(self, first: list, items: Iterator) -> Iterator:
        if self.initializer is not None:
            self.initializer(*self.initargs)
        for item in first:
            yield self.fn(item)
        while True:  # _next raises KeyboardInterrupt once stop is set
            try:
                item = self._next(items)
            except StopIteration:
                return
            yield self.fn(item)

    def map(self, items: Iterable) -> Iterator:
        """fn(item) for each item, in order."""
        items = iter(items)
        first = []
        for _ in range(2):  # a single chunk is not worth starting processes for
            try:
                first.append(self._next(items))
            except StopIteration:
                break
        if self.workers == 1 or len(first) < 2:
            yield from self._run_here(first, items)
            return
        self.spawned = True
        self.executor = ProcessPoolExecutor(
            self.workers, mp_context=mp.get_context("spawn"), initializer=_start_worker,
            initargs=(os.getpid(), self.initializer, self.initargs))
        pending = deque(self.executor.submit(self.fn, item) for item in first)
        input_error = None
        while pending:
            while input_error is None and len(pending) < self.ahead:
                try:
                    pending.append(self.executor.submit(self.fn, self._next(items)))
                except StopIteration:
                    break
                except BaseException as e:  # raised after the chunks before it, as in order
                    input_error = e
            yield self._result(pending.popleft())
        if input_error is not None:
            raise input_error

    def _result(self, future):
        start = time.perf_counter()
        try:
            while not self.stop.is_set():
                try:
                    return future.result(timeout=0.1)
                except TimeoutError:
                    pass
            raise KeyboardInterrupt
        except BrokenProcessPool:
            codes = [p.exitcode for p in (getattr(self.executor, "_processes", None) or {}).values()]
            signals = sorted({-c for c in codes if c is not None and c < 0})
            how = (f"killed by signal {', '.join(signal.Signals(s).name for s in signals)}"
                   if signals else "it exited")
            raise WorkerDied(f"a worker process died ({how}); if it was the kernel's "
                             f"out-of-memory killer, use fewer --workers") from None
        finally:
            self.wait_seconds += time.perf_counter() - start

