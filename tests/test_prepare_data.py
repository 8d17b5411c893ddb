"""Tests for prepare_data.py: every input type, modes, dedup and split, bounded memory,
the quality score, user errors at the CLI, the stdlib demo corpus, an hf: tokenizer and
the tokenizer recorded on the table."""

import gzip
import json
import os
import shutil
import subprocess
import tracemalloc

import lancedb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepare_data
from common import CORPUS_SCHEMA, LEGACY_SCHEMA, UserError, load_tokenizer, table_tokenizer
from conftest import REPO as ROOT
from conftest import assert_user_error, run_script, save_bpe
from prepare_data import build_demo, ingest, quality_score

PROSE = [
    "The river ran quietly through the valley, past the old mill and the fields of barley.",
    "In the evenings the farmers would gather by the bridge to talk about the weather.",
    "Nobody in the village could remember when the great wheel of the mill had last turned.",
    "A travelling merchant once claimed that the miller had simply grown tired of flour.",
    "Children still dared each other to climb the mossy stones at the foot of the dam.",
    "Every spring the water rose a little higher, and every autumn it fell back again.",
]


def prose(i: int) -> str:
    """A distinct, ordinary English document of a few sentences."""
    return f"Document {i}. " + " ".join(PROSE[(i + k) % len(PROSE)] for k in range(3))


def read_table(db, table="corpus") -> pa.Table:
    return lancedb.connect(str(db)).open_table(table).to_arrow().sort_by("id")


def run_cli(*args) -> subprocess.CompletedProcess:
    return run_script("prepare_data.py", *args, cwd=ROOT, timeout=120)


def main_error(capsys, *argv) -> str:
    """prepare_data.main in-process (a subprocess costs ~5 s of imports): a user error
    exits 2 with exactly one `error: ` line on stderr; returns that line."""
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def table_state(db, table="corpus"):
    """What a refused run must leave as it was: the version and the rows."""
    tbl = lancedb.connect(str(db)).open_table(table)
    return tbl.version, tbl.count_rows()


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def assert_corpus(tbl: pa.Table, texts: list[str]):
    """Schema, doc order, and that tokens round-trip the text (byte tokenizer)."""
    tok = load_tokenizer("byte")
    assert tbl.schema.remove_metadata().equals(CORPUS_SCHEMA)
    assert tbl.column("id").to_pylist() == list(range(len(texts)))
    assert tbl.column("text").to_pylist() == texts
    rows = zip(texts, tbl.column("input_ids").to_pylist(), tbl.column("n_tokens").to_pylist())
    for text, ids, n in rows:
        assert tok.decode(ids) == text
        assert n == len(ids)
    assert set(tbl.column("split").to_pylist()) <= {"train", "val"}


# ----------------------------------------------------------------------------- inputs

def make_txt_file(tmp_path):
    (tmp_path / "one.txt").write_text(prose(0), encoding="utf-8")
    return tmp_path / "one.txt", [prose(0)]


def make_txt_dir(tmp_path):
    root = tmp_path / "docs"
    (root / "b_sub").mkdir(parents=True)
    (root / "a.txt").write_text(prose(0), encoding="utf-8")
    (root / "b_sub" / "c.txt").write_text(prose(1), encoding="utf-8")
    (root / "c.txt").write_text(prose(2), encoding="utf-8")
    (root / "notes.md").write_text(prose(3), encoding="utf-8")  # other type: skipped, counted
    return root, [prose(0), prose(1), prose(2)]  # sorted walk: a.txt, b_sub/c.txt, c.txt


def make_jsonl(tmp_path):
    texts = [prose(i) for i in range(5)]
    return write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts]), texts


def make_jsonl_gz(tmp_path):
    texts = [prose(i) for i in range(5)]
    return write_jsonl(tmp_path / "d.jsonl.gz", [{"text": t} for t in texts], gzip.open), texts


