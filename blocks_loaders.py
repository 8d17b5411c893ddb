"""Loaders over the pre-packed blocks that build_packed_datasets.py writes.

Every format directory holds the same blocks in the same stored order plus a
`manifest.json` (see `read_manifest`). The Parquet loaders here are the two
baselines of the A/B harness:

- `ParquetRandomBlocks`: a seeded permutation of all blocks per epoch, read by
  random access; it opens only the row groups that hold its blocks (the random
  layout keeps one block per row group by default, so nothing is read twice).
- `ParquetSeqBlocks`: the stored (pre-shuffled) order, read sequentially.

Both are disjoint and complete across ranks and DataLoader workers: rank r owns
an equal share of the epoch's order (the `num_blocks % world_size` surplus is
dropped, as lancedb's StreamingDataset drops its split surplus, so every rank
steps the same number of times), and worker w of a rank owns a contiguous run
of the rank's share.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

import preemption
import storage
from common import UserError, is_remote

FORMATS = ("lance", "mds", "parquet-random", "parquet-seq")
# train.py --blocks-mode -> the OUT/<format> directory it reads
MODE_FORMAT = {"lance": "lance", "mosaic": "mds", "parquet-random": "parquet-random",
               "parquet-seq": "parquet-seq"}
MANIFEST = "manifest.json"
DEFAULT_MOSAIC_CACHE = "~/mosaic_cache"  # the reference's per-node cache of remote MDS shards
MANIFEST_KEYS = ("format", "num_blocks", "seq_len", "dtype", "tokenizer", "vocab_size",
                 "eos_id", "pad_id", "seed", "source", "content_hash", "multiset_hash")


def read_manifest(path: str, fmt: str | None = None) -> dict:
    """The manifest of one built format directory, checked; `fmt` is the format expected."""
    file = f"{path.rstrip('/')}/{MANIFEST}"
    try:
        if is_remote(path):
            fs, inner = storage.filesystem(file)
            with fs.open_input_stream(inner) as f:
                manifest = json.loads(f.read())
        else:
            with open(file) as f:
                manifest = json.load(f)
    except (FileNotFoundError, OSError) as e:
        if not is_remote(path) and not os.path.isdir(path):
            raise UserError(f"no blocks at {path!r}; build them with "
                            f"`python build_packed_datasets.py --db DIR --table NAME --out DIR`") from None
        if why := storage.describe(e, path):
            raise UserError(why) from None
        raise UserError(f"{path!r} has no readable {MANIFEST} ({type(e).__name__}): it was not "
                        f"written by build_packed_datasets.py, or the build did not finish") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file!r} is not valid JSON ({e})") from None
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise UserError(f"{file!r} lacks {', '.join(missing)}: not a blocks manifest")
    if fmt is not None and manifest["format"] != fmt:
        raise UserError(f"{path!r} holds {manifest['format']!r} blocks, not {fmt!r}; "
                        f"pass the {fmt} directory the builder wrote (OUT/{fmt})")
    return manifest


# ── Parquet loaders ──────────────────────────────────────────────────────────────────

def _worker_run(share: np.ndarray) -> np.ndarray:
    """This DataLoader worker's contiguous run of the rank's share (all of it outside workers)."""
    info = get_worker_info()
    if info is None:
        return share
    return np.array_split(share, info.num_workers)[info.id]


class _ParquetBlocks(IterableDataset):
    """What both Parquet loaders share: the manifest, the file index, opening files, decoding."""

    fmt = ""

    def __init__(self, path: str, rank: int, world_size: int):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.path, self.rank, self.world_size = path.rstrip("/"), rank, world_size
        m = read_manifest(self.path, self.fmt)
        for key in ("files", "row_group_blocks"):
            if key not in m:
                raise UserError(f"{self.path!r}: {MANIFEST} lacks {key!r}; "
                                f"rebuild with build_packed_datasets.py")
        self.num_blocks, self.seq_len = int(m["num_blocks"]), int(m["seq_len"])
        self.row_group_blocks = int(m["row_group_blocks"])
        self.files = [f["path"] for f in m["files"]]
        sizes = np.array([f["num_blocks"] for f in m["files"]], dtype=np.int64)
        if sizes.sum() != self.num_blocks:
            raise UserError(f"{self.path!r}: {MANIFEST} lists {sizes.sum()} blocks in its files "
                            f"but num_blocks={self.num_blocks}; rebuild with build_packed_datasets.py")
        # starts[f] = global index of file f's first block (plus the total at the end)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        if not is_remote(self.path):
            missing = [f for f in self.files if not os.path.isfile(os.path.join(self.path, f))]
            if missing:
                raise UserError(f"{self.path!r}: {MANIFEST} lists {len(missing)} file(s) that are "
                                f"missing, first {missing[0]!r}; rebuild with build_packed_datasets.py")
        self.per_rank = self.num_blocks // world_size
        if self.per_rank == 0:
            raise UserError(f"{self.path!r} holds {self.num_blocks} blocks, too few to give each "
                            f"of {world_size} ranks one")
        self.row_groups_read = 0  # counted in the iterating process (a worker's own copy)

    def __len__(self) -> int:
        return self.per_rank

    def _opener(self):
        """A function file index -> ParquetFile that opens each file once per iterator."""
        fs = root = None
        if is_remote(self.path):
            fs, root = storage.filesystem(self.path)
        cache: dict[int, pq.ParquetFile] = {}

        def open_file(f: int) -> pq.ParquetFile:
            if f not in cache:
                name = self.files[f]
                try:
                    source = (fs.open_input_file(f"{root}/{name}") if fs is not None
                              else os.path.join(self.path, name))
                    cache[f] = pq.ParquetFile(source)
                except FileNotFoundError:
                    raise UserError(f"{self.path!r}: block file {name!r} is missing; "
                                    f"rebuild with build_packed_datasets.py") from None
            return cache[f]

        return open_file

    def _read(self, pf: pq.ParquetFile, rg: int) -> np.ndarray:
        """One row group as an int32 array [rows, seq_len]."""
        self.row_groups_read += 1
        col = pf.read_row_group(rg, columns=["input_ids"]).column("input_ids")
        # flatten() honours slice offsets, which .values of a sliced list array does not
        flat = np.concatenate([chunk.flatten().to_numpy() for chunk in col.chunks])
        return flat.reshape(-1, self.seq_len)

    def _locate(self, idx: np.ndarray):
        """Global block indices -> (file, row group, offset within the row group)."""
        f = np.searchsorted(self.starts, idx, side="right") - 1
        local = idx - self.starts[f]
        return f, local // self.row_group_blocks, local % self.row_group_blocks

    @staticmethod
    def _block(row: np.ndarray) -> dict:
        return {"input_ids": torch.from_numpy(row.astype(np.int64))}


class ParquetRandomBlocks(_ParquetBlocks):
    """A seeded permutation of all blocks per epoch, read by random access.

    Rank r owns `order[r*per_rank:(r+1)*per_rank]` of
    `np.random.default_rng([seed, epoch]).permutation(num_blocks)`. The owned
    indices are walked `window` at a time and each row group holding one of them is
    read once per window, so a layout with several blocks per row group is not read
    whole for every block. Call `set_epoch` before iterating to reshuffle; with
    persistent DataLoader workers the workers keep the epoch they started with.
    """

    fmt = "parquet-random"

    def __init__(self, path: str, rank: int, world_size: int, seed: int, epoch: int = 0,
                 window: int = 64):
        super().__init__(path, rank, world_size)
        self.seed, self.epoch, self.window = seed, epoch, window

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """The global block indices this rank (and worker, inside a DataLoader) yields, in order."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_blocks)
        return _worker_run(order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank])

    def __iter__(self):
        self.row_groups_read = 0
        open_file = self._opener()
        mine = self.indices()
        for lo in range(0, len(mine), self.window):
            files, rgs, offsets = self._locate(mine[lo:lo + self.window])
            rows = {}
            for key in dict.fromkeys(zip(files.tolist(), rgs.tolist())):
                rows[key] = self._read(open_file(key[0]), key[1])
            for f, rg, off in zip(files.tolist(), rgs.tolist(), offsets.tolist()):
                yield self._block(rows[f, rg][off])


