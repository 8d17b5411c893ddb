"""Text in -> tokenized corpus table for train.py (columns: common.CORPUS_SCHEMA).

Usage:
    python prepare_data.py INPUT [INPUT ...] [--db DIR] [--table NAME] [--tokenizer SPEC]
        [--val-fraction 0.02] [--min-chars 50] [--mode create|append|overwrite]
        [--text-field text] [--score-field NAME] [--batch-size 1000] [--workers N | --ray ADDRESS]
    python prepare_data.py --demo [--db DIR] [--table NAME] [--tokenizer SPEC] [--mode ...]
    python prepare_data.py --restore VERSION [--db DIR] [--table NAME]
    python prepare_data.py --clean-fragments [--db DIR] [--table NAME]

Inputs: a `.txt` file is one document; `.jsonl` / `.jsonl.gz` hold one JSON object per
line, text under --text-field; `.parquet` has a --text-field column, read in record
batches. Directories are walked recursively, files taken in sorted path order.

Skipped and counted in the summary line, never fatal: other file types inside a
directory (`other_type`), documents shorter than --min-chars once stripped (`short`),
jsonl lines that are not JSON objects (`bad_json`), lines or rows whose text is missing,
null or not a string (`no_text`), jsonl text that is not valid Unicode (`bad_text`).
Fatal (one `error:` line, exit 2, nothing written): a missing, unreadable or corrupt
input, a named file of another type, directories with no input file, inputs with no
document left (every line skipped counts), with --score-field a document whose score is
missing or not a number, --mode create on an existing table, a --db that is a file,
--mode append onto a table made with another tokenizer, and --restore of a version the
table does not have. No space left on the --db filesystem (ENOSPC, or a quota's EDQUOT)
is one `error:` line too, with exit 3 (common.StorageFault) and the table as it was.

Each document gets a sequential `id` (after the last row's id on append), `input_ids`
(no EOS), a `score` (--score-field, else `quality_score`), a `digest` of its normalized
text (128-bit BLAKE2b), `is_dup` (that digest seen before, across appends too; the first
copy is kept) and a `split` drawn from the digest, so re-runs agree.

Parallel: the main process reads the inputs in chunks (--batch-size lines, at most
CHUNK_BYTES) and hands them to --workers processes, which parse, tokenize, score and hash
them; it takes their rows back in input order, adds `id` and `is_dup`, and writes. The
table is the same whatever --workers, and at most 2 x --workers chunks are in flight.
Dedup keeps 16 bytes per distinct document (digest_set.DigestSet), and --mode append
reads only the table's `digest` column. An append to a table made before that column
existed computes the digests of its rows once and writes them into the table, in the
same commit (it rewrites the table once, so it costs as much as a fresh ingest).

On a Ray cluster (--ray ADDRESS, 'auto' or 'local'; ray_ingest.py, the `ray` extra): the
same per-chunk work runs as Ray tasks, dedup is sharded over Ray actors by digest, the
workers write lance fragments and the driver commits them once: the same table, row for
row, as --workers writes. --clean-fragments removes the fragment files of a --ray run
killed before its commit.

The whole run is one lance commit of a stream of record batches, so a run that fails or
is killed (even SIGKILL) leaves the table at its previous version, rows and all; run it
again to complete it. A failed run removes the table or db directory it had started to
create; the data files a killed create leaves in a table directory with no committed
version are cleared by the next run (a killed append or overwrite may leave an unused
`data/.tmp*` file in the table). --mode overwrite writes a new version and keeps the
old one: it prints the version it replaced and the --restore command that brings it back
(--restore makes a new version with that version's rows).

Creating or overwriting a table records the tokenizer in the metadata of its `input_ids`
field (`tokenizer`, `vocab_size`, `eos_id`, `pad_id`; see common.table_tokenizer), so a run with
another tokenizer is refused instead of crashing in the embedding.

--demo builds the corpus train.py falls back to: the Python standard library's
docstrings, parsed with `ast` from its sources (nothing imported or downloaded).
"""

from __future__ import annotations

import startup

startup.quiet_ctrl_c(__name__)  # first: a Ctrl-C while pyarrow and lancedb import is one line

import argparse
import ast
import gzip
import hashlib
import inspect
import itertools
import json
import os
import re
import shlex
import shutil
import sys
import sysconfig
import threading
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import lancedb_cloud
import storage
from common import (CORPUS_SCHEMA, DEFAULT_DB, DEFAULT_TABLE, LEGACY_SCHEMA, FastEncoder, UserError,
                    check_table_tokenizer, corpus_schema, is_remote, load_tokenizer, out_of_space, write_stream)
from digest_set import DigestSet
from ordered_pool import OrderedPool, WorkerDied, usable_cores

DEFAULT_VAL_FRACTION = 0.02
DEFAULT_MIN_CHARS = 50  # under ~8 words there is hardly a sentence to learn from
DEFAULT_BATCH_SIZE = 1000
CHUNK_BYTES = 8 << 20  # a chunk's raw input at most: bounds the memory in flight, whatever the lines
DEMO_FILES_PER_CHUNK = 16  # stdlib sources (~16 KB each) per chunk of the demo corpus
READ_ROWS = 65536  # rows per batch when reading an existing table
STOP_GRACE_S = 10.0  # after Ctrl-C, how long lance may take to drop its uncommitted write
MODES = ("create", "append", "overwrite")
INPUT_TYPES = (".jsonl.gz", ".jsonl", ".parquet", ".txt")  # longest suffix first
DEMO_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

