"""build_packed_datasets.py: the same blocks in four formats, each read back with its own
library and checked against the manifest and against the corpus it was packed from."""

import hashlib
import json
import os

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import build_packed_datasets
from blocks_loaders import FORMATS, read_manifest
from common import LEGACY_SCHEMA, TRAIN_FILTER, MultisetDigest, UserError, block_hashes, load_tokenizer
from conftest import BLOCKS_SEQ_LEN, assert_user_error, run_script, save_bpe

SHARED_KEYS = ("num_blocks", "seq_len", "dtype", "tokenizer", "vocab_size", "eos_id", "pad_id",
               "seed", "source", "content_hash", "multiset_hash")


def read_back(out, fmt):
    """Every block of one format directory in stored order, read without the project's loaders."""
    path = out / fmt
    if fmt == "lance":
        table = lancedb.connect(str(path)).open_table("blocks").to_arrow()
        return table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(len(table), -1)
    if fmt == "mds":
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = StreamingDataset(local=str(path), shuffle=False, batch_size=1)
        blocks = np.stack([ds[i]["input_ids"] for i in range(ds.num_samples)])
        del ds
        return blocks
    manifest = read_manifest(str(path), fmt)
    return np.concatenate([
        pq.read_table(path / f["path"]).column("input_ids").combine_chunks().flatten().to_numpy()
        .reshape(f["num_blocks"], -1) for f in manifest["files"]])


def test_four_formats_hold_the_same_blocks_as_their_manifests_say(blocks_dir):
    manifests = {fmt: read_manifest(str(blocks_dir / fmt), fmt) for fmt in FORMATS}
    reference = read_back(blocks_dir, "parquet-seq")
    assert reference.shape == (manifests["lance"]["num_blocks"], BLOCKS_SEQ_LEN)
    for fmt, manifest in manifests.items():
        blocks = read_back(blocks_dir, fmt)
        assert blocks.dtype == np.int32 and np.array_equal(blocks, reference), fmt
        assert hashlib.blake2b(blocks.astype("<i4").tobytes(), digest_size=32).hexdigest() \
            == manifest["content_hash"], fmt
        digest = MultisetDigest()
        digest.add(block_hashes(blocks))
        assert (digest.count, digest.hexdigest()) == (manifest["num_blocks"], manifest["multiset_hash"])
        assert {k: manifest[k] for k in SHARED_KEYS} == {k: manifests["lance"][k] for k in SHARED_KEYS}


def test_blocks_are_the_training_documents_joined_by_eos_in_one_seeded_order(blocks_dir, demo_db):
    """Cut at EOS, the blocks give back whole training documents, each at most once, in a
    shuffled order; only the tail that does not fill a block is left out."""
    tok = load_tokenizer("byte")
    manifest = read_manifest(str(blocks_dir / "lance"), "lance")
    where = f"NOT is_dup AND score >= 1.0 AND ({TRAIN_FILTER})"
    assert manifest["source"]["filter"] == where
    table = lancedb.connect(demo_db).open_table("corpus")
    docs = table.search().where(where).select(["id", "input_ids"]).limit(table.count_rows(where)).to_arrow()
    by_tokens = {tuple(ids): i for i, ids in zip(docs.column("id").to_pylist(),
                                                  docs.column("input_ids").to_pylist())}
    stream = read_back(blocks_dir, "lance").reshape(-1)
    assert tok.pad_token_id not in stream
    cuts = np.flatnonzero(stream == tok.eos_token_id)
    pieces = np.split(stream, cuts + 1)
    whole, tail = pieces[:-1], pieces[-1]
    ids = [by_tokens[tuple(piece[:-1].tolist())] for piece in whole]  # KeyError: not a training doc
    assert len(set(ids)) == len(ids)
    assert ids != sorted(ids)  # shuffled, not storage order
    left_out = manifest["source"]["tokens"] - manifest["num_blocks"] * BLOCKS_SEQ_LEN
    assert 0 <= left_out < BLOCKS_SEQ_LEN
    # missing: the document cut at the end, and those wholly in the left-out tail (each of
    # at least 50 characters, prepare_data's --min-chars, plus its EOS)
    assert len(by_tokens) - len(ids) <= 1 + left_out // 51
    assert any(doc[:len(tail)] == tuple(tail.tolist()) for doc in by_tokens)  # the tail starts a doc


