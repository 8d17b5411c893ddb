"""No space left while prepare_data.py, build_packed_datasets.py and export_hf.py write
(issue 21, point 1): one `error:` line saying what was written, what it needs and what is
free, exit 3, nothing torn or temporary left, the previous table or output as it was,
no worker left running, and the same command succeeding once space is freed.

The faults are real: the output lies on a small tmpfs (conftest.small_fs) that a filler
file has nearly filled, so the write runs out part way; deleting the filler frees it."""

import contextlib
import errno
import io
import json
import os
import re
import subprocess
import sys

import lancedb
import pytest

import build_packed_datasets
import prepare_data
from blocks_loaders import FORMATS, read_manifest
from common import (STORAGE_FAULT_EXIT, TRAIN_FILTER, StorageFault, UserError, corpus_filter, human_bytes,
                    out_of_space, packed_token_count, synthetic_corpus)
from conftest import REPO, session_pids, wait_gone
from test_prepare_data import prose

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

MB = 1 << 20


def run_alone(script, *args, cwd):
    """A project script in a session of its own, as a user runs it; fails the test when a
    process of that session (a worker) outlives it."""
    proc = subprocess.Popen([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=300)
    assert wait_gone(session_pids(proc.pid)) == [], f"{script} left processes running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_storage_fault(proc, *fragments):
    """Exit 3 and one `error:` line on stderr naming the fault and what is free, no traceback."""
    assert proc.returncode == STORAGE_FAULT_EXIT, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in ("no space left on the device (ENOSPC)", " free of ", "then run again",
                     *fragments):
        assert fragment in lines[0], lines[0]


def fill(directory, leave):
    """A filler file leaving `leave` bytes free on the filesystem of `directory`."""
    filler = directory / "filler"
    stat = os.statvfs(directory)
    filler.write_bytes(bytes(stat.f_bavail * stat.f_frsize - leave))
    return filler


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def write_docs(path, first, count):
    """`count` distinct ~300-character documents, a few hundred bytes of table each."""
    path.write_text("".join(json.dumps({"text": prose(i)}) + "\n" for i in range(first, first + count)))
    return path


def table_state(db):
    tbl = lancedb.connect(str(db)).open_table("corpus")
    return tbl.version, tbl.count_rows()


@pytest.mark.parametrize("error, fault", [
    (OSError(errno.ENOSPC, "No space left on device"), "(ENOSPC)"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "(EDQUOT)"),
    (RuntimeError("lance error: LanceError(IO): Disk quota exceeded (os error 122), x.rs:9"),
     "(EDQUOT)"),
    (OSError(errno.EACCES, "Permission denied"), None),
    (RuntimeError("lance error: Not found: data/x.lance"), None),
    # a line already written, even one that quotes the OS error, and a Ctrl-C are not rewritten
    (StorageFault("cannot read the table: No space left on device (os error 28)"), None),
    (UserError("--out x: No space left on device"), None),
    (KeyboardInterrupt(), None),
])
def test_a_quota_is_told_from_a_full_disk_and_from_other_errors(error, fault, tmp_path):
    """EDQUOT cannot be made real here (root ignores quotas, this tmpfs has none): how the
    errors the writers raise are read, lance's text included."""
    found = out_of_space(error, str(tmp_path / "missing" / "out"), "OUT", "do this")
    assert (found and str(found).split(" writing ")[0].endswith(fault)) if fault else found is None
    if found:
        assert f" on '{tmp_path}'; do this" in str(found)


# ── prepare_data.py: the table stays at its previous version ───────────────────────

def test_a_create_that_runs_out_of_space_leaves_no_table_and_no_worker(small_fs, tmp_path):
    fs = small_fs("fs", 4 * MB)
    docs = write_docs(tmp_path / "docs.jsonl", 0, 3000)  # ~1 MB of table
    filler = fill(fs, 300_000)
    command = ("prepare_data.py", docs, "--db", fs / "db", "--workers", "2", "--batch-size", "100")
    proc = run_alone(*command, cwd=tmp_path)
    assert_storage_fault(proc, f"table 'corpus' in '{fs / 'db'}'", "no table was created")
    assert files_under(fs) == ["filler"]

    filler.unlink()
    again = run_alone(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "main process while writing" in again.stdout  # the workers ran
    assert table_state(fs / "db") == (1, 3000)


def test_an_append_that_runs_out_of_space_leaves_the_table_as_it_was(small_fs, tmp_path):
    fs = small_fs("fs", 4 * MB)
    db = fs / "db"
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_data.ingest([str(write_docs(tmp_path / "first.jsonl", 0, 500))], str(db), workers=1)
    table_files = files_under(db)
    more = write_docs(tmp_path / "more.jsonl", 500, 3000)
    filler = fill(fs, 300_000)
    command = ("prepare_data.py", more, "--db", db, "--mode", "append", "--workers", "2",
               "--batch-size", "100")
    proc = run_alone(*command, cwd=tmp_path)
    assert_storage_fault(proc, "the table is as it was (version 1, 500 rows)")
    assert table_state(db) == (1, 500)
    assert files_under(db) == table_files  # lance removed the data files it had written

    filler.unlink()
    again = run_alone(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert table_state(db) == (2, 3500)


def test_a_restore_on_a_full_disk_leaves_the_table_as_it_was(small_fs, tmp_path):
    fs = small_fs("fs", 2 * MB)
    db = fs / "db"
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_data.ingest([str(write_docs(tmp_path / "a.jsonl", 0, 100))], str(db), workers=1)
        prepare_data.ingest([str(write_docs(tmp_path / "b.jsonl", 100, 100))], str(db),
                            mode="overwrite", workers=1)
    filler = fill(fs, 0)
    command = ("prepare_data.py", "--db", db, "--restore", "1")
    proc = run_alone(*command, cwd=tmp_path)
    assert_storage_fault(proc, "a new version of table 'corpus'", "the table is as it was (version 2)")
    assert table_state(db) == (2, 100)

    filler.unlink()
    again = run_alone(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert table_state(db) == (3, 100)


# ── build_packed_datasets.py: each format directory complete or absent ───────────────

SEQ_LEN = 64


@pytest.fixture(scope="module")
def blocks_db(tmp_path_factory):
    """A corpus of ~150k tokens, ~2,300 blocks: ~600 KB in each format. Returns (db, blocks)."""
    db = tmp_path_factory.mktemp("blocks_db") / "db"
    table = synthetic_corpus(str(db), 600, 100, 400)
    return db, packed_token_count(table, corpus_filter(1.0, TRAIN_FILTER))[1] // SEQ_LEN


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_format_that_runs_out_of_space_is_not_published(fmt, blocks_db, small_fs, tmp_path):
    db, blocks = blocks_db
    fs = small_fs("fs", 3 * MB)
    filler = fill(fs, 200_000)
    command = ("build_packed_datasets.py", "--db", db, "--out", fs / "out", "--formats", fmt,
               "--seq-len", SEQ_LEN)
    proc = run_alone(*command, cwd=tmp_path)
    assert_storage_fault(proc, f"{blocks:,} blocks of {SEQ_LEN} tokens as {fmt} to '{fs / 'out'}'",
                         f"it needs at least {human_bytes(blocks * SEQ_LEN * 4)};",
                         "nothing was published")
    assert files_under(fs) in (["filler"], ["filler", "out"])  # OUT itself may stay, empty

    filler.unlink()
    again = run_alone(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert read_manifest(str(fs / "out" / fmt), fmt)["num_blocks"] == blocks
    assert os.listdir(fs / "out") == [fmt]


def test_an_overwrite_that_runs_out_of_space_keeps_the_previous_formats(blocks_db, small_fs, tmp_path):
    db, blocks = blocks_db
    fs = small_fs("fs", 12 * MB)
    out = fs / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        build_packed_datasets.build(str(db), "corpus", str(out), seq_len=SEQ_LEN)
    before = {fmt: (out / fmt / "manifest.json").read_text() for fmt in FORMATS}
    listing = files_under(out)
    filler = fill(fs, 1 * MB)
    replace = ("build_packed_datasets.py", "--db", db, "--out", out, "--seq-len", SEQ_LEN,
               "--overwrite", "--seed", "7")
    proc = run_alone(*replace, cwd=tmp_path)
    assert_storage_fault(proc, f"as {', '.join(FORMATS)} to",
                         f"it needs at least {human_bytes(len(FORMATS) * blocks * SEQ_LEN * 4)};")
    assert files_under(out) == listing
    assert {fmt: (out / fmt / "manifest.json").read_text() for fmt in FORMATS} == before

    filler.unlink()
    again = run_alone(*replace, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert all(read_manifest(str(out / fmt), fmt)["seed"] == 7 for fmt in FORMATS)
    assert sorted(os.listdir(out)) == sorted(FORMATS)


# ── export_hf.py: the export complete or absent, a previous one intact ─────────────

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """Two steps of the tiny model: a checkpoint whose export is ~3.3 MB."""
    import train

    tmp = tmp_path_factory.mktemp("tiny")
    docs = write_docs(tmp / "docs.jsonl", 0, 60)
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_data.ingest([str(docs)], str(tmp / "db"), workers=1)
        train.main(["--db", str(tmp / "db"), "--model", "tiny", "--seq-len", "64",
                    "--batch-size", "2", "--steps", "2", "--ckpt-dir", str(tmp / "ck")])
    return tmp / "ck"


def test_an_export_that_runs_out_of_space_leaves_the_previous_one(tiny_ckpt, small_fs, tmp_path):
    fs = small_fs("fs", 10 * MB)
    out = fs / "hf"
    command = ("export_hf.py", "--ckpt", "auto", "--ckpt-dir", tiny_ckpt, "--out", out)
    filler = fill(fs, 1 * MB)
    proc = run_alone(*command, cwd=tmp_path)
    assert_storage_fault(proc, f"the export '{out}'", "nothing was written")
    assert files_under(fs) == ["filler"]

    filler.unlink()
    done = run_alone(*command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    params = int(re.search(r"([\d,]+) parameters", done.stdout)[1].replace(",", ""))
    assert f"it needs at least {human_bytes(4 * params)};" in proc.stderr  # the float32 weights
    exported = {name: (out / name).read_bytes() for name in os.listdir(out)}
    filler = fill(fs, 1 * MB)
    proc = run_alone(*command, "--overwrite", cwd=tmp_path)
    assert_storage_fault(proc, f"the previous export in '{out}' is as it was")
    assert sorted(os.listdir(fs)) == ["filler", "hf"]  # no temp or old directory
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == exported

    filler.unlink()
    assert run_alone(*command, "--overwrite", cwd=tmp_path).returncode == 0
