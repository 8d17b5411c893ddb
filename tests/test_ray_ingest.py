"""prepare_data.py --ray on a real Ray cluster of 2 nodes on this machine (127.0.0.1, one
cluster for the whole module): the same table as --workers 2 (create, append, s3://),
whatever a killed worker or driver does, one line for a user's mistake, no Ray imported
without --ray and no Ray process left by a command that started its own."""

import importlib.util
import json
import os
import re
import tempfile
import signal
import subprocess
import sys
import time
from pathlib import Path

import lancedb
import pytest

from common import CORPUS_SCHEMA
from conftest import REPO, assert_user_error, make_bucket, pids_mentioning, run_script, sigint_at_default, wait_gone
from prepare_data import content_digest, ingest
from test_ingest_atomic import open_feed
from test_ingest_workers import mixed_inputs
from test_prepare_data import prose, write_jsonl

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

if not (importlib.util.find_spec("ray") and importlib.util.find_spec("lance")):  # not imported here:
    pytest.skip("the `ray` extra is not installed: pip install -e '.[ray]'",  # lance is not
                allow_module_level=True)  # fork-safe, and this process starts processes

OBJECT_STORE = 80 << 20  # per node: tiny inputs, and a small store starts faster
FLAGS = ["--batch-size", 7, "--val-fraction", 0.2]


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node, 1 CPU each, on 127.0.0.1; its address. Ray turns a driver's
    127.0.0.1 into the machine's own address, where this cluster does not listen, unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its switch for one-machine clusters): the drivers
    the tests start inherit it."""
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    started = time.perf_counter()
    node = dict(num_cpus=1, object_store_memory=OBJECT_STORE, node_ip_address="127.0.0.1")
    ray_cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    ray_cluster.add_node(**node)
    ray_cluster.wait_for_nodes()
    print(f"2-node Ray cluster up in {time.perf_counter() - started:.1f} s")
    yield ray_cluster.address
    ray_cluster.shutdown()
    mp.undo()


def ray_run(address, *args, env=None, timeout=180):
    proc = run_script("prepare_data.py", *args, "--ray", address, cwd=REPO, env=env, timeout=timeout)
    return proc


def jsonl(path, texts, **fields):
    return str(write_jsonl(path, [{"text": t, **fields} for t in texts]))


def table_of(db, table="corpus", **options):
    return lancedb.connect(str(db), **options).open_table(table)


def summary_counts(stdout):
    """(docs, tokens, dups, val, skipped) of the summary line."""
    return re.search(r"wrote (\d+) docs \((\d+) tokens\).*?: (\d+) dups, (\d+) val; "
                     r"skipped (.*?); ", stdout).groups()


def test_same_table_as_workers_then_append_with_a_worker_killed(cluster, tmp_path):
    """Every input type, duplicates across chunks and files, 2 nodes: --ray writes the table
    --workers 2 writes; then an append, whose first map task SIGKILLs its own worker
    process (Ray retries it), gives the same table as --workers 2's append."""
    inputs = mixed_inputs(tmp_path)
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    ingest(inputs, str(local), "corpus", "byte", batch_size=7, workers=2, val_fraction=0.2)
    proc = ray_run(cluster, *inputs, "--db", on_ray, *FLAGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Ray: 2 nodes" in proc.stdout and "Traceback" not in proc.stderr
    expected, got = table_of(local).to_arrow(), table_of(on_ray).to_arrow()
    assert got.schema.remove_metadata().equals(CORPUS_SCHEMA)
    assert got.equals(expected)
    assert got.num_rows > 100 and sum(got.column("is_dup").to_pylist()) > 10
    assert table_of(on_ray).schema.field("input_ids").metadata == \
        table_of(local).schema.field("input_ids").metadata  # the tokenizer, recorded

    more = jsonl(tmp_path / "more.jsonl", [prose(i) for i in range(40, 70)])  # dups, and new
    ingest([more], str(local), "corpus", "byte", batch_size=7, workers=2, val_fraction=0.2,
           mode="append")
    marker = tmp_path / "killed-once"
    proc = ray_run(cluster, more, "--db", on_ray, *FLAGS, "--mode", "append",
                   env={"PREPARE_DATA_RAY_KILL_ONCE": str(marker)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists()  # a worker process really died mid-job
    expected, got = table_of(local).to_arrow(), table_of(on_ray).to_arrow()
    assert got.equals(expected)
    assert got.column("id").to_pylist() == list(range(got.num_rows))
    assert table_of(on_ray).version == 2


def test_s3(cluster, s3_env, tmp_path):
    """To s3:// (moto): the cluster's workers write the fragments there, with the driver's
    store settings, and the table is the one --workers 2 writes locally."""
    bucket = make_bucket("ray-corpus")
    inputs = mixed_inputs(tmp_path)
    one_node = ingest(inputs, str(tmp_path / "local"), "corpus", "byte", batch_size=7, workers=2)
    proc = ray_run(cluster, *inputs, "--db", f"s3://{bucket}/db", "--batch-size", 7)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary_counts(proc.stdout)[:4] == tuple(str(one_node[k]) for k in
                                                    ("docs", "tokens", "dups", "val"))
    assert table_of(f"s3://{bucket}/db").to_arrow().equals(table_of(tmp_path / "local").to_arrow())


def data_files(table_dir):
    data = Path(table_dir) / "data"
    return set(os.listdir(data)) if data.is_dir() else set()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_driver_stopped_before_commit_leaves_the_table_and_clean_fragments(cluster, tmp_path, sig):
    """The driver reads a FIFO: once the workers have written fragments, it is SIGKILLed
    (or gets Ctrl-C) before its commit. The table is at its version, rows and all;
    --clean-fragments lists and removes the fragments."""
    db = tmp_path / "db"
    first = jsonl(tmp_path / "first.jsonl", [prose(i) for i in range(20)])
    ingest([first], str(db), "corpus", "byte", workers=1)
    before = table_of(db).to_arrow()
    table_dir = db / "corpus.lance"
    old_files = data_files(table_dir)

    fifo = tmp_path / "feed.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "prepare_data.py", str(fifo), "--db", str(db),
                             "--mode", "append", "--batch-size", "5", "--ray", cluster],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_default)
    feed = open_feed(fifo, proc)
    deadline = time.monotonic() + 90
    i = 100
    while not {name for name in data_files(table_dir) - old_files if not name.startswith(".tmp")}:  # a whole fragment
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        feed.write(json.dumps({"text": prose(i)}) + "\n")
        feed.flush()
        i += 1
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    feed.close()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and stderr.strip() == "interrupted: the table is as it was"
    leftovers = data_files(table_dir) - old_files
    tbl = table_of(db)
    assert tbl.version == 1 and tbl.to_arrow().equals(before)

    settled = data_files(table_dir)  # Ray ends the dead driver's job: its writes stop
    while time.sleep(1.0) or data_files(table_dir) != settled:
        settled = data_files(table_dir)
    clean = run_script("prepare_data.py", "--db", db, "--clean-fragments", cwd=REPO)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    removed = int(re.search(r"(\d+) unused data files? removed", clean.stdout)[1])
    assert removed == len(settled - old_files) > 0
    finished = {name for name in leftovers if not name.startswith(".tmp")}  # a temp file may have become one
    assert finished <= settled and not data_files(table_dir) - old_files
    assert table_of(db).to_arrow().equals(before)


def test_user_errors_and_no_ray_without_the_flag(cluster, tmp_path):
    """A bad --ray address and a bad input line found by a Ray task: one line each, exit 2,
    nothing on disk. Without --ray, Ray and lance are never imported."""
    docs = str(write_jsonl(tmp_path / "docs.jsonl",
                           [{"text": prose(i), "score": 1.5} for i in range(12)]
                           + [{"text": prose(50), "score": "high"}]))
    db = tmp_path / "db"
    proc = ray_run("127.0.0.1:1", docs, "--db", db)
    assert_user_error(proc, "--ray 127.0.0.1:1", "cannot join the Ray cluster")
    assert not db.exists()
    proc = ray_run(cluster, docs, "--db", db, "--score-field", "score", "--batch-size", 4)
    assert_user_error(proc, f"{docs}:13", "--score-field 'score'")
    assert not db.exists()

    without_ray = "import sys; sys.modules['ray'] = None; import prepare_data; prepare_data.main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", without_ray, docs, "--db", str(db), "--ray", cluster],
                          cwd=REPO, capture_output=True, text=True)
    assert_user_error(proc, "--ray needs Ray and pylance", "pip install -e '.[ray]'")
    assert not db.exists()

    code = ("import sys, prepare_data; prepare_data.main(sys.argv[1:]); "
            "assert not {'ray', 'lance'} & set(sys.modules), 'imported'")
    proc = subprocess.run([sys.executable, "-c", code, docs, "--db", str(db), "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_local_ray_leaves_no_process(tmp_path):
    """--ray local starts a Ray of its own (1 node, so 1 dedup shard) and stops it: the same
    table as --workers 2, and no Ray process outlives the command."""
    inputs = mixed_inputs(tmp_path)
    ingest(inputs, str(tmp_path / "local"), "corpus", "byte", batch_size=7, workers=2)
    marker = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # named by this run's Ray processes
    proc = run_script("prepare_data.py", *inputs, "--db", tmp_path / "db", "--ray", "local",
                      "--batch-size", 7, cwd=REPO, env={"RAY_TMPDIR": marker,
                                                       "RAY_object_store_memory": str(OBJECT_STORE)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fork" not in proc.stderr, proc.stderr  # lance's fork warnings, from Ray's process starts
    assert re.search(r"Ray: 1 node, \d+ CPUs, 1 dedup shard,", proc.stdout), proc.stdout
    assert table_of(tmp_path / "db").to_arrow().equals(table_of(tmp_path / "local").to_arrow())
    assert not wait_gone(pids_mentioning(marker), timeout=20)


@pytest.mark.parametrize("moment", ["importing", "Ray starting"])
def test_ctrl_c_during_a_local_rays_start_up_is_one_line(tmp_path, moment):
    """A terminal's Ctrl-C (the whole process group) while prepare_data.py imports, or while
    --ray local starts its Ray: one line, exit 130, no traceback, no Ray process left."""
    source = write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i)} for i in range(2000)])
    marker = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # named by this run's Ray processes
    proc = subprocess.Popen([sys.executable, "prepare_data.py", str(source), "--db", str(tmp_path / "db"), "--ray",
                             "local", "--batch-size", "10"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=sigint_at_default,
                            env={**os.environ, "RAY_TMPDIR": marker, "RAY_object_store_memory": str(OBJECT_STORE)})
    started = time.monotonic()
    while not (time.monotonic() - started >= 0.5 if moment == "importing" else pids_mentioning(marker)):
        assert proc.poll() is None and time.monotonic() - started < 120, proc.communicate()
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)
    assert err.strip().splitlines() in (["interrupted while starting: nothing was written"],
                                        ["interrupted: the table is as it was"]), err
    assert not wait_gone(pids_mentioning(marker), timeout=20)
    assert not (tmp_path / "db").exists() or lancedb.connect(str(tmp_path / "db")).table_names() == []