Docs = Iterable[tuple[str, "float | None"]]  # (text, score from --score-field or None)


# ----------------------------------------------------------------------------- quality

_HAS_LETTER = re.compile(r"[^\W\d_]")
_SURROGATE = re.compile("[\ud800-\udfff]")  # what JSON "\ud800" escapes decode to
_BULLET_OR_ELLIPSIS = re.compile(r"^\s*[-*\u2022\u2023\u25e6]\s|(\.\.\.|\u2026)\s*$")

# (signal, limit, is_lower_bound): the range ordinary prose sits in (Gopher / C4 rules).
SCORE_LIMITS = (
    ("words", 10, True),
    ("mean_word_len", 3.0, True),
    ("mean_word_len", 10.0, False),
    ("alpha_words", 0.8, True),
    ("letters", 0.6, True),
    ("unique_lines", 0.7, True),
    ("top_word", 0.3, False),
    ("list_lines", 0.4, False),
)


def quality_signals(text: str) -> dict[str, float]:
    """The raw measurements `quality_score` compares with SCORE_LIMITS."""
    words = text.split()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    chars = "".join(words)
    n_words, n_lines = max(len(words), 1), max(len(lines), 1)
    top = Counter(w.lower() for w in words).most_common(1)
    return {
        "words": len(words),
        "mean_word_len": len(chars) / n_words,
        "alpha_words": sum(1 for w in words if _HAS_LETTER.search(w)) / n_words,
        "letters": sum(c.isalpha() for c in chars) / max(len(chars), 1),
        "unique_lines": len(set(lines)) / n_lines,
        "top_word": top[0][1] / n_words if top else 1.0,
        "list_lines": sum(1 for ln in lines if _BULLET_OR_ELLIPSIS.search(ln)) / n_lines,
    }


def quality_score(text: str) -> float:
    """Heuristic quality in [0, 2]; training keeps documents scoring >= 1.0.

    2 x the product of one factor per SCORE_LIMITS entry, each 1.0 inside the range
    ordinary prose sits in and signal/limit (or limit/signal) outside it. It measures:
    at least 10 whitespace-separated words (fragments: under 5 words score < 1.0);
    mean word length 3..10 characters (`a a a a`, hex and base64 dumps); >= 80% of
    words containing a letter (number and symbol dumps); >= 60% of non-space
    characters being letters (code and markup made of symbols); >= 70% of non-blank
    lines distinct (boilerplate, a repeated line); the most common word <= 30% of all
    words (`the the the`); <= 40% of lines being bullets or ending in an ellipsis
    (menus, teasers). One signal far out of range, or a few a little out, give < 1.0.
    Line-final punctuation is not used: docstrings and mail are hard-wrapped.
    """
    signals = quality_signals(text)
    score = 2.0
    for name, limit, is_lower_bound in SCORE_LIMITS:
        value = signals[name]
        score *= min(1.0, value / limit if is_lower_bound else limit / max(value, 1e-9))
    return score


# ----------------------------------------------------------------------------- inputs
# The main process only reads raw bytes and cuts them into chunks; decoding, parsing
# and everything per document happen in `chunk_rows`, in the worker processes.

def input_type(path: str) -> str | None:
    """The input type of `path`, by suffix; None for files we do not read."""
    return next((t for t in INPUT_TYPES if path.lower().endswith(t)), None)


def _unreadable_directory(e: OSError):
    """os.walk would skip an unreadable directory silently: refuse it instead."""
    raise UserError(f"cannot read directory {e.filename}: {e.strerror}")


def resolve_inputs(inputs: list[str], skipped: Counter) -> list[str]:
    """Expand directories (recursive, sorted paths) into files; refuse what cannot be read."""
    paths = []
    for inp in inputs:
        if os.path.isdir(inp):
            walk = os.walk(inp, onerror=_unreadable_directory)
            files = (os.path.join(root, name) for root, _, names in walk for name in names)
            for path in sorted(files):
                if input_type(path):
                    paths.append(path)
                else:
                    skipped["other_type"] += 1
        elif not os.path.exists(inp):
            raise UserError(f"input {inp!r} does not exist")
        elif input_type(inp) is None:
            raise UserError(f"input {inp!r} is not a known type ({', '.join(INPUT_TYPES)})")
        else:
            paths.append(inp)
    if not paths:  # only (empty) directories were named
        raise UserError(f"no {' / '.join(INPUT_TYPES)} file in {', '.join(map(repr, inputs))} "
                        f"(skipped: {format_skipped(skipped)})")
    return paths


class Chunk(NamedTuple):
    """What one worker call turns into rows: a slice of one input, undecoded."""

    kind: str  # a PARSERS key
    path: str | None
    first_line: int  # line number of the payload's first line (jsonl)
    payload: Any  # jsonl: bytes of whole lines; txt: [(path, bytes)]; parquet: (texts, scores);
    #               py: [paths of Python sources]


def jsonl_chunks(path: str, batch_size: int) -> Iterator[Chunk]:
    """Whole lines, up to batch_size of them or CHUNK_BYTES, as one bytes object."""
    with (gzip.open if path.lower().endswith(".gz") else open)(path, "rb") as f:
        lines, size, first = [], 0, 1
        for line in f:
            lines.append(line)
            size += len(line)
            if len(lines) >= batch_size or size >= CHUNK_BYTES:
                yield Chunk("jsonl", path, first, b"".join(lines))
                first, lines, size = first + len(lines), [], 0
        if lines:
            yield Chunk("jsonl", path, first, b"".join(lines))


