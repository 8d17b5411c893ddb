"""Write identical pre-packed blocks in four formats for the A/B loader harness.

Usage:
    python build_packed_datasets.py --db DIR --table NAME --out DIR
        [--formats lance,mds,parquet-random,parquet-seq] [--seq-len 1024] [--seed 42]
        [--tokenizer SPEC] [--min-score 1.0] [--blocks-per-file 16384]
        [--random-row-group-blocks 1] [--seq-row-group-blocks 256] [--overwrite]

The training documents (`NOT is_dup AND score >= --min-score AND split = 'train'`)
are shuffled with --seed, joined with EOS and cut into --seq-len token blocks by
lancedb's own packer (StreamingDataset with one split and the exact block
budget), so the blocks are what `train.py --pack` would make; the tail shorter
than a block is left out. One pass writes them, in that order, to:

- OUT/lance: a LanceDB directory with table `blocks` (`input_ids`:
  fixed_size_list<int32>[seq_len]), for `--blocks-mode lance`;
- OUT/mds: MosaicML MDS shards (`input_ids`: ndarray:int32:seq_len, uncompressed);
- OUT/parquet-random: Parquet files of --blocks-per-file blocks with one block per
  row group (--random-row-group-blocks), so a random read of one block fetches
  exactly that block (a row group is Parquet's unit of access; bigger ones make
  every random take read and decode the neighbours too);
- OUT/parquet-seq: the same order in files of 1 MB row groups
  (--seq-row-group-blocks 256 at seq_len 1024), for sequential reading.

Parquet is written plain (no dictionary, no compression, no statistics), like
the other three formats, so the comparison is between loaders, not codecs.

Each format directory gets a `manifest.json` (blocks_loaders.MANIFEST_KEYS: block
count, seq_len, tokenizer, source filter and table version, `content_hash` over
the blocks in stored order and the order-free `multiset_hash`), written last. A
local format is built under a temporary name and renamed into place, so OUT/FMT
is complete or absent; an existing one is refused unless --overwrite. Running out of
space (ENOSPC, or a quota's EDQUOT) ends in one `error:` line and exit 3
(common.StorageFault), with the formats not yet published removed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import storage
from blocks_loaders import FORMATS, MANIFEST
from common import (
    DEFAULT_DB,
    DEFAULT_TABLE,
    TRAIN_FILTER,
    MultisetDigest,
    UserError,
    block_hashes,
    check_table_tokenizer,
    corpus_filter,
    is_remote,
    load_tokenizer,
    out_of_space,
    packed_token_count,
    write_stream,
)

CHUNK_BLOCKS = 1024  # blocks handed to the writers at a time: 4 MB at seq_len 1024


def blocks_schema(seq_len: int) -> pa.Schema:
    return pa.schema([pa.field("input_ids", pa.list_(pa.int32(), seq_len))])


def to_record_batch(chunk: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    seq_len = chunk.shape[1]
    flat = pa.array(chunk.reshape(-1), type=pa.int32())
    return pa.record_batch([pa.FixedSizeListArray.from_arrays(flat, seq_len)], schema=schema)


class ParquetBlocksWriter:
    """Blocks -> numbered Parquet files of `blocks_per_file`, row groups of exactly
    `row_group_blocks` (the last of a file may be short), as the loaders assume."""

    def __init__(self, directory: str, schema: pa.Schema, blocks_per_file: int, row_group_blocks: int):
        self.fs, self.root = storage.filesystem(directory)
        self.fs.create_dir(self.root, recursive=True)
        self.schema, self.per_file, self.per_group = schema, blocks_per_file, row_group_blocks
        self.files: list[dict] = []
        self.writer = None
        self.in_file = 0
        self.pending: list[np.ndarray] = []

    def write(self, chunk: np.ndarray) -> None:
        self.pending.append(chunk)
        self._drain(final=False)

    def close(self) -> list[dict]:
        self._drain(final=True)
        if self.writer is not None:
            self.writer.close()
        return self.files

    def abort(self) -> None:
        """Let go of the open local file unfinished, so that removing it frees its space now:
        closing the writer would write its footer (pyarrow's __del__ does at exit), which on
        a full disk fails again, as a traceback."""
        if self.writer is not None and self.writer.is_open:
            self.writer.is_open = False
            with contextlib.suppress(OSError):
                self.sink.close()

    def _drain(self, final: bool) -> None:
        """Write whole row groups; a short one only at the end of a file or of the data."""
        if not self.pending:
            return
        blocks = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        start = 0
        while start < len(blocks):
            if self.writer is None or self.in_file == self.per_file:
                self._next_file()
            room = self.per_file - self.in_file
            take = min(room, len(blocks) - start)
            if take < room:  # the file is not full yet: keep a partial row group for later
                take -= take % self.per_group if not final else 0
            if take == 0:
                break
            table = pa.Table.from_batches([to_record_batch(blocks[start:start + take], self.schema)])
            self.writer.write_table(table, row_group_size=self.per_group)
            self.in_file += take
            self.files[-1]["num_blocks"] += take
            start += take
        self.pending = [blocks[start:]] if start < len(blocks) else []

    def _next_file(self) -> None:
        if self.writer is not None:
            self.writer.close()
        name = f"blocks-{len(self.files):05d}.parquet"
        self.sink = self.fs.open_output_stream(f"{self.root}/{name}")
        self.writer = pq.ParquetWriter(self.sink, self.schema,
                                       compression="none", use_dictionary=False,
                                       write_statistics=False)
        self.files.append({"path": name, "num_blocks": 0})
        self.in_file = 0


class MDSBlocksWriter:
    """Blocks -> MosaicML MDS shards (64 MB, uncompressed); s3:// outputs are uploaded by MDSWriter."""

    def __init__(self, directory: str, seq_len: int):
        from streaming import MDSWriter

        self.writer = MDSWriter(out=directory, columns={"input_ids": f"ndarray:int32:{seq_len}"},
                                compression=None, size_limit=1 << 26, progress_bar=False)

    def write(self, chunk: np.ndarray) -> None:
        for block in chunk:
            self.writer.write({"input_ids": block})

    def close(self) -> dict:
        self.writer.finish()
        return {}

    def abort(self) -> None:
        """Nothing to let go of: MDSWriter opens, writes and closes each shard at once."""


def pack_blocks(table, where: str, tok, seq_len: int, seed: int, num_blocks: int):
    """The corpus's blocks in one seeded order, CHUNK_BLOCKS at a time, as int32 arrays."""
    from lancedb.streaming import StreamingDataset

    ds = StreamingDataset(table, columns=["input_ids"], filter=where, num_splits=1, shuffle=True,
                          shuffle_seed=seed, pack_sequences=seq_len, eos_id=tok.eos_token_id,
                          pad_id=tok.pad_token_id, blocks_per_epoch=num_blocks,
                          read_batch_size=64, io_queue_depth=4, transform_queue_depth=8)
    chunk = []
    for item in ds:
        chunk.append(item["input_ids"])
        if len(chunk) == CHUNK_BLOCKS:
            yield torch_stack_int32(chunk)
            chunk = []
    if chunk:
        yield torch_stack_int32(chunk)


def torch_stack_int32(rows) -> np.ndarray:
    import torch

    return torch.stack(rows).to(torch.int32).numpy()


def staging_dir(out: str, fmt: str) -> str:
    """Where a format is written before it is renamed into place (remote: in place)."""
    if is_remote(out):
        return f"{out.rstrip('/')}/{fmt}"
    return os.path.join(out, f".{fmt}.partial-{os.getpid()}")


def format_exists(out: str, fmt: str) -> bool:
    """Whether OUT/FMT holds anything (locally a directory; remotely any object under it)."""
    if not is_remote(out):
        return os.path.exists(os.path.join(out, fmt))
    import pyarrow.fs as pafs

    fs, root = storage.filesystem(f"{out.rstrip('/')}/{fmt}")
    try:
        info = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=False))
    except OSError as e:
        raise UserError(storage.describe(e, out) or f"cannot list {out!r}: {storage.first_line(e)}") from None
    return bool(info)


