"""Batches made off the training thread (prefetch.py, data.train_batches): the same batches
and checkpoint positions as made inline, errors at the batch where they happen, the next
epoch's loader started before this one runs dry, read-ahead waits kept out of fetch time,
and --loader-free's loop with no loader in it (also on --random-ids of a vocabulary no
tokenizer here has).

Sample order and resume across topologies are held by test_elastic.py and
test_resume_epochs.py, which now run through the prefetch thread too.
"""

import inspect
import itertools
import threading
import time

import numpy as np
import pytest
import torch

import bounded_streaming
import data
import train
from common import UserError, load_tokenizer, synthetic_corpus
from conftest import assert_user_error, run_script
from model import make_model
from prefetch import Prefetcher

TOK = load_tokenizer("byte")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few epochs' worth of short documents: 600 rows of 20-200 tokens."""
    db = str(tmp_path_factory.mktemp("prefetch") / "db")
    synthetic_corpus(db, 600, 20, 200, seed=3)
    return db


def training(db, *flags):
    args = train.parse_args(["--db", db, "--seq-len", "64", "--batch-size", "8", *flags])
    num_splits = train.check_args(args, 1)
    return args, data.open_training_data(args, TOK, 0, 1, CPU, num_splits, args.batch_size), num_splits


def as_list(items):
    return [(epoch, position.state_dict() if position is not None else None,
             {k: v.clone() for k, v in batch.items()}) for epoch, position, batch in items]


LAYOUTS = [("--pack",), ("--pack", "--num-workers", "2"), (), ("--num-workers", "2")]


@pytest.mark.parametrize("flags", LAYOUTS, ids=["pack", "pack-2-workers", "rows", "rows-2-workers"])
def test_prefetched_batches_and_positions_equal_inline_ones(corpus, flags):
    """Over two epochs: every batch, and the loader position recorded with it, are the ones
    the inline loader gives; each position is what lancedb's own state_dict() said right
    after that batch, however far the prefetch thread had read by then."""
    args, data_, num_splits = training(corpus, "--epochs", "2", *flags)
    inline = []
    for epoch, position, batch in data.train_batches(args, data_, 0, 1, CPU, num_splits, 0, None):
        inline.append((epoch, position.dataset.state_dict(), {k: v.clone() for k, v in batch.items()}))
    assert {e for e, _, _ in inline} == {0, 1} and len(inline) > 20
    prefetched = data.prefetched(data.train_batches(args, data_, 0, 1, CPU, num_splits, 0, None), CPU)
    got = []
    for item in prefetched:
        time.sleep(0.002)  # a consumer slower than the loader: the thread runs ahead
        got.append(item)
    got = as_list(got)
    assert len(got) == len(inline)
    for (e1, s1, b1), (e2, s2, b2) in zip(inline, got):
        assert e1 == e2 and s1 == s2 and b1.keys() == b2.keys()
        assert all(torch.equal(b1[k], b2[k]) for k in b1)
    assert got[0][1] != got[1][1]  # positions move batch by batch


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("pack", [False, True], ids=["rows", "pack"])
def test_micro_batches_of_several_cycles_are_the_same_whatever_the_workers(corpus, pack, workers):
    """--batch-size 16 over --num-splits 4: each micro-batch holds 4 cycles of the rank's 4
    splits, and each worker's batch 4 cycles of its own. With one cycle per batch several
    wrong orders (workers stacked before cycles, a worker's splits in the wrong place) give
    the right one; here each shows."""
    def input_ids(num_workers):
        args = train.parse_args(["--db", corpus, "--seq-len", "64", "--batch-size", "16", "--num-splits", "4",
                                 "--num-workers", str(num_workers), *(["--pack"] if pack else [])])
        num_splits = train.check_args(args, 1)
        source = data.open_training_data(args, TOK, 0, 1, CPU, num_splits, args.batch_size)
        return [batch["input_ids"].clone()
                for _, _, batch in data.train_batches(args, source, 0, 1, CPU, num_splits, 0, None)]

    inline, spread = input_ids(0), input_ids(workers)
    assert len(spread) == len(inline) >= 5
    for i, (want, got) in enumerate(zip(inline, spread)):
        assert torch.equal(want, got), f"micro-batch {i} differs with --num-workers {workers}"


def test_consumed_state_copies_the_pack_buffers(corpus):
    """bounded_streaming.consumed_state is lancedb's state_dict() without its deepcopy: equal
    to it, and not changed by the batches made after it."""
    args, data_, num_splits = training(corpus, "--pack")
    ds = data_.dataset(0)
    batches = iter(data.make_loader(ds, args, CPU, num_splits))
    next(batches)
    snapshot = bounded_streaming.consumed_state(ds)
    assert snapshot == ds.state_dict() and any(b["tokens"] for b in snapshot["pack_buffers"].values())
    frozen = repr(snapshot)
    for _ in range(3):
        next(batches)
        assert bounded_streaming.consumed_state(ds) == ds.state_dict()
    assert repr(snapshot) == frozen