def parquet_chunks(path: str, batch_size: int, text_field: str,
                   score_field: str | None) -> Iterator[Chunk]:
    """The text column (and the score column), one record batch at a time."""
    pf = pq.ParquetFile(path)
    types = {f.name: f.type for f in pf.schema_arrow}
    wanted = {text_field: (pa.types.is_string, pa.types.is_large_string)}
    if score_field:
        wanted[score_field] = (pa.types.is_integer, pa.types.is_floating)
    for col, checks in wanted.items():
        if col not in types or not any(check(types[col]) for check in checks):
            listing = ", ".join(f"{name}: {t}" for name, t in types.items())
            raise UserError(f"{path}: no {'numeric' if col == score_field else 'string'} "
                            f"column {col!r} (columns: {listing})")
    for batch in pf.iter_batches(batch_size=batch_size, columns=list(wanted)):
        scores = batch.column(score_field) if score_field else None
        yield Chunk("parquet", path, 0, (batch.column(text_field), scores))


def read_chunks(paths: list[str], text_field: str, score_field: str | None,
                batch_size: int) -> Iterator[Chunk]:
    """Every input, in order, as chunks. Consecutive .txt files (one document each) share
    a chunk; a file that cannot be read raises after the chunks before it."""
    txt, size = [], 0
    for path in paths:
        kind = input_type(path)
        try:
            if kind == ".txt":
                if score_field:
                    raise UserError(f"{path}: a .txt file has no fields, so --score-field "
                                    f"cannot apply")
                with open(path, "rb") as f:
                    txt.append((path, f.read()))
                size += len(txt[-1][1])
                if len(txt) >= batch_size or size >= CHUNK_BYTES:
                    yield Chunk("txt", None, 0, txt)
                    txt, size = [], 0
                continue
            if txt:
                yield Chunk("txt", None, 0, txt)
                txt, size = [], 0
            if kind == ".parquet":
                yield from parquet_chunks(path, batch_size, text_field, score_field)
            else:
                yield from jsonl_chunks(path, batch_size)
        except (OSError, EOFError, pa.ArrowException) as e:
            if txt:  # the documents before the bad file still come first
                yield Chunk("txt", None, 0, txt)
            raise UserError(f"cannot read {path}: {e}") from None
    if txt:
        yield Chunk("txt", None, 0, txt)


def stdlib_sources() -> Iterator[str]:
    """The stdlib's .py files in sorted order, without tests and site-packages."""
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in DEMO_SKIP_DIRS)
        yield from (os.path.join(root, n) for n in sorted(files) if n.endswith(".py"))


def demo_chunks() -> Iterator[Chunk]:
    sources = iter(stdlib_sources())
    while paths := list(itertools.islice(sources, DEMO_FILES_PER_CHUNK)):
        yield Chunk("py", None, 0, paths)


# ----------------------------------------------------------------------------- parsing
# These run in the workers: each turns a chunk's payload into (text, score) documents
# and counts what it skips, exactly as a serial read would.

def score_of(value, score_field: str | None, where: str) -> float | None:
    """None without --score-field (quality_score decides), else the field as a float."""
    if not score_field:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: --score-field {score_field!r} is missing or not a number "
                        f"({value!r})")
    return float(value)


def parse_jsonl(chunk: Chunk, opts: "RowOptions", skipped: Counter) -> Docs:
    """One JSON object per line; lines without a (valid) string text field are counted."""
    text_field, score_field = opts.text_field, opts.score_field
    for lineno, raw in enumerate(chunk.payload.split(b"\n"), chunk.first_line):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"cannot read {chunk.path}: line {lineno}: {e}") from None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            skipped["bad_json"] += 1
        elif not isinstance(obj.get(text_field), str):
            skipped["no_text"] += 1
        elif not obj[text_field].isascii() and _SURROGATE.search(obj[text_field]):
            skipped["bad_text"] += 1  # a lone surrogate: no tokenizer can encode it
        else:
            yield obj[text_field], score_of(obj.get(score_field), score_field,
                                            f"{chunk.path}:{lineno}")


def parse_txt(chunk: Chunk, opts: "RowOptions", skipped: Counter) -> Docs:
    """A .txt file is one document, its newlines read as text mode reads them."""
    for path, data in chunk.payload:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"cannot read {path}: {e}") from None
        yield text.replace("\r\n", "\n").replace("\r", "\n"), None


def parse_parquet(chunk: Chunk, opts: "RowOptions", skipped: Counter) -> Docs:
    texts, scores = chunk.payload
    texts = texts.to_pylist()
    scores = scores.to_pylist() if scores is not None else [None] * len(texts)
    for text, score in zip(texts, scores):
        if text is None:
            skipped["no_text"] += 1
        else:
            yield text, score_of(score, opts.score_field, chunk.path)


def parse_python(chunk: Chunk, opts: "RowOptions", skipped: Counter) -> Docs:
    """Module, class and function docstrings of Python sources (the --demo corpus)."""
    for path in chunk.payload:
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, OSError):
            continue  # py2-era fixtures and the like: not worth a document
        for node in ast.walk(tree):
            doc = isinstance(node, DOCUMENTED_NODES) and ast.get_docstring(node, clean=False)
            if doc:
                yield inspect.cleandoc(doc), None


