"""Elastic and crash-safe training under real torchrun (gloo on the CPU), checked from outside
through --trace-samples: every global step trains on the same samples whatever the world size
and however the run was cut, a run SIGKILLed in the middle of a checkpoint write resumes from
its newest complete checkpoint, loader worker processes change nothing, and a resume with
changed settings is refused without touching anything.
"""

import collections
import functools
import hashlib
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lancedb
import numpy as np
import pytest

from common import TRAIN_FILTER, load_tokenizer
from conftest import (assert_user_error, kill_tree, pids_mentioning, process_tree, read_trace,
                      run_train, run_trains, session_pids, start_train, wait_gone)

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

STEPS, HALF = 20, 10
GLOBAL_BATCH, GRAD_ACCUM = 8, 2  # samples per optimizer step: GLOBAL_BATCH x GRAD_ACCUM
SEQ_LEN = 64
FAST = ["--model", "tiny", "--seq-len", str(SEQ_LEN), "--log-every", "5", "--eval-batches", "1",
        "--warmup-steps", "5", "--lr-total-steps", str(STEPS), "--num-splits", "4",
        "--grad-accum", str(GRAD_ACCUM)]
HASH = re.compile(r"^[0-9a-f]{16}$")
CKPT = re.compile(r"^step_(\d{8})\.pt$")
TMP = {"dsrank": re.compile(r"^step_\d{8}_dsrank\d+\.pt\.tmp\d+$"),
       "rank0": re.compile(r"^step_\d{8}\.pt\.tmp\d+$")}
RESUMED = re.compile(r"^resumed from (\S+) ", re.M)
TIMEOUT = 300  # per run: a hang fails the test instead of blocking CI