def make_parquet(tmp_path):
    texts = [prose(i) for i in range(2500)]  # several parquet record batches
    table = pa.table({"text": texts, "other": list(range(len(texts)))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=700)
    return tmp_path / "d.parquet", texts


@pytest.mark.parametrize(
    "make", [make_txt_file, make_txt_dir, make_jsonl, make_jsonl_gz, make_parquet])
def test_each_input_type_ingests(tmp_path, make):
    path, texts = make(tmp_path)
    summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte")
    assert summary["docs"] == len(texts)
    assert summary["skipped"] == ({"other_type": 1} if make is make_txt_dir else {})
    assert_corpus(read_table(tmp_path / "db"), texts)


def test_bad_jsonl_lines_are_skipped_and_counted(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": prose(0)}, "this is not json", "[1, 2, 3]", {"body": prose(1)}, {"text": 42},
        {"text": None}, "", {"text": "too short"}, {"text": "\ud800 " + prose(3)},
        {"text": prose(2)},
    ])
    summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte")
    assert summary["docs"] == 2
    assert summary["skipped"] == {"bad_json": 2, "no_text": 3, "short": 1, "bad_text": 1}
    assert_corpus(read_table(tmp_path / "db"), [prose(0), prose(2)])
    assert "skipped 2 bad_json, 1 bad_text, 3 no_text, 1 short;" in capsys.readouterr().out


def test_help_documents_what_is_skipped_and_what_is_fatal(capsys):
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for word in ("other_type", "short", "bad_json", "no_text", "bad_text", "Fatal"):
        assert word in text


def test_score_field_is_used(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", [{"text": prose(i), "q": i * 0.5} for i in range(4)])
    pq.write_table(pa.table({"text": [prose(9)], "q": [7]}), tmp_path / "e.parquet")
    ingest([str(jsonl), str(tmp_path / "e.parquet")], str(tmp_path / "db"), "corpus", "byte",
           score_field="q")
    assert read_table(tmp_path / "db").column("score").to_pylist() == [0.0, 0.5, 1.0, 1.5, 7.0]
    missing = write_jsonl(tmp_path / "m.jsonl", [{"text": prose(0), "q": 1}, {"text": prose(1)}])
    with pytest.raises(UserError, match="m.jsonl:2.*'q'"):
        ingest([str(missing)], str(tmp_path / "db2"), "corpus", "byte", score_field="q")
    assert not (tmp_path / "db2").exists()


# ----------------------------------------------------------------------------- modes, dedup, split

def test_append_continues_ids_and_dedups_across_runs(tmp_path):
    db = str(tmp_path / "db")
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i)} for i in range(3)])
    ingest([str(first)], db, "corpus", "byte", mode="append")  # append creates a missing table
    same_after_normalizing = "  " + prose(1).upper().replace(" ", " \n\t ")
    second = write_jsonl(tmp_path / "b.jsonl",
                         [{"text": prose(7)}, {"text": same_after_normalizing}])
    summary = ingest([str(second)], db, "corpus", "byte", mode="append")
    assert summary["dups"] == 1
    tbl = read_table(db)
    assert tbl.column("id").to_pylist() == [0, 1, 2, 3, 4]
    assert tbl.column("is_dup").to_pylist() == [False, False, False, False, True]
    split = tbl.column("split").to_pylist()
    assert split[4] == split[1]  # a duplicate lands in its original's split: no train/val leak


def test_overwrite_replaces_and_a_failed_run_leaves_the_table_unchanged(tmp_path):
    db = str(tmp_path / "db")
    ingest([str(write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i)} for i in range(3)]))],
           db, "corpus", "byte")
    # the bad record is in the third write batch: the error surfaces after lance began writing
    records = [{"text": prose(i), "q": 1} for i in range(5)] + [{"text": prose(5)}]
    bad = write_jsonl(tmp_path / "b.jsonl", records)
    with pytest.raises(UserError, match="b.jsonl:6"):
        ingest([str(bad)], db, "corpus", "byte", mode="overwrite", score_field="q", batch_size=2)
    tbl = lancedb.connect(db).open_table("corpus")
    assert tbl.count_rows() == 3 and len(tbl.list_versions()) == 1
    ingest([str(bad)], db, "corpus", "byte", mode="overwrite", min_chars=0)
    assert read_table(db).column("text").to_pylist() == [prose(i) for i in range(6)]


