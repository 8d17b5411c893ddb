"""lancedb 0.40's StreamingDataset with a byte budget on read-ahead and a start-up linear in
the rank's rows. Delete this module when lancedb ships the three changes below.

What lancedb should change upstream:

1. Raw-stage backpressure (lancedb issue #3694). `_iter_owned` refills a split's reads
   whenever fewer than `io_queue_depth` are in flight, however many of its rows wait
   unconsumed, and `transform_queue_depth` (PR #3897) caps only the transformed rows. A
   consumer slower than the loader (every GPU step) so ends up holding its whole share of
   the epoch. `_fill_io` should not start a split's read while the fetched-but-unconsumed
   bytes exceed a budget, unless that split has less than one read batch left.
2. `Permutation.__copy__`. `select_columns`, `with_transform` and `with_skip` copy the
   permutation with `copy.copy`, which goes through `__getstate__`/`__setstate__`: the
   whole permutation table to Arrow and back into a new table, twice per split.
3. Split-local readers. A `PermutationReader` counts its split's rows, and loads its
   offset map, with a filtered scan of the whole permutation table: each split costs
   O(rows), so a rank's start-up costs O(rows x splits), again every epoch.
4. The permutation builder sorts in a DataFusion memory pool of 100 MB unless
   LANCEDB_PERM_BUILDER_MEMORY_LIMIT says otherwise (PR #2946), and fails ("Not enough
   memory to continue external sort") from about 6M rows on. It should size the pool
   from the row count. Until it does, a dataset built here sets that variable from the
   table's row count when the user has not set it.
5. A cheap checkpoint snapshot. `state_dict()` deep-copies the packed buffers (1.4 ms a
   batch for 16 splits of 1024-token blocks), which a consumer that keeps the position of
   every batch it is handed ahead of training (prefetch.py) pays on every batch. The
   buffers hold ints only, so copying their lists is as deep a copy; `consumed_state` does
   that until upstream does.
6. Read-ahead waits kept out of `fetch_time`: with (1), a read that waits for budget would
   count its wait as fetch time. Here the wait is taken back out of the counter and kept
   in `budget_wait_time` (summed over worker processes).

How, from outside lancedb and without copying its pipeline: `lancedb.streaming.Permutation`,
the one name `_iter_owned` builds its per-split readers with, is rebound to
`SplitPermutation`, a subclass that (2) copies shallowly, (3) builds a split's reader over a
table of that split's rows alone when the dataset iterating registered one, and (1) waits
for that dataset's `ReadBudget` before each read. Only `BoundedStreamingDataset` registers
anything; every other user of the name gets lancedb's behaviour unchanged. Sample order,
state dicts and checkpoints are lancedb's own.

Guard: the source of every lancedb function this relies on is fingerprinted against the
0.40.0 it was written for. On any other source, `pipeline_problem()` says why, nothing is
rebound, and `BoundedStreamingDataset` is lancedb's plain StreamingDataset (unbounded).

The same hook retries the loader's reads while the object store cannot be reached
(storage.StoreRetry); deleting this module, keep that.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import threading
import time
from multiprocessing import RawArray

import numpy as np

import lancedb.streaming as _streaming
from lancedb.permutation import Permutation
import storage

# sha256 of the source of what this module relies on, in lancedb 0.40.0. What each is for:
# _iter_owned builds its readers with the module name `Permutation`, sets
# `_local_consumed_ref` (rows popped per split, read here to free the budget) before its
# first read and clears it before its pools shut down, and adds each read's time to
# `_fetch_time`; _iter is what both __iter__ and StreamingDataLoader's workers run; the
# Permutation methods are those _iter_owned calls; state_dict and _checkpoint_snapshot are
# what consumed_state stands in for.
RELIED_ON = {
    "StreamingDataset._iter_owned":
        "b25321b5c0d0f08307da5450a477e3aa991723a1a79312da07b6107009aaf811",
    "StreamingDataset._iter":
        "631112f80bc8046dd17f5d5a240ce7852fc60a60e702d13bc4bbca687df5c981",
    "StreamingDataset._resolve_my_splits":
        "b90266cef4937700b962f13bed98ce2d8a9d61026f6071d315204b55a32941ff",
    "Permutation.from_tables":
        "472ed3c911a4cce08a5c4eb788f20ffef68f7dca9bd8f906ccdddf6d765765fc",
    "Permutation._with_selection":
        "49d2f28411fff4ba4fa58e44749ba1e7578acd4ef0744f782fb450c8a085a28c",
    "Permutation.with_transform":
        "809a10a430ed41361b9b5659d2bbab82834e96e8597c767fb25e50df36cdb246",
    "Permutation.with_skip":
        "ff8984218bed2293477205335f0d70e6f165ba33a7dcf95b0e8e344b628f3330",
    "Permutation.__getitems__":
        "ba93b2559faa22556e3986a79e099d66ff1e970a38ce3f0510f849055233125a",
    "Permutation.take_offsets":
        "f7a7cb7842c6807be4db13f35a77b72913bf7df66968c77088bfda9ab171008c",
    "StreamingDataset.state_dict":
        "61610cc8180786f1f441429b6a66c973301675e60941c6aa8fe2bcf047216a0c",
    "StreamingDataset._checkpoint_snapshot":
        "64eae71d65e98995fb7c9a944817ee1fc4aa2384fa3b73be4dff0e908a7f4384",
}

PERM_MEMORY_ENV = "LANCEDB_PERM_BUILDER_MEMORY_LIMIT"
PERM_BYTES_PER_ROW = 64  # the sort holds 16 bytes a row in one batch, and more while it merges
_sized_perm_memory = PERM_MEMORY_ENV not in os.environ  # never override the user's setting
WAKE_S = 0.002  # how often reads that wait for the budget look at the consumer again
READ_ROWS = 1 << 20  # batch size for reading the permutation table back
MAX_WORKERS = 256  # slots of the shared budget-wait counter, one per loader worker


def size_permutation_memory(rows: int) -> None:
    """Memory for lancedb's permutation builder to sort a table of `rows` rows, unless the
    user set PERM_MEMORY_ENV. Call it at start-up, on the main thread, before any loader
    runs: lancedb's native threads read the environment, and a setenv beside a getenv on
    another thread is not safe (the next epoch's dataset is made on a thread of its own)."""
    if _sized_perm_memory:
        os.environ[PERM_MEMORY_ENV] = str(max(100 * 2**20, PERM_BYTES_PER_ROW * rows))


def _source_hash(qualname: str) -> str:
    owner, name = qualname.split(".")
    cls = _streaming.StreamingDataset if owner == "StreamingDataset" else Permutation
    function = inspect.unwrap(getattr(cls, name))
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def pipeline_problem(expected: dict[str, str] | None = None) -> str | None:
    """Why lancedb's installed pipeline is not the one this module was written for, or
    None when it is."""
    import lancedb

    expected = RELIED_ON if expected is None else expected
    for qualname, digest in expected.items():
        try:
            found = _source_hash(qualname)
        except (AttributeError, OSError, TypeError):
            return f"lancedb {lancedb.__version__} has no readable {qualname}"
        if found != digest:
            return f"lancedb {lancedb.__version__}'s {qualname} is not the 0.40.0 code it was written for"
    return None


class _Read:
    """One read of `rows` rows from row `start` of the split at `position`."""

    __slots__ = ("position", "start", "end", "nbytes", "admitted")

    def __init__(self, position: int, start: int, rows: int, estimate: int):
        self.position, self.start, self.end, self.nbytes = position, start, start + rows, estimate
        self.admitted: threading.Event | None = None  # made when the read has to wait


class ReadBudget:
    """How many bytes one iterator over a rank's (or a worker's) splits may hold fetched
    and not yet consumed, and the reads that wait for them.

    A read goes when its split has at most one read batch of rows left ahead of the
    consumer (so every split can always read its next batch: no deadlock, and no split
    starved by the others), or when the bytes held plus its estimated size fit the budget.
    A read's bytes stay held until the consumer has popped all of its rows. The consumer
    frees bytes without telling anyone, so one watcher thread looks at the waiting reads
    every WAKE_S, lets through those that now fit (the split closest to running dry
    first), and all of them once the iteration has ended or the interpreter is exiting, so
    that lancedb's thread pools can shut down.
    """

    def __init__(self, dataset, splits: list[int], budget_bytes: int, batch_rows: int):
        self.dataset = dataset
        self.position = {split: i for i, split in enumerate(splits)}
        self.budget = budget_bytes
        self.batch_rows = batch_rows
        self.held = 0  # bytes of admitted reads with unconsumed rows (estimates while in flight)
        self.peak = 0
        self.fetched_rows = 0
        self.fetched_bytes = 0
        self.reads: list[list[_Read]] = [[] for _ in splits]  # admitted, per split
        self.waiting: list[_Read] = []
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.closed = False
        self.watcher = threading.Thread(target=self._watch, name="read-budget", daemon=True)
        self.watcher.start()

    def acquire(self, split: int, start: int, rows: int) -> _Read:
        """Block until the read of `rows` rows from row `start` of `split` may go."""
        with self.lock:
            estimate = int(self.fetched_bytes * rows / self.fetched_rows) if self.fetched_rows else 0
            read = _Read(self.position[split], start, rows, estimate)
            consumed = self._consumed()
            if self._fits(read, consumed):
                self._admit(read)
                return read
            read.admitted = threading.Event()
            self.waiting.append(read)
            self.wake.notify()
        started = time.perf_counter()
        read.admitted.wait()
        self.dataset._count_budget_wait(time.perf_counter() - started)
        return read

    def fetched(self, read: _Read, nbytes: int, rows: int) -> None:
        """Replace a read's estimate with the bytes it brought."""
        with self.lock:
            self.held += nbytes - read.nbytes
            read.nbytes = nbytes
            self.fetched_rows += rows
            self.fetched_bytes += nbytes
            self.peak = max(self.peak, self.held)

    def close(self) -> None:
        """The iteration is over: let every waiting read go, and stop the watcher."""
        with self.lock:
            self.closed = True
            self._let_through()
            self.wake.notify()

    def _consumed(self) -> list[int] | None:
        """Rows the consumer has popped per split (dropping what it has freed), or None
        once the iteration is over."""
        consumed = self.dataset._local_consumed_ref
        if consumed is not None:
            for i, reads in enumerate(self.reads):
                if reads and reads[0].end <= consumed[i]:
                    self.held -= sum(r.nbytes for r in reads if r.end <= consumed[i])
                    reads[:] = [r for r in reads if r.end > consumed[i]]
        return consumed

    def _fits(self, read: _Read, consumed: list[int] | None) -> bool:
        return (consumed is None or self.closed or read.start - consumed[read.position] <= self.batch_rows
                or self.held + read.nbytes <= self.budget)

    def _admit(self, read: _Read) -> None:
        self.reads[read.position].append(read)
        self.held += read.nbytes
        self.peak = max(self.peak, self.held)

    def _let_through(self) -> None:
        # The interpreter exits (the main thread has stopped) while an iterator was left
        # unclosed: lancedb's pools are being joined, so let their reads finish.
        self.closed = self.closed or not threading.main_thread().is_alive()
        consumed = self._consumed()
        if consumed is not None:
            self.waiting.sort(key=lambda r: r.start - consumed[r.position])
        still = []
        for read in self.waiting:
            if self._fits(read, consumed):
                self._admit(read)
                read.admitted.set()
            else:
                still.append(read)
        self.waiting = still

    def _watch(self) -> None:
        with self.lock:
            while not self.closed:
                if not self.waiting:
                    self.wake.wait()
                    continue
                self._let_through()
                self.lock.release()
                try:
                    time.sleep(WAKE_S)
                finally:
                    self.lock.acquire()


class SplitPermutation(Permutation):
    """lancedb's Permutation as `_iter_owned` uses it: shallow copies, a split-local
    permutation table where one is registered, reads that wait for a ReadBudget, and reads
    tried again while the store cannot be reached (storage.StoreRetry)."""

    _read_budget: ReadBudget | None = None
    _store_retry: storage.StoreRetry | None = None

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    @classmethod
    def from_tables(cls, base_table, permutation_table=None, split=None):
        registered = _ITERATING.get(id(permutation_table))
        if registered is None or split not in registered[0]:
            return super().from_tables(base_table, permutation_table, split)
        tables, budget, retry = registered
        permutation = super().from_tables(base_table, tables[split], split)
        permutation._read_budget, permutation._store_retry = budget, retry
        return permutation

    def __getitems__(self, indices):
        budget = self._read_budget
        if budget is None or not indices:
            return self._take(indices)
        read = budget.acquire(self.split, indices[0], len(indices))
        batch = self._take(indices)
        budget.fetched(read, batch.nbytes, batch.num_rows)
        return batch

    def _take(self, indices):
        take = super().__getitems__
        return take(indices) if self._store_retry is None else self._store_retry(lambda: take(indices))


# id(a dataset's permutation table) -> ({split: that split's table}, ReadBudget | None,
# StoreRetry | None), while that dataset iterates.
_ITERATING: dict[int, tuple[dict, ReadBudget | None, storage.StoreRetry | None]] = {}
PROBLEM = pipeline_problem()
if PROBLEM is None:
    _streaming.Permutation = SplitPermutation


def split_tables(permutation_table, splits: list[int]) -> dict:
    """{split: an in-memory table of that split's rows of `permutation_table`, in its
    order}: what a split's reader scans instead of the whole permutation."""
    import lancedb

    lo, hi = min(splits), max(splits) + 1
    rows = permutation_table.search().where(f"split_id >= {lo} AND split_id < {hi}").limit(None) \
        .to_batches(READ_ROWS).read_all()  # the default batch size makes this ~10x slower
    split_ids = rows.column("split_id").to_numpy()
    if np.any(split_ids[1:] < split_ids[:-1]):
        order = np.argsort(split_ids, kind="stable")
        rows, split_ids = rows.take(order), split_ids[order]
    bounds = np.searchsorted(split_ids, np.arange(lo, hi + 1))
    db = lancedb.connect("memory://")
    return {split: db.create_table(f"split_{split}", rows.slice(bounds[split - lo],
                                                                bounds[split - lo + 1] - bounds[split - lo]))
            for split in splits}


class BoundedStreamingDataset(_streaming.StreamingDataset):
    """lancedb's StreamingDataset whose iterator holds at most `buffer_bytes` of fetched,
    not yet consumed rows (None: no bound), split between DataLoader workers, and whose
    start-up reads the permutation once rather than once per split.

    The bound counts rows as lancedb fetched them (Arrow); rows already turned into samples
    by the transform are counted the same until consumed. Each split may always hold one
    read batch beyond the row the consumer is on, so the floor is about two read batches
    per split, whatever the budget.

    Its reads, and the permutation it builds, go through `storage.unretried` and are tried
    again for `retry_s` seconds while the store cannot be reached (default: the retry budget,
    storage.retry_budget_s()); what then fails, or a missing or damaged table file, is one
    line (storage.read_faults), in worker processes too.
    """

    def __init__(self, table, *, buffer_bytes: int | None = None, retry_s: float | None = None, **kwargs):
        self._store_retry = storage.StoreRetry(storage.retry_budget_s() if retry_s is None else retry_s)

        def build():
            super(BoundedStreamingDataset, self).__init__(storage.unretried(table), **kwargs)

        with storage.read_faults(table):
            self._store_retry(build)
        self._buffer_bytes = buffer_bytes
        self._last_budget: ReadBudget | None = None
        # Seconds reads waited for the budget, a slot per worker process (slot 0 in-process):
        # shared memory, like lancedb's own counters, so the parent reads the workers' waits.
        self._budget_waits = RawArray(ctypes.c_double, MAX_WORKERS)
        self._budget_wait_lock = threading.Lock()

    def _count_budget_wait(self, seconds: float) -> None:
        """A read waited `seconds` for the budget: lancedb's fetch_time counts the whole
        read, so the wait is taken back out of it here and kept apart."""
        worker = _streaming.get_worker_info()
        with self._budget_wait_lock:
            self._budget_waits[worker.id % MAX_WORKERS if worker is not None else 0] += seconds
            self._fetch_time -= seconds

    @property
    def budget_wait_time(self) -> float:
        """Seconds the loader's reads waited for read-ahead budget (--loader-buffer-mb), over
        every worker process; lancedb's `fetch_time` leaves them out here."""
        return float(sum(self._budget_waits))

    def _iter(self, *, consumer_checkpoint_transport: bool = False):
        with storage.read_faults(self._table):
            yield from self._iter_bounded(consumer_checkpoint_transport)

    def _iter_bounded(self, consumer_checkpoint_transport: bool):
        if PROBLEM is not None:
            yield from super()._iter(consumer_checkpoint_transport=consumer_checkpoint_transport)
            return
        splits = self._resolve_my_splits()
        key = id(self._perm_table)
        budget = None
        if splits:
            if self._buffer_bytes is not None:
                worker = _streaming.get_worker_info()
                share = self._buffer_bytes // (worker.num_workers if worker is not None else 1)
                budget = ReadBudget(self, splits, share, self._read_batch_size)
            _ITERATING[key] = (split_tables(self._perm_table, splits), budget, self._store_retry)
        self._last_budget = budget
        try:
            yield from super()._iter(consumer_checkpoint_transport=consumer_checkpoint_transport)
        finally:
            _ITERATING.pop(key, None)
            if budget is not None:
                budget.close()

    @property
    def buffered_bytes(self) -> int:
        """Bytes this process's iterator holds fetched and unconsumed (0 with workers: they
        hold their own)."""
        budget = self._last_budget
        return budget.held if budget is not None and not budget.closed else 0

    @property
    def peak_buffered_bytes(self) -> int:
        budget = self._last_budget
        return budget.peak if budget is not None else 0

    def __getstate__(self):
        state = super().__getstate__()
        state["_last_budget"] = None
        state["_budget_wait_lock"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._budget_wait_lock = threading.Lock()


def consumed_state(ds) -> dict:
    """`ds.state_dict()` as it stands now, at a batch boundary: the position a checkpoint
    records. The packed buffers are copied list by list rather than deep-copied (upstream
    change 5 above): they hold ints, so the copy is as deep, at a fraction of the cost."""
    if PROBLEM is not None or ds._pack_sequences is None or ds._checkpoint_invalid_reason is not None:
        return ds.state_dict()  # rows: no buffers to copy; the others raise what lancedb says
    emitted = ds._pack_blocks_emitted
    if len({emitted[split] for split in ds._rank_splits}) > 1:
        return ds.state_dict()  # not at a step boundary: lancedb's own error
    return {
        "shuffle_seed": ds._shuffle_seed,
        "num_splits": ds._num_splits,
        "epoch": ds._epoch,
        "pack_sequences": ds._pack_sequences,
        "eos_id": ds._eos_id,
        "pad_id": ds._pad_id,
        "blocks_per_epoch": ds._blocks_per_epoch,
        "samples_consumed_per_split": list(ds._pack_consumed),
        "blocks_emitted_per_split": list(emitted),
        "pack_buffers": {split: {"tokens": list(buffer["tokens"]), "starts": list(buffer["starts"])}
                         for split, buffer in ds._pack_buffers.items()},
    }