def test_an_error_reaches_the_training_thread_after_the_batches_before_it():
    def items():
        yield 0, None, {"input_ids": torch.zeros(2, 4)}
        yield 0, None, {"input_ids": torch.ones(2, 4)}
        raise ValueError("bad row 7")

    prefetcher = Prefetcher(items(), CPU)
    assert [float(b["input_ids"].sum()) for _, _, b in (next(prefetcher), next(prefetcher))] == [0.0, 8.0]
    with pytest.raises(ValueError, match="bad row 7"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_a_device_the_thread_cannot_select_reaches_the_training_thread_as_an_error():
    """The producer's first act, `torch.cuda.set_device`, failing (a device that is not there:
    no GPU here, or one past the last) raises on the training thread instead of leaving it
    waiting on the queue for ever; the source is closed."""
    source = (item for item in [(0, None, {"input_ids": torch.zeros(1)})])
    prefetcher = Prefetcher(source, torch.device("cuda", torch.cuda.device_count()))
    got = []
    consumer = threading.Thread(target=lambda: got.append(pytest.raises(Exception, next, prefetcher)), daemon=True)
    consumer.start()
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the training thread waits for a batch that never comes"
    prefetcher._thread.join(timeout=5)
    assert got and not prefetcher._thread.is_alive()
    assert inspect.getgeneratorstate(source) == inspect.GEN_CLOSED


def test_close_stops_the_thread_and_closes_its_source_mid_stream():
    made, closed = [], threading.Event()

    def items():
        try:
            for i in range(10_000):
                made.append(i)
                yield 0, None, {"input_ids": torch.full((1,), i)}
        finally:
            closed.set()

    prefetcher = Prefetcher(items(), CPU, depth=2)
    assert int(next(prefetcher)[2]["input_ids"]) == 0
    prefetcher.close()
    assert closed.is_set() and not prefetcher._thread.is_alive()
    assert len(made) <= 5  # no more than the queue and the item in hand: it stopped, not drained
    with pytest.raises(StopIteration):
        next(prefetcher)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_next_epoch_starts_before_this_one_runs_dry(corpus, workers):
    """The second epoch's StreamingDataset is built, and its loader started, while the first
    still has batches to hand out (what hides its start-up: 3-4 s with 2 workers)."""
    args, data_, num_splits = training(corpus, "--pack", "--epochs", "2", "--num-workers", str(workers))
    handed, built_at = [], {}
    make = data_.dataset

    def dataset(epoch):
        built_at[epoch] = len(handed)
        return make(epoch)

    data_.dataset = dataset
    prefetcher = data.prefetched(data.train_batches(args, data_, 0, 1, CPU, num_splits, 0, None), CPU)
    for epoch, _, _ in prefetcher:
        handed.append(epoch)
        time.sleep(0.01)
    first_epoch = handed.count(0)
    assert handed.count(1) == first_epoch > 4
    assert built_at[0] == 0 and built_at[1] < first_epoch - 2, (built_at, first_epoch)


def test_read_ahead_waits_are_kept_out_of_fetch_time(corpus):
    """With a budget far below what a slow consumer leaves unread, reads wait for it: that
    wait is budget_wait_time, and fetch_time holds the reads alone (lancedb counted both)."""
    args, data_, num_splits = training(corpus, "--pack", "--loader-buffer-mb", "0.01",
                                       "--read-batch-size", "4")
    ds = data_.dataset(0)
    batches = iter(data.make_loader(ds, args, CPU, num_splits))
    start = time.perf_counter()
    for _ in range(12):
        next(batches)
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    assert ds.budget_wait_time > 0.2 * elapsed  # the reads spent much of the run waiting
    assert 0 <= ds.fetch_time < ds.budget_wait_time


def test_loader_free_trains_on_a_pool_and_writes_no_checkpoint(demo_db, tmp_path):
    proc = run_script("train.py", "--db", demo_db, "--model", "tiny", "--seq-len", "64", "--batch-size", "4",
                      "--pack", "--steps", "6", "--log-every", "2", "--loader-free", "3",
                      "--ckpt-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saved " not in proc.stdout and "final: opt_step=6" in proc.stdout
    assert not list((tmp_path / "ck").glob("step_*"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 3 and all(" | q " not in line and "loader " in line for line in lines)


def test_loader_free_needs_steps(demo_db, tmp_path):
    """The pool is cycled for ever: without --steps the run would never end."""
    proc = run_script("train.py", "--db", demo_db, "--loader-free", "3", "--ckpt-dir", tmp_path / "ck",
                      cwd=tmp_path, timeout=120)
    assert_user_error(proc, "--loader-free 3", "pass --steps N")
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_loader_free_refuses_resume(demo_db, tmp_path):
    proc = run_script("train.py", "--db", demo_db, "--loader-free", "3", "--steps", "2", "--resume", "auto",
                      "--ckpt-dir", tmp_path / "ck", cwd=tmp_path)
    assert_user_error(proc, "--loader-free", "cannot --resume")


def test_random_ids_train_a_model_of_their_vocabulary(demo_db, tmp_path):
    """--loader-free --random-ids: the model is built for the given vocabulary (bigger than the
    byte tokenizer's), and the pool's ids span it, so no id is refused on the way."""
    proc = run_script("train.py", "--db", demo_db, "--model", "tiny", "--seq-len", "64", "--batch-size", "4",
                      "--pack", "--steps", "4", "--log-every", "2", "--loader-free", "2", "--random-ids", "50304",
                      "--ckpt-dir", tmp_path / "ck", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"params={make_model('tiny', 50304, 64).num_params():,} " in proc.stdout
    assert "final: opt_step=4" in proc.stdout


def test_random_batches_are_made_on_the_device_within_the_vocabulary():
    pool = list(itertools.islice(data.random_batches(2, 3, 16, 50304, torch.device("cpu")), 4))
    assert [batch["input_ids"].shape for _, _, batch in pool] == [(3, 16)] * 4
    assert pool[2][2] is pool[0][2] and not torch.equal(pool[0][2]["input_ids"], pool[1][2]["input_ids"])
    ids = torch.cat([batch["input_ids"] for _, _, batch in pool[:2]])
    assert 0 <= int(ids.min()) and int(ids.max()) < 50304 and int(ids.max()) >= 258  # past the byte ids
    assert all(batch["loss_mask"].all() and not batch["doc_ids"].any() for _, _, batch in pool)


def test_random_ids_need_loader_free_and_the_tokenizers_ids():
    with pytest.raises(UserError, match="--random-ids fills --loader-free's pool"):
        train.check_args(train.parse_args(["--random-ids", "50304"]), 1)
    with pytest.raises(UserError, match="smaller than the 258-id vocabulary"):
        train.run_vocabulary(train.parse_args(["--loader-free", "2", "--random-ids", "100"]), load_tokenizer("byte"))


def test_the_training_thread_does_a_fraction_of_the_inline_work(corpus):
    """The training thread's CPU per batch (time.thread_time around next()) with the prefetch
    thread against the same batches made inline: CPU time of one thread, side by side, so
    a busy machine moves both alike. Measured: 0.1 ms against 0.7-3.9 ms (16 x 1024)."""
    args, data_, num_splits = training(corpus, "--pack", "--epochs", "3")

    def thread_ms(items):
        costs = []
        it = iter(items)
        while True:
            start = time.thread_time()
            try:
                next(it)
            except StopIteration:
                break
            costs.append(time.thread_time() - start)
            time.sleep(0.003)
        return 1000 * float(np.median(costs[3:]))

    inline = thread_ms(data.train_batches(args, data_, 0, 1, CPU, num_splits, 0, None))
    made_ahead = thread_ms(data.prefetched(data.train_batches(args, data_, 0, 1, CPU, num_splits, 0, None), CPU))
    assert made_ahead < inline / 3, (made_ahead, inline)


@pytest.mark.parametrize("cores, local_ranks, flags, expected", [
    (16, 4, ("--pack",), 2),  # 4 cores a rank: the packer goes to 2 workers
    (16, 4, ("--pack", "--batch-size", "3"), 1),  # 3 splits a rank: 2 workers cannot share them
    (16, 8, ("--pack",), 0),  # 2 cores a rank: none to spare
    (16, 1, (), 0),  # rows: a numpy transform
    (16, 1, ("--blocks-mode", "lance", "--blocks-path", "b"), 0),
])
def test_num_workers_auto_follows_the_cores_a_rank_has(monkeypatch, cores, local_ranks, flags, expected):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    args = train.parse_args(list(flags))
    assert args.num_workers == expected and args.num_workers_note.startswith(f"auto: {expected}")
    assert train.parse_args([*flags, "--num-workers", "1"]).num_workers == 1  # a number is taken as it is


def test_the_start_up_line_says_what_auto_chose(smoke_run):
    proc, _ = smoke_run
    assert "num_workers=0 (auto: 0, the transform is numpy (no --pack))" in proc.stdout, proc.stdout


def test_loader_workers_start_in_a_directory_that_has_a_data_folder(demo_db, tmp_path):
    """Python's forkserver starts in the working directory without the parent's sys.path, so
    a ./data folder (ML projects have one) hid data.py from the loader workers, which died
    on an ImportError; train.py puts its own directory on their path at start-up."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text("{}\n")
    proc = run_script("train.py", "--db", demo_db, "--model", "tiny", "--seq-len", "64", "--batch-size", "8",
                      "--steps", "3", "--num-workers", "2", "--ckpt-dir", tmp_path / "ck", cwd=tmp_path, cold=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("final: opt_step=3 ")
