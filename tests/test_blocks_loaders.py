"""The Parquet block loaders (blocks_loaders.py) over layouts written here, in temporary directories."""

import json
import multiprocessing as mp
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

import blocks_loaders
from blocks_loaders import MANIFEST_KEYS, ParquetRandomBlocks, ParquetSeqBlocks
from common import UserError

SEQ_LEN = 16
FILE_SIZES = (37, 50, 13)  # uneven, and not multiples of any row group size used here
NUM_BLOCKS = sum(FILE_SIZES)


def make_blocks(n=NUM_BLOCKS, seq_len=SEQ_LEN, seed=0):
    """`n` distinct blocks of random tokens; block i is told apart by its bytes."""
    blocks = np.random.default_rng(seed).integers(0, 50_000, size=(n, seq_len), dtype=np.int32)
    assert len({b.tobytes() for b in blocks}) == n
    return blocks


def write_layout(path, fmt, blocks, row_group_blocks, file_sizes=FILE_SIZES):
    """Write `blocks` in stored order as the builder does: Parquet files + manifest.json."""
    os.makedirs(path, exist_ok=True)
    seq_len = blocks.shape[1]
    files, start = [], 0
    for i, n in enumerate(file_sizes):
        part = blocks[start:start + n]
        start += n
        col = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), seq_len)
        name = f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"input_ids": col}), os.path.join(path, name),
                       row_group_size=row_group_blocks)
        meta = pq.ParquetFile(os.path.join(path, name)).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)][:-1] == \
            [row_group_blocks] * (meta.num_row_groups - 1)
        files.append({"path": name, "num_blocks": n})
    assert start == len(blocks)
    manifest = {
        "format": fmt, "num_blocks": len(blocks), "seq_len": seq_len, "dtype": "int32",
        "tokenizer": "byte", "vocab_size": 258, "eos_id": 256, "pad_id": 257, "seed": 0,
        "source": "test", "content_hash": "0" * 16, "multiset_hash": "0" * 16,
        "row_group_blocks": row_group_blocks, "files": files,
    }
    assert set(MANIFEST_KEYS) <= set(manifest)
    with open(os.path.join(path, blocks_loaders.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return str(path)


@pytest.fixture(scope="module")
def blocks():
    return make_blocks()


@pytest.fixture(scope="module")
def random_path(tmp_path_factory, blocks):
    return write_layout(tmp_path_factory.mktemp("blocks") / "parquet-random", "parquet-random", blocks, 1)


@pytest.fixture(scope="module")
def seq_path(tmp_path_factory, blocks):
    return write_layout(tmp_path_factory.mktemp("blocks") / "parquet-seq", "parquet-seq", blocks, 4)


def make(kind, path, rank, world_size, seed=0, epoch=0):
    if kind == "random":
        return ParquetRandomBlocks(path, rank, world_size, seed, epoch)
    return ParquetSeqBlocks(path, rank, world_size)


def expected_shares(kind, world_size, seed=0, epoch=0):
    """The global indices each rank must yield, straight from the contract."""
    per_rank = NUM_BLOCKS // world_size
    order = (np.random.default_rng([seed, epoch]).permutation(NUM_BLOCKS) if kind == "random"
             else np.arange(NUM_BLOCKS))
    return [order[r * per_rank:(r + 1) * per_rank].tolist() for r in range(world_size)]


def as_indices(items, blocks):
    """Yielded blocks -> their global indices in the stored layout (by bytes)."""
    where = {b.tobytes(): i for i, b in enumerate(blocks)}
    out = []
    for x in items:
        assert x.dtype == torch.int64
        out.append(where[x.numpy().astype(np.int32).tobytes()])
    return out


def check_disjoint_complete(kind, world_size, per_rank_blocks, blocks):
    expected = expected_shares(kind, world_size)
    got = [as_indices(items, blocks) for items in per_rank_blocks]
    flat = [i for share in got for i in share]
    assert len(flat) == len(set(flat)) == (NUM_BLOCKS // world_size) * world_size
    for share, want in zip(got, expected):
        assert sorted(share) == sorted(want)
    if world_size == 1:
        assert sorted(flat) == list(range(NUM_BLOCKS))
    return got


@pytest.mark.parametrize("kind", ["random", "seq"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_disjoint_complete_in_process(kind, world_size, blocks, random_path, seq_path):
    path = random_path if kind == "random" else seq_path
    datasets = [make(kind, path, r, world_size) for r in range(world_size)]
    assert all(len(ds) == NUM_BLOCKS // world_size for ds in datasets)
    loaders = [DataLoader(ds, batch_size=None, num_workers=0) for ds in datasets]
    got = check_disjoint_complete(kind, world_size, [[b["input_ids"] for b in dl] for dl in loaders], blocks)
    # without workers the order is exactly the contract's order, not only the same set
    assert got == expected_shares(kind, world_size)


def test_ranks_and_workers_disjoint_complete(blocks, random_path, seq_path):
    """world 2 x 2 workers per loader class, all four DataLoaders started before any is
    drained so their workers start up at the same time (each worker imports torch)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["blocks_loaders"])  # import torch once, in the server
    world_size, workers = 2, 2
    runs = {}
    for kind, path in (("random", random_path), ("seq", seq_path)):
        runs[kind] = [iter(DataLoader(make(kind, path, r, world_size), batch_size=5,
                                      num_workers=workers, multiprocessing_context=ctx))
                      for r in range(world_size)]
    for kind, iterators in runs.items():
        per_rank = []
        for it in iterators:
            batches = list(it)
            assert all(b["input_ids"].shape[1:] == (SEQ_LEN,) for b in batches)
            per_rank.append([row for b in batches for row in b["input_ids"]])
        got = check_disjoint_complete(kind, world_size, per_rank, blocks)
        # worker w owns the w-th contiguous run of the rank's share
        for share, want in zip(got, expected_shares(kind, world_size)):
            runs_of = [r.tolist() for r in np.array_split(want, workers)]
            assert sorted(share) == sorted(runs_of[0] + runs_of[1])
            # batches interleave across workers, but each worker's run keeps the contract's order
            for run in runs_of:
                assert [i for i in share if i in run] == run


def test_random_deterministic_per_seed_and_epoch(blocks, random_path):
    def order(seed, epoch):
        ds = ParquetRandomBlocks(random_path, 0, 1, seed, epoch)
        return as_indices([b["input_ids"] for b in ds], blocks)

    first = order(3, 0)
    assert first == order(3, 0)
    assert first == np.random.default_rng([3, 0]).permutation(NUM_BLOCKS).tolist()
    assert first != order(4, 0)
    assert first != order(3, 1)
    ds = ParquetRandomBlocks(random_path, 0, 1, seed=3)
    ds.set_epoch(1)
    assert as_indices([b["input_ids"] for b in ds], blocks) == order(3, 1)


def test_seq_yields_stored_order_every_epoch(blocks, seq_path):
    ds = ParquetSeqBlocks(seq_path, 0, 1)
    for _ in range(2):
        assert as_indices([b["input_ids"] for b in ds], blocks) == list(range(NUM_BLOCKS))


@pytest.mark.parametrize("window", [8, 1000])
def test_random_reads_only_row_groups_it_needs(tmp_path, blocks, window):
    rgb = 4
    path = write_layout(tmp_path / "parquet-random", "parquet-random", blocks, rgb)
    starts = np.concatenate([[0], np.cumsum(FILE_SIZES)])
    ds = ParquetRandomBlocks(path, 1, 2, seed=5, window=window)
    mine = ds.indices()
    got = as_indices([b["input_ids"] for b in ds], blocks)
    assert got == mine.tolist()
    # each window reads the distinct (file, row group) pairs of its indices, once each
    needed = 0
    for lo in range(0, len(mine), window):
        idx = mine[lo:lo + window]
        f = np.searchsorted(starts, idx, side="right") - 1
        needed += len(set(zip(f.tolist(), ((idx - starts[f]) // rgb).tolist())))
    assert ds.row_groups_read == needed
    if window >= len(mine):
        # one window: exactly the row groups holding the share, fewer than the file has
        total_row_groups = sum(-(-n // rgb) for n in FILE_SIZES)
        assert needed < total_row_groups


def test_seq_reads_only_its_range(tmp_path, blocks):
    rgb = 4
    path = write_layout(tmp_path / "parquet-seq", "parquet-seq", blocks, rgb)
    starts = np.concatenate([[0], np.cumsum(FILE_SIZES)])
    for rank in range(3):
        ds = ParquetSeqBlocks(path, rank, 3)
        mine = ds.indices()
        assert as_indices([b["input_ids"] for b in ds], blocks) == mine.tolist()
        f = np.searchsorted(starts, mine, side="right") - 1
        assert ds.row_groups_read == len(set(zip(f.tolist(), ((mine - starts[f]) // rgb).tolist())))


@pytest.mark.parametrize("kind", ["random", "seq"])
def test_yields_int64_blocks_of_seq_len(kind, random_path, seq_path):
    ds = make(kind, random_path if kind == "random" else seq_path, 0, 1)
    item = next(iter(ds))
    assert set(item) == {"input_ids"}
    assert isinstance(item["input_ids"], torch.LongTensor)
    assert item["input_ids"].shape == (SEQ_LEN,) and item["input_ids"].dtype == torch.int64


@pytest.mark.parametrize("kind", ["random", "seq"])
def test_manifest_listing_a_missing_file_is_a_user_error(kind, tmp_path, blocks):
    fmt = f"parquet-{kind}"
    path = write_layout(tmp_path / fmt, fmt, blocks, 1 if kind == "random" else 4)
    ds = make(kind, path, 0, 1)
    os.remove(os.path.join(path, "part-00001.parquet"))
    with pytest.raises(UserError, match="part-00001.parquet"):
        list(ds)  # a file gone after the dataset was made is caught when it is opened
    with pytest.raises(UserError, match="part-00001.parquet"):
        make(kind, path, 0, 1)


def test_wrong_format_and_missing_dir_are_user_errors(tmp_path, random_path):
    with pytest.raises(UserError, match="parquet-random"):
        ParquetSeqBlocks(random_path, 0, 1)
    with pytest.raises(UserError, match="no blocks"):
        ParquetRandomBlocks(str(tmp_path / "nowhere"), 0, 1, seed=0)
