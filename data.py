"""What a training run reads: its samples, epoch by epoch, from the corpus or blocks table.

One batch's way in: `open_training_data` pins a table version and sizes the epoch
(`plan_epoch`); `train_batches` builds lancedb's StreamingDataset for each epoch
(`make_dataset`, read-ahead bounded by bounded_streaming.py) and turns it into
micro-batches (`make_loader`), in-process or from worker processes whose batches
`interleave_workers` re-forms so a step's samples do not depend on --num-workers.
`WaitClock` and the loader counters say whether the loader keeps up.

The --blocks-mode baselines (MosaicML, Parquet) come from blocks_loaders.py and enter
here as plain batches with no loader state.
"""

from __future__ import annotations

import functools
import itertools
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import blocks_loaders
import preemption
from blocks_loaders import MODE_FORMAT
from common import (
    DEFAULT_DB,
    TRAIN_FILTER,
    VAL_FILTER,
    StorageFault,
    UserError,
    check_table_tokenizer,
    corpus_filter,
    packed_token_count,
)
from distributed import barrier, broadcast_from_main, print0
from prefetch import NEXT_EPOCH_THREAD, Prefetcher
from storage import connect_table, read_faults

# Per rank. The loader's tokens/s on this project's benchmarks is flat from a few MiB up,
# and 256 MiB holds over a minute of a fast GPU's tokens as Arrow (README 'Bounded read-ahead').
DEFAULT_LOADER_BUFFER_MB = 256


def data_filter(args, split_filter: str) -> str:
    return corpus_filter(args.min_score, split_filter)


def rows_to_samples(batch: pa.RecordBatch, seq_len: int, pad_id: int) -> list[dict]:
    """Row mode: RecordBatch -> per-row dicts, each doc padded/truncated to seq_len.

    Module-level (bound with functools.partial) so it pickles into loader workers.
    """
    col = batch.column("input_ids")
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    ids = np.full((len(col), seq_len), pad_id, dtype=np.int64)
    lengths = np.minimum(np.diff(offsets), seq_len)
    for i, (start, n) in enumerate(zip(offsets[:-1], lengths)):
        ids[i, :n] = values[start:start + n]
    mask = np.arange(seq_len)[None, :] < lengths[:, None]
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    return [{"input_ids": ids_t[i], "loss_mask": mask_t[i]} for i in range(len(col))]


def corpus_source(args, tok, split_filter: str, packed: bool = False, blocks_per_epoch=None) -> dict:
    """make_dataset's `source` for the corpus table: filtered rows, one per sample, or
    packed by the loader into EOS-joined blocks (pads, only where a split runs dry,
    are masked from the loss by id)."""
    source = dict(filter=data_filter(args, split_filter))
    if packed:
        source.update(pack_sequences=args.seq_len, eos_id=tok.eos_token_id,
                      pad_id=tok.pad_token_id, blocks_per_epoch=blocks_per_epoch)
    else:
        source.update(transform=functools.partial(rows_to_samples, seq_len=args.seq_len,
                                                  pad_id=tok.pad_token_id))
    return source


def make_dataset(args, table, rank: int, world_size: int, *, epoch: int, shuffle: bool,
                 num_splits: int, **source):
    """lancedb's StreamingDataset with this run's loader settings, its read-ahead bounded
    by --loader-buffer-mb (bounded_streaming.py).

    `source` says which rows to read and how they become samples: `corpus_source`
    for the corpus table, a blocks transform for the pre-packed blocks table.
    """
    from bounded_streaming import BoundedStreamingDataset  # imports lancedb: not at module import

    return BoundedStreamingDataset(
        table,
        buffer_bytes=int(args.loader_buffer_mb * 2**20) or None,
        columns=["input_ids"],
        num_splits=num_splits,
        shuffle=shuffle,
        shuffle_seed=args.shuffle_seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        read_batch_size=args.read_batch_size,
        io_queue_depth=args.io_queue_depth,
        transform_parallelism=args.transform_parallelism,
        transform_queue_depth=args.transform_queue_depth or None,
        **source,
    )