def test_create_refuses_an_existing_table(tmp_path):
    path, texts = make_jsonl(tmp_path)
    ingest([str(path)], str(tmp_path / "db"), "corpus", "byte")
    version = lancedb.connect(str(tmp_path / "db")).open_table("corpus").version
    proc = run_cli(path, "--db", tmp_path / "db", "--table", "corpus")
    assert_user_error(proc, "'corpus'", "--mode append", "--mode overwrite")
    tbl = lancedb.connect(str(tmp_path / "db")).open_table("corpus")
    assert tbl.version == version and tbl.count_rows() == len(texts)


def test_dedup_and_split_are_deterministic(tmp_path):
    texts = [prose(i) for i in range(200)] + [prose(i).upper() for i in range(0, 200, 7)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    tables = []
    for run in ("a", "b"):
        ingest([str(path)], str(tmp_path / run), "corpus", "byte", val_fraction=0.3, batch_size=64)
        tables.append(read_table(tmp_path / run).select(["id", "is_dup", "split", "score"]))
    assert tables[0].equals(tables[1])
    splits = tables[0].column("split").to_pylist()
    assert 30 < splits.count("val") < 100  # the hash really splits ~30%
    assert sum(tables[0].column("is_dup").to_pylist()) == len(range(0, 200, 7))


@pytest.mark.parametrize("workers", [1, 2])
def test_memory_stays_bounded_and_the_run_is_one_commit(tmp_path, workers):
    """Peak Python allocation of the main process while ingesting a ~21 MB jsonl stays far
    below its size, in-process and with worker processes.

    A batch of byte-tokenized text costs a few times its size in Python objects and Arrow
    arrays, so batches of 5 docs of ~10 KB peak near 1 MB in-process; with 2 workers at
    most 4 chunks (and their rows) are in flight, ~3 MB. Anything holding the input (or
    its tokens) at once would peak above the 21 MB of the file itself.
    """
    words = [w.strip(".,") for w in " ".join(PROSE).split()]
    texts = [f"{i} " + "-".join(words[(i * 7 + k) % len(words)] for k in range(2000))
             for i in range(2000)]
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in texts])
    size = os.path.getsize(path)
    assert size > 20_000_000
    load_tokenizer("byte")
    tracemalloc.start()
    try:
        summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte", batch_size=5,
                         workers=workers)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert summary["docs"] == len(texts) and summary["batches"] == len(texts) // 5
    assert peak < size / 5, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB input"
    tbl = lancedb.connect(str(tmp_path / "db")).open_table("corpus")
    assert tbl.count_rows() == len(texts) and len(tbl.list_versions()) == 1


# ----------------------------------------------------------------------------- quality

def test_quality_score_passes_prose_and_fails_junk():
    paragraph = " ".join(PROSE)
    assert quality_score(paragraph) > 1.0
    assert quality_score("\n".join(paragraph[i:i + 70] for i in range(0, len(paragraph), 70))) > 1.0
    junk = {
        "symbols": "#$%^&*(){}[]<>|\\/~`!@=+-_;:" * 15,
        "spaced symbols": " ".join(["{}", "[];", "=>", "&&", "||", "#!", "%%"] * 20),
        "repeated line": "Click here to subscribe to our newsletter today!\n" * 50,
        "a a a a": "a a a a",
        "fragment": "Hello there.",
        "code dump": "x = {a: [1, 2]}; y = (x[0] + x[1]) * 3; z = f(y) || g(&x);\n" * 5,
        "numbers": " ".join(str(n * 7919 % 100003) for n in range(100)),
        "the the": " ".join(["the"] * 100),
        "bullets": "\n".join(f"- item {i} of the menu" for i in range(30)),
    }
    for name, text in junk.items():
        assert quality_score(text) < 1.0, name


# ----------------------------------------------------------------------------- cli errors

def bad_missing(tmp_path):
    return [tmp_path / "nothere.jsonl"], ["nothere.jsonl", "does not exist"]


