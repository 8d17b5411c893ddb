"""bench/loader_memory.py end to end in --quick (no timing asserted): every path measured, the
bounded lance paths reading far less ahead than the unbounded ones, and its usage errors."""

import json

import pytest

from conftest import assert_user_error, run_script

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

LANCE = ("lance-docs", "lance-rows", "lance")
PATHS = {f"{p} {b}" for p in LANCE for b in ("bounded", "unbounded")} | {
    "lance-docs x2 workers bounded", "mosaic", "parquet-random", "parquet-seq"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("loader_memory")
    out = cwd / "x.json"
    # Smaller than --quick where the tests check that each part runs and reports, not its
    # figures: start-up at two sizes 10x apart, 10x smaller, on one split count (each size x
    # split count x path is one process); 200,000 tokens per path at a third of the pace:
    # 2 s of consuming, 8 RSS samples, of which a loaded machine's sampler still takes the 3
    # a slope needs (at --quick's pace and half its tokens, one path got 2 in a CI run);
    # 4,000-row epochs at the boundary. About half its time.
    proc = run_script("bench/loader_memory.py", "--quick", "--startup-rows", "2000,20000", "--startup-splits", "8",
                      "--tokens", "200000", "--tokens-per-s", "100000", "--boundary-rows", "4000", "--out", out,
                      cwd=cwd, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text()), cwd


def test_every_path_consumes_its_tokens_at_the_pace_and_is_sampled(quick):
    proc, data, cwd = quick
    assert {"machine", "settings", "memory", "startup"} <= data.keys() and data["complete"] is True
    settings = data["settings"]
    runs = {r["name"]: r for r in data["memory"]}
    assert set(runs) == PATHS
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error"), r.get("traceback"))
        assert r["tokens"] >= settings["tokens"] and r["tokens_per_s"] > 0, name
        assert 0 < r["baseline_rss_mib"] <= r["peak_rss_mib"] and r["peak_pss_mib"] > 0, name
        assert r["rss_mib_per_mtoken"] is not None and len(r["trace"]) >= 3, name
        assert r["trace"][-1]["tokens"] > 0, name
        assert name in proc.stdout
    assert (cwd / "x.png").stat().st_size > 0
    assert "fetched / consumed / total rows" in proc.stdout


def test_bounded_read_ahead_is_far_below_lancedbs_own(quick):
    _, data, _ = quick
    runs = {r["name"]: r for r in data["memory"]}
    for path in LANCE:
        bounded, unbounded = runs[f"{path} bounded"], runs[f"{path} unbounded"]
        assert bounded["rows_total"] == unbounded["rows_total"] > 0, path
        # The consumer is slower than the loader: unbounded, lancedb reads the epoch ahead.
        assert 3 * bounded["peak_read_ahead_rows"] < unbounded["peak_read_ahead_rows"], (path, bounded, unbounded)
        assert bounded["rows_fetched"] < 0.6 * bounded["rows_total"], (path, bounded["rows_fetched"])
        assert bounded["rows_consumed"] <= bounded["rows_fetched"], path
        assert 0 < bounded["peak_buffered_mib"], path
    workers = runs["lance-docs x2 workers bounded"]
    assert 0 < workers["peak_read_ahead_rows"] < runs["lance-docs unbounded"]["peak_read_ahead_rows"] / 3


def test_startup_covers_sizes_splits_and_paths(quick):
    proc, data, _ = quick
    settings = data["settings"]
    got = {(r["rows"], r["splits"], r["impl"], r["path"]) for r in data["startup"]}
    for rows in settings["startup_rows"]:
        for splits in settings["startup_splits"]:
            assert (rows, splits, "build", None) in got
            for path in ("rows", "packed"):
                assert {(rows, splits, "bounded", path), (rows, splits, "lancedb", path)} <= got
    for r in data["startup"]:
        assert "error" not in r, r
        key = "build_s" if r["impl"] == "build" else "first_batch_s"
        assert r[key] > 0 and r["peak_rss_mib"] >= r["rss_before_mib"] > 0, r
        if r["impl"] != "build":
            assert r["dataset"] == ("BoundedStreamingDataset" if r["impl"] == "bounded" else "StreamingDataset")
    assert "bounded first s" in proc.stdout


def test_an_epoch_boundary_is_measured_beside_the_stated_bound(quick):
    proc, data, _ = quick
    assert [r["workers"] for r in data["boundary"]] == [0, 2]
    for r in data["boundary"]:
        assert "error" not in r, r
        assert r["overlap_peak_rss_mib"] >= r["first_batch_rss_mib"] > 0 and r["overlap_s"] >= 0, r
        assert "while one epoch drains and the next starts" in r["line"], r
    assert data["boundary"][1]["processes_overlap"] > data["boundary"][0]["processes_overlap"]
    assert "epoch boundary" in proc.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--budget-mb", "2"], "must be at least 10x --budget-mb"),
    (["--skip-memory", "--skip-startup", "--skip-boundary"], "leave nothing to run"),
    (["--nope"], "unrecognized arguments"),
])
def test_usage_mistakes_are_one_line_errors(tmp_path, args, fragment):
    proc = run_script("bench/loader_memory.py", "--quick", "--out", tmp_path / "x.json", *args, cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert not (tmp_path / "x.json").exists()