def make_loader(ds, args, device: torch.device, splits_per_rank: int):
    """Training micro-batches: in-process (num_workers=0) or lancedb's consumer-
    committed StreamingDataLoader with worker processes, yielding the same batches.
    Nothing is pinned here: prefetch.Prefetcher pins whole batches on its own thread."""
    if args.num_workers == 0:
        return DataLoader(ds, batch_size=args.batch_size, num_workers=0)
    from lancedb.streaming import StreamingDataLoader

    # Not fork: ranks have CUDA + lancedb's async runtime initialised, and
    # forked workers can deadlock (lancedb warns about exactly this).
    loader = StreamingDataLoader(
        ds,
        batch_size=args.batch_size // args.num_workers,
        num_workers=args.num_workers,
        multiprocessing_context=args.mp_context,
        worker_init_fn=init_worker,
    )
    return interleave_workers(loader, args.num_workers, splits_per_rank // args.num_workers)


def init_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: Ctrl-C is the rank's to handle (preemption.ignore_interrupts),
    and torch's intra-op pool stays at one thread. A worker's torch work (a tensor per block,
    collating) is too small to split, and a pool of cpu_count threads in every worker of
    every rank is that many more threads for the node's scheduler beside the ones that
    launch the GPU's kernels."""
    preemption.ignore_interrupts(worker_id)
    torch.set_num_threads(1)


def prefetched(items, device: torch.device, **options) -> Prefetcher:
    """`items` (train_batches) made ahead on a thread of their own, which owns the loaders
    and their teardown (prefetch.py; `options`: its stop_waiting, step_items, gate)."""
    return Prefetcher(items, device, **options)


def loader_free_batches(items, count: int, device: torch.device, check: Callable) -> Iterator:
    """The first `count` micro-batches of `items` (train_batches), each `check`ed, moved to
    `device` and cycled for ever: the training step with no loader in it (--loader-free,
    the ceiling bench/gpu_check.py measures the fed run against)."""
    pool = []
    try:
        for epoch, _, batch in itertools.islice(items, count):
            check(batch["input_ids"])
            pool.append((epoch, None, {key: value.to(device) for key, value in batch.items()}))
    finally:
        items.close()
    if pool:
        yield from itertools.cycle(pool)


def random_batches(count: int, batch_size: int, seq_len: int, vocab_size: int, device: torch.device) -> Iterator:
    """`count` micro-batches of uniform random ids in [0, vocab_size), made on `device` and
    cycled for ever (--loader-free --random-ids): the step at a vocabulary no tokenizer here
    has, with no corpus read. Each row is one document and every position a target."""
    g = torch.Generator(device=device).manual_seed(0)
    pool = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=device, generator=g)
        pool.append((0, None, {"input_ids": ids, "doc_ids": torch.zeros_like(ids),
                               "loss_mask": torch.ones_like(ids, dtype=torch.bool)}))
    yield from itertools.cycle(pool)


def interleave_workers(loader, num_workers: int, splits_per_worker: int):
    """One batch from each worker -> the batch an in-process loader would have made.

    Worker w owns a contiguous run of the rank's splits and yields whole cycles over
    them; the in-process loader yields each cycle over all of the rank's splits. So the
    samples of a training step, and their order, do not depend on --num-workers.
    """
    batches = iter(loader)
    while group := list(itertools.islice(batches, num_workers)):
        yield {key: torch.stack([b[key].unflatten(0, (-1, splits_per_worker)) for b in group],
                                dim=1).flatten(0, 2)  # (cycles, workers, splits, T) -> (B, T)
               for key in group[0]}


def read_ahead_line(args) -> str:
    """The start-up line that states how much a rank's lance loader may read ahead."""
    import bounded_streaming

    if bounded_streaming.PROBLEM is not None:
        return (f"loader: read-ahead NOT bounded: {bounded_streaming.PROBLEM} (bounded_streaming.py), "
                f"so lancedb reads ahead without limit (upstream issue #3694)")
    if not args.loader_buffer_mb:
        return "loader: read-ahead not bounded (--loader-buffer-mb 0)"
    workers = f", {args.loader_buffer_mb / args.num_workers:g} MiB per worker" if args.num_workers else ""
    second = f" (and {args.num_workers} more loader workers)" if args.num_workers else ""
    return (f"loader: read-ahead at most {args.loader_buffer_mb:g} MiB per rank{workers} "
            f"(--loader-buffer-mb), plus about two read batches per split; twice that{second} "
            f"while one epoch drains and the next starts")


