"""prepare_data.py at node scale: the same table whatever --workers, clean ends (a bad
input in a worker, Ctrl-C, SIGKILL) with no process left behind, appends that read only
the digest column, and tables made before that column existed."""

import base64
import fcntl
import gzip
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepare_data
from common import CORPUS_SCHEMA, LEGACY_SCHEMA, UserError
from conftest import REPO, _proc_stat, pids_mentioning, sigint_at_default, wait_gone
from prepare_data import content_digest, ingest
from test_ingest_atomic import open_feed
from test_prepare_data import bpe_spec, prose, read_table, write_jsonl  # noqa: F401 (a fixture)


def mixed_inputs(tmp_path) -> list[str]:
    """Every input type, ~160 documents: with --batch-size 7 they span ~25 chunks. Holds
    exact and normalized duplicates (across files and types), short documents, blank and
    bad lines, a missing and a non-string text, a lone surrogate, a null parquet text,
    CRLF and CR line ends in .txt files, and a directory's other file types."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i:02d}.txt").write_bytes(prose(i).replace(". ", ".\r\n").encode())
    (docs / "12.txt").write_text("too short")
    (docs / "13.txt").write_bytes(prose(100).replace(". ", ".\r").encode())
    (docs / "notes.md").write_text(prose(3))
    lines = []
    for i in range(60):
        lines.append({"text": prose(i % 45)})  # 15 exact duplicates
        if i % 9 == 0:
            lines += ["", "{not json", json.dumps([1, 2]), {"body": prose(i)}, {"text": 7},
                      {"text": "short"}, '{"text": "a lone \\ud800 surrogate ' + "x" * 60 + '"}']
    write_jsonl(tmp_path / "a.jsonl", lines)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for i in range(40):  # normalized duplicates of a.jsonl's: case and spacing differ
            f.write(json.dumps({"text": prose(i).upper() if i % 4 == 0 else prose(200 + i)}) + "\n")
    texts = [prose(300 + i) if i % 10 else None for i in range(50)] + [prose(1), prose(2)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet", row_group_size=9)
    return [str(docs), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"),
            str(tmp_path / "c.parquet")]


def test_the_table_is_the_same_whatever_the_worker_count(tmp_path):
    inputs = mixed_inputs(tmp_path)
    tables, summaries = [], []
    for workers in (1, 2, 3):
        db = str(tmp_path / f"db{workers}")
        summaries.append(ingest(inputs, db, "corpus", "byte", batch_size=7, workers=workers,
                                val_fraction=0.2))
        tables.append(lancedb.connect(db).open_table("corpus").to_arrow())  # in stored order
    assert tables[0].schema.remove_metadata().equals(CORPUS_SCHEMA)
    assert tables[1].equals(tables[0]) and tables[2].equals(tables[0])
    assert [s["workers"] for s in summaries] == [1, 2, 3]
    first = summaries[0]
    for s in summaries[1:]:
        assert {k: s[k] for k in ("docs", "tokens", "dups", "val", "skipped", "batches")} == \
               {k: first[k] for k in ("docs", "tokens", "dups", "val", "skipped", "batches")}
    assert first["batches"] > 15  # really many chunks
    assert first["skipped"] == {"other_type": 1, "short": 8, "bad_json": 14, "no_text": 19,
                                "bad_text": 7}
    rows = tables[0].to_pylist()
    assert [r["id"] for r in rows] == list(range(len(rows)))
    assert all(r["digest"] == content_digest(r["text"]) for r in rows)
    assert all("\r" not in r["text"] for r in rows[:13])  # .txt read as text mode reads it
    first_seen, expected_dups = set(), []
    for r in rows:
        expected_dups.append(r["digest"] in first_seen)
        first_seen.add(r["digest"])
    assert [r["is_dup"] for r in rows] == expected_dups and sum(expected_dups) >= 25


def test_an_hf_tokenizer_writes_the_same_ids_from_the_command_line_and_in_process(tmp_path,
                                                                                 bpe_spec):
    """The command line loads transformers without torch and hands the workers the fast
    tokenizer's Rust backend; this process has torch and tokenizes in-process."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": prose(i) + " [SEP] <pad>"} for i in range(60)])
    proc = subprocess.run([sys.executable, "prepare_data.py", str(path), "--db", str(tmp_path / "cli"),
                           "--tokenizer", bpe_spec, "--batch-size", "7", "--workers", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 workers" in proc.stdout, proc.stdout + proc.stderr
    ingest([str(path)], str(tmp_path / "here"), "corpus", bpe_spec, batch_size=7, workers=1)
    cli, here = read_table(tmp_path / "cli"), read_table(tmp_path / "here")
    assert here.num_rows == 60  # not two empty tables
    assert cli.equals(here) and cli.schema.field("input_ids").metadata == \
        here.schema.field("input_ids").metadata
    sep = prepare_data.load_tokenizer(bpe_spec).eos_token_id  # [SEP] is this tokenizer's EOS
    assert all(sep not in ids for ids in here.column("input_ids").to_pylist())  # text, not EOS


def test_workers_1_runs_in_process_and_a_bad_worker_count_is_refused(tmp_path, capsys):
    prepare_data._worker.clear()
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": prose(i)} for i in range(30)])
    summary = ingest([str(path)], str(tmp_path / "db"), "corpus", "byte", batch_size=4,
                     workers=1)
    assert summary["docs"] == 30 and prepare_data._worker["opts"].tokenizer == "byte"
    assert "main process" not in capsys.readouterr().out  # no worker process to wait for
    with pytest.raises(UserError, match="--workers must be at least 1"):
        ingest([str(path)], str(tmp_path / "db2"), "corpus", "byte", workers=0)


def spawned_children(pid: int) -> list[int]:
    """The worker processes (spawned Python interpreters) whose parent is `pid`."""
    return [p for p in pids_mentioning("spawn_main") if (stat := _proc_stat(p)) and stat[1] == pid]


def test_a_fatal_input_in_a_worker_is_one_error_and_leaves_the_table(tmp_path):
    db = str(tmp_path / "db")
    ingest([str(write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i), "q": 1} for i in range(5)]))],
           db, "corpus", "byte", score_field="q")
    before = lancedb.connect(db).open_table("corpus").version
    records = [{"text": prose(i), "q": 0.5} for i in range(200)]
    records[150] = {"text": prose(150), "q": "high"}  # line 151, in the 16th chunk of 10
    path = write_jsonl(tmp_path / "b.jsonl", records)
    with pytest.raises(UserError, match=r"b\.jsonl:151: --score-field 'q' is missing or not a number"):
        ingest([str(path)], db, "corpus", "byte", mode="append", score_field="q", batch_size=10,
               workers=2)
    tbl = lancedb.connect(db).open_table("corpus")
    assert tbl.version == before and tbl.count_rows() == 5
    assert wait_gone(spawned_children(os.getpid()), timeout=10.0) == []


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_ctrl_c_or_a_kill_mid_run_leaves_the_table_and_no_worker(tmp_path, how):
    """The run reads a FIFO the test feeds: several chunks go to the workers, then the
    main process waits for more input, uncommitted, while its workers are alive."""
    db = str(tmp_path / "db")
    ingest([str(write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i)} for i in range(5)]))], db,
           "corpus", "byte")
    before = lancedb.connect(db).open_table("corpus").version
    fifo = tmp_path / "feed.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "prepare_data.py", str(fifo), "--db", db, "--mode", "append",
         "--batch-size", "10", "--workers", "2"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=sigint_at_default)
    feed = open_feed(fifo, proc)
    feed.writelines(json.dumps({"text": prose(i)}) + "\n" for i in range(100, 200))
    feed.flush()
    deadline = time.monotonic() + 60
    while len(workers := spawned_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(workers) == 2 and proc.poll() is None, proc.communicate()
    time.sleep(1.0)  # the chunks reach the workers and come back
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends its foreground group
        time.sleep(0.5)
    else:
        proc.kill()
    feed.close()  # the main process, if still there, sees the end of its input
    out, err = proc.communicate(timeout=60)
    if how == "ctrl-c":
        assert proc.returncode == 130 and out == "", out + err
        assert err.strip().splitlines() == ["interrupted: the table is as it was"], err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert wait_gone(workers, timeout=10.0) == []
    tbl = lancedb.connect(db).open_table("corpus")
    assert tbl.version == before and tbl.count_rows() == 5


def incompressible_corpus(db: str, rows: int, *, legacy: bool = False):
    """A corpus table of `rows` ~22 KB documents of random base64 (lance cannot compress
    them, so reading `text` costs its size), written straight with pyarrow."""
    rng = np.random.default_rng(0)
    texts = [f"{i} " + base64.b64encode(rng.bytes(16_000)).decode() for i in range(rows)]
    ids = [list(t.encode()[:8]) for t in texts]
    columns = {"id": np.arange(rows), "text": texts, "input_ids": ids,
               "n_tokens": [len(x) for x in ids], "score": [2.0] * rows, "is_dup": [False] * rows,
               "split": ["train"] * rows}
    if not legacy:
        columns["digest"] = [content_digest(t) for t in texts]
    schema = LEGACY_SCHEMA if legacy else CORPUS_SCHEMA
    lancedb.connect(db).create_table("corpus", pa.table(columns, schema=schema))
    return texts


def bytes_read() -> int:
    """Bytes this process has read through system calls so far (page cache hits too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")
def test_an_append_reads_only_the_digest_column(tmp_path):
    db = str(tmp_path / "db")
    texts = incompressible_corpus(db, 1500)
    text_bytes = sum(map(len, texts))
    path = write_jsonl(tmp_path / "new.jsonl", [{"text": texts[7]}] + [
        {"text": prose(i)} for i in range(20)])
    ingest([str(path)], str(tmp_path / "warm"), "corpus", "byte", workers=1)  # imports done
    start = bytes_read()
    summary = ingest([str(path)], db, "corpus", "byte", mode="append", workers=1)
    read = bytes_read() - start
    assert summary["docs"] == 21 and summary["dups"] == 1  # texts[7], seen by its digest
    assert read < 2_000_000, f"the append read {read / 1e6:.1f} MB of a {text_bytes / 1e6:.0f} MB table"
    start = bytes_read()  # the measure sees a read of the text column
    lancedb.connect(db).open_table("corpus").search().select(["text"]).to_arrow()
    assert bytes_read() - start > 0.8 * text_bytes
    rows = read_table(db)
    assert rows.column("id").to_pylist() == list(range(1521))
    assert rows.column("is_dup").to_pylist()[1500:] == [True] + [False] * 20


def test_an_append_to_a_table_without_the_digest_column_adds_it_once(tmp_path, capsys):
    db = str(tmp_path / "db")
    old = incompressible_corpus(db, 40, legacy=True)
    version = lancedb.connect(db).open_table("corpus").version
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": old[3]}, {"text": old[5].upper()},
                                               {"text": prose(1)}])
    summary = ingest([str(first)], db, "corpus", "byte", mode="append", workers=1)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "has no digest column" in out[0] and "40 rows" in out[0]
    assert out[1].startswith("wrote 3 docs")
    tbl = lancedb.connect(db).open_table("corpus")
    assert tbl.version == version + 1  # one commit: old rows with digests, then the new ones
    assert tbl.schema.remove_metadata().equals(CORPUS_SCHEMA)
    rows = read_table(db)
    assert rows.column("text").to_pylist()[:40] == old and summary["dups"] == 2
    assert rows.column("digest").to_pylist() == [content_digest(t) for t in rows.column("text").to_pylist()]
    assert rows.column("is_dup").to_pylist()[40:] == [True, True, False]

    second = write_jsonl(tmp_path / "b.jsonl", [{"text": prose(1)}, {"text": prose(2)}])
    summary = ingest([str(second)], db, "corpus", "byte", mode="append", workers=2)
    out = capsys.readouterr().out
    assert "has no digest column" not in out and summary["dups"] == 1
    assert read_table(db).column("id").to_pylist() == list(range(45))


def test_progress_shows_docs_and_tokens_per_second(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": prose(i) * 20} for i in range(3000)])
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal
    proc = subprocess.Popen([sys.executable, "prepare_data.py", str(path), "--db",
                             str(tmp_path / "db"), "--workers", "2", "--batch-size", "50"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    err = b""
    while True:  # read as it comes: a full pty would block the writer
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process is gone and the pty drained
            break
        if not chunk:
            break
        err += chunk
    os.close(leader)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out + err.decode(errors="replace")
    assert b"doc/s" in err and b"tok/s" in err, err[-2000:]
    summary = out.splitlines()[0]
    assert "2 workers" in summary and summary.endswith(" tokens/s")
    assert out.splitlines()[1].startswith("main process while writing:")


INGEST_MOMENTS = {  # when to press Ctrl-C during prepare_data.py --workers 2's start-up
    "importing": lambda workers, age: age >= 0.5,  # past the interpreter's own start (site, encodings)
    "a worker starting": lambda workers, age: len(workers) >= 1,
    "workers importing": lambda workers, age: len(workers) >= 2,
}


@pytest.mark.parametrize("moment", INGEST_MOMENTS)
def test_ctrl_c_at_any_moment_of_an_ingests_start_up_is_one_line(tmp_path, moment):
    """A terminal's Ctrl-C while the run or a spawned worker still imports (pyarrow, lancedb,
    the tokenizer): one line, exit 130, no traceback from any process, no table made, no
    worker left."""
    source = write_jsonl(tmp_path / "a.jsonl", [{"text": prose(i)} for i in range(3000)])
    db = tmp_path / "db"
    proc = subprocess.Popen([sys.executable, "prepare_data.py", str(source), "--db", str(db), "--batch-size", "10",
                             "--workers", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_at_default)
    seen, started = set(), time.monotonic()
    deadline = started + 60
    while not INGEST_MOMENTS[moment](workers := spawned_children(proc.pid), time.monotonic() - started):
        seen.update(workers)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    seen.update(workers)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() in (["interrupted while starting: nothing was written"],
                                        ["interrupted: the table is as it was"]), err
    assert wait_gone(sorted(seen), timeout=10.0) == []
    assert not db.exists() or lancedb.connect(str(db)).table_names() == []