PARSERS = {"jsonl": parse_jsonl, "txt": parse_txt, "parquet": parse_parquet, "py": parse_python}


# ----------------------------------------------------------------------------- rows

def content_digest(text: str) -> bytes:
    """16-byte hash of the text after NFKC, lowercasing and collapsing whitespace."""
    normalized = " ".join(unicodedata.normalize("NFKC", text).lower().split())
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=16).digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """'val' for a fixed fraction of content hashes, so a document keeps its split."""
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


@dataclass(frozen=True)
class RowOptions:
    """What a worker needs to turn chunks into rows."""

    tokenizer: str
    text_field: str = "text"
    score_field: str | None = None
    min_chars: int = DEFAULT_MIN_CHARS
    val_fraction: float = DEFAULT_VAL_FRACTION


@dataclass
class ChunkRows:
    """A chunk's rows, every column but `id` and `is_dup` (those need the order of the
    whole corpus, so the main process adds them), and what the chunk skipped."""

    rows: pa.RecordBatch | None  # ROW_SCHEMA; None when nothing in the chunk was kept
    input_ids: pa.ListArray | None  # None for the byte tokenizer: see byte_token_ids
    skipped: Counter
    tokens: int = 0
    val: int = 0


ROW_SCHEMA = pa.schema([f for f in CORPUS_SCHEMA if f.name not in ("id", "is_dup", "input_ids")])
_worker: dict = {}  # this process's RowOptions and tokenizer, set by start_worker


def start_worker(opts: RowOptions, encode: FastEncoder | None = None) -> None:
    """The pool's initializer: the main process's `encode` where it pickles cheaply (a fast
    Hugging Face tokenizer), else the tokenizer loaded here, once per process."""
    _worker.update(opts=opts, encode=encode or load_tokenizer(opts.tokenizer).encode)


def string_offsets(texts: pa.StringArray) -> np.ndarray:
    """Where each string of the column starts in its data buffer, and where the last ends."""
    return np.frombuffer(texts.buffers()[1], dtype=np.int32)[texts.offset:texts.offset + len(texts) + 1]


