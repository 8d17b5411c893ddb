"""Text in -> tokenized corpus table for train.py (columns: common.CORPUS_SCHEMA).

Usage:
    python prepare_data.py INPUT [INPUT ...] [--db DIR] [--table NAME] [--tokenizer SPEC]
        [--val-fraction 0.02] [--min-chars 50] [--mode create|append|overwrite]
        [--text-field text] [--score-field NAME] [--batch-size 1000]
    python prepare_data.py --demo [--db DIR] [--table NAME] [--tokenizer SPEC] [--mode ...]
    python prepare_data.py --restore VERSION [--db DIR] [--table NAME]

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
table does not have.

Each document gets a sequential `id` (after the table's max id on append), `input_ids`
(no EOS), a `score` (--score-field, else `quality_score`), `is_dup` (normalized text seen
before, across appends too; the first copy is kept) and a `split` drawn from the hash of
the normalized text, so re-runs agree.

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
import time
import unicodedata
from collections import Counter
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

import storage
from common import (CORPUS_SCHEMA, DEFAULT_DB, DEFAULT_TABLE, UserError, check_table_tokenizer,
                    corpus_schema, is_remote, load_tokenizer, write_stream)

DEFAULT_VAL_FRACTION = 0.02
DEFAULT_MIN_CHARS = 50  # under ~8 words there is hardly a sentence to learn from
DEFAULT_BATCH_SIZE = 1000
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

def input_type(path: str) -> str | None:
    """The READERS key for `path`, by suffix; None for files we do not read."""
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


def score_of(value, score_field: str | None, where: str) -> float | None:
    """None without --score-field (quality_score decides), else the field as a float."""
    if not score_field:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: --score-field {score_field!r} is missing or not a number "
                        f"({value!r})")
    return float(value)


def read_txt(path: str, text_field: str, score_field: str | None, skipped: Counter):
    """A .txt file is one document."""
    if score_field:
        raise UserError(f"{path}: a .txt file has no fields, so --score-field cannot apply")
    with open(path, encoding="utf-8") as f:
        yield f.read(), None


def read_jsonl(path: str, text_field: str, score_field: str | None, skipped: Counter):
    """One JSON object per line; lines without a (valid) string text field are counted."""
    with (gzip.open if path.lower().endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
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
                where = f"{path}:{lineno}"
                yield obj[text_field], score_of(obj.get(score_field), score_field, where)


def read_parquet(path: str, text_field: str, score_field: str | None, skipped: Counter):
    """A text column (and maybe a score column), one record batch at a time."""
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
    for batch in pf.iter_batches(batch_size=DEFAULT_BATCH_SIZE, columns=list(wanted)):
        texts = batch.column(text_field).to_pylist()
        scores = batch.column(score_field).to_pylist() if score_field else [None] * len(texts)
        for text, score in zip(texts, scores):
            if text is None:
                skipped["no_text"] += 1
            else:
                yield text, score_of(score, score_field, path)


READERS = {".txt": read_txt, ".jsonl": read_jsonl, ".jsonl.gz": read_jsonl,
           ".parquet": read_parquet}


def read_documents(paths: list[str], text_field: str, score_field: str | None,
                   skipped: Counter) -> Docs:
    """Every document of every input, lazily, in input order."""
    for path in paths:
        try:
            yield from READERS[input_type(path)](path, text_field, score_field, skipped)
        except (OSError, EOFError, UnicodeDecodeError, pa.ArrowException) as e:
            raise UserError(f"cannot read {path}: {e}") from None


def stdlib_docstrings() -> Iterator[str]:
    """Module, class and function docstrings of the stdlib, in sorted file order."""
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in DEMO_SKIP_DIRS)
        for name in (n for n in sorted(files) if n.endswith(".py")):
            try:
                with open(os.path.join(root, name), "rb") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, ValueError, OSError):
                continue  # py2-era fixtures and the like: not worth a document
            for node in ast.walk(tree):
                doc = isinstance(node, DOCUMENTED_NODES) and ast.get_docstring(node, clean=False)
                if doc:
                    yield inspect.cleandoc(doc)


# ----------------------------------------------------------------------------- rows

def content_digest(text: str) -> bytes:
    """16-byte hash of the text after NFKC, lowercasing and collapsing whitespace."""
    normalized = " ".join(unicodedata.normalize("NFKC", text).lower().split())
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=16).digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """'val' for a fixed fraction of content hashes, so a document keeps its split."""
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def long_enough(docs: Docs, min_chars: int, skipped: Counter) -> Docs:
    """Drop (and count) documents too short to teach anything."""
    for text, score in docs:
        if len(text.strip()) >= min_chars:
            yield text, score
        else:
            skipped["short"] += 1


def corpus_batches(docs: Docs, tok, seen: set[bytes], first_id: int, val_fraction: float,
                   batch_size: int, stats: Counter) -> Iterator[pa.RecordBatch]:
    """Tokenize, dedup, score and split documents, batch_size at a time.

    Memory is one batch of documents plus `seen`: O(number of distinct documents)
    16-byte digests (~100 bytes each with CPython's set overhead).
    """
    docs = iter(docs)
    while chunk := list(itertools.islice(docs, batch_size)):
        texts = [text for text, _ in chunk]
        token_ids = tok.encode(texts)
        digests = [content_digest(t) for t in texts]
        is_dup = []
        for d in digests:
            is_dup.append(d in seen)
            seen.add(d)
        splits = [split_of(d, val_fraction) for d in digests]
        n_tokens = [len(ids) for ids in token_ids]
        next_id = first_id + stats["docs"]
        stats.update(docs=len(chunk), tokens=sum(n_tokens), dups=sum(is_dup),
                     val=splits.count("val"), batches=1)
        yield pa.record_batch([
            pa.array(range(next_id, next_id + len(chunk)), pa.int64()),
            pa.array(texts, pa.string()),
            pa.array(token_ids, pa.list_(pa.int32())),
            pa.array(n_tokens, pa.int32()),
            pa.array([quality_score(t) if s is None else s for t, s in chunk], pa.float32()),
            pa.array(is_dup, pa.bool_()),
            pa.array(splits, pa.string()),
        ], schema=CORPUS_SCHEMA)


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


def existing_contents(tbl, batch_size: int) -> tuple[set[bytes], int]:
    """Digests of the table's texts and its next free id, read batch by batch."""
    if not tbl.schema.remove_metadata().equals(CORPUS_SCHEMA):
        raise UserError(f"cannot append: the columns of the table ({', '.join(tbl.schema.names)}) "
                        f"are not the corpus schema; use --mode overwrite or another --table")
    seen, max_id = set(), -1
    for batch in tbl.search().select(["id", "text"]).to_batches(batch_size):
        seen.update(content_digest(t) for t in batch.column("text").to_pylist())
        if batch.num_rows:
            max_id = max(max_id, pc.max(batch.column("id")).as_py())
    return seen, max_id + 1


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


def commit(db: str, table: str, existing, mode: str, tok,
           batches: Iterator[pa.RecordBatch]) -> None:
    """Write every batch in one commit, so a failure leaves the table as it was.

    A created or replaced table records `tok` on its `input_ids` field; an append keeps
    the table's own (lance keeps a table's field metadata on add). A failed write removes the
    directories it had created, so no empty db or table directory is left behind. A table
    directory with no committed version (what a killed create leaves) is cleared first.
    """
    if existing is None and not is_remote(db):
        remove_uncommitted(os.path.join(db, f"{table}.lance"))
    created = created_by_write(db, table)
    try:
        if existing is not None and mode == "append":
            write_stream(existing.add, CORPUS_SCHEMA, batches)
        else:  # a missing table on --mode append is simply created
            schema = corpus_schema(tok)
            write_stream(lambda reader: storage.connect(db).create_table(
                table, data=reader, schema=schema,
                mode="overwrite" if mode == "overwrite" else "create"), schema, batches)
    except OSError as e:  # input errors arrive as UserError: this is the db itself
        remove_uncommitted(created)
        raise UserError(storage.describe(e, db) or f"cannot write table {table!r} in {db!r}: {e}") from None
    except BaseException:
        remove_uncommitted(created)
        raise


def write_corpus(docs: Docs, db: str, table: str, tokenizer_spec: str, *, val_fraction: float,
                 min_chars: int, mode: str, batch_size: int, skipped: Counter) -> dict:
    """Check options, stream `docs` into the table in one commit, print the summary."""
    if mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not 0.0 <= val_fraction < 1.0 or min_chars < 0 or batch_size < 1:
        raise UserError("need 0 <= --val-fraction < 1, --min-chars >= 0 and --batch-size >= 1")
    start = time.perf_counter()
    check_destination(db, table)
    tok = load_tokenizer(tokenizer_spec)
    existing = open_existing(db, table)
    if existing is not None and mode == "create":
        raise UserError(f"table {table!r} already exists in {db!r}; "
                        f"use --mode append to add to it or --mode overwrite to replace it")
    appending = existing is not None and mode == "append"
    replaced = None  # (version, rows) an overwrite replaces: printed with how to restore it
    if existing is not None and mode == "overwrite":
        replaced = existing.version, existing.count_rows()
    if appending:
        check_table_tokenizer(existing, tok, f"the table {table!r} in {db!r}")
    seen, first_id = existing_contents(existing, batch_size) if appending else (set(), 0)
    stats = Counter()
    with tqdm(long_enough(docs, min_chars, skipped), desc=table, unit="doc", file=sys.stderr,
              delay=0.5, mininterval=0.5) as kept:
        try:
            batches = corpus_batches(kept, tok, seen, first_id, val_fraction, batch_size, stats)
            first = next(batches, None)
            if first is None:
                hint = "; is --text-field right?" if skipped["no_text"] else ""
                raise UserError(f"the inputs hold no document of at least {min_chars} characters "
                                f"(skipped: {format_skipped(skipped)}){hint}")
            commit(db, table, existing, mode, tok, itertools.chain([first], batches))
        except BaseException:
            kept.leave = False  # clear the bar: an error is the only line left on stderr
            raise
    summary = {"db": db, "table": table, "docs": 0, "tokens": 0, "dups": 0, "val": 0, **stats,
               "skipped": dict(skipped), "seconds": round(time.perf_counter() - start, 2)}
    print(f"wrote {summary['docs']} docs ({summary['tokens']} tokens) to {db}/{table} [{mode}]: "
          f"{summary['dups']} dups, {summary['val']} val; skipped {format_skipped(skipped)}; "
          f"{summary['seconds']:.1f} s")
    if replaced:
        summary["replaced_version"] = replaced[0]
        print(f"replaced version {replaced[0]} ({replaced[1]} rows) of {db}/{table}; to bring it "
              f"back: {restore_command(db, table, replaced[0])}")
    return summary


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
    try:
        tbl.restore(version)
    except OSError as e:
        raise UserError(storage.describe(e, db) or f"cannot restore {table!r} in {db!r}: {e}") from None
    print(f"restored version {version} ({tbl.count_rows()} rows) of {db}/{table} "
          f"as its new version {tbl.version}")


def format_skipped(skipped: Counter) -> str:
    """'1 bad_json, 3 short' (or 'none') for the one-line summary."""
    return ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()) if n) or "none"


