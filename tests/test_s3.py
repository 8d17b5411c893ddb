"""The corpus and the blocks on object storage, against a real S3 API on 127.0.0.1 (moto):
ingest to s3://, train row and --pack from it under torchrun, resume elastically from it
with the same per-step samples as the same corpus on local disk, the A/B lance and mosaic
modes from s3://, and one clear line (quickly) when the store is unreachable or the bucket
does not exist.
"""

import contextlib
import json
import os
import random
import signal
import time

import pytest

import build_packed_datasets
from blocks_loaders import read_manifest
from conftest import (assert_user_error, free_port, is_alive, kill_tree, make_bucket, pids_mentioning, process_tree,
                      read_trace, run_script, run_trains, start_train, wait_gone)
from test_elastic import per_step, resumed_from
from test_fault_tolerance import rank_pids
from test_preemption import wait_for_steps

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

STEPS, HALF = 12, 6
SEQ_LEN = 64
FAST = ["--model", "tiny", "--seq-len", SEQ_LEN, "--log-every", 3, "--eval-batches", 1,
        "--warmup-steps", 3, "--lr-total-steps", STEPS, "--num-splits", 4, "--grad-accum", 2]
WORDS = ("lance stream shard block token epoch split rank loader packed corpus model "
         "gradient optimizer checkpoint resume bucket object store node batch").split()


def corpus_jsonl(path, docs=240):
    """Documents of varied length, scored 2.0 so all pass the quality filter."""
    rng = random.Random(7)
    with open(path, "w") as f:
        for i in range(docs):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 90))]
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(words) + ".", "score": 2.0}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpora(s3_env, tmp_path_factory):
    """The same documents ingested by prepare_data.py into a local db and into s3://."""
    tmp = tmp_path_factory.mktemp("s3")
    bucket = make_bucket("corpus-bucket")
    source = corpus_jsonl(tmp / "docs.jsonl")
    local, remote = str(tmp / "db"), f"s3://{bucket}/lancedb"
    started = time.perf_counter()
    for db in (local, remote):
        proc = run_script("prepare_data.py", source, "--db", db, "--score-field", "score",
                          "--val-fraction", "0.1", cwd=tmp)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"tmp": tmp, "local": local, "remote": remote, "bucket": bucket,
            "ingest_s": time.perf_counter() - started}


def run_flags(db, nproc, path, tmp, name, *extra):
    return ["--db", db, *FAST, "--batch-size", 8 // nproc, *(["--pack"] if path == "pack" else []),
            "--ckpt-dir", tmp / f"ck-{name}", "--trace-samples", tmp / f"trace-{name}", *extra]


@pytest.mark.parametrize("path", ["row", "pack"])
def test_train_from_s3_on_two_ranks_then_resume_on_one_like_local_disk(corpora, s3_env, path):
    """s3: 2 ranks to HALF (checkpoint), then 1 rank to STEPS with --resume auto and two loader
    workers, the endpoint given by --storage-option only; local disk: 1 rank straight."""
    tmp, remote = corpora["tmp"], corpora["remote"]
    resume_options = ["--num-workers", 2, "--resume", "auto",
                      "--storage-option", f"aws_endpoint={s3_env['AWS_ENDPOINT_URL']}",
                      "--storage-option", "allow_http=true"]
    started = time.perf_counter()
    local, first = run_trains([
        (1, run_flags(corpora["local"], 1, path, tmp, f"local-{path}", "--steps", STEPS)),
        (2, run_flags(remote, 2, path, tmp, f"s3-{path}", "--steps", HALF, "--ckpt-every", HALF)),
    ], cwd=tmp)
    for proc in (local, first):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.MonkeyPatch.context() as mp:  # the workers must get the endpoint from the flag
        mp.delenv("AWS_ENDPOINT_URL")
        (second,) = run_trains([(1, run_flags(remote, 1, path, tmp, f"s3-{path}", "--steps", STEPS,
                                              *resume_options))], cwd=tmp)
    assert second.returncode == 0, second.stdout + second.stderr
    print(f"s3 {path}: {time.perf_counter() - started:.1f} s for the three runs")

    assert resumed_from(second.stdout).endswith(f"step_{HALF:08d}.pt")
    assert "data_wait" in first.stdout and "data_wait" in second.stdout
    want = per_step(read_trace(tmp / f"trace-local-{path}"))
    got = per_step(read_trace(tmp / f"trace-s3-{path}"))
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == want[step], f"step {step}: s3 (2 ranks, then 1) differs from local disk"
    assert want[1] != want[2]