def ensure_demo_corpus(args, rank: int, world_size: int) -> None:
    """The default db is built from the demo corpus on first use; any other db must exist."""
    if args.db != DEFAULT_DB:
        return
    if rank == 0:
        import prepare_data

        if prepare_data.open_existing(args.db, args.table) is None:
            print(f"no corpus at {args.db} (table {args.table}): building the demo corpus there "
                  f"(python prepare_data.py --demo)", flush=True)
            prepare_data.build_demo(args.db, args.table, args.tokenizer)
    barrier(world_size)


@dataclass
class EpochPlan:
    """How much one epoch holds, computed from the table before training."""

    train_rows: int
    blocks_per_epoch: int | str | None  # packed only: int, or "auto"
    micro_steps_per_epoch: int
    ends_on_step: bool = False  # --global-batch-size: cut to whole optimizer steps (train_batches)


def whole_steps(cycles: int, args, num_splits: int, holds: str) -> int:
    """--global-batch-size: the loader cycles (a sample of every split each) of an epoch, cut
    to whole optimizer steps. A step then never spans two epochs, and its samples are the
    same on every world size: micro-batches of --batch-size x ranks samples would otherwise
    end each epoch in a partial one whose size depends on the world size."""
    per_step = args.global_batch_size // num_splits
    if cycles < per_step:
        raise UserError(f"an epoch holds {holds}, less than one optimizer step of --global-batch-size "
                        f"{args.global_batch_size}: lower --global-batch-size or add data")
    return cycles - cycles % per_step


