"""Tests for prepare_data.py: every input type, modes, dedup and split, bounded memory,
the quality score, user errors at the CLI, the stdlib demo corpus and an hf: tokenizer."""

import gzip
import json
import os
import subprocess
import tracemalloc

import lancedb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import CORPUS_SCHEMA, UserError, load_tokenizer
from conftest import REPO as ROOT
from conftest import assert_user_error, run_script
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


def test_bad_jsonl_lines_are_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": prose(0)}, "this is not json", "[1, 2, 3]", {"body": prose(1)}, {"text": 42},
        {"text": None}, "", {"text": "too short"}, {"text": prose(2)},
    ])
    summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte")
    assert summary["docs"] == 2
    assert summary["skipped"] == {"bad_json": 2, "no_text": 3, "short": 1}
    assert_corpus(read_table(tmp_path / "db"), [prose(0), prose(2)])


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


def test_memory_stays_bounded_and_the_run_is_one_commit(tmp_path):
    """Peak Python allocation while ingesting a ~10 MB jsonl stays far below its size.

    A batch of byte-tokenized text costs ~20x its size in Python objects (token lists,
    word lists), so batches of 5 docs of ~10 KB peak near 1 MB, while anything holding
    the input (or its tokens) at once would peak above the 10 MB of the file itself.
    """
    words = [w.strip(".,") for w in " ".join(PROSE).split()]
    texts = [f"{i} " + "-".join(words[(i * 7 + k) % len(words)] for k in range(2000))
             for i in range(1000)]
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in texts])
    size = os.path.getsize(path)
    assert size > 10_000_000
    load_tokenizer("byte")
    tracemalloc.start()
    try:
        summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte", batch_size=5)
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

def test_empty_input_is_a_user_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    proc = run_cli(tmp_path / "empty.jsonl", "--db", tmp_path / "db")
    assert_user_error(proc, "no document")
    assert not (tmp_path / "db").exists()


def test_unknown_explicit_file_type_is_a_user_error(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n", encoding="utf-8")
    proc = run_cli(tmp_path / "data.csv", "--db", tmp_path / "db")
    assert_user_error(proc, "data.csv")


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
    assert stdout.startswith(f"wrote {a.num_rows} docs") and len(stdout.splitlines()) == 1
    scores = a.column("score").to_pylist()
    assert sum(s >= 1.0 for s in scores) > 0.9 * len(scores)  # stdlib docs are mostly good text
    assert 0 < a.column("split").to_pylist().count("val") < 0.1 * a.num_rows
    assert_corpus(a.slice(0, 200), a.column("text").to_pylist()[:200])


def test_hf_tokenizer_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [prose(i) for i in range(40)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[SEP]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    spec = f"hf:{tmp_path / 'tok'}"
    PreTrainedTokenizerFast(tokenizer_object=tk, sep_token="[SEP]").save_pretrained(spec[3:])
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
