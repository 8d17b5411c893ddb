"""Every input mistake train.py can meet ends in one `error:` line, exit 2, and nothing written.

Run in-process (train.main) for speed: the UserError path is the same one a
subprocess takes, and tests/test_train.py checks it once as a real process.
"""

import lancedb
import pyarrow as pa
import pytest
import torch

import train
from common import LEGACY_SCHEMA, load_tokenizer
from conftest import save_bpe

FAST = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--log-every", "1",
        "--warmup-steps", "2", "--eval-batches", "1"]


def corpus(db, n_train=6, n_val=0, max_id=None, tokenizer="byte"):
    """A corpus table as another tool might write it (no tokenizer recorded)."""
    tok = load_tokenizer(tokenizer)
    texts = [f"document {i} says something about the sea and the weather." for i in range(n_train + n_val)]
    ids = tok.encode(texts)
    if max_id is not None:  # every document: the first batch holds it
        for doc in ids:
            doc[3] = max_id
    n = len(texts)
    table = pa.table({
        "id": pa.array(range(n), pa.int64()), "text": texts,
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "n_tokens": pa.array([len(x) for x in ids], pa.int32()),
        "score": pa.array([2.0] * n, pa.float32()), "is_dup": [False] * n,
        "split": ["train"] * n_train + ["val"] * n_val}, schema=LEGACY_SCHEMA)
    lancedb.connect(str(db)).create_table("corpus", table)
    return str(db)


def fails(capsys, argv, *fragments):
    """train.main(argv) exits 2 with one `error:` line holding every fragment; returns it."""
    with pytest.raises(SystemExit) as exit_info:
        train.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def small_db(tmp_path):
    return corpus(tmp_path / "db", n_train=6, n_val=2)


@pytest.fixture
def out(tmp_path):
    """Where a run would write: checkpoints and metrics must stay absent after an error."""
    ck, metrics = tmp_path / "ck", tmp_path / "m" / "run.jsonl"
    yield ["--ckpt-dir", ck, "--metrics-file", metrics]
    assert not ck.exists() and not metrics.parent.exists()


def test_missing_table(small_db, out, capsys):
    fails(capsys, ["--db", small_db, "--table", "nope", *FAST, *out], "'nope'")


@pytest.mark.parametrize("column", ["input_ids", "n_tokens", "score", "is_dup", "split"])
def test_missing_or_mistyped_column(tmp_path, out, capsys, column):
    corpus(tmp_path / "db")
    tbl = lancedb.connect(str(tmp_path / "db")).open_table("corpus")
    tbl.alter_columns({"path": column, "rename": f"{column}_renamed"})
    fails(capsys, ["--db", tmp_path / "db", *FAST, *out], column)


def test_wrong_column_type(tmp_path, out, capsys):
    schema = LEGACY_SCHEMA.set(LEGACY_SCHEMA.get_field_index("score"), pa.field("score", pa.string()))
    data = {"id": [0], "text": ["x"], "input_ids": [[1, 2]], "n_tokens": [2], "score": ["high"],
            "is_dup": [False], "split": ["train"]}
    lancedb.connect(str(tmp_path / "db")).create_table("corpus", pa.table(data, schema=schema))
    fails(capsys, ["--db", tmp_path / "db", *FAST, *out], "score", "a float")


def test_min_score_that_selects_nothing_names_the_best_score(small_db, out, capsys):
    fails(capsys, ["--db", small_db, *FAST, "--min-score", "50", *out],
          "no training rows pass", "best training score is 2.000", "--min-score")


def test_no_training_split_at_all(tmp_path, out, capsys):
    db = corpus(tmp_path / "db", n_train=0, n_val=4)
    fails(capsys, ["--db", db, *FAST, *out], "no non-duplicate rows with split = 'train'")


def test_eval_due_without_validation_rows(tmp_path, out, capsys):
    db = corpus(tmp_path / "db", n_train=6, n_val=0)
    fails(capsys, ["--db", db, *FAST, "--eval-every", "2", *out],
          "--eval-every 2: no validation rows pass", "--val-fraction")


def test_fewer_training_rows_than_splits(small_db, out, capsys):
    fails(capsys, ["--db", small_db, *FAST, "--batch-size", "8", *out],
          "only 6 training rows", "num_splits is 8")


@pytest.mark.parametrize("flags,fragment", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--num-splits", "3"], "must be a multiple of num_splits (3)"),
    (["--tokenizer", "hf:surely-not-a-cached-model"], "hf:surely-not-a-cached-model"),
    (["--blocks-per-epoch", "many", "--pack"], "--blocks-per-epoch must be an integer"),
    (["--doc-mask"], "--doc-mask needs --pack"),
])
def test_bad_flags(small_db, out, capsys, flags, fragment):
    fails(capsys, ["--db", small_db, *FAST, *flags, *out], fragment)


