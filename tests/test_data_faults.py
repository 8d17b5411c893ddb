"""A table that cannot be read, and an object store that goes away, under a real run.

A data file of the corpus table deleted or truncated before the start, or while the run is
in its epoch (a loader thread, or a loader worker process, then hits it), and the local S3
server (moto) killed after some steps: the run ends in one line naming the table, its
version and the file (or the store), exit 3 (common.StorageFault), on 1 rank and on 2 under
torchrun, where the rank that did not fail leaves at once instead of waiting out
--dist-timeout. Nothing is left behind (no lock, no temporary file, no process), the newest
checkpoint is intact, and once the file or the store is back, --resume auto trains on the
samples an uninterrupted run trains on.
"""

import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import lancedb
import numpy as np
import pyarrow as pa
import pytest

import checkpoint
from common import LEGACY_SCHEMA, TRAIN_FILTER, corpus_filter
from conftest import (free_port, kill_tree, pids_mentioning, process_tree, read_trace, run_train, start_train,
                      wait_gone)
from test_elastic import per_step, resumed_from

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

# Four appends, so four data files; the second is one row, read by one rank only, late in
# the epoch (`lonely_row_step`), so a file deleted after a few steps is met mid-epoch, and on
# 2 ranks by one of them while the other waits in a collective.
APPENDS = (80, 1, 80, 80)
STEPS, DAMAGE_AT = 40, 2
GLOBAL_BATCH, SPLITS = 4, 4
RETRY_S = 3  # the test's retry budget (--storage-option client_retry_timeout)
# A tiny read-ahead, so the loader reads all through the epoch rather than all at once.
FLAGS = ["--model", "tiny", "--seq-len", 64, "--log-every", 1, "--warmup-steps", 2, "--lr-total-steps", STEPS,
         "--num-splits", SPLITS, "--ckpt-every", 2, "--read-batch-size", 4, "--loader-buffer-mb", 0.001]
FAULT = re.compile(r"^error: cannot read version 4 of the table 'corpus' in '(?P<db>[^']+)': (?P<why>.+)$")
RESTORE = "restore the table's files from a backup or copy, or train a new run on an older version"


def write_corpus(uri):
    """The corpus table at `uri` (local or s3://), in APPENDS; returns the one-row append's tokens."""
    rng = np.random.default_rng(5)
    table, first, lonely = None, 0, None
    for rows in APPENDS:
        docs = [rng.integers(0, 256, rng.integers(20, 120)).tolist() for _ in range(rows)]
        part = pa.table({
            "id": pa.array(range(first, first + rows), pa.int64()), "text": [""] * rows,
            "input_ids": pa.array(docs, pa.list_(pa.int32())), "n_tokens": pa.array(map(len, docs), pa.int32()),
            "score": pa.array([2.0] * rows, pa.float32()), "is_dup": [False] * rows,
            "split": ["train"] * rows}, schema=LEGACY_SCHEMA)
        if table is None:
            table = lancedb.connect(uri).create_table("corpus", part)
        else:
            table.add(part)
        lonely = docs[0] if rows == 1 else lonely
        first += rows
    assert table.version == len(APPENDS)
    return lonely


def lonely_row_step(db, lonely):
    """(rank, optimizer step) of 2 ranks that trains on the one-row append: the samples of a
    step do not depend on the number of ranks (lancedb's elastic order), one cycle per step."""
    from lancedb.streaming import StreamingDataset

    table = lancedb.connect(db).open_table("corpus")
    for rank in range(2):
        ds = StreamingDataset(table, num_splits=SPLITS, shuffle_seed=42, epoch=0, rank=rank, world_size=2,
                              columns=["input_ids"], filter=corpus_filter(1.0, TRAIN_FILTER))
        for i, row in enumerate(ds):
            if row["input_ids"] == lonely:
                return rank, i // (SPLITS // 2) + 1
    raise AssertionError("the one-row append is in no split")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    db = str(tmp / "db")
    lonely = write_corpus(db)
    rank, step = lonely_row_step(db, lonely)
    assert rank == 0 and step > DAMAGE_AT + 10, (rank, step)  # what the 2-rank tests rely on
    return {"tmp": tmp, "db": db, "lonely_step": step}