def publish(out: str, fmt: str, staged: str, manifest: dict, overwrite: bool) -> None:
    """Write the manifest last, then move a local build into OUT/FMT."""
    fs, root = storage.filesystem(staged)
    with fs.open_output_stream(f"{root}/{MANIFEST}") as f:
        f.write(json.dumps(manifest, indent=2).encode())
    if is_remote(out):
        return
    final = os.path.join(out, fmt)
    old = None
    if os.path.exists(final):
        if not overwrite:
            raise UserError(f"{final} appeared while building; not replacing it")
        old = os.path.join(out, f".{fmt}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(staged, final)
    if old:
        shutil.rmtree(old)


def build(db: str, table: str, out: str, *, formats=FORMATS, seq_len: int = 1024, seed: int = 42,
          tokenizer_spec: str = "byte", min_score: float = 1.0, blocks_per_file: int = 16384,
          random_row_group_blocks: int = 1, seq_row_group_blocks: int = 256,
          overwrite: bool = False) -> dict[str, dict]:
    """Pack the corpus once and write it to each of `formats`; returns the manifests."""
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UserError(f"--formats takes a comma-separated subset of {','.join(FORMATS)} "
                        f"(got {','.join(formats) or 'nothing'})")
    if seq_len < 2:
        raise UserError(f"--seq-len must be at least 2 (got {seq_len})")
    for flag, value in (("--blocks-per-file", blocks_per_file),
                        ("--random-row-group-blocks", random_row_group_blocks),
                        ("--seq-row-group-blocks", seq_row_group_blocks)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    existing = [fmt for fmt in formats if format_exists(out, fmt)]  # one listing per format
    if existing and not overwrite:
        raise UserError(f"{out.rstrip('/')}/{existing[0]} already exists; pass --overwrite to replace it")
    tok = load_tokenizer(tokenizer_spec)
    tbl = storage.connect_table(db, table)
    check_table_tokenizer(tbl, tok, f"the table {table!r} in {db!r}")
    where = corpus_filter(min_score, TRAIN_FILTER)
    docs, tokens = packed_token_count(tbl, where)
    num_blocks = tokens // seq_len
    if num_blocks == 0:
        raise UserError(f"{docs} documents ({tokens:,} tokens with EOS) pass {where!r}: "
                        f"not one {seq_len}-token block; lower --min-score or --seq-len, or add data")

    if is_remote(out):  # written in place: clear what --overwrite replaces first
        for fmt in existing:
            fs, root = storage.filesystem(staging_dir(out, fmt))
            fs.delete_dir(root)
    start = time.perf_counter()
    schema = blocks_schema(seq_len)
    staged = {fmt: staging_dir(out, fmt) for fmt in formats}
    row_group_blocks = {"parquet-random": random_row_group_blocks, "parquet-seq": seq_row_group_blocks}
    writers, manifests = {}, {}
    try:
        for fmt in formats:
            if fmt == "mds":
                writers[fmt] = MDSBlocksWriter(staged[fmt], seq_len)
            elif fmt in row_group_blocks:
                writers[fmt] = ParquetBlocksWriter(staged[fmt], schema, blocks_per_file,
                                                   row_group_blocks[fmt])
        content, multiset = hashlib.blake2b(digest_size=32), MultisetDigest()

        def chunks():
            with tqdm(total=num_blocks, desc="blocks", unit="block", file=sys.stderr,
                      delay=0.5, mininterval=0.5, disable=None) as bar:
                bar.leave = False  # until the last block: an error is the only line left
                for chunk in pack_blocks(tbl, where, tok, seq_len, seed, num_blocks):
                    if (chunk == tok.pad_token_id).any():
                        raise UserError(f"column n_tokens of table {table!r} disagrees with "
                                        f"input_ids: the packer ran out of tokens early")
                    content.update(np.ascontiguousarray(chunk, dtype="<i4").tobytes())
                    multiset.add(block_hashes(chunk))
                    for writer in writers.values():
                        writer.write(chunk)
                    bar.update(len(chunk))
                    yield to_record_batch(chunk, schema)
                bar.leave = True

        if "lance" in formats:
            write_stream(lambda reader: storage.connect(staged["lance"]).create_table(
                "blocks", data=reader, schema=schema), schema, chunks())
        else:
            for _ in chunks():
                pass
        extras = {fmt: w.close() for fmt, w in writers.items()}
        if multiset.count != num_blocks:
            raise RuntimeError(f"packer gave {multiset.count} blocks, expected {num_blocks}")

        common = {
            "num_blocks": num_blocks, "seq_len": seq_len, "dtype": "int32",
            "tokenizer": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_token_id,
            "pad_id": tok.pad_token_id, "seed": seed,
            "source": {"db": db if is_remote(db) else os.path.abspath(db), "table": table,
                       "filter": where, "table_version": tbl.version, "documents": docs,
                       "tokens": tokens},
            "content_hash": content.hexdigest(), "multiset_hash": multiset.hexdigest(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "builder": "build_packed_datasets.py",
        }
        for fmt in formats:
            manifest = {"format": fmt, **common}
            if fmt in row_group_blocks:
                manifest.update(row_group_blocks=row_group_blocks[fmt], files=extras[fmt])
            publish(out, fmt, staged[fmt], manifest, overwrite)
            manifests[fmt] = manifest
    except BaseException as e:  # the local formats not published go, then what is free is measured
        if not is_remote(out):
            for writer in writers.values():
                writer.abort()
            for path in staged.values():
                if os.path.exists(path):
                    shutil.rmtree(path, ignore_errors=True)
        kept = (f"{', '.join(manifests)} complete, the other formats not published" if manifests
                else "nothing was published")
        if fault := out_of_space(
                e, out, f"{num_blocks:,} blocks of {seq_len} tokens as {', '.join(formats)} to {out!r}",
                f"free space there or use another --out, then run again; {kept}",
                needed=len(formats) * num_blocks * seq_len * 4):
            raise fault from None
        raise

    seconds = time.perf_counter() - start
    print(f"built {num_blocks:,} blocks of {seq_len} tokens ({num_blocks * seq_len:,} of "
          f"{tokens:,} tokens from {docs:,} documents of {db}/{table}) -> {out}: "
          f"{', '.join(formats)}; {seconds:.1f} s ({num_blocks * seq_len / seconds:,.0f} tokens/s); "
          f"content hash {common['content_hash'][:16]}")
    return manifests


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB, help="LanceDB directory or URI of the corpus")
    p.add_argument("--table", default=DEFAULT_TABLE)
    p.add_argument("--out", required=True, help="directory (or s3:// URI) that gets one subdirectory per format")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of the four formats")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42, help="document order before packing")
    p.add_argument("--tokenizer", default="byte", help="the corpus's tokenizer: its EOS joins documents")
    p.add_argument("--min-score", type=float, default=1.0)
    p.add_argument("--blocks-per-file", type=int, default=16384, help="Parquet blocks per file")
    p.add_argument("--random-row-group-blocks", type=int, default=1,
                   help="blocks per row group of parquet-random (its unit of random access)")
    p.add_argument("--seq-row-group-blocks", type=int, default=256,
                   help="blocks per row group of parquet-seq")
    p.add_argument("--overwrite", action="store_true", help="replace formats already in --out")
    storage.add_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        storage.configure(args.storage_option)
        build(args.db, args.table, args.out, formats=[f.strip() for f in args.formats.split(",") if f.strip()],
              seq_len=args.seq_len, seed=args.seed, tokenizer_spec=args.tokenizer,
              min_score=args.min_score, blocks_per_file=args.blocks_per_file,
              random_row_group_blocks=args.random_row_group_blocks,
              seq_row_group_blocks=args.seq_row_group_blocks, overwrite=args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted: nothing was published", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