@pytest.mark.parametrize("flags,world_size,message", [
    (["--batch-size", "3", "--num-splits", "3"], 2, r"num_splits \(3\) must be divisible by the world size \(2\)"),
    (["--batch-size", "4", "--num-workers", "4", "--num-splits", "4"], 2,
     r"num_splits \(4\) must be divisible by world_size x num_workers \(2 x 4\)"),
])
def test_split_layout_must_divide_over_ranks_and_workers(flags, world_size, message):
    """Multi-rank rules, checked before any process group or worker starts (train.main
    leaves a run with workers by os._exit, so these call the check itself)."""
    with pytest.raises(train.UserError, match=message):
        train.check_args(train.parse_args(flags), world_size)


def test_token_ids_beyond_the_vocabulary_stop_before_the_model_sees_them(tmp_path, out, capsys):
    db = corpus(tmp_path / "db", max_id=4000)
    line = fails(capsys, ["--db", db, *FAST, "--steps", "2", *out], "token id 4000", "258-id vocabulary")
    assert "--tokenizer byte" in line


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 2-step run's checkpoint directory, on its own small corpus."""
    root = tmp_path_factory.mktemp("ckpt")
    db = corpus(root / "db", n_train=6, n_val=2)
    train.main(["--db", db, *FAST, "--steps", "2", "--ckpt-dir", str(root / "ck")])
    return db, root / "ck"


@pytest.mark.parametrize("content,fragment", [
    (None, "does not exist"),
    (b"", "cannot read checkpoint"),
    (b"this is not a checkpoint", "cannot read checkpoint"),
    ("truncated", "cannot read checkpoint"),
    ("foreign", "is not a checkpoint written by train.py"),
])
def test_resume_from_a_bad_file(checkpoint, tmp_path, out, capsys, content, fragment):
    db, ck = checkpoint
    path = tmp_path / "resume.pt"
    if content == "truncated":
        path.write_bytes((ck / "step_00000002.pt").read_bytes()[:2000])
    elif content == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    elif content is not None:
        path.write_bytes(content)
    fails(capsys, ["--db", db, *FAST, "--steps", "4", "--resume", path, *out], fragment)


@pytest.mark.parametrize("flags,fragment", [
    (["--model", "small"], "model='tiny'"),
    (["--seq-len", "64"], "seq_len=32"),
    (["--tokenizer", "BPE"], "tokenizer='byte'"),  # another vocabulary
])
def test_resume_into_another_model(checkpoint, tmp_path, out, capsys, flags, fragment):
    db, ck = checkpoint
    if "BPE" in flags:
        save_bpe(tmp_path / "bpe", ["text to learn a few merges from"] * 5, ["[SEP]"], sep_token="[SEP]")
        flags = ["--tokenizer", f"hf:{tmp_path / 'bpe'}"]
    fails(capsys, ["--db", db, *FAST, "--steps", "4", "--resume", ck / "step_00000002.pt", *flags, *out],
          "cannot resume", fragment)


def test_resume_auto_without_a_checkpoint(small_db, tmp_path, out, capsys):
    fails(capsys, ["--db", small_db, *FAST, "--resume", "auto", *out], "no complete checkpoint")


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(checkpoint, tmp_path, capsys):
    """A learning rate no model survives: the run stops at the first check after the loss
    goes NaN or inf, writes no checkpoint past it, and says which one is good."""
    db, ck = checkpoint
    work = tmp_path / "ck"
    work.mkdir()
    (work / "step_00000002.pt").write_bytes((ck / "step_00000002.pt").read_bytes())
    fails(capsys, ["--db", db, *FAST, "--steps", "20", "--ckpt-dir", work, "--ckpt-every", "2",
                   "--resume", "auto", "--lr", "1e30"],
          "NaN or inf", "step 2, is the last good one")
    assert sorted(p.name for p in work.iterdir()) == ["step_00000002.pt"]


def test_a_table_prepared_with_another_tokenizer(tmp_path, out, capsys):
    """prepare_data.py records its tokenizer on the table: training with another is refused
    before anything runs, naming the one to pass."""
    import prepare_data

    texts = [f"document {i} says something about the sea and the weather today." for i in range(30)]
    save_bpe(tmp_path / "bpe", texts, ["[SEP]"], sep_token="[SEP]")
    (tmp_path / "docs.txt").write_text("\n".join(texts))
    prepare_data.ingest([str(tmp_path / "docs.txt")], str(tmp_path / "db"), "corpus",
                        f"hf:{tmp_path / 'bpe'}", min_chars=10)
    capsys.readouterr()
    fails(capsys, ["--db", tmp_path / "db", *FAST, *out],
          "was tokenized with 'hf:", "--tokenizer 'byte' has vocab 258", "pass --tokenizer hf:")