@pytest.fixture(scope="module")
def straight(corpus):
    """step -> samples of an uninterrupted run on 1 rank."""
    tmp = corpus["tmp"]
    proc = run_train(1, "--db", corpus["db"], *FLAGS, "--batch-size", GLOBAL_BATCH, "--steps", STEPS,
                     "--ckpt-dir", tmp / "ck-straight", "--trace-samples", tmp / "trace-straight", cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = per_step(read_trace(tmp / "trace-straight"))
    assert sorted(steps) == list(range(1, STEPS + 1))
    return steps


def data_files(db):
    """The corpus table's data files, the one-row append's (the smallest) first."""
    return sorted(glob.glob(os.path.join(db, "corpus.lance", "data", "*.lance")), key=os.path.getsize)


def damage(path, how):
    if how == "deleted":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)


class Run:
    """train.py started in the background, its stdout read as it comes; `wait_for_step` blocks
    until rank 0 has logged a step, `finish` until the run (and every process it had) ends."""

    def __init__(self, nproc, args, cwd):
        self.err = open(cwd / f"stderr-{time.monotonic_ns()}", "w+")
        self.proc = start_train(nproc, *args, cwd=cwd, stderr=self.err, cold=False)  # process_tree follows it
        self.lines, self.seen = [], threading.Condition()
        self.tree = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.seen:
                self.lines.append(line)
                self.seen.notify_all()
        with self.seen:
            self.lines.append(None)
            self.seen.notify_all()

    def wait_for_step(self, step, timeout=300):
        deadline = time.monotonic() + timeout
        with self.seen:
            while not any(line is not None and f" step {step}/" in line for line in self.lines):
                assert None not in self.lines, self.finish()
                assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
                self.seen.wait(1)
        self.tree = process_tree(self.proc.pid)  # the agent, ranks, loader workers and their helpers

    def finish(self, timeout=300):
        """(exit code, stdout, stderr, processes of the run still alive 30 s after it ended)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid, self.tree)
            self.proc.wait()
            pytest.fail(f"the run did not end within {timeout} s after the fault:\n{self.output()[1]}")
        with self.seen:
            self.seen.wait_for(lambda: None in self.lines, 30)
        survivors = wait_gone(self.tree, timeout=30)
        out, err = self.output()
        return self.proc.returncode, out, err, survivors

    def output(self):
        self.err.seek(0)
        return "".join(line for line in self.lines if line is not None), self.err.read()


def logged_steps(out):
    return [int(s) for s in re.findall(r"^epoch 0 step (\d+)/", out, re.M)]


def check_fault_lines(code, err, nproc, why, db, failing=None):
    """One line on each rank that failed (`failing` of them, where known), one short line on a
    rank whose peer left, nothing else but the torchrun agent's report; exit 3 on the rank
    that failed."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    faults = [line for line in lines if FAULT.match(line)]
    assert faults and all(FAULT.match(line)["db"] == db and why in line for line in faults), err
    assert failing is None or len(faults) == failing, err
    assert 'train.py", line' not in err and "lance error" not in err and "Warning" not in err, err
    if nproc == 1:
        assert code == 3 and lines == [line for line in err.splitlines() if line.strip()], err
        return
    assert code == 1 and len(lines) == 2, err  # torchrun: 1 when any rank failed; the ranks' codes below
    codes = sorted(int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", err))
    peer = [line for line in lines if not FAULT.match(line)]
    if peer:  # the other rank was in a collective: it leaves at once, in one line
        # whichever rank meets the fault first (a peer waits for it at the StepGate, not reading)
        assert re.match(r"error: rank [01] lost contact with the other ranks", peer[0]), err
        assert 3 in codes, err
    else:
        assert set(codes) == {3}, err


def check_left_behind(ck, survivors, last_step):
    """No lock, no temporary file, no process; the newest checkpoint loads and is at most the
    last step trained. Returns its step."""
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors]
    names = sorted(p.name for p in ck.iterdir()) if ck.exists() else []
    assert all(re.fullmatch(r"step_\d{8}(_dsrank\d+)?\.pt", name) for name in names), names
    if not names:
        return 0
    path, ckpt, _ = checkpoint.load_resume("auto", str(ck))
    assert 0 < ckpt["opt_step"] <= last_step and ckpt["opt_step"] % 2 == 0, (path, last_step)
    return ckpt["opt_step"]


