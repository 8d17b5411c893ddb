"""Training from a LanceDB Cloud / Enterprise table (`--db db://NAME`), against
bench/lancedb_server.py: a local HTTP server that answers lancedb's own remote client from
the real demo table through Lance's API. The loader reads the same rows in the same order
as from the local table, a run traces the local run's samples, a cut-and-resume equals a
straight run, every request is a bounded scan or a take by row id, and a wrong key or a
server out of reach is one line."""

import json
import subprocess
import sys

import lancedb
import pytest

from conftest import REPO, assert_user_error, free_port, read_trace, run_script, run_trains

KEY = "test-key"
STEPS, CUT = 8, 4


@pytest.fixture(scope="module")
def server(demo_db, tmp_path_factory):
    """The server over the demo db's directory, its URL, request log and the environment
    lancedb's client needs to reach it."""
    log = tmp_path_factory.mktemp("lancedb_server") / "requests.jsonl"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "lancedb_server.py"), "--root", demo_db,
                             "--log", str(log), "--api-key", KEY], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("serving "), first
        url = first.split()[-1]
        yield {"url": url, "log": log, "env": {"LANCEDB_API_KEY": KEY, "LANCEDB_HOST_OVERRIDE": url}}
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def remote_env(server, monkeypatch):
    for name, value in server["env"].items():
        monkeypatch.setenv(name, value)
    return server


def requests(server, since=0):
    lines = server["log"].read_text().splitlines()[since:]
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("pack", [None, 128], ids=["rows", "pack"])
def test_the_loaders_read_the_local_tables_order_through_the_server(demo_db, remote_env, pack):
    from bounded_streaming import BoundedStreamingDataset
    from lancedb.streaming import StreamingDataset

    local = lancedb.connect(demo_db).open_table("corpus")
    remote = lancedb.connect("db://demo", api_key=KEY, host_override=remote_env["url"]).open_table("corpus")
    named = dict(num_splits=4, columns=["input_ids"], read_batch_size=16, shuffle_seed=3,
                 filter="NOT is_dup AND split = 'train'", pack_sequences=pack, eos_id=0 if pack else None,
                 pad_id=0 if pack else None, blocks_per_epoch=400 if pack else None)

    def first(table, cls, n=200):
        out = []
        for sample in cls(table, **named):
            out.append(list(sample["input_ids"]))
            if len(out) == n:
                return out
        return out

    expected = first(local, StreamingDataset)
    assert len(expected) == 200
    since = len(requests(remote_env))
    assert first(remote, StreamingDataset) == expected  # lancedb's own loader, as upstream tests it
    assert first(remote, BoundedStreamingDataset) == expected  # and through this project's wrapper
    assert [r for r in requests(remote_env, since) if r["route"] == "query"], "the server was not read"


def train_flags(db, ck, trace, *extra):
    return ["--model", "tiny", "--db", db, "--steps", STEPS, "--global-batch-size", 8, "--batch-size", 4,
            "--seq-len", 64,
            "--ckpt-dir", ck, "--ckpt-every", CUT, "--eval-every", CUT, "--eval-batches", 1, "--log-every", CUT,
            "--trace-samples", trace, *extra]


@pytest.fixture(scope="module")
def runs(demo_db, server, tmp_path_factory):
    """On the local table and through the server, side by side: a straight run each, on the
    server a run cut at step CUT and resumed and a two-rank run; and the requests they made."""
    root = tmp_path_factory.mktemp("remote_runs")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in server["env"].items():
            mp.setenv(name, value)
        since = len(requests(server))
        local, straight, cut, two = run_trains(
            [(1, train_flags(demo_db, root / "ck-local", root / "tr-local")),
             (1, train_flags("db://demo", root / "ck-remote", root / "tr-remote")),
             (1, train_flags("db://demo", root / "ck-cut", root / "tr-cut", "--steps", CUT)),
             (2, train_flags("db://demo", root / "ck-two", root / "tr-two"))], cwd=root)
        resumed = run_trains([(1, train_flags("db://demo", root / "ck-cut", root / "tr-cut", "--resume", "auto"))],
                             cwd=root)[0]
        made = requests(server, since)
    for proc in (local, straight, cut, two, resumed):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"root": root, "local": local, "straight": straight, "resumed": resumed, "requests": made}


