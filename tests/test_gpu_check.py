"""bench/gpu_check.py: its --dry-run end to end on the CPU (every stage: 1 rank, then 2 gloo
ranks under torchrun, and GPT-2's vocabulary on the tiny model's layers; no timing asserted),
--sweep with one stage past its limit, SIGTERM mid-stage, and its refusals."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, assert_user_error, run_script

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out


RUNS = [("plain", "fed", 1), ("plain", "none", 1), ("gpt2-124m", "none", 1), ("doc-mask", "fed", 1),
        ("doc-mask", "none", 1), ("deterministic", "fed", 1), ("plain", "fed", 2), ("doc-mask", "fed", 2)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One --workdir for the dry runs here: the demo corpus is built once."""
    return tmp_path_factory.mktemp("gpu_check_work")


def run_dir(workdir, r):
    return workdir / (f"{r['devices']}dev-{r['variant']}" + ("-ceiling" if r["loader"] == "none" else ""))


def test_dry_run_measures_one_then_two_ranks(tmp_path, workdir):
    out = tmp_path / "gpu.json"
    proc = run_script("bench/gpu_check.py", "--dry-run", "--out", "gpu.json", "--workdir", workdir,  # --out from cwd
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, *rows = [line for line in proc.stdout.splitlines() if line.strip()][:9]
    assert header.split() == ["variant", "loader", "cpus", "tok/s", "tok/s/cpu", "scaling", "vs_ceiling", "MFU",
                              "MFU_llmc", "data_wait", "loader_ms", "peak", "mem", "compile", "s", "epochs", "wall",
                              "s"]
    assert [(row.split()[0], row.split()[1], int(row.split()[2])) for row in rows] == RUNS
    assert "wrote gpu.json" in proc.stdout
    assert "building the demo corpus" in proc.stderr  # in the workdir, once, before every run

    data = json.loads(out.read_text())
    assert data["settings"]["dry_run"] is True and data["settings"]["steps"] == 6
    assert data["settings"]["db"] == str(workdir / "data" / "lancedb")
    assert {"torch", "cuda", "gpu", "gpu_count", "gpu_bf16_peak_tflops"} <= data["machine"].keys()
    # every stage, in order, done within its limit, and the budget the two torchrun runs widen
    names = ["correctness", "corpus", "1dev-plain", "1dev-plain-ceiling", "1dev-gpt2-124m-ceiling", "1dev-doc-mask",
             "1dev-doc-mask-ceiling", "1dev-deterministic", "2dev-plain", "2dev-doc-mask"]
    assert [s["name"] for s in data["stages"]] == names
    assert all(s["status"] == "done" and 0 < s["wall_s"] <= s["limit_s"] for s in data["stages"]), data["stages"]
    assert data["running"] is None and data["unfinished"] == [] and data["budget_s"] == 420 + 2 * 90
    correctness = data["correctness"]  # tests/test_cuda.py ran first, and skips on the CPU with its reason
    assert correctness["passed"] == correctness["failed"] == 0 and correctness["skipped"] >= 6, correctness
    assert "correctness: 0 passed, 0 failed" in proc.stderr and "no CUDA device" in proc.stderr
    tests = {d["test"].split("::")[1].split("[")[0] for d in correctness["durations"]}  # pytest --durations=0
    assert {"test_fused_adamw_is_used_and_steps", "test_resume_on_one_gpu_repeats_the_uninterrupted_run"} <= tests
    assert all(d["when"] in ("setup", "call", "teardown") and d["s"] >= 0 for d in correctness["durations"])
    results = data["results"]
    assert [(r["variant"], r["loader"], r["devices"]) for r in results] == RUNS
    for r in results:
        assert r["status"] == "ok" and r["steps"] == 6 and r["records_used"] == 4, r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / r["devices"])
        assert 0 <= r["data_wait"] <= 1 and r["compile_s"] >= 0, r
        assert r["mfu"] is None and r["mfu_llmc"] is None and r["peak_mem_gib"] is None, r  # no peak on the CPU
        assert r["epochs"] == 1 and r["wall_s"] > 0, r
        assert r["loader_thread_ms_per_step"] >= 0, r
        assert not (run_dir(workdir, r) / "ckpt").exists()  # deleted once read, or never written (the ceiling)
        if r["loader"] == "none":  # no loader in the loop: no lance counters in its records
            assert "saved " not in (run_dir(workdir, r) / "train.log").read_text()
            assert all(set(json.loads(line).get("loader") or {}) <= {"thread_ms_per_step"}
                       for line in (run_dir(workdir, r) / "metrics.jsonl").read_text().splitlines())
    # scaling: a run's throughput per device over its own variant's 1-device run's, as printed;
    # vs_ceiling: a fed run's over its variant's loader-free run's (deterministic has none)
    one_device = {(r["variant"], r["loader"]): r["tokens_per_s_per_device"] for r in results if r["devices"] == 1}
    for r, row in zip(results, rows):
        assert r["scaling"] == pytest.approx(r["tokens_per_s_per_device"] / one_device[r["variant"], r["loader"]]), r
        assert row.split()[5] == f"{r['scaling']:.2f}", row
        if r["loader"] == "fed" and r["variant"] != "deterministic":
            assert r["vs_ceiling"] == pytest.approx(r["tokens_per_s_per_device"] / one_device[r["variant"], "none"])
            assert row.split()[6] == f"{r['vs_ceiling']:.3f}", row
        else:
            assert r["vs_ceiling"] is None and row.split()[6] == "n/a", row
    log = (workdir / "1dev-doc-mask" / "train.log").read_text()
    assert "doc_mask=True" in log  # the doc-mask runs did run with the mask (the SDPA path on the CPU)
    # GPT-2's vocabulary on random ids (the tiny model's layers in a dry run), FLOPs counted both ways
    gpt2 = results[2]
    log = (run_dir(workdir, gpt2) / "train.log").read_text()
    n = int(re.search(r"params=([0-9,]+) ", log).group(1).replace(",", ""))
    assert gpt2["vocab"] == 50304 and gpt2["model"] == "tiny" and n > 50304 * 128  # the embedding alone
    L, C, T = 4, 128, 64
    assert gpt2["flops_per_token"] == 6 * n + 12 * L * C * T  # train.flops_per_token
    assert gpt2["flops_per_token_llmc"] == 6 * (n + T * C) + 6 * L * C * T  # llm.c: N with the positions


