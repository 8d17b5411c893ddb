"""Shared pieces: defaults, the corpus schema, tokenizers, atomic writes, the CLI parser.

Everything a user can get wrong here (a tokenizer that is not available offline, a
table tokenized with other ids, a file that cannot be written) is raised as
`UserError`, which the entrypoints turn into one line on stderr and an exit code.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa

DEFAULT_DB = "data/lancedb"
DEFAULT_TABLE = "corpus"
TRAIN_FILTER = "split = 'train'"
VAL_FILTER = "split = 'val'"

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("text", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("n_tokens", pa.int32()),
        pa.field("score", pa.float32()),
        pa.field("is_dup", pa.bool_()),
        pa.field("split", pa.string()),
        pa.field("digest", pa.binary(16)),
    ]
)
# A corpus table made before prepare_data stored the digest: training reads it the same,
# and the first append to it adds the column.
LEGACY_SCHEMA = pa.schema([f for f in CORPUS_SCHEMA if f.name != "digest"])

# What training reads, and the arrow types it accepts for each column
# (storage.connect_table checks a table against it).
TRAIN_COLUMNS: dict[str, tuple[str, Callable[[pa.DataType], bool]]] = {
    "input_ids": (
        "a list of integers",
        lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t))
        and pa.types.is_integer(t.value_type),
    ),
    "n_tokens": ("an integer", pa.types.is_integer),
    "score": ("a float", pa.types.is_floating),
    "is_dup": ("a bool", pa.types.is_boolean),
    "split": ("a string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
}


class UserError(Exception):
    """A mistake the user can fix; printed as one line, never as a traceback, then the
    entrypoint exits with `exit_code`."""

    exit_code = 2


class StorageFault(UserError):
    """The storage a run depends on failed under it: a full disk or quota, a table that
    cannot be read, an object store that stays unreachable, a --ckpt-dir that became
    unwritable. One line like a UserError, but exit code 3 (STORAGE_FAULT_EXIT), so a
    scheduler can tell "fix the storage, then --resume auto" from a mistake in the command."""

    exit_code = 3


STORAGE_FAULT_EXIT = StorageFault.exit_code

# A write that found no room, by errno; lance and safetensors raise errors of their own
# that carry the OS error only in their text ("No space left on device (os error 28)").
NO_SPACE = {errno.ENOSPC: ("no space left on the device (ENOSPC)",
                           re.compile(r"No space left on device|os error 28\b")),
            errno.EDQUOT: ("the disk quota is exceeded (EDQUOT)",
                           re.compile(r"Disk quota exceeded|os error 122\b"))}


def out_of_space(error: BaseException, path: str, writing: str, advice: str,
                 needed: int | None = None) -> StorageFault | None:
    """The one line for a write under `path` that ran out of space or quota, None for any
    other error: what was being written, what it needs where the caller knows (bytes),
    what is free there now (call it after removing the failed write's files) and `advice`.
    A UserError (the line is written already) and a Ctrl-C are None too."""
    if isinstance(error, UserError) or not isinstance(error, Exception):
        return None
    code = getattr(error, "errno", None)
    if code not in NO_SPACE:
        code = next((c for c, (_, text) in NO_SPACE.items() if text.search(str(error))), None)
    if code is None:
        return None
    while not os.path.isdir(path):  # the nearest directory that exists
        path = os.path.dirname(os.path.abspath(path))
    fs = os.statvfs(path)
    needs = f"; it needs at least {human_bytes(needed)}" if needed else ""
    return StorageFault(f"{NO_SPACE[code][0]} writing {writing}{needs}; "
                        f"{human_bytes(fs.f_bavail * fs.f_frsize)} free of "
                        f"{human_bytes(fs.f_blocks * fs.f_frsize)} on {path!r}; {advice}")


def human_bytes(n: float) -> str:
    """A size as people read it in a one-line error: 980.0 KiB, 2.9 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's usage mistakes as UserError, so they too end in one `error:` line
    rather than argparse's usage block."""

    def error(self, message):
        raise UserError(message)


def is_remote(uri: str) -> bool:
    """Object-store URIs (s3://, gs://, az://...) cannot be checked with os.path."""
    return "://" in uri


def block_hashes(blocks: np.ndarray) -> list[str]:
    """Name each row of a (n, seq_len) token array by the first 16 hex digits of
    BLAKE2b over its tokens as little-endian int32.

    The same name everywhere (sample traces, manifests, the loader benchmark), so
    a block can be followed from the builder through any loader into a step.
    """
    rows = np.ascontiguousarray(blocks, dtype="<i4").reshape(len(blocks), -1)
    return [hashlib.blake2b(row.tobytes()).hexdigest()[:16] for row in rows]


class MultisetDigest:
    """Order-independent digest of a multiset of blocks: their count and the sum of
    their 64-bit names mod 2**64 (a sum, unlike XOR, does not cancel duplicates)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0

    def add(self, names: list[str]) -> None:
        self.count += len(names)
        self.total = (self.total + sum(int(h, 16) for h in names)) % (1 << 64)

    def hexdigest(self) -> str:
        return f"{self.total:016x}"


def corpus_filter(min_score: float, split_filter: str) -> str:
    """The SQL that picks training (or validation) documents: not duplicates, good enough."""
    return f"NOT is_dup AND score >= {min_score} AND ({split_filter})"


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)`, fsync, rename over `path`, fsync the directory: the file is complete or
    absent, even after a power loss. A write that fails (a full disk, a read-only directory)
    is a UserError and leaves no temp file."""
    try:
        atomic_replace(path, write)
    except OSError as e:
        raise UserError(f"cannot write {path!r}: {e.strerror or e}") from None


def atomic_replace(path: str, write: Callable[[str], None]) -> None:
    """atomic_write's steps, raising the OSError of the one that failed: its errno tells a
    full disk from a read-only or removed directory (checkpoint.py words each)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        fsync_path(tmp)  # the data is on disk before the name points at it
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")  # and the rename itself
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_path(path: str) -> None:
    """Flush a file's (or a directory's entries') data to disk; `write` callables take a
    path, so the file is reopened rather than synced through their handle."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it); a filesystem that cannot sync a
    directory (EINVAL, ENOTSUP) is let be."""
    try:
        fsync_path(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def check_out_dir(flag: str, path: str) -> None:
    """Refuse an output file whose directory does not exist, before any work: the
    benchmarks make no directories, so a mistyped --out is not silently created."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path!r}: no directory {folder!r}; create it first")


