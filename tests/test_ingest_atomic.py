"""An ingest is one lance commit: prepare_data.py SIGKILLed mid-write leaves the previous
version current and readable, and a re-run completes it; --mode overwrite keeps the old
version and --restore brings it back.

The killed run reads its jsonl from a FIFO that the test feeds until lance has written
data bytes for the new version and then stops feeding: the process is then blocked
inside the write, uncommitted, with no race against the end of the run.
"""

import contextlib
import errno
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import lancedb
import pytest

import prepare_data
from conftest import REPO, run_script
from prepare_data import ingest

TABLE = "corpus"
SENTENCE = "The river ran quietly through the valley, past the old mill and the fields. "


def doc(i: int) -> str:
    """A distinct ~4 KB document: ~700 of them make lance write its first data bytes."""
    return f"Document {i}. " + SENTENCE * 50


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def snapshot(db, table=TABLE):
    """(version, ids, texts) of the current version, read in full."""
    tbl = lancedb.connect(str(db)).open_table(table)
    rows = tbl.to_arrow().sort_by("id")
    assert tbl.count_rows() == rows.num_rows
    return tbl.version, rows.column("id").to_pylist(), rows.column("text").to_pylist()


def data_files(db, table=TABLE):
    """name -> size of each file under the table's data/ (one renamed meanwhile is left out)."""
    data, sizes = Path(db) / f"{table}.lance" / "data", {}
    for path in data.iterdir() if data.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            sizes[path.name] = path.stat().st_size
    return sizes


def open_feed(fifo, proc, timeout=60.0):
    """The FIFO's write end, once the process has opened it for reading (never blocks
    on a process that died first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"prepare_data.py never read its input: {proc.communicate()}")
            time.sleep(0.05)
            continue
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w", encoding="utf-8")


def kill_mid_write(tmp_path, db, mode, texts):
    """Run `prepare_data.py FIFO --mode MODE`, feed it `texts` until a new data file under
    the table has bytes in it, then SIGKILL it; returns the leftover new data files."""
    fifo = tmp_path / "feed.jsonl"
    os.mkfifo(fifo)
    before = data_files(db)
    proc = subprocess.Popen(
        [sys.executable, "prepare_data.py", str(fifo), "--db", str(db), "--table", TABLE,
         "--mode", mode, "--batch-size", "20"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    feed = open_feed(fifo, proc)
    try:
        for i, text in enumerate(texts):
            feed.write(json.dumps({"text": text}) + "\n")
            if i % 20 == 19:
                feed.flush()
                new = {n: size for n, size in data_files(db).items() if n not in before}
                if any(new.values()):
                    break
        else:
            pytest.fail(f"lance wrote no data file after {len(texts)} documents")
        assert proc.poll() is None, proc.communicate()  # still waiting for input: uncommitted
        proc.kill()
        out, err = proc.communicate(timeout=30)
    finally:
        try:
            feed.close()
        except BrokenPipeError:
            pass
    assert proc.returncode == -9 and "wrote" not in out, out + err
    return new


@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_a_killed_ingest_leaves_the_previous_version_and_a_rerun_completes_it(tmp_path, mode):
    db = tmp_path / "db"
    old = [doc(i) for i in range(30)]
    ingest([write_jsonl(tmp_path / "old.jsonl", old)], str(db), TABLE, "byte")
    before = snapshot(db)
    new = [doc(i) for i in range(1000, 3000)]

    leftover = kill_mid_write(tmp_path, db, mode, new)

    assert set(leftover) <= set(data_files(db))  # the killed write's bytes are on disk...
    assert snapshot(db) == before  # ...yet the table is its previous version, all of it
    summary = ingest([write_jsonl(tmp_path / "new.jsonl", new)], str(db), TABLE, "byte",
                     mode=mode, batch_size=100)
    assert summary["docs"] == len(new) and summary["dups"] == 0
    version, ids, texts = snapshot(db)
    assert version == before[0] + 1
    assert texts == (old + new if mode == "append" else new)
    assert ids == list(range(len(texts)))  # every id once, in order


def test_a_killed_create_leaves_no_table_and_a_rerun_creates_it(tmp_path, capsys):
    db = tmp_path / "db"
    texts = [doc(i) for i in range(2000)]

    leftover = kill_mid_write(tmp_path, db, "create", texts)

    assert not (db / f"{TABLE}.lance" / "_versions").exists()  # nothing was committed
    assert prepare_data.open_existing(str(db), TABLE) is None
    prepare_data.main([write_jsonl(tmp_path / "in.jsonl", texts), "--db", str(db),
                       "--table", TABLE, "--mode", "create"])
    assert capsys.readouterr().out.startswith(f"wrote {len(texts)} docs")
    assert snapshot(db) == (1, list(range(len(texts))), texts)
    assert not set(leftover) & set(data_files(db))  # the killed run's files were cleared


def test_overwrite_prints_how_to_restore_and_restore_brings_the_old_rows_back(tmp_path, capsys):
    db = tmp_path / "db"
    old, new = [doc(i) for i in range(30)], [doc(i) for i in range(100, 110)]
    ingest([write_jsonl(tmp_path / "old.jsonl", old)], str(db), TABLE, "byte")
    before = snapshot(db)

    proc = run_script("prepare_data.py", write_jsonl(tmp_path / "new.jsonl", new), "--db", db,
                      "--table", TABLE, "--mode", "overwrite", cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    command = f"python prepare_data.py --db {db} --table {TABLE} --restore {before[0]}"
    assert line == f"replaced version {before[0]} ({len(old)} rows) of {db}/{TABLE}; " \
                   f"to bring it back: {command}"
    assert snapshot(db)[2] == new

    capsys.readouterr()
    prepare_data.main(shlex.split(command)[2:])  # the printed command, as printed
    assert capsys.readouterr().out.startswith(f"restored version {before[0]} ({len(old)} rows)")
    version, ids, texts = snapshot(db)
    assert (ids, texts) == before[1:] and version == before[0] + 2  # restoring is a new version

    for argv, fragment in [(["--restore", "99"], "no version 99 (versions: 1, 2, 3)"),
                           (["--restore", "-1"], "no version -1"),
                           (["--table", "other", "--restore", "1"], "no table 'other'"),
                           (["--restore", "1", "--demo"], "--restore takes no INPUT")]:
        with pytest.raises(SystemExit) as exit_:
            prepare_data.main(["--db", str(db), "--table", TABLE, *argv])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.startswith("error: ") and fragment in err, err
        assert "\n" not in err
    assert snapshot(db) == (version, ids, texts)  # nothing changed