def plan_epoch(args, table, num_splits: int, global_batch: int) -> EpochPlan:
    train_filter = data_filter(args, TRAIN_FILTER)
    train_rows, total_tokens = packed_token_count(table, train_filter)
    if train_rows == 0:
        raise UserError(f"no training rows pass the filter ({train_filter}): "
                        f"{why_no_training_rows(table, args.min_score)}")
    if train_rows < num_splits:
        raise UserError(
            f"only {train_rows} training rows pass the filter ({train_filter}) but "
            f"num_splits is {num_splits}: every split needs at least one row; lower "
            f"--min-score, --num-splits or --batch-size, or add data"
        )
    cycles_per_batch = global_batch // num_splits
    if not args.pack:
        cycles = train_rows // num_splits
        if args.global_batch_size:
            cycles = whole_steps(cycles, args, num_splits, f"{train_rows:,} training rows")
        return EpochPlan(train_rows, None, -(-cycles // cycles_per_batch), ends_on_step=bool(args.global_batch_size))
    exact = total_tokens // args.seq_len
    exact -= exact % num_splits
    if args.global_batch_size and exact:
        exact = whole_steps(exact // num_splits, args, num_splits, f"{exact:,} blocks of {args.seq_len}") * num_splits
    if args.blocks_per_epoch == "auto":
        blocks_per_epoch = "auto"
    elif args.blocks_per_epoch:
        try:
            blocks_per_epoch = int(args.blocks_per_epoch)
        except ValueError:
            raise UserError(f"--blocks-per-epoch must be an integer or 'auto' (got {args.blocks_per_epoch!r})") from None
        if blocks_per_epoch <= 0 or blocks_per_epoch % num_splits:
            raise UserError(f"--blocks-per-epoch ({blocks_per_epoch}) must be a positive multiple of num_splits ({num_splits})")
        if args.global_batch_size and blocks_per_epoch % args.global_batch_size:
            raise UserError(f"--blocks-per-epoch ({blocks_per_epoch}) must be a multiple of --global-batch-size "
                            f"({args.global_batch_size}): an epoch ends on a whole optimizer step")
    else:  # exact budget from the materialized token counts
        blocks_per_epoch = exact
    if blocks_per_epoch == 0:
        raise UserError(
            f"the training split holds {total_tokens:,} tokens, less than one "
            f"{args.seq_len}-token block per split ({num_splits} splits); lower --num-splits or --seq-len"
        )
    sized = exact if blocks_per_epoch == "auto" else blocks_per_epoch
    return EpochPlan(train_rows, blocks_per_epoch, -(-(sized // num_splits) // cycles_per_batch),
                     ends_on_step=bool(args.global_batch_size) and blocks_per_epoch != "auto")


def why_no_training_rows(table, min_score: float) -> str:
    """What to change when the filter leaves nothing: the split, or the score cutoff."""
    import pyarrow.compute as pc

    candidates = f"NOT is_dup AND ({TRAIN_FILTER})"  # the training filter without its score cutoff
    rows = table.count_rows(candidates)
    if rows == 0:
        return "the table has no non-duplicate rows with split = 'train'; re-run prepare_data.py"
    scores = table.search().where(candidates).select(["score"]).limit(rows).to_arrow()
    best = pc.max(scores.column("score")).as_py()
    return f"the best training score is {best:.3f}, below --min-score {min_score}; lower --min-score"


@dataclass
class TrainingData:
    """Where a run's training samples come from, epoch by epoch.

    The corpus table (rows or --pack) and the lance blocks table give a lancedb
    StreamingDataset per epoch, whose state checkpoints carry, read at one pinned table
    `version`; the other --blocks-mode baselines give plain batches and no state.
    With --data-version latest on a resume, `newer` holds what epochs from `newer_epoch`
    on read: the same source at the newest version.
    """

    plan: EpochPlan
    identity: str  # what the samples are; a checkpoint pins it
    table: object | None = None  # the corpus table, for validation
    dataset: Callable[[int], object] | None = None
    baseline: object | None = None  # blocks_loaders.BlocksEpochs
    version: dict | None = None  # {"version", "timestamp"} of the table read; checkpoints record it
    newer: TrainingData | None = None
    newer_epoch: int = 0

    def at(self, epoch: int) -> TrainingData:
        """What epoch `epoch` reads."""
        return self.newer if self.newer is not None and epoch >= self.newer_epoch else self


def open_training_data(args, tok, rank: int, world_size: int, device, num_splits: int,
                       global_batch: int, saved: dict | None = None, epoch: int = 0) -> TrainingData:
    """The run's samples; `saved` is the resumed checkpoint's data version (None on a fresh
    start) and `epoch` the epoch it resumes in."""
    from bounded_streaming import size_permutation_memory

    if args.blocks_mode == "off":
        ensure_demo_corpus(args, rank, world_size)
        where = f"table {args.table!r} in {args.db!r}"
        open_table = functools.partial(connect_table, args.db, args.table)
        check_table_tokenizer(open_table(), tok, f"the {where}")

        def source(table) -> TrainingData:
            with read_faults(table):
                plan = plan_epoch(args, table, num_splits, global_batch)
                size_permutation_memory(table.count_rows())  # here, on the main thread, before any loader
            corpus = corpus_source(args, tok, TRAIN_FILTER, args.pack, plan.blocks_per_epoch)
            return TrainingData(plan, "corpus", table, dataset=lambda epoch: make_dataset(
                args, table, rank, world_size, epoch=epoch, shuffle=True, num_splits=num_splits,
                **corpus))
    else:
        manifest = blocks_loaders.read_manifest(args.blocks_path, MODE_FORMAT[args.blocks_mode])
        check_blocks_manifest(args, tok, manifest)
        identity = f"blocks:{manifest['content_hash'][:16]}"
        num_blocks = manifest["num_blocks"]
        if args.blocks_mode != "lance":
            baseline = blocks_loaders.BlocksEpochs(
                args.blocks_mode, args.blocks_path, rank=rank, world_size=world_size,
                batch_size=args.batch_size, seed=args.shuffle_seed, num_workers=args.num_workers,
                mp_context=args.mp_context, pin_memory=device.type == "cuda",
                mosaic_cache=args.mosaic_cache)
            plan = EpochPlan(num_blocks, None, -(-baseline.blocks_per_rank // args.batch_size))
            return TrainingData(plan, identity, baseline=baseline)
        if num_blocks < num_splits:
            raise UserError(f"{args.blocks_path!r} holds {num_blocks} blocks, fewer than num_splits "
                            f"({num_splits}); lower --num-splits or --batch-size")
        where = f"blocks table at {args.blocks_path!r}"
        open_table = lambda: blocks_loaders.open_lance_blocks(args.blocks_path)[0]  # noqa: E731
        cycles = num_blocks // num_splits
        if args.global_batch_size:
            cycles = whole_steps(cycles, args, num_splits, f"{num_blocks:,} blocks")
        plan = EpochPlan(num_blocks, None, -(-cycles // (global_batch // num_splits)),
                         ends_on_step=bool(args.global_batch_size))
        transform = functools.partial(blocks_loaders.blocks_to_samples, seq_len=args.seq_len)

        def source(table) -> TrainingData:
            size_permutation_memory(num_blocks)
            return TrainingData(plan, identity, dataset=lambda epoch: make_dataset(
                args, table, rank, world_size, epoch=epoch, shuffle=True, num_splits=num_splits,
                transform=transform))

    latest = open_table()
    newest = broadcast_from_main(table_version(latest, latest.version), world_size)
    if saved is None:
        version = newest if args.data_version in ("", "latest") else \
            pinned_version(open_table, int(args.data_version), where, f"--data-version {args.data_version}")
    else:
        if args.data_version not in ("", "latest") and int(args.data_version) != saved["version"]:
            raise UserError(f"--data-version {args.data_version}: the checkpoint trained on version "
                            f"{saved['version']} of the {where}; drop --data-version to keep reading "
                            f"it, or pass --data-version latest to move to the newest at the next epoch")
        version = pinned_version(open_table, saved["version"], where, "the checkpoint", saved)
    data = source(checked_out(open_table(), version))
    data.version = version
    print0(f"data: {where}, version {version['version']} ({version['timestamp']})")
    if saved is not None and args.data_version == "latest":
        if newest["version"] == version["version"]:
            message = f"data: --data-version latest: version {version['version']} of the {where} is the newest"
        else:
            data.newer, data.newer_epoch = source(checked_out(latest, newest)), epoch + 1
            data.newer.version = newest
            message = (f"data: --data-version latest: epoch {epoch} finishes on version "
                       f"{version['version']} of the {where}, epochs from {epoch + 1} read version "
                       f"{newest['version']}")
        print0(message)
    return data


def table_version(table, version: int) -> dict:
    """{"version", "timestamp"} of one of `table`'s versions: the timestamp tells that version
    apart from a same-numbered one of a table dropped and made anew."""
    for entry in table.list_versions():
        if entry["version"] == version:
            return {"version": version, "timestamp": entry["timestamp"].isoformat()}
    raise ValueError(f"Version {version} not found")


def pinned_version(open_table, version: int, where: str, whose: str, saved: dict | None = None) -> dict:
    """Version `version` of the table, refused in one line when it no longer exists, or
    (for a checkpoint's) exists but was written at another time than the one `saved`."""
    table = open_table()
    try:
        found = table_version(table, version)
    except ValueError:
        kept = sorted(v["version"] for v in table.list_versions())
        have = f"it has versions {kept[0]}..{kept[-1]}" if kept else "it has no versions"
        if saved is None:
            raise UserError(f"{whose}: the {where} has no version {version} ({have})") from None
        raise UserError(f"{whose} trained on version {version} of the {where}, which no longer exists "
                        f"(cleaned up by optimize; {have}): the run cannot go on with the same data; "
                        f"start a new run in another --ckpt-dir") from None
    if saved is not None and found["timestamp"] != saved["timestamp"]:
        raise UserError(f"{whose} trained on version {version} of the {where} written at "
                        f"{saved['timestamp']}, but that version now dates from {found['timestamp']}: "
                        f"the table was made anew; start a new run in another --ckpt-dir")
    return found


def checked_out(table, version: dict):
    """`table` pinned at `version` for every read of the run: lancedb's StreamingDataset
    records it in its permutation, so loader workers read it too, whatever is appended,
    deleted or overwritten meanwhile."""
    table.checkout(version["version"])
    return table


def check_blocks_manifest(args, tok, manifest: dict) -> None:
    """The blocks must be this run's length and tokenizer (ids beyond the vocabulary
    would crash the embedding; another length would cut blocks apart)."""
    if manifest["seq_len"] != args.seq_len:
        raise UserError(f"the blocks at {args.blocks_path!r} hold {manifest['seq_len']} tokens; "
                        f"pass --seq-len {manifest['seq_len']}")
    built = (manifest["vocab_size"], manifest["eos_id"], manifest["pad_id"])
    if built != (tok.vocab_size, tok.eos_token_id, tok.pad_token_id):
        raise UserError(f"the blocks at {args.blocks_path!r} were tokenized with "
                        f"{manifest['tokenizer']!r}, not {tok.spec!r}; pass --tokenizer {manifest['tokenizer']}")


def check_validation_data(args, data, world_size: int) -> None:
    """--eval-every needs a validation row for every rank; say so before training."""
    if not args.eval_every:
        return
    if data.table is None:
        raise UserError(f"--eval-every {args.eval_every}: --blocks-mode {args.blocks_mode} trains on "
                        f"blocks, which have no validation split; drop --eval-every")
    val_filter = data_filter(args, VAL_FILTER)
    with read_faults(data.table):
        val_rows = data.table.count_rows(val_filter)
    if val_rows < world_size:
        found = "no validation rows pass" if not val_rows else f"only {val_rows} validation rows pass"
        raise UserError(f"--eval-every {args.eval_every}: {found} the filter ({val_filter}), and each "
                        f"of the {world_size} ranks needs one; prepare the corpus with "
                        f"--val-fraction above 0, lower --min-score, or drop --eval-every")


def train_batches(args, data: TrainingData, rank, world_size, device, num_splits, start_epoch,
                  loader_state, start_micro: int = 0):
    """Micro-batches across epochs as (epoch, LoaderPosition or None, batch); resumes
    mid-epoch from loader_state, `start_micro` micro-batches into `start_epoch`. An epoch
    planned to end on a whole optimizer step (`EpochPlan.ends_on_step`) ends there.

    Once an epoch's loader has asked for all of its rows (lancedb's `unscanned_rows` is 0:
    what is left is already read ahead), the next epoch's loader is started on a thread of
    its own (its permutation built, its worker processes spawned, its first batch made),
    so the boundary costs no wait. Till this epoch drains, the two read ahead side by side.
    """
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix=NEXT_EPOCH_THREAD)
    upcoming = None  # Future of the next epoch's started EpochBatches
    try:
        for epoch in range(start_epoch, args.epochs):
            source = data.at(epoch)
            if source.baseline is not None:
                for batch in source.baseline.epoch(epoch):
                    yield epoch, None, batch
                continue
            if upcoming is not None:
                current, upcoming = upcoming.result(), None
            else:
                current = EpochBatches(args, source, epoch, device, num_splits // world_size, loader_state)
            loader_state = None
            following = epoch + 1 < args.epochs and data.at(epoch + 1).baseline is None
            left = max(source.plan.micro_steps_per_epoch - (start_micro if epoch == start_epoch else 0), 0) \
                if source.plan.ends_on_step else None
            with current:
                for position, batch in itertools.islice(current, left):
                    if following and upcoming is None and current.requested_all():
                        upcoming = ahead.submit(EpochBatches.started, args, data.at(epoch + 1), epoch + 1,
                                                device, num_splits // world_size)
                    yield epoch, position, batch
    finally:
        if upcoming is not None:
            try:
                upcoming.result().close()
            except BaseException:  # noqa: BLE001 - the run ends anyway; its own error comes first
                pass
        ahead.shutdown(wait=True)


class LoaderPosition:
    """Where the loader stood just after one batch: what a checkpoint of the step that
    trained on that batch records, however far the loader has read since."""

    def __init__(self, dataset, state: dict):
        self.dataset = dataset  # for its counters (loader_stats)
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class EpochBatches:
    """One epoch of a lance source: its StreamingDataset, its loader, and the position
    after each batch (bounded_streaming.consumed_state, taken as the batch is made)."""

    def __init__(self, args, source: TrainingData, epoch: int, device, splits_per_rank: int,
                 loader_state: dict | None = None):
        self.dataset = source.dataset(epoch)
        if loader_state is not None:
            try:
                self.dataset.load_state_dict(loader_state)
            except ValueError as e:
                raise UserError(f"the checkpoint's loader state does not fit this run: {e}") from None
        self.batches = make_loader(self.dataset, args, device, splits_per_rank)
        self._iterator = None
        self._first = None

    @classmethod
    def started(cls, *args) -> EpochBatches:
        """An epoch whose loader runs and whose first batch is made already."""
        epoch = cls(*args)
        try:
            epoch._first = epoch._next()
        except BaseException:
            epoch.close()
            raise
        return epoch

    def requested_all(self) -> bool:
        return self.dataset.unscanned_rows == 0

    def _next(self):
        from bounded_streaming import consumed_state

        if self._iterator is None:
            self._iterator = iter(self.batches)
        try:
            batch = next(self._iterator)
        except StorageFault as e:
            # The traceback's frames hold the loader that raised it: free it, and so its
            # workers and their queues, now (the rank may leave by os._exit).
            traceback.clear_frames(e.__traceback__)
            raise StorageFault(worker_fault(str(e))) from None
        return LoaderPosition(self.dataset, consumed_state(self.dataset)), batch

    def __iter__(self):
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while True:
            try:
                yield self._next()
            except StopIteration:
                return

    def close(self) -> None:
        """Stop the loader's worker processes now (and the in-process pipeline's threads)."""
        self._iterator = self._first = None
        if isinstance(self.batches, Generator):
            self.batches.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def worker_fault(text: str) -> str:
    """A StorageFault's one line, also when a loader worker raised it: the DataLoader then
    re-raises it with the worker's traceback, whose last line is the original one."""
    last = text.strip().splitlines()[-1]
    return last.partition("StorageFault: ")[2] or last


class WaitClock:
    """What getting its batches costs the training loop: wall seconds blocked on the next
    one (`waited`: the share of a log interval spent here says whether the loader starves
    the device) and the training thread's own CPU seconds in it (`thread_s`: on a GPU,
    time the kernels of the step are not launched)."""

    def __init__(self):
        self.waited = 0.0
        self.thread_s = 0.0

    def timed(self, batches):
        """`batches`, with each `next` timed. It leaves them open: their owner closes them
        (train.batch_pipeline), after a stop's checkpoint."""
        it = iter(batches)
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                item = next(it)
            except StopIteration:
                return
            self.thread_s += time.thread_time() - cpu
            self.waited += time.perf_counter() - start
            yield item


def slowest_share(waited: float, elapsed: float, world_size: int, device: torch.device) -> float:
    """The largest share of `elapsed` that any rank spent waiting for data: one starved
    rank stalls every rank at the next gradient all-reduce."""
    share = torch.tensor(waited / elapsed if elapsed > 0 else 0.0, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
    return float(share)


def loader_stats(position) -> dict | None:
    """The lancedb loader's queue and timing counters, where the source has them. `fetch_s`
    is time spent reading; `budget_wait_s` is time reads waited for read-ahead budget
    (--loader-buffer-mb), which bounded_streaming.py keeps out of lancedb's fetch time."""
    if position is None:
        return None
    ds = position.dataset
    return dict(unscanned_rows=ds.unscanned_rows, raw_queue_depth=ds.raw_queue_depth,
                prefetch_queue_depth=ds.prefetch_queue_depth, consumed_rows=ds.consumed_rows,
                fetch_s=round(ds.fetch_time, 3), budget_wait_s=round(ds.budget_wait_time, 3),
                transform_s=round(ds.transform_time, 3))


def format_loader_stats(stats: dict | None) -> str:
    if stats is None:
        return ""
    return (f" | q {stats['unscanned_rows']}/{stats['raw_queue_depth']}/"
            f"{stats['prefetch_queue_depth']}/{stats['consumed_rows']} | "
            f"fetch {stats['fetch_s']:.1f}s tx {stats['transform_s']:.1f}s budget {stats['budget_wait_s']:.1f}s")