def byte_token_ids(texts: pa.StringArray) -> pa.ListArray:
    """The byte tokenizer's ids: the UTF-8 bytes of the string column, taken from its own
    buffers. Built where the rows are written, so a worker sends its text once instead of
    text plus 4 bytes per byte of it."""
    offsets = string_offsets(texts)
    data = np.frombuffer(texts.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    return pa.ListArray.from_arrays(pa.array(offsets - offsets[0]), pa.array(data.astype(np.int32)))


def chunk_rows(chunk: Chunk) -> ChunkRows:
    """Parse, filter, tokenize, score, hash and split one chunk (runs in a worker)."""
    opts, encode = _worker["opts"], _worker["encode"]
    skipped = Counter()
    docs = []
    for text, score in PARSERS[chunk.kind](chunk, opts, skipped):
        if len(text.strip()) >= opts.min_chars:
            docs.append((text, score))
        else:
            skipped["short"] += 1
    if not docs:
        return ChunkRows(None, None, skipped)
    texts = [text for text, _ in docs]
    text_column = pa.array(texts, pa.string())
    ids = None if opts.tokenizer == "byte" else pa.array(encode(texts), pa.list_(pa.int32()))
    n_tokens = np.diff(np.asarray(ids.offsets) if ids is not None else string_offsets(text_column))
    n_tokens = n_tokens.astype(np.int32)
    digests = [content_digest(t) for t in texts]
    splits = [split_of(d, opts.val_fraction) for d in digests]
    rows = pa.record_batch([
        text_column,
        pa.array(n_tokens),
        pa.array([quality_score(t) if s is None else s for t, s in docs], pa.float32()),
        pa.array(splits, pa.string()),
        pa.array(digests, pa.binary(16)),
    ], schema=ROW_SCHEMA)
    return ChunkRows(rows, ids, skipped, tokens=int(n_tokens.sum()), val=splits.count("val"))


def digest_matrix(digests: pa.Array) -> np.ndarray:
    """A fixed_size_binary(16) column as an (n, 16) uint8 array, without copying."""
    if digests.null_count:
        raise UserError("the table's digest column has nulls; rebuild it with --mode overwrite")
    data = np.frombuffer(digests.buffers()[1], dtype=np.uint8)
    return data[digests.offset * 16:(digests.offset + len(digests)) * 16].reshape(-1, 16)


# ----------------------------------------------------------------------------- table

def open_existing(db: str, table: str):
    """The table if it exists, else None; never creates the database directory."""
    if not is_remote(db) and not os.path.isdir(db):
        return None
    conn = storage.connect(db)
    try:
        return conn.open_table(table)
    except (ValueError, FileNotFoundError, OSError) as e:
        if why := storage.describe(e, db):  # the store failed, not the lookup
            raise UserError(why) from None
        return None


def existing_contents(tbl, read_digests: bool = True) -> tuple[DigestSet, int, bool]:
    """The table's digests (reading only its 16-byte `digest` column; none read without
    `read_digests`), its next free id (after its last row's: prepare_data gives ids in row
    order) and whether it predates the digest column (then the caller computes the digests
    from `text`, once)."""
    schema = tbl.schema.remove_metadata()
    legacy = schema.equals(LEGACY_SCHEMA)
    if not (legacy or schema.equals(CORPUS_SCHEMA)):
        raise UserError(f"cannot append: the columns of the table ({', '.join(tbl.schema.names)}) "
                        f"are not the corpus schema; use --mode overwrite or another --table")
    seen, rows = DigestSet(), tbl.count_rows()
    if rows == 0:
        return seen, 0, legacy
    last_id = tbl.take_offsets([rows - 1]).select(["id"]).to_arrow().column("id")[0].as_py()
    if read_digests and not legacy:
        with tqdm(total=rows, desc="reading digests", unit="doc", file=sys.stderr, delay=0.5,
                  mininterval=0.5, leave=False, disable=None) as bar:
            for batch in tbl.search().select(["digest"]).to_batches(READ_ROWS):
                seen.add(digest_matrix(batch.column("digest")))
                bar.update(batch.num_rows)
    return seen, last_id + 1, legacy


def legacy_rows(tbl, seen: DigestSet, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The rows of a table made before the digest column, with their digests: an append
    to it writes them back with the new rows, in the same commit."""
    with tqdm(total=tbl.count_rows(), desc="digests of the existing rows", unit="doc",
              file=sys.stderr, delay=0.5, mininterval=0.5, leave=False, disable=None) as bar:
        for batch in tbl.search().select(LEGACY_SCHEMA.names).to_batches(READ_ROWS):
            digests = pa.array([content_digest(t) for t in batch.column("text").to_pylist()],
                               pa.binary(16))
            seen.add(digest_matrix(digests))
            bar.update(batch.num_rows)
            yield pa.record_batch(batch.columns + [digests], schema=schema)


def check_destination(db: str, table: str) -> None:
    """Refuse a --table name lance rejects and a --db that is, or lies under, a file."""
    from lancedb.util import validate_table_name

    try:
        validate_table_name(table)
    except ValueError as e:
        raise UserError(f"--table {table!r}: {e}") from None
    if is_remote(db):
        return
    path = os.path.abspath(db)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if path == os.path.abspath(db) and not os.path.isdir(path):
        raise UserError(f"--db {db!r} is a file, not a LanceDB directory")
    if not os.path.isdir(path):
        raise UserError(f"--db {db!r} cannot be created: {path!r} is a file")


def created_by_write(db: str, table: str) -> str | None:
    """The directory a write into `db`/`table` would create: the topmost missing one of
    the db path, else the table's own; None when both exist (or the db is remote)."""
    if is_remote(db):
        return None
    path = os.path.abspath(db)
    if os.path.isdir(path):
        table_dir = os.path.join(path, f"{table}.lance")
        return None if os.path.lexists(table_dir) else table_dir
    while not os.path.exists(os.path.dirname(path)):
        path = os.path.dirname(path)
    return path


def remove_uncommitted(path: str | None) -> None:
    """Remove `path` after a failed write, unless some table under it has a committed
    version (another process created it meanwhile)."""
    if path is None or not os.path.isdir(path):
        return
    if any("_versions" in dirs for _, dirs, _ in os.walk(path)):
        return
    shutil.rmtree(path, ignore_errors=True)


def commit(db: str, table: str, existing, mode: str, schema: pa.Schema,
           batches: Iterator[pa.RecordBatch], rewrite: bool = False) -> None:
    """Write every batch in one commit, so a failure leaves the table as it was.

    A created or replaced table records the tokenizer on its `input_ids` field (`schema`
    carries it); an append keeps the table's own (lance keeps a table's field metadata on
    add). `rewrite` replaces an existing table with `batches` (its own rows come first):
    the append to a table that predates the digest column. A failed write removes the
    directories it had created, so no empty db or table directory is left behind. A table
    directory with no committed version (what a killed create leaves) is cleared first.
    """
    if existing is None and not is_remote(db):
        remove_uncommitted(os.path.join(db, f"{table}.lance"))
    created = created_by_write(db, table)
    try:
        if existing is not None and mode == "append" and not rewrite:
            write_stream(existing.add, schema, batches)
        else:  # a missing table on --mode append is simply created
            write_stream(lambda reader: storage.connect(db).create_table(
                table, data=reader, schema=schema,
                mode="create" if mode == "create" else "overwrite"), schema, batches)
    except BaseException as e:
        remove_uncommitted(created)
        if isinstance(e, UserError) or not isinstance(e, Exception):  # the input's fault, Ctrl-C
            raise
        kept = (f"the table is as it was (version {existing.version}, {existing.count_rows()} rows)"
                if existing is not None else "no table was created")
        if fault := out_of_space(e, db, f"table {table!r} in {db!r}",
                                 f"free space there or use another --db, then run again; {kept}"):
            raise fault from None
        if isinstance(e, OSError):
            raise UserError(storage.describe(e, db)
                            or f"cannot write table {table!r} in {db!r}: {e}") from None
        raise


def corpus_batch(result: ChunkRows, first_id: int, is_dup: np.ndarray,
                 schema: pa.Schema = CORPUS_SCHEMA) -> pa.RecordBatch:
    """A chunk's rows as table rows: ids from `first_id` on, and the chunk's `is_dup`."""
    rows, n = result.rows, result.rows.num_rows
    ids = result.input_ids if result.input_ids is not None else byte_token_ids(rows.column("text"))
    return pa.record_batch([
        pa.array(np.arange(first_id, first_id + n, dtype=np.int64)), rows.column("text"),
        ids, rows.column("n_tokens"), rows.column("score"),
        pa.array(is_dup), rows.column("split"), rows.column("digest"),
    ], schema=schema)


def corpus_batches(results: Iterable[ChunkRows], seen: DigestSet, first_id: int, stats: Counter,
                   skipped: Counter, bar: tqdm, main_seconds: Counter) -> Iterator[pa.RecordBatch]:
    """The workers' rows in order, with the two columns that need that order: `id`, and
    `is_dup` from the digests seen so far. This is all the per-document work left to the
    main process; `main_seconds` gets its time and the time lance spends writing."""
    start = time.perf_counter()
    for result in results:
        skipped.update(result.skipped)
        if result.rows is None:
            continue
        began = time.perf_counter()
        n = result.rows.num_rows
        is_dup = seen.add(digest_matrix(result.rows.column("digest")))
        batch = corpus_batch(result, first_id + stats["docs"], is_dup)
        stats.update(docs=n, tokens=result.tokens, dups=int(is_dup.sum()), val=result.val,
                     batches=1)
        bar.update(n)
        bar.set_postfix_str(f"{stats['tokens'] / (time.perf_counter() - start):,.0f} tok/s",
                            refresh=False)
        handed = time.perf_counter()
        main_seconds["dedup"] += handed - began
        yield batch
        main_seconds["write"] += time.perf_counter() - handed


def interruptible(write: Callable[[], None], stop: threading.Event) -> None:
    """Run `write` in a thread and wait for it here, so that Ctrl-C is seen at once.

    Python runs signal handlers only on the main thread, between bytecodes; lance's write
    would hold this thread in Rust until the commit, so a Ctrl-C would be ignored and the
    run committed anyway. On Ctrl-C, `stop` makes the stream raise, lance drops the
    uncommitted write, and the KeyboardInterrupt goes on from here.
    """
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, name="lance-write", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except KeyboardInterrupt:
        stop.set()
        thread.join(STOP_GRACE_S)  # lance drops the write; then the created dirs go
        raise
    if outcome:
        raise outcome[0]


def cpu_seconds() -> float:
    """CPU time of this process, all its threads (lance writes from threads of its own)."""
    times = os.times()
    return times.user + times.system


def no_documents(min_chars: int, skipped: Counter) -> UserError:
    hint = "; is --text-field right?" if skipped["no_text"] else ""
    return UserError(f"the inputs hold no document of at least {min_chars} characters "
                     f"(skipped: {format_skipped(skipped)}){hint}")


def write_corpus(chunks: Iterable[Chunk], db: str, table: str, opts: RowOptions, *, mode: str,
                 workers: int | None = None, skipped: Counter, ray: str | None = None) -> dict:
    """Check options, turn `chunks` into rows in `workers` processes (or on the Ray cluster
    at `ray`: ray_ingest.py), write them in one commit and print the summary."""
    if ray is not None and workers is not None:
        raise UserError("--workers and --ray exclude each other: on Ray, the cluster's CPUs work")
    workers = usable_cores() if workers is None else workers
    if mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not 0.0 <= opts.val_fraction < 1.0 or opts.min_chars < 0:
        raise UserError("need 0 <= --val-fraction < 1 and --min-chars >= 0")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, not {workers}")
    if lancedb_cloud.is_cloud(db):
        raise UserError(lancedb_cloud.NO_INGEST.format(db=db))
    start = time.perf_counter()
    check_destination(db, table)
    tok = load_tokenizer(opts.tokenizer)
    existing = open_existing(db, table)
    if existing is not None and mode == "create":
        raise UserError(f"table {table!r} already exists in {db!r}; "
                        f"use --mode append to add to it or --mode overwrite to replace it")
    replaced = None  # (version, rows) an overwrite replaces: printed with how to restore it
    if existing is not None and mode == "overwrite":
        replaced = existing.version, existing.count_rows()
    seen, first_id, legacy, schema = DigestSet(), 0, False, corpus_schema(tok)
    if existing is not None and mode == "append":
        check_table_tokenizer(existing, tok, f"the table {table!r} in {db!r}")
        seen, first_id, legacy = existing_contents(existing, read_digests=ray is None)
        schema = existing.schema.append(CORPUS_SCHEMA.field("digest")) if legacy else CORPUS_SCHEMA
        if legacy and ray is not None:
            raise UserError(f"{db}/{table} has no digest column (it predates it); append to it once "
                            f"without --ray (that adds the column), then --ray appends work")
        if legacy:
            print(f"{db}/{table} has no digest column (it predates it): computing the digests of "
                  f"its {existing.count_rows()} rows once; this append writes them into the "
                  f"table, in the same commit", flush=True)
    stats, main_seconds, write_start = Counter(), Counter(), (time.perf_counter(), cpu_seconds())
    encode = tok.encode if isinstance(tok.encode, FastEncoder) else None
    if ray is not None:
        engine = ray_engine()
        cluster = engine.write_corpus(chunks, db, table, existing, mode, schema, opts, encode,
                                      first_id, stats, skipped, ray)
        return summarize(db, table, mode, start, stats, skipped, cluster["cpus"], replaced,
                         ray=cluster)
    with OrderedPool(chunk_rows, workers, start_worker, (opts, encode)) as pool, \
            tqdm(desc=table, unit="doc", file=sys.stderr, delay=0.5, mininterval=0.5,
                 disable=None) as bar:
        try:
            batches = corpus_batches(pool.map(chunks), seen, first_id, stats, skipped, bar,
                                     main_seconds)
            if legacy:  # the table's own rows go first, so their digests are seen first
                stream = itertools.chain(legacy_rows(existing, seen, schema),
                                         some_rows(batches, opts.min_chars, skipped))
            else:
                first = next(batches, None)
                if first is None:
                    raise no_documents(opts.min_chars, skipped)
                stream = itertools.chain([first], batches)
            interruptible(lambda: commit(db, table, existing, mode, schema, stream, rewrite=legacy),
                          pool.stop)
        except BaseException:
            bar.leave = False  # clear the bar: an error is the only line left on stderr
            raise
        spawned = pool.spawned
        main_seconds.update(read=pool.read_seconds, wait=pool.wait_seconds,
                            wall=time.perf_counter() - write_start[0],
                            cpu=cpu_seconds() - write_start[1])
    summary = summarize(db, table, mode, start, stats, skipped, workers, replaced,
                        main_process={k: round(v, 2) for k, v in main_seconds.items()})
    if spawned:  # where the main process's time went: what caps the scaling
        print(f"main process while writing: {main_seconds['cpu']:.1f} s of CPU in "
              f"{main_seconds['wall']:.1f} s: reading input {main_seconds['read']:.1f} s, waiting "
              f"for workers {main_seconds['wait']:.1f} s, ids and dedup "
              f"{main_seconds['dedup']:.1f} s, lance's encoding and writing most of the rest")
    return summary


def summarize(db: str, table: str, mode: str, start: float, stats: Counter, skipped: Counter,
              workers: int, replaced: tuple | None, *, ray: dict | None = None, **more) -> dict:
    """Print the summary line (and how to undo an overwrite); return the summary."""
    seconds = time.perf_counter() - start
    summary = {"db": db, "table": table, "docs": 0, "tokens": 0, "dups": 0, "val": 0, **stats,
               "skipped": dict(skipped), "seconds": round(seconds, 2), "workers": workers,
               "tokens_per_s": round(stats["tokens"] / seconds), **more}
    where = (f"{workers} worker{'s' * (workers > 1)}" if ray is None else
             f"Ray: {ray['nodes']} node{'s' * (ray['nodes'] > 1)}, {workers} CPUs, "
             f"{ray['shards']} dedup shard{'s' * (ray['shards'] > 1)}")
    print(f"wrote {summary['docs']} docs ({summary['tokens']} tokens) to {db}/{table} [{mode}]: "
          f"{summary['dups']} dups, {summary['val']} val; skipped {format_skipped(skipped)}; "
          f"{seconds:.1f} s, {where}, {summary['tokens_per_s']:,} tokens/s")
    if ray is not None:
        summary["ray"] = ray
        print(f"driver: peak RSS {ray['driver_peak_rss_mib']:.0f} MiB, {ray['driver_cpu_s']:.1f} s of "
              f"CPU; {ray['fragments']} fragments written by the workers, committed once by the driver")
    if replaced:
        summary["replaced_version"] = replaced[0]
        print(f"replaced version {replaced[0]} ({replaced[1]} rows) of {db}/{table}; to bring it "
              f"back: {restore_command(db, table, replaced[0])}")
    return summary


def ray_engine():
    """ray_ingest, imported only for --ray (Ray and pylance are the optional `ray` extra)."""
    try:
        import ray_ingest
    except ImportError as e:
        if e.name not in ("ray", "lance") and not str(e.name).startswith(("ray.", "lance.")):
            raise
        raise UserError(f"--ray needs Ray and pylance ({e.name} is not installed): "
                        f"pip install -e '.[ray]'") from None
    return ray_ingest


def some_rows(batches: Iterator[pa.RecordBatch], min_chars: int,
              skipped: Counter) -> Iterator[pa.RecordBatch]:
    """`batches`, refused when there are none (for a stream already being written)."""
    empty = True
    for batch in batches:
        empty = False
        yield batch
    if empty:
        raise no_documents(min_chars, skipped)


def restore_command(db: str, table: str, version: int) -> str:
    """The command line that brings `version` back, ready to paste into a shell."""
    return (f"python prepare_data.py --db {shlex.quote(db)} --table {shlex.quote(table)} "
            f"--restore {version}")


def restore(db: str, table: str, version: int) -> None:
    """Make `version` current again, as a new version with its rows: the undo of an
    --mode overwrite (lance keeps every version until they are cleaned up)."""
    check_destination(db, table)
    tbl = open_existing(db, table)
    if tbl is None:
        raise UserError(f"no table {table!r} in {db!r} to restore")
    versions = sorted(v["version"] for v in tbl.list_versions())
    if version not in versions:
        have = ", ".join(map(str, versions)) if len(versions) <= 10 else \
            f"{len(versions)} from {versions[0]} to {versions[-1]}"
        raise UserError(f"table {table!r} in {db!r} has no version {version} (versions: {have})")
    latest = tbl.version
    try:
        tbl.restore(version)
    except Exception as e:
        if fault := out_of_space(e, db, f"a new version of table {table!r} in {db!r}",
                                 f"free space there, then run again; the table is as it was "
                                 f"(version {latest})"):
            raise fault from None
        if isinstance(e, OSError):
            raise UserError(storage.describe(e, db) or f"cannot restore {table!r} in {db!r}: {e}") from None
        raise
    print(f"restored version {version} ({tbl.count_rows()} rows) of {db}/{table} "
          f"as its new version {tbl.version}")


def format_skipped(skipped: Counter) -> str:
    """'1 bad_json, 3 short' (or 'none') for the one-line summary."""
    return ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()) if n) or "none"


