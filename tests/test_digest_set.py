"""digest_set.py: is_dup equal to a Python set's answer (within a batch, across batches, on
64-bit prefix collisions, for any max_run), runs merged like a binary counter and never past
max_run, and the memory on 3M digests: 16 bytes per digest held, one merge's transient
bounded by max_run.
"""

import time
import tracemalloc

import numpy as np
import pytest

from digest_set import DigestSet


def random_digests(rng, n):
    return np.frombuffer(rng.bytes(16 * n), dtype=np.uint8).reshape(n, 16)


def digests_of(parts):
    """(n, 16) uint8 array from 16-byte bytes objects."""
    return np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(-1, 16)


def reference_is_dup(seen, batch):
    """is_dup as prepare_data computed it with a Python set (updates `seen`)."""
    out = []
    for row in batch:
        d = row.tobytes()
        out.append(d in seen)
        seen.add(d)
    return out


def held(ds):
    """The digests a DigestSet holds, as a set of bytes; also checks each run's invariants."""
    out = set()
    for hi, lo in ds._runs:
        assert 0 < len(hi) == len(lo) <= ds.max_run
        assert hi.dtype == lo.dtype == np.uint64
        assert np.all(hi[1:] >= hi[:-1]), "run not sorted by hi"
        raw = np.stack([hi, lo], axis=1).astype(">u8").tobytes()
        out.update(raw[i:i + 16] for i in range(0, len(raw), 16))
    assert len(out) == len(ds), "a digest is held twice"
    return out


def check_against_set(ds, batches):
    seen = set()
    for i, batch in enumerate(batches):
        expected = reference_is_dup(seen, batch)
        arg = batch.tobytes() if i % 2 else batch  # both input forms
        is_dup = ds.add(arg)
        assert is_dup.dtype == bool and is_dup.shape == (len(batch),)
        assert is_dup.tolist() == expected, f"batch {i}"
        assert len(ds) == len(seen)
    assert held(ds) == seen
    assert ds.nbytes == 16 * len(ds)


@pytest.mark.parametrize("max_run", [4, 64, 1 << 26])
def test_random_duplicates_match_python_set(max_run):
    rng = np.random.default_rng(max_run)
    pool = random_digests(rng, 400)
    batches = []
    for size in rng.choice([0, 1, 1, 2, 7, 50, 300, 1000], size=60):
        if rng.random() < 0.2:
            batches.append(random_digests(rng, size))  # all new
        else:
            batches.append(pool[rng.integers(0, len(pool), size)])  # repeats within and across
    batches[5] = pool[[3, 3, 3]]
    ds = DigestSet(max_run)
    check_against_set(ds, batches)
    assert len(ds) > len(pool) // 2


@pytest.mark.parametrize("max_run", [4, 1 << 26])
def test_shared_64_bit_prefixes_are_told_apart(max_run):
    his = [b"\x00" * 8, b"\x07" * 8, b"\xff" * 8]  # incl. the smallest and largest hi
    los = [bytes([0] * 7 + [k]) for k in range(20)] + [b"\xff" * 8]

    def d(h, l):
        return his[h] + los[l]

    ds = DigestSet(max_run)
    assert not ds.add(digests_of([d(1, 0), d(1, 1), d(1, 2)])).any()
    assert ds.add(digests_of([d(1, 3), d(1, 1), d(1, 3), d(1, 4)])).tolist() == [False, True, True, False]
    # Same last 8 bytes, other first 8: not a duplicate either.
    assert ds.add(digests_of([d(0, 1), d(2, 1), d(1, 1)])).tolist() == [False, False, True]
    # One at a time in shuffled order, so equal-hi entries spread over runs and merges.
    rng = np.random.default_rng(0)
    rest = [d(h, l) for h in range(3) for l in range(len(los))]
    for i in rng.permutation(len(rest)):
        ds.add(digests_of([rest[i]]))
    assert len(ds) == len(rest)
    assert ds.add(digests_of(rest)).all()
    assert not ds.add(digests_of([his[1] + b"\x00" * 6 + b"\x01\x00"])).any()  # hi held, lo not
    assert held(ds) == set(rest) | {his[1] + b"\x00" * 6 + b"\x01\x00"}

    # The same, randomly: 3 hi values x 21 lo values, many repeats, many batch sizes.
    combos = digests_of(rest)
    batches = [combos[rng.integers(0, len(combos), size)] for size in rng.choice([0, 1, 3, 10, 40], 50)]
    check_against_set(DigestSet(max_run), batches)


def test_runs_merge_like_a_binary_counter():
    rng = np.random.default_rng(1)
    ds, capped = DigestSet(), DigestSet(max_run=4)
    for k in range(1, 100):
        d = random_digests(rng, 1)
        ds.add(d)
        capped.add(d)
        powers = [1 << b for b in range(k.bit_length() - 1, -1, -1) if k >> b & 1]
        assert [len(hi) for hi, _ in ds._runs] == powers
        assert [len(hi) for hi, _ in capped._runs] == [4] * (k // 4) + [p for p in powers if p < 4]
    ds = DigestSet(max_run=4)
    ds.add(random_digests(rng, 10))  # a batch larger than max_run is held in runs of max_run
    assert [len(hi) for hi, _ in ds._runs] == [4, 4, 2]


def test_empty_and_invalid_input():
    ds = DigestSet()
    for empty in (b"", np.zeros((0, 16), np.uint8)):
        out = ds.add(empty)
        assert out.dtype == bool and out.shape == (0,)
    assert len(ds) == 0 and ds.nbytes == 0
    for bad in (b"x" * 15, np.zeros((2, 8), np.uint8), np.zeros((2, 16), np.int64), np.zeros(16, np.uint8)):
        with pytest.raises(ValueError):
            ds.add(bad)
    assert len(ds) == 0


def test_memory_per_digest():
    """3M distinct digests in batches of 1000, max_run 1M entries.

    Held: exactly 16 B per digest (nbytes and tracemalloc agree), asserted <= 24. Peak: each
    add may exceed the memory held before it by at most one merge's transient: the merged
    run's new arrays (16 B/entry), its insert positions (int64) and a bool mask, ~25 B per
    entry of a run of at most max_run entries; asserted <= 32 * max_run bytes. Without the
    max_run cap the last merges (2M entries) would take ~50 MB, over that bound.
    """
    n, batch, max_run = 3_000_000, 1000, 1 << 20
    digests = random_digests(np.random.default_rng(2), n)
    ds = DigestSet(max_run)
    tracemalloc.start()
    try:
        worst_transient = peak = 0
        start = time.perf_counter()
        for i in range(0, n, batch):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert not ds.add(digests[i:i + batch]).any()
            add_peak = tracemalloc.get_traced_memory()[1]
            peak = max(peak, add_peak)
            worst_transient = max(worst_transient, add_peak - before)
        seconds = time.perf_counter() - start
        current = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ds) == n
    print(f"\nDigestSet: {n:,} digests in {seconds:.1f}s; held {ds.nbytes / n:.2f} B/doc "
          f"(tracemalloc {current / n:.2f}), peak {peak / n:.2f} B/doc, "
          f"worst add transient {worst_transient / 2**20:.1f} MiB = {worst_transient / max_run:.1f} B x max_run")
    assert ds.nbytes / n <= 24
    assert current / n <= 24
    assert worst_transient <= 32 * max_run
    assert peak <= ds.nbytes + 32 * max_run
    assert max(len(hi) for hi, _ in ds._runs) <= max_run