def ingest(inputs: list[str], db: str = DEFAULT_DB, table: str = DEFAULT_TABLE,
           tokenizer_spec: str = "byte", *, val_fraction: float = DEFAULT_VAL_FRACTION,
           min_chars: int = DEFAULT_MIN_CHARS, mode: str = "create", text_field: str = "text",
           score_field: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    """Build (or extend) a corpus table from txt / jsonl / jsonl.gz / parquet inputs."""
    skipped = Counter()
    docs = read_documents(resolve_inputs(inputs, skipped), text_field, score_field, skipped)
    return write_corpus(docs, db, table, tokenizer_spec, val_fraction=val_fraction,
                        min_chars=min_chars, mode=mode, batch_size=batch_size, skipped=skipped)


def build_demo(db: str = DEFAULT_DB, table: str = DEFAULT_TABLE, tokenizer_spec: str = "byte", *,
               mode: str = "create", val_fraction: float = DEFAULT_VAL_FRACTION,
               min_chars: int = DEFAULT_MIN_CHARS, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    """Build the stdlib-docstring corpus, which train.py uses when no table exists."""
    docs = ((text, None) for text in stdlib_docstrings())
    return write_corpus(docs, db, table, tokenizer_spec, val_fraction=val_fraction,
                        min_chars=min_chars, mode=mode, batch_size=batch_size, skipped=Counter())


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
                   help="documents per tokenize / write batch")
    p.add_argument("--restore", type=int, metavar="VERSION",
                   help="make this earlier version of --table current again (e.g. after "
                   "--mode overwrite), then exit")
    storage.add_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    options = dict(mode=args.mode, val_fraction=args.val_fraction, min_chars=args.min_chars,
                   batch_size=args.batch_size)
    try:
        storage.configure(args.storage_option)
        if args.restore is not None:
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
                   score_field=args.score_field, **options)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