def ingest(inputs: list[str], db: str = DEFAULT_DB, table: str = DEFAULT_TABLE,
           tokenizer_spec: str = "byte", *, val_fraction: float = DEFAULT_VAL_FRACTION,
           min_chars: int = DEFAULT_MIN_CHARS, mode: str = "create", text_field: str = "text",
           score_field: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
           workers: int | None = None, ray: str | None = None) -> dict:
    """Build (or extend) a corpus table from txt / jsonl / jsonl.gz / parquet inputs."""
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    skipped = Counter()
    chunks = read_chunks(resolve_inputs(inputs, skipped), text_field, score_field, batch_size)
    opts = RowOptions(tokenizer_spec, text_field, score_field, min_chars, val_fraction)
    return write_corpus(chunks, db, table, opts, mode=mode, workers=workers, skipped=skipped,
                        ray=ray)


def build_demo(db: str = DEFAULT_DB, table: str = DEFAULT_TABLE, tokenizer_spec: str = "byte", *,
               mode: str = "create", val_fraction: float = DEFAULT_VAL_FRACTION,
               min_chars: int = DEFAULT_MIN_CHARS, workers: int | None = None,
               ray: str | None = None) -> dict:
    """Build the stdlib-docstring corpus, which train.py uses when no table exists."""
    opts = RowOptions(tokenizer_spec, min_chars=min_chars, val_fraction=val_fraction)
    return write_corpus(demo_chunks(), db, table, opts, mode=mode, workers=workers,
                        skipped=Counter(), ray=ray)


