"""Data safety: a run reads one pinned table version whatever happens to the table meanwhile,
checkpoints cannot run code when read, and one run at a time writes a checkpoint directory.

Corpora are small jsonl-made tables, so an epoch is a handful of steps; runs are in-process
where nothing needs a process of its own (num_workers 0, one rank).
"""

import collections
import datetime
import json
import pathlib
import random
import socket
import time

import lancedb
import pytest
import torch

import prepare_data
import train
from conftest import (assert_user_error, kill_tree, process_tree, read_trace, run_script, run_train,
                      start_train)

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

SEQ_LEN, BATCH = 64, 4
FAST = ["--model", "tiny", "--seq-len", SEQ_LEN, "--batch-size", BATCH, "--num-splits", 4,
        "--log-every", 2, "--warmup-steps", 2, "--lr-total-steps", 40, "--eval-batches", 1]
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone "
         "cloud paper garden window letter market").split()


def documents(path, count, first):
    """`count` distinct prose-like documents (they pass the quality filter) as a jsonl file."""
    rng = random.Random(first)
    with open(path, "w") as f:
        for i in range(first, first + count):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
            f.write(json.dumps({"text": f"Document {i} tells of {words}."}) + "\n")
    return str(path)


def make_corpus(tmp_path, count=40):
    db = tmp_path / "db"
    prepare_data.ingest([documents(tmp_path / "a.jsonl", count, 0)], str(db), val_fraction=0.1)
    return db


def append(tmp_path, db, count=24):
    prepare_data.ingest([documents(tmp_path / "b.jsonl", count, 1000)], str(db), mode="append")


def by_step(trace_dir):
    """step -> (epoch, samples) from a one-rank trace; a resumed step replaces the older record."""
    return {r["step"]: (r["epoch"], r["samples"]) for r in read_trace(trace_dir)[0]}


@pytest.fixture
def run(capsys):
    """train.py in this process; returns its stdout."""
    def run(db, ckpt_dir, *args):
        train.main([str(a) for a in ("--db", db, *FAST, "--ckpt-dir", ckpt_dir, *args)])
        return capsys.readouterr().out
    return run


# ── Pinned table versions ─────────────────────────────────────────────────────