class ParquetSeqBlocks(_ParquetBlocks):
    """The stored (already shuffled) order, read sequentially, the same every epoch.

    Rank r owns the contiguous range `[r*per_rank, (r+1)*per_rank)`; a worker reads
    only the row groups that overlap its run, trimming the first and last.
    """

    fmt = "parquet-seq"

    def indices(self) -> np.ndarray:
        """The global block indices this rank (and worker, inside a DataLoader) yields, in order."""
        return _worker_run(np.arange(self.rank * self.per_rank, (self.rank + 1) * self.per_rank))

    def __iter__(self):
        self.row_groups_read = 0
        mine = self.indices()
        if len(mine) == 0:
            return
        open_file = self._opener()
        lo, hi = int(mine[0]), int(mine[-1]) + 1
        rgb = self.row_group_blocks
        for f in range(len(self.files)):
            # the run's overlap with file f, in the file's own block numbering
            a = max(lo, self.starts[f]) - self.starts[f]
            b = min(hi, self.starts[f + 1]) - self.starts[f]
            if a >= b:
                continue
            pf = open_file(f)
            for rg in range(a // rgb, (b - 1) // rgb + 1):
                rows = self._read(pf, rg)
                first = rg * rgb
                for row in rows[max(a - first, 0):b - first]:
                    yield self._block(row)



# ── The other formats, and one constructor per --blocks-mode ─────────────────────

# DataLoader workers per rank when --num-workers is 0, as the reference used them
# (capped at the machine's cores): random reads hide their latency behind many
# concurrent readers, sequential ones need few.
DEFAULT_WORKERS = {"mosaic": 8, "parquet-random": 8, "parquet-seq": 2}
BASELINE_MODES = tuple(DEFAULT_WORKERS)  # the --blocks-mode values BlocksEpochs serves


def open_lance_blocks(path: str):
    """(table, manifest) of OUT/lance: the LanceDB table `blocks` and its manifest."""
    manifest = read_manifest(path, "lance")
    try:
        return storage.connect(path).open_table("blocks"), manifest
    except (ValueError, FileNotFoundError) as e:
        raise UserError(f"{path!r} has a manifest but no table 'blocks' ({e}); "
                        f"rebuild it with build_packed_datasets.py") from None


def blocks_to_samples(batch, seq_len: int) -> list[dict]:
    """StreamingDataset transform for the blocks table: one LongTensor per block.

    Module-level (bound with functools.partial) so it pickles into loader workers.
    """
    ids = batch.column("input_ids").flatten().to_numpy().reshape(-1, seq_len)
    return [{"input_ids": row} for row in torch.from_numpy(ids.astype(np.int64))]


def mosaic_cache_dir(cache_root: str, manifest: dict) -> str:
    """Where a node keeps the shards of remote MDS blocks: one directory per content hash,
    so a rebuilt dataset at the same URI never mixes with shards cached from the old one."""
    return os.path.join(os.path.expanduser(cache_root), manifest["content_hash"][:16])


def mosaic_blocks(path: str, *, batch_size: int, seed: int, cache_root: str = DEFAULT_MOSAIC_CACHE):
    """MosaicML StreamingDataset over OUT/mds, set up as the reference did.

    Imported here only: MosaicML is needed for --blocks-mode mosaic and nothing
    else. It reads rank and world size from torchrun's environment, and keeps
    its sample order fixed across topologies through num_canonical_nodes=8. A
    remote path is cached once per node (`mosaic_cache_dir`): the node's local
    ranks share that directory, and Mosaic lets one of them download each shard
    (to a temp name, then renamed) while the others wait for it. Shared memory that
    a killed run left behind is reported, not cleared: Mosaic's cleaner would also
    unlink the shared memory of live runs on this machine.
    """
    from streaming import StreamingDataset

    manifest = read_manifest(path, "mds")
    kwargs = dict(batch_size=batch_size, shuffle=True, shuffle_seed=seed, num_canonical_nodes=8)
    if is_remote(path):
        kwargs.update(remote=path, local=mosaic_cache_dir(cache_root, manifest))
    else:
        kwargs.update(local=path)
    stale = ("MosaicML shared memory of an earlier run is in the way ({}); if no other Mosaic run is "
             "live on this machine, clear it with `python -c 'from streaming.base.util import "
             "clean_stale_shared_memory as c; c()'`")
    try:
        return StreamingDataset(**kwargs)
    except FileExistsError as e:
        raise UserError(stale.format(e.filename)) from None
    except ValueError as e:
        if "Reused local directory" not in str(e):
            raise
        raise UserError(stale.format(f"another dataset holds the cache {kwargs['local']}")) from None


class BlocksEpochs:
    """Per-epoch batches of pre-packed blocks through MosaicML or a Parquet loader.

    These baselines keep no resumable loader state; the lance blocks table goes
    through lancedb's StreamingDataset like the corpus does (see train.py).
    """

    def __init__(self, mode: str, path: str, *, rank: int, world_size: int, batch_size: int,
                 seed: int, num_workers: int, mp_context: str, pin_memory: bool = False,
                 mosaic_cache: str = DEFAULT_MOSAIC_CACHE):
        from torch.utils.data import DataLoader

        if mode not in BASELINE_MODES:
            raise ValueError(f"BlocksEpochs serves {', '.join(BASELINE_MODES)}, not {mode!r}")
        self.mode = mode
        self.num_workers = num_workers or min(DEFAULT_WORKERS[mode], os.cpu_count() or 1)
        self.manifest = read_manifest(path, MODE_FORMAT[mode])
        loader_kwargs = dict(batch_size=batch_size, num_workers=self.num_workers,
                             multiprocessing_context=mp_context, pin_memory=pin_memory,
                             prefetch_factor=4, worker_init_fn=preemption.ignore_interrupts)
        if mode == "mosaic":
            from streaming import StreamingDataLoader

            self.dataset = mosaic_blocks(path, batch_size=batch_size, seed=seed, cache_root=mosaic_cache)
            self.loader = StreamingDataLoader(self.dataset, **loader_kwargs)
            self.blocks_per_rank = -(-self.manifest["num_blocks"] // world_size)
        else:
            self.dataset = (ParquetRandomBlocks(path, rank, world_size, seed) if mode == "parquet-random"
                            else ParquetSeqBlocks(path, rank, world_size))
            self.loader = DataLoader(self.dataset, **loader_kwargs)
            self.blocks_per_rank = len(self.dataset)

    def epoch(self, epoch: int):
        """The batches of one epoch (Mosaic counts its epochs itself, one per pass)."""
        if isinstance(self.dataset, ParquetRandomBlocks):
            self.dataset.set_epoch(epoch)
        return self.loader