def write_stream(write: Callable, schema: pa.Schema, batches) -> None:
    """Call `write(reader)` (a lance create_table / add) on a stream of record batches.

    Lance re-raises an exception from inside the stream as its own RuntimeError;
    the original is re-raised instead, so a UserError or Ctrl-C reads as itself.
    """
    errors = []

    def recorded():
        try:
            yield from batches
        except (Exception, KeyboardInterrupt) as e:
            errors.append(e)
            raise

    try:
        write(pa.RecordBatchReader.from_batches(schema, recorded()))
    except RuntimeError:
        if errors:
            raise errors[0] from None
        raise


def synthetic_corpus(db: str, rows: int, min_tokens: int, max_tokens: int, *, seed: int = 0,
                     table: str = DEFAULT_TABLE, chunk_rows: int = 500_000):
    """A corpus table of `rows` training documents of random byte-tokenizer ids, lengths
    uniform in [min_tokens, max_tokens], written straight with pyarrow (millions of rows
    in seconds): the big tables of the tests and benchmarks, with no ingest in the way."""
    import lancedb

    schema = corpus_schema(load_tokenizer("byte"))
    rng = np.random.default_rng(seed)

    def batches():
        for first in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - first)
            lengths = rng.integers(min_tokens, max_tokens + 1, n, dtype=np.int32)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            ids = rng.integers(0, 256, int(offsets[-1]), dtype=np.int32)
            yield pa.record_batch([
                pa.array(np.arange(first, first + n)), pa.nulls(n, pa.string()).fill_null(""),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)), pa.array(lengths),
                pa.array(np.full(n, 2.0, dtype=np.float32)), pa.array(np.zeros(n, dtype=bool)),
                pa.array(np.full(n, "train")), pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(16), n, [None, pa.py_buffer(rng.bytes(16 * n))]),
            ], schema=schema)

    return lancedb.connect(db).create_table(table, pa.RecordBatchReader.from_batches(schema, batches()),
                                            mode="overwrite")


