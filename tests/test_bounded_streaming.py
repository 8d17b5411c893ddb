"""bounded_streaming.py: read-ahead held to --loader-buffer-mb on every lance path (rows,
--pack, lance blocks, loader workers), measured with the loader's own counters; the samples
of lancedb's own StreamingDataset, in its order, for any budget and across a state_dict
handed between the two; an epoch finished on a budget below one read batch; a start-up that
reads the permutation once whatever the splits; and the guard that falls back when lancedb
is not 0.40's.
"""

import functools
import gc
import hashlib
import time

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import torch
from lancedb.streaming import StreamingDataset

import blocks_loaders
import bounded_streaming
import data
import train
from common import TRAIN_FILTER, load_tokenizer, synthetic_corpus
from conftest import REPO, run_script

ROWS, MIN_TOKENS, MAX_TOKENS = 20_000, 100, 300  # ~4M tokens, ~16 MB of Arrow
SPLITS, READ_BATCH, SEQ_LEN = 4, 16, 128
BUDGET_MB = 0.25
ROW_BYTES = 4 * (MIN_TOKENS + MAX_TOKENS) / 2 + 4  # Arrow bytes per row: int32 ids and an offset


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("bounded") / "db")
    return synthetic_corpus(db, ROWS, MIN_TOKENS, MAX_TOKENS, seed=1)


@pytest.fixture(scope="module")
def blocks_table(tmp_path_factory):
    """A pre-packed blocks table as build_packed_datasets.py writes it: SEQ_LEN ids a row."""
    ids = np.random.default_rng(2).integers(0, 256, (ROWS, SEQ_LEN), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(np.arange(0, ids.size + 1, SEQ_LEN, dtype=np.int32)),
                                      pa.array(ids.ravel()))
    db = lancedb.connect(str(tmp_path_factory.mktemp("blocks")))
    return db.create_table("blocks", pa.table({"input_ids": column}))


def train_args(*extra):
    return train.parse_args(["--seq-len", str(SEQ_LEN), "--batch-size", str(SPLITS),
                             "--read-batch-size", str(READ_BATCH), *map(str, extra)])


def dataset(path, corpus, blocks_table, budget_mb, num_workers=0):
    """data.make_dataset as train.py builds it for `path`, with this budget."""
    args = train_args("--loader-buffer-mb", budget_mb, "--num-workers", num_workers,
                      *(["--pack"] if path == "pack" else []))
    if path == "blocks":
        source = dict(transform=functools.partial(blocks_loaders.blocks_to_samples, seq_len=SEQ_LEN))
        table = blocks_table
    else:
        plan = data.plan_epoch(args, corpus, SPLITS, SPLITS)
        source = data.corpus_source(args, load_tokenizer("byte"), TRAIN_FILTER, path == "pack",
                                     plan.blocks_per_epoch)
        table = corpus
    ds = data.make_dataset(args, table, 0, 1, epoch=0, shuffle=True, num_splits=SPLITS, **source)
    return ds, args


def stop(batches) -> None:
    """Drop a loader iterator now: its dataset generator closes, and lancedb's pools with it."""
    del batches
    gc.collect()


