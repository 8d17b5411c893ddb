"""Tokenizers, table checks and atomic writes (common.py; storage.connect_table)."""

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import lancedb
import pyarrow as pa
import pytest
from tokenizers import Tokenizer as RawTokenizer

from common import (CORPUS_SCHEMA, ArgumentParser, Tokenizer, UserError, atomic_write, check_table_tokenizer,
                    load_tokenizer, table_tokenizer)
from conftest import REPO, save_bpe
from storage import connect_table

TEXTS = ["hello world, this is a tokenizer test.", "the quick brown fox jumps over the lazy dog"] * 20


def test_byte_round_trip_and_reserved_ids():
    tok = load_tokenizer("byte")
    text = "naïve café ☃ — tabs\tand\nnewlines"
    (ids,) = tok.encode([text])
    assert tok.decode(ids) == text
    assert max(ids) < 256
    assert (tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (256, 257, 258)
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text


def test_hf_local_dir_without_eos_or_pad_reserves_pad_and_uses_sep(tmp_path):
    n = save_bpe(tmp_path, TEXTS, ["[SEP]"], sep_token="[SEP]")
    tok = load_tokenizer(f"hf:{tmp_path}")
    sep = RawTokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("[SEP]")
    assert tok.eos_token_id == sep
    assert tok.pad_token_id == n  # a fresh id above every real token
    assert tok.vocab_size == n + 1
    texts = ["a document that mentions [SEP] literally", "ünïcödé text"]
    ids = tok.encode(texts)
    flat = [i for row in ids for i in row]
    assert tok.eos_token_id not in flat and tok.pad_token_id not in flat
    assert max(flat) < tok.vocab_size
    assert [tok.decode(row) for row in ids] == texts


def test_hf_pad_equal_to_eos_gets_its_own_id(tmp_path):
    n = save_bpe(tmp_path, TEXTS, ["<|endoftext|>"], eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert tok.pad_token_id == n and tok.pad_token_id != tok.eos_token_id


def test_hf_with_dedicated_pad_keeps_it(tmp_path):
    save_bpe(tmp_path, TEXTS, ["</s>", "<pad>"], eos_token="</s>", pad_token="<pad>")
    tok = load_tokenizer(f"hf:{tmp_path}")
    vocab = RawTokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab()
    assert (tok.eos_token_id, tok.pad_token_id) == (vocab["</s>"], vocab["<pad>"])
    (ids,) = tok.encode(["text with <pad> and </s> inside"])
    assert tok.pad_token_id not in ids and tok.eos_token_id not in ids


def test_hf_without_eos_or_sep_is_refused(tmp_path):
    save_bpe(tmp_path, TEXTS, [])
    with pytest.raises(UserError, match="neither an EOS nor a separator"):
        load_tokenizer(f"hf:{tmp_path}")


def test_hf_not_available_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError, match="nothing is downloaded"):
        load_tokenizer("hf:some-org/not-a-cached-model")
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(f"hf:{tmp_path}/missing-dir")


def test_unknown_tokenizer_spec():
    with pytest.raises(UserError, match="unknown tokenizer"):
        load_tokenizer("sentencepiece")


def write_table(db, schema, rows=2):
    data = {
        "id": pa.array(range(rows), pa.int64()),
        "text": ["x"] * rows,
        "input_ids": pa.array([[1, 2]] * rows, pa.list_(pa.int32())),
        "n_tokens": pa.array([2] * rows, pa.int32()),
        "score": pa.array([2.0] * rows, pa.float32()),
        "is_dup": [False] * rows,
        "split": ["train"] * rows,
        "digest": pa.array([bytes(16)] * rows, pa.binary(16)),
    }
    table = pa.table({f.name: pa.array(data[f.name]).cast(f.type) for f in schema}, schema=schema)
    lancedb.connect(str(db)).create_table("corpus", table)


def test_connect_table_accepts_the_corpus_schema(tmp_path):
    write_table(tmp_path / "db", CORPUS_SCHEMA)
    assert connect_table(str(tmp_path / "db"), "corpus").count_rows() == 2


def test_connect_table_errors(tmp_path):
    with pytest.raises(UserError, match="no LanceDB database"):
        connect_table(str(tmp_path / "nope"), "corpus")
    assert not (tmp_path / "nope").exists()  # checking must not create it
    write_table(tmp_path / "db", CORPUS_SCHEMA)
    with pytest.raises(UserError, match="table 'other' not found"):
        connect_table(str(tmp_path / "db"), "other")


@pytest.mark.parametrize("column", ["input_ids", "n_tokens", "score", "is_dup", "split"])
def test_connect_table_missing_column(tmp_path, column):
    write_table(tmp_path, pa.schema([f for f in CORPUS_SCHEMA if f.name != column]))
    with pytest.raises(UserError, match=f"no '{column}' column"):
        connect_table(str(tmp_path), "corpus")


@pytest.mark.parametrize("column,wrong", [("input_ids", pa.list_(pa.float32())),
                                          ("n_tokens", pa.string()), ("is_dup", pa.int32())])
def test_connect_table_wrong_type(tmp_path, column, wrong):
    schema = pa.schema([pa.field(f.name, wrong) if f.name == column else f for f in CORPUS_SCHEMA])
    write_table(tmp_path, schema)
    with pytest.raises(UserError, match=f"column '{column}'"):
        connect_table(str(tmp_path), "corpus")


def gpt2_like(spec, vocab_size=50258, eos=50256, pad=50257):
    """A Tokenizer with the given ids; the checks compare ids only, never encode."""
    return Tokenizer(spec, vocab_size, eos, pad, encode=lambda texts: [], decode=lambda ids: "")


GPT2_METADATA = {"tokenizer": "hf:gpt2", "vocab_size": "50258", "eos_id": "50256",
                 "pad_id": "50257"}


def ids_metadata(meta):
    """CORPUS_SCHEMA with `meta` on its input_ids field, where prepare_data records the tokenizer."""
    index = CORPUS_SCHEMA.get_field_index("input_ids")
    return CORPUS_SCHEMA.set(index, CORPUS_SCHEMA.field(index).with_metadata(meta))


def test_table_tokenizer_reads_the_input_ids_metadata(tmp_path):
    write_table(tmp_path / "plain", CORPUS_SCHEMA)
    assert table_tokenizer(lancedb.connect(str(tmp_path / "plain")).open_table("corpus")) is None
    write_table(tmp_path / "gpt2", ids_metadata(GPT2_METADATA))
    tbl = lancedb.connect(str(tmp_path / "gpt2")).open_table("corpus")
    assert table_tokenizer(tbl) == {"tokenizer": "hf:gpt2", "vocab_size": 50258,
                                    "eos_id": 50256, "pad_id": 50257}
    write_table(tmp_path / "bad", ids_metadata({**GPT2_METADATA, "eos_id": "?"}))
    with pytest.raises(UserError, match="malformed"):
        table_tokenizer(lancedb.connect(str(tmp_path / "bad")).open_table("corpus"))


def test_check_table_tokenizer_compares_ids_not_spec(tmp_path):
    write_table(tmp_path / "gpt2", ids_metadata(GPT2_METADATA))
    tbl = lancedb.connect(str(tmp_path / "gpt2")).open_table("corpus")
    where = "the table 'corpus' in DB"
    with pytest.raises(UserError) as e:
        check_table_tokenizer(tbl, load_tokenizer("byte"), where)
    assert str(e.value) == ("the table 'corpus' in DB was tokenized with 'hf:gpt2' (vocab 50258); "
                            "this run's --tokenizer 'byte' has vocab 258: pass --tokenizer hf:gpt2")
    with pytest.raises(UserError, match=r"\(vocab 50258, pad 50257\).*has vocab 50258, pad 7"):
        check_table_tokenizer(tbl, gpt2_like("hf:other", pad=7), where)
    check_table_tokenizer(tbl, gpt2_like("hf:/models/gpt2"), where)  # same ids, other path
    write_table(tmp_path / "plain", CORPUS_SCHEMA)
    check_table_tokenizer(lancedb.connect(str(tmp_path / "plain")).open_table("corpus"),
                          load_tokenizer("byte"), where)  # records nothing: unchecked


def test_common_does_not_import_storage():
    """storage imports common, never the other way round (no import cycle)."""
    code = "import sys, common; assert 'storage' not in sys.modules, 'common imported storage'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_argument_parser_mistakes_are_user_errors():
    p = ArgumentParser()
    p.add_argument("--n", type=int, required=True)
    with pytest.raises(UserError, match="--n"):
        p.parse_args([])
    with pytest.raises(UserError, match="invalid int value"):
        p.parse_args(["--n", "x"])


def record_fsyncs(monkeypatch):
    """Patch os.fsync and os.replace to log ("file" | "dir" | "replace") in call order."""
    log = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        log.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    def logged_replace(src, dst):
        log.append("replace")
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    return log


def test_atomic_write_syncs_the_data_then_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    log = record_fsyncs(monkeypatch)
    path = tmp_path / "out.txt"
    atomic_write(str(path), lambda tmp: Path(tmp).write_text("done"))
    assert path.read_text() == "done" and os.listdir(tmp_path) == ["out.txt"]
    assert log == ["file", "replace", "dir"]


def test_atomic_write_failure_is_a_user_error_and_leaves_nothing(tmp_path):
    path = tmp_path / "out.txt"

    def half(tmp):
        Path(tmp).write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError, match="cannot write .*No space left"):
        atomic_write(str(path), half)
    assert os.listdir(tmp_path) == []


def test_atomic_write_on_a_filesystem_that_cannot_sync_a_directory(tmp_path, monkeypatch):
    fsync = os.fsync

    def no_dir_sync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_dir_sync)
    atomic_write(str(tmp_path / "out.txt"), lambda tmp: Path(tmp).write_text("done"))
    assert (tmp_path / "out.txt").read_text() == "done"
