"""bench/: the loader and learning benchmarks end to end on a small corpus (no timing asserted), and the stdlib corpus."""

import itertools
import json
import math
from collections import Counter

import pytest

import build_packed_datasets
import prepare_data
from conftest import assert_user_error, run_script

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

MODES = {"lance-docs", "lance", "mosaic", "parquet-random", "parquet-seq", "lance-docs-unbounded",
         "lance-unbounded"}


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """An eighth of the demo corpus (the whole one makes every check epoch 8x longer)
    and its 128-token blocks in all four formats."""
    root = tmp_path_factory.mktemp("bench")
    db = str(root / "db")
    chunks = itertools.islice(prepare_data.demo_chunks(), 3)  # 48 stdlib files' docstrings
    prepare_data.write_corpus(chunks, db, "corpus", prepare_data.RowOptions("byte"), mode="create",
                              workers=1, skipped=Counter())
    build_packed_datasets.build(db, "corpus", str(root / "blocks"), seq_len=128)
    return root, db


def test_loaders_quick_measures_and_checks_every_path(blocks, tmp_path):
    root, db = blocks
    out = tmp_path / "x.json"
    proc = run_script("bench/loaders.py", "--blocks", root / "blocks", "--db", db, "--table", "corpus",
                      "--quick", "--workers", "1", "--out", out, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {"machine", "settings", "results"} <= data.keys()
    assert data["machine"]["logical_cores"] >= 1 and data["settings"]["batch_size"] == 32
    assert {r["mode"] for r in data["results"]} == MODES
    for r in data["results"]:
        assert r["tokens_per_s"] > 0 and r["runs"] and r["thread_ms"] >= 0, r["mode"]
        assert r["check"]["ok"] is True, (r["mode"], r["check"])
        assert f"check {r['mode']}: ok" in proc.stdout
    assert (tmp_path / "x.png").stat().st_size > 0
    assert "lance / mosaic:" in proc.stdout
    assert "lance-docs bounded at 256 MiB / unbounded:" in proc.stdout


def test_loader_step_measures_each_path_and_worker_count(blocks, tmp_path):
    """bench/loader_step.py end to end on a small corpus: every (path, workers) pair, an
    epoch boundary in each, the training thread's CPU and the process tree's memory."""
    root, db = blocks
    out = tmp_path / "step.json"
    proc = run_script("bench/loader_step.py", "--db", db, "--table", "corpus", "--paths", "rows,pack",
                      "--workers", "0,1", "--batch-size", "4", "--seq-len", "64", "--step-ms", "2",
                      "--epochs", "2", "--out", out, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["path"], r["workers"]) for r in results] == [("rows", 0), ("rows", 1), ("pack", 0), ("pack", 1)]
    for r in results:
        assert r["batches"] > 10 and len(r["boundary_s"]) == len(r["neighbours_s"]) == 1, r
        assert 0 < r["thread_ms"] and r["others_ms"] > 0 and 0 <= r["data_wait"] <= 1, r
        assert r["peak_rss_mib"] > 100 and r["step_slowdown"] > 0, r
        assert bool(r["worker_threads"]) == (r["workers"] > 0), r  # a worker's threads were seen
    assert "wrote " in proc.stdout


def test_loaders_without_blocks_is_a_one_line_error(tmp_path):
    proc = run_script("bench/loaders.py", "--blocks", tmp_path / "nowhere", "--out", tmp_path / "x.json",
                      cwd=tmp_path)
    assert_user_error(proc, "no blocks at")
    assert not (tmp_path / "x.json").exists()


def test_stdlib_corpus_writes_one_scored_line_per_source_file(tmp_path):
    out = tmp_path / "stdlib.jsonl"
    proc = run_script("bench/stdlib_corpus.py", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) > 100 and all(d["score"] == 2.0 and isinstance(d["text"], str) for d in lines)
    assert any("def " in d["text"] for d in lines)


def test_stdlib_corpus_into_a_missing_directory_is_a_one_line_error(tmp_path):
    proc = run_script("bench/stdlib_corpus.py", tmp_path / "nowhere" / "out.jsonl", cwd=tmp_path)
    assert_user_error(proc, "no directory", "nowhere")
    assert list(tmp_path.iterdir()) == []  # nothing written, no directory made