def read_ahead(path, corpus, blocks_table, budget_mb, num_workers=0):
    """Consume 30 batches slowly, then idle: the most rows the loader held fetched and
    not yet consumed (raw + transformed queues) at any sample, and the rows it fetched. With
    workers, the counters are those of the worker that reported last, over its own splits."""
    ds, args = dataset(path, corpus, blocks_table, budget_mb, num_workers)
    batches = iter(data.make_loader(ds, args, torch.device("cpu"), SPLITS))
    held, fetched = 0, 0
    try:
        for i in range(40):
            next(batches)
            time.sleep(0.05 if i < 30 else 0.2)
            held = max(held, ds.raw_queue_depth + ds.prefetch_queue_depth)
            fetched = max(fetched, ROWS // max(num_workers, 1) - ds.unscanned_rows)
    finally:
        stop(batches)
    return held, fetched


# The bound in rows: the budget, one read in flight per split whose size is still an
# estimate, and the floor of about two read batches per split.
BOUND_ROWS = BUDGET_MB * 2**20 / ROW_BYTES + 3 * SPLITS * READ_BATCH


@pytest.mark.parametrize("path,num_workers", [("rows", 0), ("pack", 0), ("blocks", 0), ("pack", 2)])
def test_read_ahead_stays_within_the_budget(corpus, blocks_table, path, num_workers):
    held, fetched = read_ahead(path, corpus, blocks_table, BUDGET_MB, num_workers)
    assert 0 < held <= BOUND_ROWS, (held, BOUND_ROWS)
    print(f"{path} x{num_workers} workers: held {held} rows, bound {BOUND_ROWS:.0f}, fetched {fetched}")
    assert fetched < ROWS / 10, fetched
    if num_workers == 0:  # the same consumer without the bound reads far ahead: the check can fail
        unbounded, _ = read_ahead(path, corpus, blocks_table, 0)
        assert unbounded > 2 * BOUND_ROWS, (unbounded, BOUND_ROWS)


def sample_hashes(ds, count, start_state=None):
    """The first `count` samples of `ds` (after `start_state`) as short hashes, and its state."""
    if start_state is not None:
        ds.load_state_dict(start_state)
    hashes = []
    iterator = iter(ds)
    for sample in iterator:
        hashes.append(hashlib.blake2b(sample["input_ids"].numpy().tobytes(), digest_size=8).hexdigest())
        if len(hashes) == count:
            break
    state = ds.state_dict()
    iterator.close()
    return hashes, state


@pytest.mark.parametrize("path", ["rows", "pack", "blocks"])
def test_the_samples_of_lancedb_itself_for_any_budget(corpus, blocks_table, path):
    """Budgets 10^6 apart, and none, give lancedb's own StreamingDataset's samples in its
    order; a state_dict written by either resumes in the other (checkpoints from before the
    bound load, and checkpoints written with it load without it)."""
    bounded = {mb: dataset(path, corpus, blocks_table, mb)[0] for mb in (1e-6, 1.0, 0)}
    plain_kwargs = {k: getattr(bounded[0], f"_{k}") for k in (
        "num_splits", "shuffle", "shuffle_seed", "epoch", "rank", "world_size", "read_batch_size",
        "io_queue_depth", "columns", "filter", "transform", "transform_parallelism", "pack_sequences",
        "eos_id", "pad_id", "blocks_per_epoch", "transform_queue_depth")}
    table = blocks_table if path == "blocks" else corpus

    def plain():
        return StreamingDataset(table, **plain_kwargs)

    first, state = sample_hashes(plain(), 3 * SPLITS * READ_BATCH + 3 * SPLITS)
    rest, _ = sample_hashes(plain(), 2 * SPLITS * READ_BATCH, state)
    assert len(first) == 3 * SPLITS * READ_BATCH + 3 * SPLITS and len(rest) == 2 * SPLITS * READ_BATCH
    for mb, ds in bounded.items():
        assert type(ds) is bounded_streaming.BoundedStreamingDataset
        got_first, got_state = sample_hashes(ds, len(first))
        assert got_first == first, f"budget {mb} MiB: other samples than lancedb's"
        assert got_state == state
        fresh = dataset(path, corpus, blocks_table, mb)[0]
        assert sample_hashes(fresh, len(rest), state)[0] == rest, f"budget {mb} MiB: resume differs"
    assert sample_hashes(plain(), len(rest), got_state)[0] == rest


@pytest.mark.parametrize("path", ["rows", "pack"])
def test_a_budget_below_one_read_batch_finishes_the_epoch(tmp_path, path):
    corpus = synthetic_corpus(str(tmp_path / "db"), 600, 20, 60, seed=3)
    args = train_args("--loader-buffer-mb", 1e-6, *(["--pack"] if path == "pack" else []))
    plan = data.plan_epoch(args, corpus, SPLITS, SPLITS)
    source = data.corpus_source(args, load_tokenizer("byte"), TRAIN_FILTER, path == "pack",
                                 plan.blocks_per_epoch)
    ds = data.make_dataset(args, corpus, 0, 1, epoch=0, shuffle=True, num_splits=SPLITS, **source)
    batches = list(data.make_loader(ds, args, torch.device("cpu"), SPLITS))
    assert len(batches) == plan.micro_steps_per_epoch > 0
    assert ds.peak_buffered_bytes > 0  # the budget was in force, at its floor


def first_batch_readers(table, splits, path, monkeypatch):
    """Up to the first batch of a `splits`-split dataset: the split lists the permutation was
    read for, and {split: the permutation table its reader was built over}."""
    reads, readers = [], {}
    read_splits, build = bounded_streaming.split_tables, bounded_streaming.SplitPermutation.from_tables

    def counted_read(permutation_table, wanted):
        reads.append(list(wanted))
        return read_splits(permutation_table, wanted)

    def recorded_build(base_table, permutation_table=None, split=None):
        permutation = build(base_table, permutation_table, split)
        readers[split] = permutation.permutation_table
        return permutation

    monkeypatch.setattr(bounded_streaming, "split_tables", counted_read)
    monkeypatch.setattr(bounded_streaming.SplitPermutation, "from_tables", recorded_build)
    args = train.parse_args(["--seq-len", str(SEQ_LEN), "--batch-size", str(splits), "--num-workers", "0",
                             *(["--pack"] if path == "pack" else [])])
    source = data.corpus_source(args, load_tokenizer("byte"), TRAIN_FILTER, path == "pack",
                                blocks_per_epoch=splits * 4)
    ds = data.make_dataset(args, table, 0, 1, epoch=0, shuffle=True, num_splits=splits, **source)
    batches = iter(data.make_loader(ds, args, torch.device("cpu"), splits))
    next(batches)
    rows = ds._perm_table.count_rows()
    stop(batches)
    monkeypatch.undo()
    return reads, readers, rows


@pytest.mark.parametrize("path", ["rows", "pack"])
def test_start_up_reads_the_permutation_once_whatever_the_splits(tmp_path, path, monkeypatch):
    """lancedb 0.40 alone scans the whole permutation table per split (its row count, its
    offset map) and copies it to Arrow and back twice per split: ~4x the time to the first
    batch from 8 to 32 splits. Here the permutation is read once, and each split's reader
    is built over that split's rows alone, so start-up is linear in the rank's rows. Counted
    here; bench/loader_memory.py times it against lancedb's own (its start-up table)."""
    table = synthetic_corpus(str(tmp_path / "db"), 20_000, 10, 60, seed=4)
    for splits in (8, 32):
        reads, readers, rows = first_batch_readers(table, splits, path, monkeypatch)
        assert reads == [list(range(splits))], splits
        assert sorted(readers) == list(range(splits)), splits
        assert sum(t.count_rows() for t in readers.values()) == rows > 0, splits
        for split, split_table in readers.items():
            assert set(split_table.to_arrow().column("split_id").to_pylist()) == {split}, (splits, split)


def test_an_unknown_lancedb_pipeline_is_recognised():
    assert bounded_streaming.PROBLEM is None  # the installed lancedb is the one written for
    changed = {**bounded_streaming.RELIED_ON, "StreamingDataset._iter_owned": "0" * 64}
    assert "_iter_owned is not the 0.40.0 code" in bounded_streaming.pipeline_problem(changed)
    missing = {**bounded_streaming.RELIED_ON, "Permutation.gone": "0" * 64}
    assert "no readable Permutation.gone" in bounded_streaming.pipeline_problem(missing)


FALLBACK = """
import sys
sys.path.insert(0, {repo!r})
import lancedb.streaming as streaming
lancedb_iter_owned = streaming.StreamingDataset._iter_owned
def _iter_owned(self, **kwargs):  # what a lancedb release that changed its pipeline looks like
    yield from lancedb_iter_owned(self, **kwargs)
streaming.StreamingDataset._iter_owned = _iter_owned
import train
train.main(sys.argv[1:])
"""


def test_train_falls_back_to_lancedb_unbounded_with_a_warning(demo_db, tmp_path):
    """On a lancedb whose pipeline is not 0.40's, train.py says so at start-up and trains
    on lancedb's own StreamingDataset: the same samples, read ahead without a bound."""
    script = tmp_path / "other_lancedb.py"
    script.write_text(FALLBACK.format(repo=str(REPO)))
    runs = {}
    for name, runner in (("fallback", str(script)), ("bounded", train.__file__)):
        proc = run_script(runner, "--db", demo_db, "--model", "tiny", "--seq-len", "64", "--pack",
                          "--steps", "3", "--batch-size", "4", "--ckpt-dir", tmp_path / f"ck-{name}",
                          "--trace-samples", tmp_path / f"trace-{name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = proc.stdout
    assert "loader: read-ahead NOT bounded: lancedb 0.40.0's StreamingDataset._iter_owned" in runs["fallback"]
    assert "upstream issue #3694" in runs["fallback"]
    assert "loader: read-ahead at most 256 MiB per rank" in runs["bounded"]
    traces = [(tmp_path / f"trace-{name}" / "rank0.jsonl").read_text() for name in ("fallback", "bounded")]
    assert traces[0].count("\n") == 3  # a record per step
    assert traces[0] == traces[1]