def check_resume(corpus, straight, nproc, ck, name, *extra):
    """--resume auto, the file or the store back: the steps after the checkpoint are the
    straight run's."""
    tmp = corpus["tmp"]
    proc = run_train(nproc, "--db", extra[0] if extra else corpus["db"], *FLAGS, "--batch-size",
                     GLOBAL_BATCH // nproc, "--steps", STEPS, "--ckpt-dir", ck, "--resume", "auto",
                     "--trace-samples", tmp / f"trace-{name}-resumed", *extra[1:], cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    start = int(re.search(r"step_(\d+)\.pt", resumed_from(proc.stdout))[1])
    resumed = per_step(read_trace(tmp / f"trace-{name}-resumed"))
    assert sorted(resumed) == list(range(start + 1, STEPS + 1))
    for step, samples in resumed.items():
        assert samples == straight[step], f"step {step} after the resume differs from the straight run"


@pytest.mark.parametrize("how,nproc", [("deleted", 1), ("truncated", 2)])
def test_a_damaged_data_file_at_start_up_is_one_line(corpus, tmp_path, how, nproc):
    db = str(tmp_path / "db")
    shutil.copytree(corpus["db"], db)
    victim = data_files(db)[-1]
    damage(victim, how)
    ck = tmp_path / "ck"
    proc = run_train(nproc, "--db", db, *FLAGS, "--batch-size", GLOBAL_BATCH // nproc, "--steps", STEPS,
                     "--ckpt-dir", ck, cwd=tmp_path, timeout=180, cold=True)  # found by its command line
    name = f"data/{os.path.basename(victim)}"
    why = f"its data file {name} is missing" if how == "deleted" else f"its data file {name} is truncated"
    check_fault_lines(proc.returncode, proc.stderr, nproc, why, db, failing=nproc)  # every rank reads it
    assert RESTORE in proc.stderr and "--data-version N" in proc.stderr
    assert logged_steps(proc.stdout) == []
    assert check_left_behind(ck, pids_mentioning(str(ck)), 0) == 0


# Each of deleted/truncated, 1/2 ranks and 0/2 loader workers, in three runs (2 ranks with
# and without workers: their pipelines end differently, and a peer waits at the StepGate).
@pytest.mark.parametrize("how,nproc,workers", [("truncated", 1, 2), ("deleted", 2, 2), ("truncated", 2, 0)])
def test_a_data_file_damaged_mid_epoch_ends_the_run_in_one_line(corpus, straight, tmp_path, how, nproc, workers):
    """The one-row append's file is damaged after step DAMAGE_AT; rank 0 meets it when its
    loader reads ahead of the lonely row's step, a loader worker process where there are some."""
    db = str(tmp_path / "db")
    shutil.copytree(corpus["db"], db)
    victim = data_files(db)[0]
    ck, name = tmp_path / "ck", f"mid-{how}-{nproc}-{workers}"
    run = Run(nproc, ["--db", db, *FLAGS, "--batch-size", GLOBAL_BATCH // nproc, "--steps", STEPS,
                      "--num-workers", workers, "--ckpt-dir", ck,
                      "--trace-samples", corpus["tmp"] / f"trace-{name}"], tmp_path)
    run.wait_for_step(DAMAGE_AT)
    damage(victim, how)
    damaged = time.monotonic()
    code, out, err, survivors = run.finish()
    took = time.monotonic() - damaged
    print(f"{name}: the run ended {took:.1f} s after the damage")

    why = f"its data file data/{os.path.basename(victim)} is {'missing' if how == 'deleted' else 'truncated'}"
    check_fault_lines(code, err, nproc, why, db, failing=1)  # only rank 0 reads the file
    assert took < 120  # on 2 ranks, rank 1 does not wait out --dist-timeout (600 s)
    last = max(logged_steps(out))
    assert DAMAGE_AT < last < corpus["lonely_step"], out  # mid-epoch, before the lonely row's step
    failed = per_step(read_trace(corpus["tmp"] / f"trace-{name}"))
    assert all(failed[step] == straight[step] for step in failed)
    saved = check_left_behind(ck, survivors, last)
    assert saved >= DAMAGE_AT

    shutil.copyfile(os.path.join(corpus["db"], "corpus.lance", "data", os.path.basename(victim)), victim)
    check_resume(corpus, straight, nproc, ck, name, db, "--num-workers", workers)


# ── The object store going away mid-run ──────────────────────────────────────────────


class MotoServer:
    """moto's S3 server on a fixed port, killed and started again by the test; a restarted
    moto is empty, so `restart` puts back the objects the store held (a real store comes
    back with its data)."""

    def __init__(self):
        self.port = free_port()
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
                    "AWS_ALLOW_HTTP": "true"}
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, "moto did not start"
            time.sleep(0.2)

    def kill(self):
        kill_tree(self.proc.pid)
        self.proc.wait()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def snapshot(self, bucket):
        s3 = self.client()
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
        return {key: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}

    def restart(self, bucket, objects):
        self.start()
        s3 = self.client()
        s3.create_bucket(Bucket=bucket)
        for key, body in objects.items():
            s3.put_object(Bucket=bucket, Key=key, Body=body)