def test_rows_appended_after_a_checkpoint_change_nothing_the_resume_trains_on(tmp_path, run):
    """A packed run checkpointed at step 6, then rows appended, resumes (with loader worker
    processes, which reopen the table) on exactly the samples of a run on the original data;
    a fresh run on the grown table trains on others."""
    db = make_corpus(tmp_path)
    run(db, tmp_path / "straight", "--pack", "--steps", 12, "--trace-samples", tmp_path / "t-straight")
    run(db, tmp_path / "ck", "--pack", "--steps", 6, "--trace-samples", tmp_path / "t-cut")
    append(tmp_path, db)
    proc = run_train(1, "--db", db, *FAST, "--pack", "--steps", 12, "--ckpt-dir", tmp_path / "ck",
                     "--resume", "auto", "--num-workers", 2, "--num-splits", 4,
                     "--trace-samples", tmp_path / "t-cut", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "data: table 'corpus'" in proc.stdout and "version 1 " in proc.stdout
    straight = by_step(tmp_path / "t-straight")
    assert sorted(straight) == list(range(1, 13))
    assert by_step(tmp_path / "t-cut") == straight
    saved = torch.load(tmp_path / "ck" / "step_00000012.pt", weights_only=True)["data_version"]
    assert saved["version"] == 1

    run(db, tmp_path / "grown", "--pack", "--steps", 12, "--trace-samples", tmp_path / "t-grown")
    assert by_step(tmp_path / "t-grown") != straight  # the append did change what a new run reads


def test_data_version_latest_moves_to_the_newest_version_at_the_next_epoch(tmp_path, run):
    db = make_corpus(tmp_path)
    run(db, tmp_path / "straight", "--epochs", 2, "--trace-samples", tmp_path / "t-straight")
    run(db, tmp_path / "ck", "--steps", 4, "--trace-samples", tmp_path / "t-moved")
    append(tmp_path, db)
    out = run(db, tmp_path / "ck", "--epochs", 2, "--resume", "auto", "--data-version", "latest",
              "--trace-samples", tmp_path / "t-moved")
    moved_line = [line for line in out.splitlines() if "--data-version latest" in line]
    assert moved_line == ["data: --data-version latest: epoch 0 finishes on version 1 of the table "
                          f"'corpus' in '{db}', epochs from 1 read version 2"]
    straight, moved = by_step(tmp_path / "t-straight"), by_step(tmp_path / "t-moved")
    epoch = {e: [s for s, (ep, _) in steps.items() if ep == e]
             for steps in (straight,) for e in (0, 1)}
    assert epoch[0] and epoch[1], straight  # the straight run traced both epochs
    assert {s: moved[s] for s in epoch[0]} == {s: straight[s] for s in epoch[0]}
    moved_epoch1 = [samples for ep, samples in moved.values() if ep == 1]
    assert len(moved_epoch1) > len(epoch[1])  # 24 more documents: more steps
    final = max(moved)
    saved = torch.load(tmp_path / "ck" / f"step_{final:08d}.pt", weights_only=True)
    assert saved["data_version"]["version"] == 2 and saved["epoch"] == 1

    # From there on the run is pinned to version 2: a plain resume says so.
    out = run(db, tmp_path / "ck", "--epochs", 2, "--resume", "auto")
    assert "version 2 (" in out and "--data-version latest" not in out


def test_a_fresh_run_can_pin_an_older_version(tmp_path, run):
    db = make_corpus(tmp_path)
    run(db, tmp_path / "before", "--steps", 4, "--trace-samples", tmp_path / "t-before")
    append(tmp_path, db)
    run(db, tmp_path / "pinned", "--steps", 4, "--data-version", 1, "--trace-samples", tmp_path / "t-pinned")
    before = by_step(tmp_path / "t-before")
    assert sorted(before) == [1, 2, 3, 4]
    assert by_step(tmp_path / "t-pinned") == before


def test_a_version_that_is_gone_or_remade_is_refused_in_one_line(tmp_path, run):
    db = make_corpus(tmp_path)
    run(db, tmp_path / "ck", "--steps", 2)
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())

    proc = run_script("train.py", "--db", db, *FAST, "--steps", 4, "--data-version", 7,
                      "--ckpt-dir", tmp_path / "other", cwd=tmp_path)
    assert_user_error(proc, "--data-version 7", "has no version 7", "versions 1..1")
    proc = run_script("train.py", "--db", db, *FAST, "--data-version", "newest", cwd=tmp_path)
    assert_user_error(proc, "--data-version must be a version number or 'latest'")

    append(tmp_path, db)
    table = lancedb.connect(str(db)).open_table("corpus")
    with pytest.warns(UserWarning):
        table.optimize(cleanup_older_than=datetime.timedelta(0))  # drops version 1
    for extra in ([], ["--data-version", "latest"]):
        proc = run_script("train.py", "--db", db, *FAST, "--steps", 4, "--ckpt-dir", tmp_path / "ck",
                          "--resume", "auto", *extra, cwd=tmp_path)
        assert_user_error(proc, "trained on version 1 of the table 'corpus'", "no longer exists")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before

    # A table dropped and made anew starts again at version 1: same number, other data.
    lancedb.connect(str(db)).drop_table("corpus")
    make_corpus(tmp_path)
    proc = run_script("train.py", "--db", db, *FAST, "--steps", 4, "--ckpt-dir", tmp_path / "ck",
                      "--resume", "auto", cwd=tmp_path)
    assert_user_error(proc, "version 1 of the table 'corpus'", "made anew")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    assert not (tmp_path / "other").exists()


# ── Checkpoints cannot run code ───────────────────────────────────────────────