def packed_token_count(table, where: str) -> tuple[int, int]:
    """Documents passing `where`, and their tokens once packed (one EOS after each).

    Read from the `n_tokens` column, so the packed block budget is exact without
    touching the token lists.
    """
    import pyarrow.compute as pc

    rows = table.count_rows(where)
    if rows == 0:
        return 0, 0
    counts = table.search().select(["n_tokens"]).where(where).limit(rows).to_arrow()
    return rows, pc.sum(counts.column("n_tokens")).as_py() + rows


@dataclass
class Tokenizer:
    """The few things training and ingest need from a tokenizer.

    `pad_token_id` is reserved: no text ever encodes to it and it differs from
    EOS, so the packed loss mask `input_ids != pad_token_id` is exact.
    """

    spec: str
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    encode: Callable[[list[str]], list[list[int]]] = field(repr=False)
    decode: Callable[[list[int]], str] = field(repr=False)


def _byte_tokenizer() -> Tokenizer:
    eos, pad = 256, 257

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    return Tokenizer("byte", vocab_size=258, eos_token_id=eos, pad_token_id=pad,
                     encode=encode, decode=decode)


class FastEncoder:
    """A Hugging Face fast tokenizer's encode, as `tok(texts, add_special_tokens=False,
    split_special_tokens=True)` runs it (no truncation or padding; a literal "<pad>" or
    "</s>" in a document is text, so EOS and PAD can only come from the packer).

    It holds only the Rust `tokenizers.Tokenizer`, so it pickles without transformers:
    prepare_data's worker processes get it in milliseconds instead of spending seconds
    importing transformers and loading the tokenizer again.
    """

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = True
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def load_hf_tokenizer(name: str):
    """A Hugging Face tokenizer from a local directory or the local cache, never the network
    (`hf:<name>` without the prefix); what it cannot find is a one-line UserError."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork/spawn workers
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if name.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise UserError(f"tokenizer directory {name!r} (from 'hf:{name}') does not exist")
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(name), local_files_only=True)
    except (OSError, ValueError) as e:
        if os.path.isdir(os.path.expanduser(name)):
            raise UserError(f"'hf:{name}' is not a loadable tokenizer directory: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        raise UserError(
            f"tokenizer 'hf:{name}' is neither a local directory nor in the local Hugging "
            f"Face cache, and nothing is downloaded: run `AutoTokenizer.from_pretrained("
            f"{name!r}).save_pretrained(DIR)` where there is network, then pass hf:DIR"
        ) from None


def _hf_tokenizer(name: str) -> Tokenizer:
    tok = load_hf_tokenizer(name)
    tok.model_max_length = 1 << 62  # documents are longer than any context; no warnings
    n_real = len(tok)  # base vocabulary plus added tokens
    special = set(tok.all_special_ids)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None:
        raise UserError(
            f"tokenizer 'hf:{name}' has neither an EOS nor a separator token; "
            f"packing needs one to join documents"
        )
    pad = tok.pad_token_id
    if pad is None or pad == eos or pad >= n_real:
        pad = n_real  # reserve a fresh id above every real token
    vocab_size = max(n_real, pad + 1, eos + 1)

    if tok.is_fast:
        encode = FastEncoder(tok.backend_tokenizer)
    else:
        def encode(texts: list[str]) -> list[list[int]]:
            # split_special_tokens: a literal "<pad>" or "</s>" in a document is text,
            # so EOS and PAD can only come from the packer.
            return tok(texts, add_special_tokens=False, split_special_tokens=True,
                       return_attention_mask=False)["input_ids"]

    def decode(ids: list[int]) -> str:
        return tok.decode([i for i in ids if i < n_real and i not in special])

    return Tokenizer(f"hf:{name}", vocab_size=vocab_size, eos_token_id=eos,
                     pad_token_id=pad, encode=encode, decode=decode)


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte` or `hf:<name-or-local-dir>`, loaded offline."""
    if spec == "byte":
        return _byte_tokenizer()
    if spec.startswith("hf:") and len(spec) > 3:
        return _hf_tokenizer(spec[3:])
    raise UserError(f"unknown tokenizer {spec!r}: use 'byte' or 'hf:<name-or-local-dir>'")