def bad_corrupt_gz(tmp_path):
    (tmp_path / "d.jsonl.gz").write_bytes(b"plain text, not gzip data\n" * 10)
    return [tmp_path / "d.jsonl.gz"], ["cannot read", "d.jsonl.gz"]


def bad_corrupt_parquet(tmp_path):
    (tmp_path / "d.parquet").write_bytes(os.urandom(4096))
    return [tmp_path / "d.parquet"], ["cannot read", "d.parquet"]


def bad_not_utf8(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    return [tmp_path / "d.jsonl"], ["cannot read", "d.jsonl", "utf-8"]


def bad_corrupt_after_a_good_file(tmp_path):
    """With --batch-size 1 the corrupt file is read after lance began writing."""
    good, _ = make_jsonl(tmp_path)
    (tmp_path / "e.parquet").write_bytes(os.urandom(4096))
    return [good, tmp_path / "e.parquet", "--batch-size", 1], ["cannot read", "e.parquet"]


def bad_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    return [tmp_path / "empty.jsonl"], ["no document", "skipped: none"]


def bad_empty_dir(tmp_path):
    (tmp_path / "in").mkdir()
    return [tmp_path / "in"], ["no .jsonl.gz / .jsonl / .parquet / .txt file", "skipped: none"]


def bad_dir_of_unknown_types(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.md").write_text(prose(0), encoding="utf-8")
    (tmp_path / "in" / "sub" / "b.csv").write_text(prose(1), encoding="utf-8")
    return [tmp_path / "in"], ["no .jsonl.gz", "2 other_type"]


def bad_unknown_named_type(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n", encoding="utf-8")
    return [tmp_path / "data.csv"], ["data.csv", "not a known type"]


def bad_every_line_skipped(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json", {"body": prose(0)}, {"text": 7}])
    return [path], ["no document", "1 bad_json, 2 no_text", "--text-field"]


@pytest.fixture(scope="module")
def existing_db(tmp_path_factory):
    """A corpus table that refused runs append to (and must leave as it was)."""
    tmp = tmp_path_factory.mktemp("existing")
    path, _ = make_jsonl(tmp)
    ingest([str(path)], str(tmp / "db"), "corpus", "byte")
    return tmp / "db", table_state(tmp / "db")


@pytest.mark.parametrize("make", [
    bad_missing, bad_corrupt_gz, bad_corrupt_parquet, bad_not_utf8, bad_corrupt_after_a_good_file,
    bad_empty_file, bad_empty_dir, bad_dir_of_unknown_types, bad_unknown_named_type,
    bad_every_line_skipped])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, existing_db, make):
    """Into a db that does not exist yet (no directory may be left behind), then appended
    to an existing table (which must keep its version and rows)."""
    args, fragments = make(tmp_path)
    line = main_error(capsys, *args, "--db", tmp_path / "new" / "db")
    for fragment in fragments:
        assert fragment in line
    assert not (tmp_path / "new").exists()
    db, state = existing_db
    assert main_error(capsys, *args, "--db", db, "--mode", "append") == line.replace(
        str(tmp_path / "new" / "db"), str(db))
    assert table_state(db) == state


def test_a_failed_write_removes_the_table_directory_it_created(tmp_path, capsys):
    db = tmp_path / "db"
    first, texts = make_jsonl(tmp_path)
    ingest([str(first)], str(db), "other", "byte")
    args = bad_corrupt_after_a_good_file(tmp_path)[0]
    main_error(capsys, *args, "--db", db)
    assert sorted(os.listdir(db)) == ["other.lance"]
    assert table_state(db, "other")[1] == len(texts)


def path_too_long_to_open(top):
    """Nested directories under `top` whose deepest path is longer than PATH_MAX: made one
    level at a time relative to the last, so that even root cannot list the deepest one."""
    fd, depth = os.open(top, os.O_RDONLY), 0
    try:
        while len(str(top)) + depth * 251 < os.pathconf(top, "PC_PATH_MAX"):
            os.mkdir("d" * 250, dir_fd=fd)
            deeper = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd, depth = deeper, depth + 1
    finally:
        os.close(fd)
    return os.path.join(top, *["d" * 250] * depth)


def test_an_input_walk_that_meets_what_nobody_can_read_ends_in_one_line(tmp_path, capsys):
    """Root reads files whatever their mode, so these are failures no user escapes: a
    .jsonl name that is a symlink loop, and a directory deeper than PATH_MAX."""
    (tmp_path / "in").mkdir()
    make_jsonl(tmp_path / "in")
    (tmp_path / "in" / "loop.jsonl").symlink_to("loop.jsonl")
    line = main_error(capsys, tmp_path / "in", "--db", tmp_path / "db")
    assert f"cannot read {tmp_path / 'in' / 'loop.jsonl'}" in line and "symbolic links" in line, line
    (tmp_path / "in" / "loop.jsonl").unlink()

    (tmp_path / "in" / "deep").mkdir()
    deepest = path_too_long_to_open(tmp_path / "in" / "deep")
    line = main_error(capsys, tmp_path / "in", "--db", tmp_path / "db")
    assert line == f"error: cannot read directory {deepest}: File name too long"
    assert not (tmp_path / "db").exists()


def test_unreadable_file_and_directory(tmp_path, capsys):
    """The everyday case of the test above, where the user is not root."""
    path, _ = make_jsonl(tmp_path)
    (tmp_path / "in" / "locked").mkdir(parents=True)
    try:
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("this user reads files whatever their mode (root)")
        assert "cannot read" in main_error(capsys, path, "--db", tmp_path / "db")
        (tmp_path / "in" / "locked").chmod(0)
        assert "cannot read directory" in main_error(capsys, tmp_path / "in", "--db", tmp_path / "db")
    finally:
        path.chmod(0o644)
        (tmp_path / "in" / "locked").chmod(0o755)
    assert not (tmp_path / "db").exists()


def test_db_that_is_a_file(tmp_path, capsys):
    path, _ = make_jsonl(tmp_path)
    (tmp_path / "db").write_text("not a database", encoding="utf-8")
    assert "is a file, not a LanceDB directory" in main_error(capsys, path, "--db", tmp_path / "db")
    assert "cannot be created" in main_error(capsys, path, "--db", tmp_path / "db" / "sub")
    assert (tmp_path / "db").read_text(encoding="utf-8") == "not a database"


def test_bad_table_name_and_unwritable_db(tmp_path, capsys):
    path, _ = make_jsonl(tmp_path)
    line = main_error(capsys, path, "--db", tmp_path / "db", "--table", "a/b")
    assert "--table 'a/b'" in line and "Invalid table name" in line
    assert not (tmp_path / "db").exists()
    if os.path.isdir("/proc/self"):  # not even root can make a directory there
        assert "cannot write table" in main_error(capsys, path, "--db", "/proc/self/lancedb")


# ----------------------------------------------------------------------------- demo, hf tokenizer

@pytest.fixture(scope="module")
def demo_tables(tmp_path_factory):
    """The demo corpus built twice, once through the CLI and once through build_demo."""
    db = tmp_path_factory.mktemp("demo")
    proc = run_cli("--demo", "--db", db, "--table", "a")
    assert proc.returncode == 0, proc.stderr
    summary = build_demo(str(db), "b", "byte")
    return read_table(db, "a"), read_table(db, "b"), summary, proc.stdout


def test_demo_builds_thousands_of_docs_deterministically(demo_tables):
    a, b, summary, stdout = demo_tables
    assert a.equals(b)
    assert 3000 <= a.num_rows <= 20000 and summary["docs"] == a.num_rows
    lines = stdout.splitlines()
    assert lines[0].startswith(f"wrote {a.num_rows} docs") and lines[0].endswith(" tokens/s")
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("main process while"))
    scores = a.column("score").to_pylist()
    assert sum(s >= 1.0 for s in scores) > 0.9 * len(scores)  # stdlib docs are mostly good text
    assert 0 < a.column("split").to_pylist().count("val") < 0.1 * a.num_rows
    assert_corpus(a.slice(0, 200), a.column("text").to_pylist()[:200])


@pytest.fixture(scope="module")
def bpe_spec(tmp_path_factory):
    """`hf:DIR` of a small BPE tokenizer trained on the test prose and saved locally."""
    spec = f"hf:{tmp_path_factory.mktemp('bpe') / 'tok'}"
    save_bpe(spec[3:], [prose(i) for i in range(40)], ["[SEP]"], sep_token="[SEP]")
    return spec


def test_hf_tokenizer_from_a_local_directory(tmp_path, bpe_spec):
    texts = [prose(i) for i in range(40)]
    spec = bpe_spec
    tok = load_tokenizer(spec)

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    summary = ingest([str(path)], str(tmp_path / "db"), "corpus", spec)
    tbl = read_table(tmp_path / "db")
    ids = tbl.column("input_ids").to_pylist()
    assert summary["docs"] == len(texts) and summary["tokens"] == sum(map(len, ids))
    assert sum(map(len, ids)) < sum(map(len, texts))  # BPE merges: fewer tokens than bytes
    for text, row in zip(texts, ids):
        assert tok.decode(row) == text
        assert tok.eos_token_id not in row and tok.pad_token_id not in row


# ----------------------------------------------------------------------------- tokenizer on the table

def test_the_table_records_its_tokenizer(tmp_path, capsys, bpe_spec):
    """Create and overwrite record the tokenizer, append keeps it, and an append with
    other ids is refused before writing; the same tokenizer from another path is not."""
    db, path = tmp_path / "db", make_jsonl(tmp_path)[0]
    ingest([str(path)], str(db), "corpus", "byte")
    byte = {"tokenizer": "byte", "vocab_size": 258, "eos_id": 256, "pad_id": 257}
    assert table_tokenizer(lancedb.connect(str(db)).open_table("corpus")) == byte
    ingest([str(make_jsonl_gz(tmp_path)[0])], str(db), "corpus", "byte", mode="append")
    assert table_tokenizer(lancedb.connect(str(db)).open_table("corpus")) == byte

    bpe = load_tokenizer(bpe_spec)
    ingest([str(path)], str(db), "corpus", bpe_spec, mode="overwrite")
    recorded = {"tokenizer": bpe_spec, "vocab_size": bpe.vocab_size, "eos_id": bpe.eos_token_id,
                "pad_id": bpe.pad_token_id}
    assert table_tokenizer(lancedb.connect(str(db)).open_table("corpus")) == recorded

    state = table_state(db)
    line = main_error(capsys, path, "--db", db, "--mode", "append", "--tokenizer", "byte")
    assert f"was tokenized with '{bpe_spec}' (vocab {bpe.vocab_size}" in line
    assert "'byte' has vocab 258" in line and line.endswith(f"pass --tokenizer {bpe_spec}")
    assert table_state(db) == state

    copy = shutil.copytree(bpe_spec[3:], tmp_path / "same-tokenizer")
    ingest([str(make_jsonl_gz(tmp_path)[0])], str(db), "corpus", f"hf:{copy}", mode="append")
    tbl = lancedb.connect(str(db)).open_table("corpus")
    assert table_tokenizer(tbl) == recorded and tbl.version == state[0] + 1
    assert tbl.schema.remove_metadata().equals(CORPUS_SCHEMA)


def test_append_to_a_table_that_records_no_tokenizer(tmp_path):
    """Tables made by other tools carry no metadata: appending is allowed, unchecked."""
    db = lancedb.connect(str(tmp_path / "db"))
    row = pa.table({"id": [0], "text": ["x"], "input_ids": [[120]], "n_tokens": [1],
                    "score": [2.0], "is_dup": [False], "split": ["train"]})
    db.create_table("corpus", row.cast(LEGACY_SCHEMA))
    summary = ingest([str(make_jsonl(tmp_path)[0])], str(tmp_path / "db"), "corpus", "byte",
                     mode="append")
    tbl = db.open_table("corpus")
    assert summary["docs"] == 5 and tbl.count_rows() == 6 and table_tokenizer(tbl) is None