@pytest.fixture
def moto(monkeypatch):
    server = MotoServer()
    server.start()
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_ENDPOINT", "AWS_PROFILE", "AWS_SESSION_TOKEN", "S3_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    yield server
    server.kill()


@pytest.mark.parametrize("nproc,workers", [(1, 0), (2, 2)])
def test_the_object_store_gone_mid_run_ends_after_the_retry_budget_and_resume_continues(
        corpus, straight, moto, tmp_path, nproc, workers):
    """moto killed after step DAMAGE_AT: the loader retries its reads for RETRY_S seconds,
    then the run ends in one line, exit 3; moto back with the same objects, --resume auto
    trains on the straight run's samples."""
    bucket = "faults"
    moto.client().create_bucket(Bucket=bucket)
    db = f"s3://{bucket}/db"
    write_corpus(db)
    objects = moto.snapshot(bucket)
    ck, name = tmp_path / "ck", f"s3-{nproc}-{workers}"
    budget = ["--storage-option", f"client_retry_timeout={RETRY_S}"]
    run = Run(nproc, ["--db", db, *FLAGS, "--batch-size", GLOBAL_BATCH // nproc, "--steps", STEPS,
                      "--num-workers", workers, "--ckpt-dir", ck, *budget,
                      "--trace-samples", corpus["tmp"] / f"trace-{name}"], tmp_path)
    run.wait_for_step(DAMAGE_AT)
    moto.kill()
    killed = time.monotonic()
    code, out, err, survivors = run.finish()
    took = time.monotonic() - killed
    print(f"{name}: the run ended {took:.1f} s after the store went away (budget {RETRY_S} s)")

    endpoint = moto.env["AWS_ENDPOINT_URL"]
    check_fault_lines(code, err, nproc, f"the object store at {endpoint} could not be reached for", db)
    assert f"(the retry budget is {RETRY_S} s: --storage-option client_retry_timeout=SECONDS)" in err, err
    assert "continue with --resume auto" in err
    waited = [int(s) for s in re.findall(r"could not be reached for (\d+) s", err)]
    assert all(w >= RETRY_S for w in waited) and RETRY_S <= took < RETRY_S + 60, (waited, took)
    last = max(logged_steps(out))
    failed = per_step(read_trace(corpus["tmp"] / f"trace-{name}"))
    assert all(failed[step] == straight[step] for step in failed)
    saved = check_left_behind(ck, survivors, last)
    assert saved >= DAMAGE_AT

    moto.restart(bucket, objects)
    check_resume(corpus, straight, nproc, ck, name, db, "--num-workers", workers, *budget)


def test_an_object_store_back_within_the_retry_budget_costs_a_pause_not_the_run(corpus, straight, moto, tmp_path):
    """moto killed after step DAMAGE_AT and started again OUTAGE_S later, inside the retry
    budget: the loader's reads wait it out, and the run ends as the straight run does."""
    outage_s, budget_s = 4, 90
    bucket = "faults"
    moto.client().create_bucket(Bucket=bucket)
    db = f"s3://{bucket}/db"
    write_corpus(db)
    objects = moto.snapshot(bucket)
    run = Run(1, ["--db", db, *FLAGS, "--batch-size", GLOBAL_BATCH, "--steps", STEPS, "--ckpt-dir", tmp_path / "ck",
                  "--storage-option", f"client_retry_timeout={budget_s}",
                  "--trace-samples", corpus["tmp"] / "trace-s3-back"], tmp_path)
    run.wait_for_step(DAMAGE_AT)
    moto.kill()
    time.sleep(outage_s)
    assert run.proc.poll() is None, run.finish()  # still waiting for the store
    moto.restart(bucket, objects)
    code, out, err, survivors = run.finish()

    assert code == 0 and "error:" not in err, out + err
    assert survivors == []
    assert per_step(read_trace(corpus["tmp"] / "trace-s3-back")) == straight