# ----------------------------------------------------------------------------- cli

def parse_args(argv=None) -> argparse.Namespace:
    policy = next(part for part in __doc__.split("\n\n") if part.startswith("Skipped"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=policy)
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="txt / jsonl / jsonl.gz / parquet files or directories")
    p.add_argument("--demo", action="store_true", help="build the stdlib-docstring demo corpus")
    p.add_argument("--db", default=DEFAULT_DB, help="LanceDB directory or URI")
    p.add_argument("--table", default=DEFAULT_TABLE)
    p.add_argument("--tokenizer", default="byte", help="'byte' or 'hf:<name-or-local-dir>'")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    p.add_argument("--min-chars", type=int, default=DEFAULT_MIN_CHARS,
                   help="skip documents shorter than this (after stripping)")
    p.add_argument("--mode", choices=MODES, default="create", help="append creates a missing table")
    p.add_argument("--text-field", default="text", help="jsonl key or parquet column of the text")
    p.add_argument("--score-field", help="numeric field used as score instead of quality_score")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help="input lines (documents) per chunk a worker tokenizes: one write batch")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that parse, tokenize and score (default: every core this "
                   f"process may use, here {usable_cores()}); 1 runs in-process")
    p.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster: its address "
                   "(host:6379), 'auto' (the cluster this node belongs to) or 'local' (a Ray of "
                   "this machine's own, stopped at the end); the table is the one --workers writes")
    p.add_argument("--clean-fragments", action="store_true",
                   help="list and remove the data files of --table that no version uses (what a "
                   "--ray run killed before its commit leaves), then exit; not while an ingest "
                   "into the table runs")
    p.add_argument("--restore", type=int, metavar="VERSION",
                   help="make this earlier version of --table current again (e.g. after "
                   "--mode overwrite), then exit")
    storage.add_argument(p)
    return p.parse_args(argv)