@pytest.fixture(scope="module")
def s3_blocks(corpora):
    """build_packed_datasets.py from the s3 corpus to s3:// (lance and mds), and the same
    build from the local corpus to local disk."""
    tmp, out = corpora["tmp"], f"s3://{corpora['bucket']}/blocks"
    proc = run_script("build_packed_datasets.py", "--db", corpora["remote"], "--out", out,
                      "--formats", "lance,mds", "--seq-len", SEQ_LEN, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    local = build_packed_datasets.build(corpora["local"], "corpus", str(tmp / "blocks"),
                                        formats=["lance", "parquet-seq"], seq_len=SEQ_LEN)
    again = run_script("build_packed_datasets.py", "--db", corpora["remote"], "--out", out,
                       "--formats", "mds", "--seq-len", SEQ_LEN, cwd=tmp)
    assert_user_error(again, f"{out}/mds already exists", "--overwrite")
    return out, local


def test_blocks_built_on_s3_are_the_local_blocks(s3_blocks):
    out, local = s3_blocks
    for fmt in ("lance", "mds"):
        manifest = read_manifest(f"{out}/{fmt}", fmt)
        assert manifest["content_hash"] == local["lance"]["content_hash"]
        assert manifest["num_blocks"] == local["lance"]["num_blocks"] > 0


def test_ab_lance_and_mosaic_modes_train_from_s3(s3_blocks, corpora):
    """Both modes on 2 ranks from s3://; Mosaic caches the shards once per node, under the
    blocks' content hash, and its two local ranks start at the same moment."""
    from test_blocks_train import built_block_names

    out, local = s3_blocks
    tmp = corpora["tmp"]
    cache = tmp / "mosaic-cache"
    modes = {"lance": "lance", "mosaic": "mds"}
    jobs = [(2, [*FAST[:4], "--steps", 4, "--log-every", 2, "--batch-size", 4, "--num-splits", 8,
                 "--blocks-mode", mode, "--blocks-path", f"{out}/{fmt}", "--mosaic-cache", cache,
                 "--ckpt-dir", tmp / f"ck-ab-{mode}", "--trace-samples", tmp / f"trace-ab-{mode}",
                 "--num-workers", 0 if mode == "lance" else 1])
            for mode, fmt in modes.items()]
    for mode, proc in zip(modes, run_trains(jobs, cwd=tmp, timeout=400)):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"[{mode}] final: opt_step=4" in proc.stdout
        names = built_block_names(tmp / "blocks")
        steps = per_step(read_trace(tmp / f"trace-ab-{mode}"))
        assert sorted(steps) == [1, 2, 3, 4]
        unknown = [h for c in steps.values() for h in c if h not in names]
        assert not unknown, f"{mode}: {len(unknown)} trained blocks are not the built blocks"
    assert [p.name for p in cache.iterdir()] == [local["lance"]["content_hash"][:16]]


def test_s3_loader_benchmark_runs_side_by_side(s3_blocks, corpora, tmp_path):
    """bench/s3_loaders.py copies the local blocks and corpus to the bucket and times both
    lance paths from disk and from S3 (no timing asserted)."""
    out = tmp_path / "s3.json"
    proc = run_script("bench/s3_loaders.py", "--blocks", corpora["tmp"] / "blocks", "--out", out,
                      "--bucket", "bench-bucket", "--repeats", 1, "--min-tokens", 20_000,
                      "--batch-size", 4, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["lance", "lance-docs"]
    for r in data["results"]:
        assert set(r["runs"]) == {"disk", "s3"}
        assert all(run["tokens"] >= 20_000 for runs in r["runs"].values() for run in runs)
        assert r["steady_s3_over_disk"] > 0 and r["overall_s3_over_disk"] > 0


@pytest.fixture
def silent_endpoint():
    """An endpoint that accepts connections and never answers (the kernel's backlog does)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


FAILURES = [(script, case) for script in ("train", "prepare_data", "build_packed_datasets", "blocks")
            for case in ("missing bucket", "unreachable endpoint")] + [("train", "silent endpoint")]
EXPECTED = {"missing bucket": "does not exist", "unreachable endpoint": "cannot reach the object store",
            "silent endpoint": "did not answer in time"}


@pytest.mark.parametrize("script,case", FAILURES)
def test_a_store_that_fails_is_one_line(s3_env, corpora, tmp_path, request, script, case):
    bucket = "no-such-bucket" if case == "missing bucket" else corpora["bucket"]
    endpoint = {"unreachable endpoint": lambda: f"http://127.0.0.1:{free_port()}",
                "silent endpoint": lambda: request.getfixturevalue("silent_endpoint")}.get(case)
    argv = {
        "train": ("train.py", "--db", f"s3://{bucket}/lancedb", "--steps", 1),
        "prepare_data": ("prepare_data.py", corpus_jsonl(tmp_path / "d.jsonl", 5), "--db",
                         f"s3://{bucket}/lancedb", "--table", "other"),
        "build_packed_datasets": ("build_packed_datasets.py", "--db", corpora["local"], "--out",
                                  f"s3://{bucket}/other-blocks", "--formats", "lance"),
        "blocks": ("train.py", "--blocks-mode", "lance", "--blocks-path", f"s3://{bucket}/blocks/lance",
                   "--seq-len", SEQ_LEN, "--steps", 1),
    }[script]
    started = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        if endpoint:
            mp.setenv("AWS_ENDPOINT_URL", endpoint())
        proc = run_script(*argv, cwd=tmp_path, timeout=120)
    elapsed = time.perf_counter() - started
    assert_user_error(proc, EXPECTED[case])
    assert elapsed < 60, f"{script} took {elapsed:.0f} s to give up"
    assert not list(tmp_path.glob("ck*")) and not (tmp_path / "checkpoints").exists()


@contextlib.contextmanager
def starved(proc, trace, s3_env):
    """Once the run has traced 2 steps, the store freezes (moto SIGSTOPped: requests hang);
    once no step has been traced for 3 s, the read-ahead is drained and the next epoch's
    permutation cannot be read: the loader starves. Yields the run's process tree; the store
    thaws and the run's tree is killed on the way out."""
    (store,) = pids_mentioning(f"moto.server -H 127.0.0.1 -p {s3_env['AWS_ENDPOINT_URL'].rsplit(':', 1)[1]}")
    try:
        wait_for_steps(trace, 2, proc)
        os.kill(store, signal.SIGSTOP)
        traced, since, deadline = -1, time.monotonic(), time.monotonic() + 120
        while time.monotonic() - since < 3:  # a slow machine drains the epoch's read-ahead later
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            now = sum(len(records) for records in read_trace(trace).values())
            if now != traced:
                traced, since = now, time.monotonic()
            time.sleep(0.1)
        yield process_tree(proc.pid)
    finally:
        os.kill(store, signal.SIGCONT)
        kill_tree(proc.pid)


def seconds_to_saved(ck, proc, sent):
    """Seconds from `sent` until a checkpoint is in `ck` (or the run ended, or 30 s passed)."""
    while not list(ck.glob("step_*[0-9].pt")) and proc.poll() is None and time.monotonic() - sent < 30:
        time.sleep(0.01)
    return time.monotonic() - sent


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stop_while_the_store_hangs_saves_at_once_and_a_second_ctrl_c_ends_the_teardown(
        corpora, s3_env, tmp_path, workers):
    """The loader starves (the store frozen). A Ctrl-C then checkpoints the last step at once:
    the wait for a batch gives way, and the checkpoint does not wait for the loader's teardown,
    which cannot end while reads hang. A second Ctrl-C during that teardown exits 130 at once,
    with one line, and leaves no loader worker (nor forkserver) behind."""
    ck, trace = tmp_path / "ck-hang", tmp_path / "trace-hang"
    proc = start_train(1, *run_flags(corpora["remote"], 1, "row", tmp_path, "hang", "--epochs", 1000,
                                     "--ckpt-every", 100000, "--loader-buffer-mb", 1, "--num-workers", workers),
                       cwd=tmp_path)
    with starved(proc, trace, s3_env) as tree:
        proc.send_signal(signal.SIGINT)
        saved = seconds_to_saved(ck, proc, time.monotonic())
        again = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        exited = time.monotonic() - again
        survivors = wait_gone(tree, timeout=2)
    assert proc.returncode == 130 and "Traceback" not in err, out + err
    assert err.strip().splitlines()[-1].startswith("interrupted by a second Ctrl-C"), err
    assert saved < 5 and list(ck.glob("step_*[0-9].pt")), (saved, out + err)
    assert exited < 3, exited
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]


def test_a_stop_to_one_rank_while_the_store_hangs_checkpoints_every_rank_at_once(corpora, s3_env, tmp_path):
    """Two ranks (--grad-accum 2) starve (the store frozen), and SIGTERM reaches rank 1 alone.
    The step neither rank has its batches for is called off for both (preemption.StepGate):
    they checkpoint the last step at once, together, and the run exits 0 after its bounded
    teardown, leaving no process behind. Without the gate both wait out the store's retry
    budget, then exit 3."""
    ck, trace = tmp_path / "ck-hang2", tmp_path / "trace-hang2"
    proc = start_train(2, *run_flags(corpora["remote"], 2, "row", tmp_path, "hang2", "--epochs", 1000,
                                     "--ckpt-every", 100000, "--loader-buffer-mb", 1), cwd=tmp_path)
    with starved(proc, trace, s3_env) as tree:
        sent = time.monotonic()
        for pid in rank_pids(proc.pid)[1]:
            os.kill(pid, signal.SIGTERM)
        saved = seconds_to_saved(ck, proc, sent)
        out, err = proc.communicate(timeout=30)
        exited = time.monotonic() - sent
        survivors = wait_gone(tree, timeout=2)
    assert proc.returncode == 0 and "Traceback" not in err, out + err
    assert saved < 5, (saved, out + err)
    (path,) = ck.glob("step_????????.pt")  # the main file; each rank adds its own
    steps = {rank: [r["step"] for r in records] for rank, records in read_trace(trace).items()}
    assert steps[0] == steps[1] and steps[0][-1] == int(path.stem.split("_")[1]), (steps, path)
    assert exited < saved + 15, exited
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read() for pid in survivors if is_alive(pid)]
