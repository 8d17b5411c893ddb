"""Exact dedup state for prepare_data.py that fits a billion documents.

prepare_data.py marks a document as a duplicate when the 16-byte digest of its normalized
text was seen before. A Python `set` of 16-byte `bytes` costs ~100 bytes per document (a
49-byte object plus its hash-table slots), so 100 GB at a billion documents. DigestSet
holds the same digests in sorted numpy arrays at 16 bytes each, and stays exact: digests
are compared in full, all 128 bits, so there are no false positives (unlike a Bloom filter).

Layout: each digest is split into hi (its first 8 bytes) and lo (its last 8), both read as
big-endian integers and held as uint64. The set is a list of runs, each a pair of (hi, lo)
arrays sorted by hi. A batch's new digests become a new run; runs are then merged like a
binary counter (the newest two while the newer is at least as large as the older), which
keeps the number of runs logarithmic and each digest merged O(log n) times. No merge makes
a run larger than `max_run` entries, so the transient memory of one merge is bounded by
`max_run` (about 25 bytes per entry of the merged run: the new arrays plus index and mask),
not by the size of the whole set.
"""

from __future__ import annotations

import numpy as np

DIGEST_SIZE = 16


def split_digests(digests) -> tuple[np.ndarray, np.ndarray]:
    """(n, 16) uint8 array or n*16 bytes -> (hi, lo) uint64 arrays: first and last 8 bytes, big-endian."""
    if isinstance(digests, (bytes, bytearray)):
        if len(digests) % DIGEST_SIZE:
            raise ValueError(f"digest bytes must be a multiple of {DIGEST_SIZE} long, got {len(digests)}")
        pairs = np.frombuffer(digests, dtype=">u8").reshape(-1, 2)
    else:
        arr = np.asarray(digests)
        if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != DIGEST_SIZE:
            raise ValueError(f"digests must be an (n, {DIGEST_SIZE}) uint8 array, got {arr.shape} {arr.dtype}")
        pairs = np.ascontiguousarray(arr).view(">u8")  # (n, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def run_contains(run_hi: np.ndarray, run_lo: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """For each query (hi[i], lo[i]): is it in the run? The run is sorted by hi only, so the
    entries sharing a query's hi (almost always none or one) are stepped through one at a time."""
    found = np.zeros(len(hi), dtype=bool)
    query = np.arange(len(hi))  # queries still undecided
    pos = np.searchsorted(run_hi, hi, side="left")  # their next candidate entry in the run
    while query.size:
        keep = pos < len(run_hi)
        query, pos = query[keep], pos[keep]
        keep = run_hi[pos] == hi[query]  # past the entries with this hi: not in the run
        query, pos = query[keep], pos[keep]
        hit = run_lo[pos] == lo[query]
        found[query[hit]] = True
        query, pos = query[~hit], pos[~hit] + 1
    return found


def merge_runs(a_hi, a_lo, b_hi, b_lo) -> tuple[np.ndarray, np.ndarray]:
    """Merge two runs sorted by hi into one, placing b's entries among a's (no re-sort)."""
    n = len(a_hi) + len(b_hi)
    dest = np.searchsorted(a_hi, b_hi)  # b[j] lands after the a entries below it ...
    dest += np.arange(len(b_hi))  # ... and after b[:j]
    from_a = np.ones(n, dtype=bool)
    from_a[dest] = False
    hi = np.empty(n, dtype=np.uint64)
    hi[dest] = b_hi
    hi[from_a] = a_hi
    lo = np.empty(n, dtype=np.uint64)
    lo[dest] = b_lo
    lo[from_a] = a_lo
    return hi, lo


class DigestSet:
    """Exact set of 16-byte digests held in sorted numpy runs (16 bytes per digest)."""

    def __init__(self, max_run: int = 1 << 26):
        if max_run < 1:
            raise ValueError(f"max_run must be >= 1, got {max_run}")
        self.max_run = max_run
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (hi, lo), each sorted by hi

    def add(self, digests) -> np.ndarray:
        """digests: (n, 16) uint8 array or n*16 bytes, in document order. Returns is_dup (n,):
        True where the digest was already in the set or appeared earlier in this batch (the
        first occurrence is False). Inserts the new digests."""
        hi, lo = split_digests(digests)
        n = len(hi)
        if n == 0:
            return np.zeros(0, dtype=bool)

        # Distinct digests of the batch, sorted by (hi, lo). lexsort is stable, so each
        # group of equal digests starts with its first occurrence in document order.
        order = np.lexsort((lo, hi))
        hi, lo = hi[order], lo[order]
        first = np.ones(n, dtype=bool)
        first[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
        hi, lo, where = hi[first], lo[first], order[first]

        seen = np.zeros(len(hi), dtype=bool)
        for run_hi, run_lo in self._runs:
            seen |= run_contains(run_hi, run_lo, hi, lo)
        is_dup = np.ones(n, dtype=bool)
        is_dup[where] = seen

        new_hi, new_lo = hi[~seen], lo[~seen]  # still sorted by hi
        for start in range(0, len(new_hi), self.max_run):
            stop = start + self.max_run
            self._push(new_hi[start:stop].copy(), new_lo[start:stop].copy())
        return is_dup

    def _push(self, hi: np.ndarray, lo: np.ndarray) -> None:
        """Append a run, then merge the newest two while the newer is at least as large and
        the merged run fits in max_run."""
        self._runs.append((hi, lo))
        while len(self._runs) >= 2:
            (a_hi, a_lo), (b_hi, b_lo) = self._runs[-2:]
            if len(b_hi) < len(a_hi) or len(a_hi) + len(b_hi) > self.max_run:
                break
            self._runs[-2:] = [merge_runs(a_hi, a_lo, b_hi, b_lo)]

    def __len__(self) -> int:
        return sum(len(hi) for hi, _ in self._runs)

    @property
    def nbytes(self) -> int:
        """Bytes of the numpy arrays held."""
        return sum(hi.nbytes + lo.nbytes for hi, lo in self._runs)
