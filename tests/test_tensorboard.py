"""train.py --tensorboard on real runs, read back as TensorBoard reads it: the metrics
file's scalars at its steps, one curve across a resume, nothing written by a refused run."""

import json
import time

import lancedb
import numpy as np
import pyarrow as pa
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from common import LEGACY_SCHEMA, load_tokenizer
from conftest import assert_user_error, run_script

FAST = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--log-every", "2", "--eval-every", "3",
        "--eval-batches", "1", "--warmup-steps", "3"]
TRAIN_TAGS = {"train/loss": "loss", "train/lr": "lr", "train/tokens_per_s": "tokens_per_s",
              "train/data_wait": "data_wait", "train/tokens_seen": "tokens_seen", "train/epoch": "epoch"}


def corpus(db, max_id=None):
    """80 training and 8 validation rows, byte-tokenized; `max_id` put into every document
    makes the first batch hold a token id outside the vocabulary."""
    tok = load_tokenizer("byte")
    texts = [f"Document {i} tells how the river ran past mill number {i % 7} on a windy day." for i in range(88)]
    ids = tok.encode(texts)
    if max_id is not None:
        for doc in ids:
            doc[3] = max_id
    table = pa.table({
        "id": pa.array(range(88), pa.int64()), "text": texts,
        "input_ids": pa.array(ids, pa.list_(pa.int32())), "n_tokens": pa.array([len(x) for x in ids], pa.int32()),
        "score": pa.array([2.0] * 88, pa.float32()), "is_dup": [False] * 88,
        "split": ["train"] * 80 + ["val"] * 8}, schema=LEGACY_SCHEMA)
    lancedb.connect(str(db)).create_table("corpus", table)
    return str(db)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("tb") / "db")


def train_run(db, ckpt_dir, *flags):
    train.main(["--db", db, *FAST, "--ckpt-dir", str(ckpt_dir), *map(str, flags)])


def scalars(directory):
    """tag -> [(step, value, wall_time)] as TensorBoard's reader draws them, every point kept."""
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_float32(x):
    """A value as an event file stores a scalar."""
    return float(np.float32(x))


def attempts(metrics_file):
    """The records of each run that wrote the metrics file, split at its start records."""
    runs = []
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "start":
            runs.append([])
        else:
            runs[-1].append(record)
    return runs


def drawn(curves, tag, records, field):
    """The (step, value) points of `tag`, and those of the records of its kind (train, eval)."""
    kind = "eval" if tag.startswith("val/") else "train"
    return ([(step, value) for step, value, _ in curves[tag]],
            [(r["step"], as_float32(r[field])) for r in records if r["kind"] == kind])


def test_scalars_are_the_metrics_file_records_at_their_steps(db, tmp_path, capsys):
    tb, metrics = tmp_path / "tb", tmp_path / "metrics.jsonl"
    train_run(db, tmp_path / "ck", "--steps", "6", "--metrics-file", metrics, "--tensorboard", tb)
    assert f"tensorboard: {tb}\n" in capsys.readouterr().out
    curves = scalars(tb)
    assert set(curves) == {*TRAIN_TAGS, "val/loss"}  # no train/mfu or train/max_mem_gib: no peak, no CUDA
    [records] = attempts(metrics)
    for tag, field in TRAIN_TAGS.items():
        points, expected = drawn(curves, tag, records, field)
        assert [step for step, _ in points] == [2, 4, 6]  # --log-every 2
        assert points == expected, tag
    points, expected = drawn(curves, "val/loss", records, "val_loss")
    assert [step for step, _ in points] == [3, 6]  # --eval-every 3; the end of the run falls on one
    assert points == expected


def test_a_resumed_run_draws_each_step_once(db, tmp_path, capsys):
    """The lost attempt trains to 12 but its last checkpoint is at 6; the resumed one trains
    7..12 again. Its steps are the ones drawn, the lost attempt's 7..12 are not, and
    1..6 stay those of the first attempt."""
    tb, metrics, ck = tmp_path / "tb", tmp_path / "metrics.jsonl", tmp_path / "ck"
    common = ["--steps", "12", "--ckpt-every", "6", "--keep-last", "0", "--metrics-file", metrics,
              "--tensorboard", tb]
    train_run(db, ck, *common)
    (ck / "step_00000012.pt").unlink()
    between = time.time()
    train_run(db, ck, *common, "--resume", "auto")
    assert "(epoch 0, opt step 6)" in capsys.readouterr().out
    lost, resumed = attempts(metrics)
    kept = [r for r in lost if r["step"] <= 6]

    curves = scalars(tb)
    assert len(list(tb.iterdir())) == 2  # an event file per attempt
    for tag, field in (*TRAIN_TAGS.items(), ("val/loss", "val_loss")):
        points, expected = drawn(curves, tag, kept + resumed, field)
        assert points == expected, tag
        assert all((wall_time > between) == (step > 6) for step, _, wall_time in curves[tag]), tag
    assert [step for step, _, _ in curves["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert [step for step, _, _ in curves["val/loss"]] == [3, 6, 9, 12]
    # the attempts really drew different points past 6 (their speed differs), so the check above tells them apart
    assert drawn(curves, "train/tokens_per_s", lost, "tokens_per_s")[1][3:] != \
        drawn(curves, "train/tokens_per_s", resumed, "tokens_per_s")[1]


def test_a_fresh_run_into_the_same_directory_replaces_the_curves(db, tmp_path):
    tb = tmp_path / "tb"
    train_run(db, tmp_path / "ck-old", "--steps", "8", "--tensorboard", tb)
    train_run(db, tmp_path / "ck-new", "--steps", "4", "--tensorboard", tb)
    curves = scalars(tb)
    assert [step for step, _, _ in curves["train/loss"]] == [2, 4]
    assert [step for step, _, _ in curves["val/loss"]] == [3, 4]


def test_no_event_file_without_the_flag(db, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # SummaryWriter's default directory would be ./runs
    train_run(db, tmp_path / "ck", "--steps", "2")
    out = capsys.readouterr().out
    assert "final: opt_step=2 " in out and "tensorboard: " not in out
    assert not list(tmp_path.rglob("*tfevents*"))


@pytest.mark.parametrize("refusal", ["flags", "first batch"])
def test_a_refused_run_leaves_no_event_file(tmp_path, capsys, refusal):
    """Refused by check_args, before anything is opened, or at the first batch, after the
    run's records are set up but before the first step is trained."""
    db = corpus(tmp_path / "db", max_id=4000 if refusal == "first batch" else None)
    flags = ["--doc-mask"] if refusal == "flags" else []
    with pytest.raises(SystemExit) as exit_info:
        train_run(db, tmp_path / "ck", "--steps", "2", "--tensorboard", tmp_path / "tb", *flags)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert ("token id 4000" if refusal == "first batch" else "--doc-mask needs --pack") in captured.err
    assert ("tensorboard: " in captured.out) == (refusal == "first batch")
    assert not (tmp_path / "tb").exists()


def test_a_missing_tensorboard_package_is_a_one_line_error(db, tmp_path):
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboard'\")\n")
    proc = run_script("train.py", "--db", db, *FAST, "--steps", "2", "--ckpt-dir", tmp_path / "ck",
                      "--tensorboard", tmp_path / "tb", cwd=tmp_path, env={"PYTHONPATH": str(shadow.parent)})
    assert_user_error(proc, "--tensorboard needs the tensorboard package", "pip install tensorboard")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "tb").exists()