def flags(db, nproc, path, *extra):
    """train.py arguments for `nproc` ranks, keeping the global batch at GLOBAL_BATCH."""
    return ["--db", db, *FAST, "--batch-size", str(GLOBAL_BATCH // nproc),
            *(["--pack"] if path == "pack" else []), *map(str, extra)]


def train_ok(nproc, *args, cwd, timeout=TIMEOUT):
    proc = run_train(nproc, *args, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"$ {' '.join(proc.args)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def final_step(stdout):
    final = stdout.strip().splitlines()[-1]
    assert final.startswith("final: opt_step="), stdout
    return int(final.split()[1].split("=")[1])


def resumed_from(stdout):
    found = RESUMED.findall(stdout)
    assert len(found) == 1, stdout
    return found[0]


def steps_by_rank(traces):
    return {rank: [r["step"] for r in records] for rank, records in traces.items()}


def per_step(traces, steps=None):
    """step -> Counter of the sample hashes all ranks trained on in that optimizer step."""
    counts = collections.defaultdict(collections.Counter)
    for rank, records in traces.items():
        for r in records:
            assert set(r) == {"step", "rank", "epoch", "samples"}, r
            assert r["rank"] == rank and r["epoch"] == 0, r
            assert r["samples"] and all(HASH.match(h) for h in r["samples"]), r
            if steps is None or r["step"] in steps:
                counts[r["step"]].update(r["samples"])
    return dict(counts)


def check_step_sizes(traces, ranks_at):
    """Each record holds the rank's share of the step; all ranks together GLOBAL_BATCH x GRAD_ACCUM."""
    for records in traces.values():
        for r in records:
            assert len(r["samples"]) == GLOBAL_BATCH * GRAD_ACCUM // ranks_at(r["step"]), r


@functools.lru_cache(maxsize=None)
def train_row_hashes(db):
    """Hashes of every training document as the row path feeds it, computed from the table:
    input_ids truncated / padded with PAD to SEQ_LEN, little-endian int32, BLAKE2b, 16 hex."""
    pad = load_tokenizer("byte").pad_token_id
    table = lancedb.connect(db).open_table("corpus")
    where = f"NOT is_dup AND score >= 1.0 AND ({TRAIN_FILTER})"
    docs = table.search().where(where).select(["input_ids"]).limit(table.count_rows(where)).to_arrow()
    hashes = set()
    for ids in docs.column("input_ids").to_pylist():
        row = np.full(SEQ_LEN, pad, dtype="<i4")
        row[:min(len(ids), SEQ_LEN)] = ids[:SEQ_LEN]
        hashes.add(hashlib.blake2b(row.tobytes()).hexdigest()[:16])
    return frozenset(hashes)


# ── Shared runs ───────────────────────────────────────────────────────────────


def elastic_runs_for(db, root, path):
    """The three ways to reach step 20 with the same global batch, each with its own dirs:
    a: 2 ranks straight; b: 2 ranks to 10, then 1 rank; c: 1 rank to 10, then 2 ranks.
    b and c hold their loaders to a read-ahead budget ~25,000x below a's default, which on
    this corpus never binds: the bound changes no sample. The three run side by side (a
    run's segments in turn) to overlap their start-up."""
    tiny = ["--loader-buffer-mb", "0.01"]
    plan = {"a": [(2, ["--steps", STEPS])],
            "b": [(2, ["--steps", HALF, "--ckpt-every", HALF, *tiny]),
                  (1, ["--steps", STEPS, "--resume", "auto", *tiny])],
            "c": [(1, ["--steps", HALF, "--ckpt-every", HALF, *tiny]),
                  (2, ["--steps", STEPS, "--resume", "auto", *tiny])]}

    def run(name):
        ck, trace = root / f"ck-{name}", root / f"trace-{name}"
        outs = []
        for nproc, extra in plan[name]:
            outs.append(train_ok(nproc, *flags(db, nproc, path, *extra, "--ckpt-dir", ck,
                                               "--trace-samples", trace), cwd=root).stdout)
        return {"ck": ck, "trace": trace, "stdout": outs}

    with ThreadPoolExecutor(len(plan)) as pool:
        futures = {name: pool.submit(run, name) for name in plan}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def elastic_runs(demo_db, tmp_path_factory):
    """path ('row' or 'pack') -> its runs a, b, c; each path's runs are made once, on first use."""
    made = {}

    def get(path):
        if path not in made:
            made[path] = elastic_runs_for(demo_db, tmp_path_factory.mktemp(f"elastic-{path}"), path)
        return made[path]

    return get


# ── Tests ─────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("path", ["row", "pack"])
def test_every_global_step_sees_the_same_samples_on_any_world_size(elastic_runs, demo_db, path):
    runs = elastic_runs(path)
    for name in "bc":
        first, second = runs[name]["stdout"]
        assert final_step(first) == HALF and final_step(second) == STEPS
        assert resumed_from(second) == str(runs[name]["ck"] / f"step_{HALF:08d}.pt")
    assert final_step(runs["a"]["stdout"][0]) == STEPS

    # every step exactly once per rank in every run segment, appended in order
    whole, first_half, second_half = (list(range(1, STEPS + 1)), list(range(1, HALF + 1)),
                                      list(range(HALF + 1, STEPS + 1)))
    traces = {name: read_trace(run["trace"]) for name, run in runs.items()}
    assert steps_by_rank(traces["a"]) == {0: whole, 1: whole}
    assert steps_by_rank(traces["b"]) == {0: whole, 1: first_half}
    assert steps_by_rank(traces["c"]) == {0: whole, 1: second_half}
    check_step_sizes(traces["a"], lambda step: 2)
    check_step_sizes(traces["b"], lambda step: 2 if step <= HALF else 1)
    check_step_sizes(traces["c"], lambda step: 1 if step <= HALF else 2)

    counts = {name: per_step(trace) for name, trace in traces.items()}
    for step in whole:
        assert sum(counts["a"][step].values()) == GLOBAL_BATCH * GRAD_ACCUM
        assert counts["b"][step] == counts["a"][step], f"step {step}: 2 ranks -> 1 rank differs"
        assert counts["c"][step] == counts["a"][step], f"step {step}: 1 rank -> 2 ranks differs"
    assert counts["a"][1] != counts["a"][2]  # the trace does follow the data
    if path == "row":  # recomputed from the table: each traced row is a training document
        unknown = [h for c in counts["a"].values() for h in c if h not in train_row_hashes(demo_db)]
        assert not unknown, f"{len(unknown)} traced hashes match no training document, e.g. {unknown[:3]}"


@pytest.mark.parametrize("target,after,resume_ranks", [
    ("dsrank", 3, 2),  # killed while a rank writes its loader state; resumed on 2 ranks
    ("rank0", 5, 1),  # killed while rank 0 writes the committing file; resumed on 1 rank
])
def test_kill_inside_a_checkpoint_write_then_resume_auto(elastic_runs, demo_db, tmp_path,
                                                         target, after, resume_ranks):
    reference = per_step(read_trace(elastic_runs("row")["a"]["trace"]))  # uninterrupted, 2 ranks
    ck = tmp_path / "ck"
    with open(tmp_path / "killed.log", "w") as log:
        proc = start_train(2, *flags(demo_db, 2, "row", "--steps", STEPS, "--ckpt-every", 1,
                                     "--ckpt-dir", ck, "--trace-samples", tmp_path / "trace-killed"),
                           cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        killed, known, walked = None, [], 0.0
        deadline = time.monotonic() + TIMEOUT
        try:
            while killed is None and proc.poll() is None and time.monotonic() < deadline:
                names = os.listdir(ck) if ck.is_dir() else []
                complete = sum(bool(CKPT.match(n)) for n in names)
                if complete >= after and any(TMP[target].match(n) for n in names):
                    killed = kill_tree(proc.pid, first=known)  # stop the known pids at once
                elif complete < after:
                    if time.monotonic() - walked > 0.2:  # keep the tree at hand: torchrun + workers
                        known, walked = process_tree(proc.pid), time.monotonic()
                    time.sleep(0.001)
                # else: spin; a loader-state temp file lives for about a millisecond
        finally:
            if killed is None:
                kill_tree(proc.pid)
            proc.wait(timeout=30)
    assert killed is not None, (f"no {target} temp file appeared after {after} checkpoints:\n"
                                + (tmp_path / "killed.log").read_text())
    assert len(killed) >= 3  # torchrun and its two workers
    assert wait_gone(killed) == [], "processes of the killed run are still alive"
    assert pids_mentioning(str(ck)) == [], "a process of the killed run escaped the kill"

    names = sorted(os.listdir(ck))
    newest = max(int(m.group(1)) for m in map(CKPT.match, names) if m)
    assert newest >= after, names
    torn = [n for n in names if ".tmp" in n]
    assert all(int(n[len("step_"):][:8]) > newest for n in torn), \
        f"a file of a committed step was still being written (rank 0 must commit last): {names}"
    print(f"\n{target}: killed at {names}; torn temp files left: {torn}")

    killed_trace = read_trace(tmp_path / "trace-killed")
    for rank, steps in steps_by_rank(killed_trace).items():
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= newest, (rank, steps)
    for step, count in per_step(killed_trace, range(1, newest + 1)).items():
        assert count == reference[step], f"step {step} of the killed run"

    keep = ["--ckpt-every", 5, "--keep-last", 2] if target == "rank0" else []
    proc = train_ok(resume_ranks, *flags(demo_db, resume_ranks, "row", "--steps", STEPS,
                                         "--resume", "auto", "--ckpt-dir", ck, *keep,
                                         "--trace-samples", tmp_path / "trace-resumed"), cwd=tmp_path)
    assert resumed_from(proc.stdout) == str(ck / f"step_{newest:08d}.pt")
    assert final_step(proc.stdout) == STEPS
    if keep:  # saved 10, 15, 20: only the newest two complete checkpoints stay, whole
        names = sorted(os.listdir(ck))
        assert [int(m.group(1)) for m in map(CKPT.match, names) if m] == [15, 20], names
        assert not [n for n in names if re.match(r"^step_(\d{8})_dsrank", n)
                    and int(n[5:13]) <= newest], f"loader files of pruned checkpoints left: {names}"
    resumed = read_trace(tmp_path / "trace-resumed")
    rest = list(range(newest + 1, STEPS + 1))
    assert steps_by_rank(resumed) == {rank: rest for rank in range(resume_ranks)}
    check_step_sizes(resumed, lambda step: resume_ranks)
    counts = per_step(resumed)
    for step in rest:
        assert counts[step] == reference[step], f"step {step} after resuming from step {newest}"


@pytest.fixture(scope="module")
def worker_runs(demo_db, tmp_path_factory):
    """1 rank with --num-workers 2 to step 10, row and pack side by side -> {path: (proc, trace dir)}."""
    root = tmp_path_factory.mktemp("workers")
    jobs = [(1, flags(demo_db, 1, path, "--num-workers", 2, "--steps", HALF, "--ckpt-dir",
                      root / f"ck-{path}", "--trace-samples", root / f"trace-{path}"))
            for path in ("row", "pack")]
    procs = run_trains(jobs, cwd=root, timeout=150)  # must exit by itself: no hang at teardown
    return {path: (proc, root / f"trace-{path}") for path, proc in zip(("row", "pack"), procs)}


@pytest.mark.parametrize("path", ["row", "pack"])
def test_loader_workers_feed_the_same_samples_and_exit(worker_runs, elastic_runs, path):
    proc, trace_dir = worker_runs[path]
    assert proc.returncode == 0, f"$ {' '.join(proc.args)}\n{proc.stdout}\n{proc.stderr}"
    assert final_step(proc.stdout) == HALF
    assert wait_gone(session_pids(proc.pid), timeout=10) == [], "loader workers outlived the run"
    traces = read_trace(trace_dir)
    assert steps_by_rank(traces) == {0: list(range(1, HALF + 1))}
    check_step_sizes(traces, lambda step: 1)
    # reference: run c's first segment, 1 rank with --num-workers 0 to step 10
    reference = per_step({0: read_trace(elastic_runs(path)["c"]["trace"])[0]}, range(1, HALF + 1))
    assert per_step(traces) == reference


def snapshot(directory):
    """Everything a write would change: the names, and each file's size, mtime and bytes (not
    the directory's mtime: the run's --ckpt-dir lock comes and goes, as it must)."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.blake2b(p.read_bytes()).hexdigest())
            for p in sorted(Path(directory).iterdir())}


REFUSED = {  # a changed flag -> what the one error line must name
    ("--num-splits", "8"): "num_splits=",
    ("--shuffle-seed", "7"): "shuffle_seed=",
    ("--seq-len", "32"): "seq_len=",
    ("--model", "small"): "model=",
    ("--batch-size", "4"): "global_batch=",  # 1 rank x 4: the global batch halves
    ("--grad-accum", "1"): "global_batch=",  # so do the samples of an optimizer step
}


@pytest.fixture(scope="module")
def refused_resumes(elastic_runs, demo_db, tmp_path_factory):
    """Each REFUSED change tried on its own copy of run c's checkpoints (1 rank at step 10,
    2 ranks at step 20) and traces, side by side; -> {change: (proc, before, after)}."""
    made = elastic_runs("row")["c"]
    root = tmp_path_factory.mktemp("refused")
    dirs, jobs = {}, []
    for i, (flag, value) in enumerate(REFUSED):
        ck, trace = root / f"ck{i}", root / f"trace{i}"
        shutil.copytree(made["ck"], ck)
        shutil.copytree(made["trace"], trace)
        dirs[flag, value] = ck, trace, (snapshot(ck), snapshot(trace))
        args = flags(demo_db, 1, "row", "--steps", 30, "--resume", "auto", "--ckpt-dir", ck,
                     "--trace-samples", trace)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        jobs.append((1, args))
    procs = run_trains(jobs, cwd=root, timeout=120)
    return {change: (proc, before, (snapshot(ck), snapshot(trace)))
            for (change, (ck, trace, before)), proc in zip(dirs.items(), procs)}


@pytest.mark.parametrize("change", list(REFUSED), ids=lambda c: "=".join(c).lstrip("-"))
def test_resume_with_a_changed_setting_is_refused(refused_resumes, change):
    proc, before, after = refused_resumes[change]
    assert_user_error(proc, REFUSED[change])
    assert after == before, "a refused resume wrote to the checkpoint or trace directory"