def test_sweep_keeps_what_finished_when_a_stage_runs_out_of_time(tmp_path, workdir):
    """--sweep: micro-batches 2 and 4 on the dry run's ceiling, then the other compile modes at
    the fastest. A 1 s limit on batch 4 kills that run: the check goes on, records it as
    unfinished with why, keeps every other figure, and exits 1 naming it."""
    out = tmp_path / "sweep.json"
    proc = run_script("bench/gpu_check.py", "--dry-run", "--sweep", "--limit", "sweep-b4-default=1", "--out", out,
                      "--workdir", workdir, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: 1 stage(s) did not finish: sweep-b4-default; the figures that " \
                                           f"did are in {out}"
    assert "sweep-b4-default: unfinished (train.py on 1 cpu(s) (sweep-b4-default) did not finish within 1 s" \
        in proc.stderr
    data = json.loads(out.read_text())
    assert data["settings"]["sweep"] is True and data["correctness"] is None  # the sweep runs no correctness
    assert [(s["name"], s["status"]) for s in data["stages"]] == [
        ("corpus", "done"), ("sweep-b2-default", "done"), ("sweep-b4-default", "unfinished"),
        ("sweep-b2-reduce-overhead", "done"), ("sweep-b2-max-autotune-no-cudagraphs", "done")]
    assert [s["limit_s"] for s in data["stages"]] == [40, 60, 1, 60, 240]  # max-autotune's is its own
    assert data["unfinished"] == ["sweep-b4-default"]
    sweep = data["sweep"]
    assert [(r["batch_size"], r["compile_mode"], r["status"]) for r in sweep] == [
        (2, "default", "ok"), (4, "default", "unfinished"), (2, "reduce-overhead", "ok"),
        (2, "max-autotune-no-cudagraphs", "ok")]
    assert "did not finish within 1 s" in sweep[1]["reason"] and "tokens_per_s" not in sweep[1]
    for r in sweep[::2]:
        assert r["tokens_per_s"] > 0 and r["vocab"] == 50304 and r["loader"] == "none" and r["steps"] == 6, r
    best = max((r for r in sweep if r["status"] == "ok"), key=lambda r: r["tokens_per_s"])
    assert data["best"] == best
    assert f"fastest: --batch-size 2 --compile-mode {best['compile_mode']}: " in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    assert table[0] == ["batch", "compile", "mode", "status", "tok/s", "MFU", "MFU_llmc", "peak", "mem", "compile",
                        "s"]
    assert table[2][:3] == ["4", "default", "unfinished"]


def test_sigterm_leaves_the_finished_figures_and_names_the_running_stage(tmp_path, workdir):
    out = tmp_path / "stopped.json"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", "--sweep",
                             "--out", str(out), "--workdir", str(workdir)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the JSON names a stage as running before it starts it
        time.sleep(0.2)
        if out.exists() and json.loads(out.read_text())["running"] == "sweep-b2-default":
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout + stderr
    assert stderr.splitlines()[-1] == f"error: stopped by SIGTERM during sweep-b2-default; the figures finished " \
                                      f"before it are in {out}"
    data = json.loads(out.read_text())
    assert [(s["name"], s["status"], s["reason"]) for s in data["stages"]] == [
        ("corpus", "done", None), ("sweep-b2-default", "unfinished", "stopped by SIGTERM")]
    assert data["running"] is None and data["unfinished"] == ["sweep-b2-default"]


def test_a_failing_train_run_fails_the_check_with_its_log_tail(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_script("bench/gpu_check.py", "--dry-run", "--db", tmp_path / "nowhere", "--out", out,
                      "--workdir", tmp_path / "work", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("error: train.py on 1 cpu(s) (1dev-plain) exited with 2; its log: "), proc.stderr
    assert any(line.startswith("error: ") and "nowhere" in line for line in lines[:-1])  # train.py's own line
    assert "Traceback" not in proc.stderr
    stages = json.loads(out.read_text())["stages"]  # what ran, and the run that failed, with why
    assert [(s["name"], s["status"]) for s in stages] == [("correctness", "done"), ("1dev-plain", "failed")]
    assert stages[1]["reason"] == lines[-1].removeprefix("error: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_points_to_dry_run(tmp_path):
    proc = run_script("bench/gpu_check.py", "--out", tmp_path / "gpu.json", "--workdir", tmp_path, cwd=tmp_path)
    assert_user_error(proc, "no CUDA device", "--dry-run")
    assert not (tmp_path / "gpu.json").exists()


def test_too_few_steps_to_measure_is_refused(tmp_path):
    proc = run_script("bench/gpu_check.py", "--dry-run", "--steps", "2", "--out", tmp_path / "gpu.json",
                      "--workdir", tmp_path, cwd=tmp_path)
    assert_user_error(proc, "--steps 2", "at least 3")


@pytest.mark.parametrize("flags, fragment", [(["--limit", "corpus"], "STAGE=SECONDS"),
                                             (["--budget-s", "0"], "--budget-s must be positive")])
def test_bad_limits_are_refused(tmp_path, flags, fragment):
    proc = run_script("bench/gpu_check.py", "--dry-run", *flags, "--out", tmp_path / "gpu.json",
                      "--workdir", tmp_path, cwd=tmp_path)
    assert_user_error(proc, fragment)