# The metadata prepare_data stores on a corpus table's `input_ids` field: which tokenizer
# made the ids. On the field, not the schema: lancedb 0.40's StreamingDataset panics
# ("target schema is not superset of current schema") on a table with schema metadata.
TOKENIZER_KEYS = ("tokenizer", "vocab_size", "eos_id", "pad_id")


def tokenizer_metadata(tok: Tokenizer) -> dict[str, str]:
    """Arrow field metadata (strings only) recording the tokenizer that made a table."""
    return {"tokenizer": tok.spec, "vocab_size": str(tok.vocab_size),
            "eos_id": str(tok.eos_token_id), "pad_id": str(tok.pad_token_id)}


def corpus_schema(tok: Tokenizer) -> pa.Schema:
    """CORPUS_SCHEMA with `tok` recorded on its `input_ids` field."""
    index = CORPUS_SCHEMA.get_field_index("input_ids")
    return CORPUS_SCHEMA.set(index, CORPUS_SCHEMA.field(index).with_metadata(tokenizer_metadata(tok)))


def table_tokenizer(table) -> dict | None:
    """The tokenizer recorded on `table` by prepare_data, or None when it records none
    (tables made by other tools): {"tokenizer": spec, "vocab_size", "eos_id", "pad_id"}."""
    meta = table.schema.field("input_ids").metadata or {}
    raw = {key: meta.get(key.encode()) for key in TOKENIZER_KEYS}
    if raw["tokenizer"] is None:
        return None
    try:
        return {"tokenizer": raw["tokenizer"].decode(),
                **{key: int(raw[key]) for key in TOKENIZER_KEYS[1:]}}
    except (TypeError, ValueError, UnicodeDecodeError):
        shown = {k: v.decode(errors="replace") if v is not None else None for k, v in raw.items()}
        raise UserError(f"the table's tokenizer metadata is incomplete or malformed ({shown}); "
                        f"rebuild it with prepare_data.py --mode overwrite") from None


def check_table_tokenizer(table, tok: Tokenizer, where: str) -> None:
    """Refuse `tok` when `table` was tokenized with different ids: its token ids would not
    fit the embedding (or EOS / PAD would mean other tokens).

    Only vocab_size, eos_id and pad_id are compared, so the same tokenizer loaded from
    another path passes; a table that records no tokenizer passes unchecked.
    `where` names the table in the message, e.g. "the table 'corpus' in 'data/lancedb'".
    """
    recorded = table_tokenizer(table)
    if recorded is None:
        return
    ours = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id}
    if all(recorded[key] == ours[key] for key in ours):
        return
    shown = ["vocab_size"]  # and, when that agrees, the special ids that do not
    if recorded["vocab_size"] == ours["vocab_size"]:
        shown += [key for key in ("eos_id", "pad_id") if recorded[key] != ours[key]]

    def describe(ids: dict) -> str:
        return ", ".join(f"{key.split('_')[0]} {ids[key]}" for key in shown)

    raise UserError(
        f"{where} was tokenized with {recorded['tokenizer']!r} ({describe(recorded)}); "
        f"this run's --tokenizer {tok.spec!r} has {describe(ours)}: "
        f"pass --tokenizer {recorded['tokenizer']}"
    )