def test_parquet_layout_is_the_documented_one(blocks_dir):
    for fmt, per_group in (("parquet-random", 1), ("parquet-seq", 300)):
        manifest = read_manifest(str(blocks_dir / fmt), fmt)
        assert manifest["row_group_blocks"] == per_group
        assert len(manifest["files"]) > 1 and all(f["num_blocks"] <= 10_000 for f in manifest["files"][:-1])
        for f in manifest["files"]:
            meta = pq.ParquetFile(blocks_dir / fmt / f["path"]).metadata
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            assert sum(sizes) == f["num_blocks"]
            assert all(n == per_group for n in sizes[:-1]) and 0 < sizes[-1] <= per_group
            column = meta.row_group(0).column(0)
            assert column.compression == "UNCOMPRESSED" and not column.is_stats_set


def test_same_seed_same_blocks_other_seed_other_order(demo_db, tmp_path, blocks_dir):
    again = build_packed_datasets.build(demo_db, "corpus", str(tmp_path / "a"), formats=["parquet-seq"],
                                        seq_len=BLOCKS_SEQ_LEN)["parquet-seq"]
    other = build_packed_datasets.build(demo_db, "corpus", str(tmp_path / "b"), formats=["parquet-seq"],
                                        seq_len=BLOCKS_SEQ_LEN, seed=7)["parquet-seq"]
    first = read_manifest(str(blocks_dir / "lance"))
    assert again["content_hash"] == first["content_hash"]
    assert other["content_hash"] != first["content_hash"]
    assert other["num_blocks"] == first["num_blocks"] > 0


def test_existing_output_is_refused_and_replaced_only_with_overwrite(demo_db, tmp_path):
    out = tmp_path / "out"
    args = ["--db", demo_db, "--table", "corpus", "--out", out, "--formats", "parquet-seq,lance",
            "--seq-len", "256"]
    first = run_script("build_packed_datasets.py", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("built ") and "content hash" in first.stdout
    before = (out / "lance" / "manifest.json").read_text()

    refused = run_script("build_packed_datasets.py", *args, "--seed", "5", cwd=tmp_path)
    assert_user_error(refused, "already exists", "--overwrite")
    assert (out / "lance" / "manifest.json").read_text() == before

    replaced = run_script("build_packed_datasets.py", *args, "--seed", "5", "--overwrite", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    after = json.loads((out / "lance" / "manifest.json").read_text())
    assert after["seed"] == 5 and after["content_hash"] != json.loads(before)["content_hash"]
    assert sorted(os.listdir(out)) == ["lance", "parquet-seq"]  # no staging or old copies left


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    """A table whose n_tokens overstates its token lists makes the packer run dry: the build
    stops with one line and no format directory, finished or partial, is left in OUT."""
    tok = load_tokenizer("byte")
    ids = tok.encode([f"document number {i} " * 5 for i in range(40)])
    table = pa.table({
        "id": pa.array(range(40), pa.int64()), "text": ["x"] * 40,
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "n_tokens": pa.array([len(x) * 3 for x in ids], pa.int32()),
        "score": pa.array([2.0] * 40, pa.float32()),
        "is_dup": [False] * 40, "split": ["train"] * 40}, schema=LEGACY_SCHEMA)
    lancedb.connect(str(tmp_path / "db")).create_table("corpus", table)
    out = tmp_path / "out"
    proc = run_script("build_packed_datasets.py", "--db", tmp_path / "db", "--table", "corpus",
                      "--out", out, "--seq-len", "64", cwd=tmp_path)
    assert_user_error(proc, "n_tokens", "disagrees")
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.parametrize("flags,fragment", [
    (["--formats", "lance,zip"], "--formats takes"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--seq-len", "100000000"], "not one 100000000-token block"),
    (["--random-row-group-blocks", "0"], "--random-row-group-blocks must be at least 1"),
    (["--db", "nowhere"], "no LanceDB database"),
])
def test_bad_arguments_are_one_line_errors(demo_db, tmp_path, flags, fragment):
    proc = run_script("build_packed_datasets.py", "--db", demo_db, "--out", tmp_path / "out", *flags,
                      cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_another_tokenizer_than_the_tables_is_refused(demo_db, tmp_path):
    import build_packed_datasets

    save_bpe(tmp_path / "bpe", ["some text to learn merges from"] * 5, ["[SEP]"], sep_token="[SEP]")
    with pytest.raises(UserError, match="was tokenized with 'byte'.*pass --tokenizer byte"):
        build_packed_datasets.build(demo_db, "corpus", str(tmp_path / "out"), seq_len=64,
                                    tokenizer_spec=f"hf:{tmp_path / 'bpe'}")
    assert not (tmp_path / "out").exists()