def test_learning_quick_trains_every_variant_on_the_same_budget(blocks, tmp_path):
    root, db = blocks
    out = tmp_path / "learning.json"
    proc = run_script("bench/learning.py", "--quick", "--db", db, "--table", "corpus", "--out", out,
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {"machine", "settings", "results", "recommendation"} <= data.keys()
    settings = data["settings"]
    assert settings["budget_positions"] == settings["steps"] * settings["batch_size"] * settings["seq_len"]
    results = {r["variant"]: r for r in data["results"]}
    assert list(results) == ["row", "pack", "pack+doc-mask"]
    for name, r in results.items():
        assert len(r["runs"]) == len(settings["seeds"]) == 1, name
        assert all(math.isfinite(run["val_loss"]) for run in r["runs"]), name
        assert r["val_loss_min"] <= r["val_loss_mean"] <= r["val_loss_max"] and r["tokens_per_s"] > 0, name
        assert r["real_tokens"] <= settings["budget_positions"], name
        assert f"{name} seed 1: val " in proc.stderr
    assert results["row"]["pad_share"] > results["pack"]["pad_share"] >= 0  # short documents pad their rows
    assert (tmp_path / "learning.png").stat().st_size > 0
    assert "val loss mean" in proc.stdout and "pad share" in proc.stdout
    assert f"recommendation: {data['recommendation']}" in proc.stdout


def test_ingest_measures_every_worker_count_the_ceiling_and_appends(tmp_path):
    out = tmp_path / "ingest.json"
    proc = run_script("bench/ingest.py", "--docs", 1500, "--tokenizers", "byte", "--workers", "1,2",
                      "--repeats", 1, "--append-rows", 5000, "--out", out, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (tmp_path / "ingest.png").stat().st_size > 0
    points = {r["workers"]: r for r in data["results"]}
    assert set(points) == {1, 2} and all(p["same_table"] for p in points.values())
    assert points[1]["docs"] == points[2]["docs"] > 0 and points[2]["tokens"] == points[1]["tokens"]
    assert points[2]["ceiling"]["processes"] == 2 and points[2]["ceiling"]["tokens"] == points[2]["tokens"]
    assert points[2]["main_process"]["wait_s"] >= 0 and points[1]["main_process"] is None
    assert [a["table_rows"] for a in data["appends"]] == [points[1]["docs"], 5000]
    assert all(a["summary"].startswith("wrote 100 docs") for a in data["appends"])


def test_fault_tolerance_quick_times_every_part_of_a_node_loss(tmp_path):
    """bench/fault_tolerance.py --quick: one node of two killed after its first checkpoint; the
    survivor's recovery in parts that add up, resumed at that checkpoint, its memory sampled."""
    out = tmp_path / "ft.json"
    work = tmp_path / "tmp"  # the temp dirs of the bench (and torch's): cold, so that TMPDIR is read afresh
    work.mkdir()
    proc = run_script("bench/fault_tolerance.py", "--quick", "--out", out, cwd=tmp_path, timeout=300,
                      env={"TMPDIR": str(work)}, cold=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    [result] = data["results"]
    assert (result["rows"], result["settings"]) == (20000, "fast") and len(result["runs"]) == 1
    [loss] = result["runs"]
    parts = [loss[k] for k in ("detection_s", "rerendezvous_s", "resume_s", "first_step_s")]
    assert all(p > 0 for p in parts) and math.isclose(sum(parts), loss["total_s"], rel_tol=1e-6), loss
    assert loss["resumed_step"] == loss["checkpoint_at_loss"] >= 5 and loss["survivor_peak_rss_mib"] > 100, loss
    assert not list(work.glob("ft-bench-*")) and "wrote " in proc.stdout  # its tables and nodes' files removed


def test_stop_timing_quick_times_a_stop(tmp_path):
    """bench/stop_timing.py --quick: one SIGTERM at a random moment of a run of 8-step epochs;
    the times from the signal to the checkpoint and to the exit, and what the run left behind
    (the case with workers is held to its bound in tests/test_preemption.py)."""
    out = tmp_path / "stop.json"
    work = tmp_path / "tmp"  # the bench's temp dirs: cold, so that TMPDIR is read afresh
    work.mkdir()
    proc = run_script("bench/stop_timing.py", "--quick", "--out", out, cwd=tmp_path, timeout=300,
                      env={"TMPDIR": str(work)}, cold=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = json.loads(out.read_text())["results"]
    [trial] = result["runs"]
    assert result["case"] == "epoch-end" and trial["exit_code"] == 0, trial
    assert 0 < trial["saved_s"] <= trial["exit_s"] and trial["bound_s"] > 1 and trial["save_s"] >= 0, trial
    assert trial["left_after_linger"] == [], trial
    assert not list(work.glob("stop-bench-*")) and "wrote " in proc.stdout