class MakesAFile:
    """Unpickling this calls Path.touch: what a malicious checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path, run):
    db = make_corpus(tmp_path)
    ck = tmp_path / "ck"
    run(db, ck, "--steps", 2)
    marker = tmp_path / "pwned"
    good = torch.load(ck / "step_00000002.pt", weights_only=True)
    evil = ck / "step_00000004.pt"
    torch.save({**good, "opt_step": 4, "config": {**good["config"], "note": MakesAFile(marker)}}, evil)

    proc = run_script("train.py", "--db", db, *FAST, "--steps", 6, "--ckpt-dir", tmp_path / "ck2",
                      "--resume", evil, cwd=tmp_path)
    assert_user_error(proc, f"refusing checkpoint {str(evil)!r}: unpickling it would call", "could run code")
    proc = run_script("sample.py", "--ckpt", evil, "--max-new-tokens", 4, cwd=tmp_path)
    assert_user_error(proc, "refusing checkpoint", "could run code")
    # Picked by "auto" as the newest: skipped with a warning, the older good one is used.
    proc = run_script("sample.py", "--ckpt", "auto", "--ckpt-dir", ck, "--max-new-tokens", 4, cwd=tmp_path)
    assert proc.returncode == 0 and "skipping checkpoint" in proc.stderr and "step_00000002.pt" in proc.stderr
    proc = run_script("train.py", "--db", db, *FAST, "--steps", 3, "--ckpt-dir", ck, "--resume", "auto",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint" in proc.stderr and "(epoch 0, opt step 2)" in proc.stdout
    assert not marker.exists()
    assert collections.Counter(p.suffix for p in ck.iterdir()) == {".pt": 3}


# ── One run per checkpoint directory ──────────────────────────────────────────


def test_a_second_run_on_a_locked_dir_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    """Two ranks share the first run's lock; a second run (two ranks too) is refused at once on
    every rank, naming the holder; once the first is SIGKILLed, --resume auto takes over."""
    db = make_corpus(tmp_path)
    ck = tmp_path / "ck"
    first = start_train(2, "--db", db, *FAST, "--batch-size", BATCH // 2, "--epochs", 1000,
                        "--ckpt-every", 2, "--ckpt-dir", ck, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list(ck.glob("step_*.pt")) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and list(ck.glob("step_*.pt")), first.communicate()
        holder = json.loads((ck / "train.lock").read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] in process_tree(first.pid)

        proc = run_train(2, "--db", db, *FAST, "--batch-size", BATCH // 2, "--steps", 4,
                         "--ckpt-dir", ck, "--resume", "auto", cwd=tmp_path, timeout=120)
        assert proc.returncode != 0  # torchrun reports its failed ranks (exit 2) in a traceback of its own
        # Both ranks print the refusal (their lines may interleave) and leave; none waits on the other.
        assert proc.stderr.count(f"is in use by pid {holder['pid']} on host {holder['host']}") == 2, proc.stderr
        assert first.poll() is None  # the holder trains on, untouched
    finally:
        kill_tree(first.pid)
        first.communicate()

    proc = run_script("train.py", "--db", db, *FAST, "--steps", 2, "--ckpt-dir", ck, "--resume", "auto",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"taking over the stale lock {ck / 'train.lock'} of pid {holder['pid']}" in proc.stderr
    assert "resumed from" in proc.stdout and not (ck / "train.lock").exists()


def test_a_lock_from_another_host_needs_force_unlock(tmp_path, run, capsys):
    db = make_corpus(tmp_path)
    ck = tmp_path / "ck"
    run(db, ck, "--steps", 2)
    lock = {"host": "gpu-node-17", "boot_id": None, "pid": 4242, "starttime": None,
            "started": "2026-12-01T08:00:00+00:00", "argv": ["train.py"]}
    (ck / "train.lock").write_text(json.dumps(lock))
    before = sorted(p.name for p in ck.iterdir())
    proc = run_script("train.py", "--db", db, *FAST, "--steps", 4, "--ckpt-dir", ck, "--resume", "auto",
                      cwd=tmp_path)
    assert_user_error(proc, "in use by pid 4242 on host gpu-node-17", "--force-unlock")
    assert sorted(p.name for p in ck.iterdir()) == before

    train.main([str(a) for a in ("--db", db, *FAST, "--steps", 4, "--ckpt-dir", ck, "--resume", "auto",
                                 "--force-unlock")])
    out, err = capsys.readouterr()
    assert "warning: --force-unlock: taking over the lock" in err and "gpu-node-17" in err
    assert "resumed from" in out and (ck / "step_00000004.pt").exists()
    assert not (ck / "train.lock").exists()
