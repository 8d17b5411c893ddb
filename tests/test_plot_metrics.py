"""plot_metrics.py on metrics files shaped like train.py --metrics-file's: resumed runs,
torn last lines, unknown kinds, and the mistakes a user can make on the command line."""

import json

import matplotlib.image
import pytest

import plot_metrics
from conftest import assert_user_error, run_script

TOKENS_PER_STEP = 8192
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def start(resumed_from_step=0, world_size=2, t=1_700_000_000.0):
    return {"kind": "start", "time": t, "model": "tiny", "params": 834_000, "world_size": world_size,
            "global_batch": 16, "seq_len": 512, "tokens_per_step": TOKENS_PER_STEP,
            "blocks_mode": "off", "resumed_from_step": resumed_from_step}


def train(step, loss, mfu=None):
    return {"kind": "train", "time": 1.7e9 + step, "step": step, "epoch": 0, "loss": loss, "lr": 6e-4,
            "tokens_per_s": 12_000.0 + step, "mfu": mfu, "tokens_seen": step * TOKENS_PER_STEP,
            "loader": {"unscanned_rows": 10, "raw_queue_depth": 1, "prefetch_queue_depth": 2,
                       "consumed_rows": step * 16, "fetch_s": 0.1, "transform_s": 0.2}}


def evaluation(step, val_loss):
    return {"kind": "eval", "time": 1.7e9 + step, "step": step, "epoch": 0,
            "tokens_seen": step * TOKENS_PER_STEP, "val_loss": val_loss}


def write_jsonl(path, records, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def resumed_run(path, mfu=None):
    """Steps 10-50, a crash, a resume from the step-20 checkpoint that redoes step 30 with
    another loss and gets to 40 (the lost attempt's 50 is not part of the run), then a
    crash mid-line."""
    return write_jsonl(path, [
        start(),
        train(10, 5.0, mfu), train(20, 4.5, mfu), evaluation(20, 4.6), train(30, 4.2, mfu),
        evaluation(30, 4.3), train(50, 4.0, mfu),
        start(resumed_from_step=20, world_size=4),
        train(30, 4.1, mfu), {**train(40, 3.9, mfu), "new_field": [1, 2]},
        {"kind": "grad_norms", "step": 40, "norm": 1.0},  # a kind from a newer train.py
        evaluation(40, None), evaluation(40, 3.95),
    ], tail='\n[1, 2]\n{"kind": "train", "step": 50, "lo')


def test_load_metrics_last_record_wins_and_torn_lines_are_skipped(tmp_path):
    m = plot_metrics.load_metrics(resumed_run(tmp_path / "run.jsonl"))
    assert [r["step"] for r in m["train"]] == [10, 20, 30, 40]
    assert [r["loss"] for r in m["train"]] == [5.0, 4.5, 4.1, 3.9]  # the resume's step 30
    assert [(r["step"], r["val_loss"]) for r in m["eval"]] == [(20, 4.6), (40, 3.95)]
    assert [s["resumed_from_step"] for s in m["starts"]] == [0, 20]
    assert plot_metrics.resume_steps(m) == [20]
    assert plot_metrics.tokens_at(m, 20) == 20 * TOKENS_PER_STEP


def test_format_count():
    assert [plot_metrics.format_count(n) for n in (0, 512, 1_200_000, 3.4e9, 12_345)] == \
        ["0", "512", "1.2M", "3.4B", "12.3K"]


def test_runs_sharing_a_stem_are_told_apart_by_their_start_records(tmp_path):
    paths = [tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl", tmp_path / "c.jsonl"]
    runs = [{"starts": [start(world_size=1)]}, {"starts": [start(world_size=4)]}, {"starts": []}]
    assert plot_metrics.run_labels(paths, runs) == ["metrics (1 rank)", "metrics (4 ranks)", "c"]
    assert plot_metrics.run_labels(paths[:2], runs[:1] * 2) == ["metrics #1", "metrics #2"]


def test_plot_two_runs_writes_a_png(tmp_path):
    a = resumed_run(tmp_path / "a" / "metrics.jsonl", mfu=0.41)
    b = write_jsonl(tmp_path / "b" / "metrics.jsonl",
                    [start(world_size=1)] + [train(s, 5.0 - s / 100) for s in range(10, 60, 10)])
    out = tmp_path / "runs.png"
    assert plot_metrics.plot([str(a), str(b)], str(out), title="two runs") == 4 + 5
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    height, width = matplotlib.image.imread(out).shape[:2]
    assert height > 0 and width > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "runs.png"]  # no temp file left


@pytest.mark.parametrize("case", ["missing file", "no train records", "no out dir", "no files"])
def test_user_errors_are_one_line_and_write_nothing(tmp_path, capsys, case):
    empty = write_jsonl(tmp_path / "empty.jsonl", [start()], tail='{"kind": "tra')
    out = tmp_path / "out.png"
    argv, fragment = {
        "missing file": ([str(tmp_path / "nope.jsonl"), "--out", str(out)], "nope.jsonl"),
        "no train records": ([str(empty), "--out", str(out)], "no train records"),
        "no out dir": ([str(empty), "--out", str(tmp_path / "nodir" / "x.png")], "nodir"),
        "no files": (["--out", str(out)], "no metrics files given"),
    }[case]
    with pytest.raises(SystemExit) as exit_info:
        plot_metrics.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_command_line(tmp_path):
    """As a user runs it: one summary line; a mistake is one `error:` line and no image."""
    run = resumed_run(tmp_path / "run.jsonl")
    proc = run_script("plot_metrics.py", run, "--out", "run.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "wrote run.png (1 run, 4 train points)"
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)

    proc = run_script("plot_metrics.py", "missing.jsonl", "--out", "missing.png", cwd=tmp_path)
    assert_user_error(proc, "missing.jsonl")
    assert not (tmp_path / "missing.png").exists()