def samples_by_step(trace_dir):
    """step -> the samples every rank trained on in it, in rank order."""
    steps = {}
    for _, records in sorted(read_trace(trace_dir).items()):
        for r in records:
            steps.setdefault(r["step"], []).extend(r["samples"])
    return steps


def test_a_run_through_the_server_trains_the_local_runs_samples(runs):
    root = runs["root"]
    local = samples_by_step(root / "tr-local")
    assert sorted(local) == list(range(1, STEPS + 1))
    assert samples_by_step(root / "tr-remote") == local
    two = samples_by_step(root / "tr-two")  # --global-batch-size: the same samples on any world size
    assert {step: sorted(samples) for step, samples in two.items()} == \
        {step: sorted(samples) for step, samples in local.items()}
    assert len(read_trace(root / "tr-two")) == 2
    assert "data: table 'corpus' in 'db://demo', version 1" in runs["straight"].stdout
    assert runs["straight"].stdout.count("val loss @ step") == STEPS // CUT


def test_a_cut_and_resume_through_the_server_equals_the_straight_run(runs):
    root = runs["root"]
    assert samples_by_step(root / "tr-cut") == samples_by_step(root / "tr-remote")
    assert "resumed from" in runs["resumed"].stdout


def test_the_loader_never_asks_for_a_whole_table(runs):
    queries = [r for r in runs["requests"] if r.get("route") == "query"]
    takes = [r for r in queries if r["body"].get("take_rows")]
    assert takes and all(r["status"] == 200 for r in runs["requests"])
    for r in queries:
        if r["body"].get("take_rows"):
            continue  # rows fetched by id: at most a read batch
        columns = r["body"].get("columns")
        columns = list(columns.values()) if isinstance(columns, dict) else columns
        # a scan reads one narrow column (row ids, token counts) or a single row
        assert r["body"].get("k") == 1 or (columns and set(columns) <= {"_rowid", "n_tokens"}), r
    assert max(r["body"]["take_rows"] for r in takes) <= 64


def test_a_wrong_key_and_a_server_out_of_reach_are_one_line(server, tmp_path, monkeypatch):
    monkeypatch.setenv("LANCEDB_HOST_OVERRIDE", server["url"])
    monkeypatch.setenv("LANCEDB_API_KEY", "wrong")
    args = ["--model", "tiny", "--db", "db://demo", "--steps", 1, "--ckpt-dir", tmp_path / "ck"]
    wrong_key = run_trains([(1, args)], cwd=tmp_path)[0]
    assert_user_error(wrong_key, "refused the API key", "LANCEDB_API_KEY")
    monkeypatch.setenv("LANCEDB_API_KEY", KEY)
    monkeypatch.setenv("LANCEDB_HOST_OVERRIDE", f"http://127.0.0.1:{free_port()}")
    out_of_reach = run_trains([(1, args)], cwd=tmp_path)[0]
    assert_user_error(out_of_reach, "cannot reach the LanceDB server")
    monkeypatch.delenv("LANCEDB_API_KEY")
    assert_user_error(run_trains([(1, args)], cwd=tmp_path)[0], "needs an API key")
    assert not (tmp_path / "ck").exists()


def test_prepare_data_refuses_a_server_in_one_line(server, tmp_path, monkeypatch):
    monkeypatch.setenv("LANCEDB_API_KEY", KEY)
    monkeypatch.setenv("LANCEDB_HOST_OVERRIDE", server["url"])
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a document long enough to be kept " * 4}) + "\n")
    proc = run_script("prepare_data.py", tmp_path / "d.jsonl", "--db", "db://demo", "--table", "other", cwd=tmp_path)
    assert_user_error(proc, "cannot write to db://demo", "Lance's own files")