def without_torch() -> None:
    """Let transformers load a tokenizer without importing torch: this process never runs a
    model, and the import is most of an hf: tokenizer's start-up (7.9 s -> 2.3 s measured).
    Only for the command line (`python prepare_data.py`): it sets the process's environment,
    which a program calling main() keeps, and would see transformers without torch from then on."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("USE_TORCH", "0")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "None of PyTorch..."


def main(argv=None) -> None:
    startup.script_handles_ctrl_c()  # as KeyboardInterrupt: "interrupted: the table is as it was"
    args = parse_args(argv)
    options = dict(mode=args.mode, val_fraction=args.val_fraction, min_chars=args.min_chars,
                   workers=args.workers, ray=args.ray)
    try:
        storage.configure(args.storage_option)
        if args.clean_fragments:
            if args.inputs or args.demo or args.restore is not None:
                raise UserError("--clean-fragments takes no INPUT, --demo or --restore")
            ray_engine().clean_fragments(args.db, args.table)
        elif args.restore is not None:
            if args.inputs or args.demo:
                raise UserError("--restore takes no INPUT and no --demo")
            restore(args.db, args.table, args.restore)
        elif args.demo:
            if args.inputs or args.score_field:
                raise UserError("--demo takes no INPUT and no --score-field")
            build_demo(args.db, args.table, args.tokenizer, **options)
        elif not args.inputs:
            raise UserError("give at least one INPUT file or directory, or --demo")
        else:
            ingest(args.inputs, args.db, args.table, args.tokenizer, text_field=args.text_field,
                   score_field=args.score_field, batch_size=args.batch_size, **options)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except WorkerDied as e:
        print(f"error: {e}; the table is as it was", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: the table is as it was", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    without_torch()
    main()
