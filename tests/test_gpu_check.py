"""bench/gpu_check.py: its --dry-run end to end on the CPU (1 rank, then 2 gloo ranks under
torchrun; no timing asserted), and its refusals."""

import json

import pytest
import torch

from conftest import assert_user_error, run_script


def test_dry_run_measures_one_then_two_ranks(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_script("bench/gpu_check.py", "--dry-run", "--out", "gpu.json", "--workdir", "work",  # from cwd
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, *rows = [line for line in proc.stdout.splitlines() if line.strip()][:9]
    assert header.split() == ["variant", "loader", "cpus", "tok/s", "tok/s/cpu", "scaling", "vs_ceiling", "MFU",
                              "data_wait", "loader_ms", "peak", "mem", "compile", "s", "epochs", "wall", "s"]
    runs = [("plain", "fed", 1), ("plain", "none", 1), ("plain", "fed", 2), ("doc-mask", "fed", 1),
            ("doc-mask", "none", 1), ("doc-mask", "fed", 2), ("deterministic", "fed", 1), ("deterministic", "none", 1)]
    assert [(row.split()[0], row.split()[1], int(row.split()[2])) for row in rows] == runs
    assert "wrote gpu.json" in proc.stdout
    assert "building the demo corpus" in proc.stderr  # in the workdir, once, before every run

    data = json.loads(out.read_text())
    assert data["settings"]["dry_run"] is True and data["settings"]["steps"] == 6
    assert data["settings"]["db"] == str(tmp_path / "work" / "data" / "lancedb")
    assert {"torch", "cuda", "gpu", "gpu_count", "gpu_bf16_peak_tflops"} <= data["machine"].keys()
    correctness = data["correctness"]  # tests/test_cuda.py ran first, and skips on the CPU with its reason
    assert correctness["passed"] == correctness["failed"] == 0 and correctness["skipped"] >= 6, correctness
    assert "correctness: 0 passed, 0 failed" in proc.stderr and "no CUDA device" in proc.stderr
    results = data["results"]
    assert [(r["variant"], r["loader"], r["devices"]) for r in results] == runs
    for r in results:
        assert r["steps"] == 6 and r["records_used"] == 4, r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / r["devices"])
        assert 0 <= r["data_wait"] <= 1 and r["compile_s"] >= 0, r
        assert r["mfu"] is None and r["peak_mem_gib"] is None, r  # no device peak, no CUDA memory on the CPU
        assert r["epochs"] == 1 and r["wall_s"] > 0, r
        assert r["loader_thread_ms_per_step"] >= 0, r
        run_dir = tmp_path / "work" / (f"{r['devices']}dev-{r['variant']}" + ("-ceiling" if r["loader"] == "none" else ""))
        assert not (run_dir / "ckpt").exists()  # deleted once read, or never written (the ceiling)
        if r["loader"] == "none":  # no loader in the loop: no lance counters in its records
            assert "saved " not in (run_dir / "train.log").read_text()
            assert all(set(json.loads(line).get("loader") or {}) <= {"thread_ms_per_step"}
                       for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    # scaling: a run's throughput per device over its own variant's 1-device run's, as printed;
    # vs_ceiling: a fed run's over its variant's loader-free run's
    one_device = {(r["variant"], r["loader"]): r["tokens_per_s_per_device"] for r in results if r["devices"] == 1}
    for r, row in zip(results, rows):
        assert r["scaling"] == pytest.approx(r["tokens_per_s_per_device"] / one_device[r["variant"], r["loader"]]), r
        assert row.split()[5] == f"{r['scaling']:.2f}", row
        if r["loader"] == "fed":
            assert r["vs_ceiling"] == pytest.approx(r["tokens_per_s_per_device"] / one_device[r["variant"], "none"])
            assert row.split()[6] == f"{r['vs_ceiling']:.3f}", row
        else:
            assert r["vs_ceiling"] is None and row.split()[6] == "n/a", row
    log = (tmp_path / "work" / "1dev-doc-mask" / "train.log").read_text()
    assert "doc_mask=True" in log  # the doc-mask runs did run with the mask (the SDPA path on the CPU)


def test_a_failing_train_run_fails_the_check_with_its_log_tail(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_script("bench/gpu_check.py", "--dry-run", "--db", tmp_path / "nowhere", "--out", out,
                      "--workdir", tmp_path / "work", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("error: train.py on 1 cpu(s) (plain) exited with 2; its log: "), proc.stderr
    assert any(line.startswith("error: ") and "nowhere" in line for line in lines[:-1])  # train.py's own line
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_points_to_dry_run(tmp_path):
    proc = run_script("bench/gpu_check.py", "--out", tmp_path / "gpu.json", "--workdir", tmp_path, cwd=tmp_path)
    assert_user_error(proc, "no CUDA device", "--dry-run")
    assert not (tmp_path / "gpu.json").exists()


def test_too_few_steps_to_measure_is_refused(tmp_path):
    proc = run_script("bench/gpu_check.py", "--dry-run", "--steps", "2", "--out", tmp_path / "gpu.json",
                      "--workdir", tmp_path, cwd=tmp_path)
    assert_user_error(proc, "--steps 2", "at least 3")
