"""Loader-only throughput (no model) of the loader paths over the same pre-packed blocks.

Usage:
    python bench/loaders.py --blocks OUT --db DIR --table NAME --out FILE.json
        [--quick] [--batch-size 32] [--workers 2] [--repeats 3] [--min-tokens N]
        [--read-batch-size 64] [--io-queue-depth 1] [--transform-parallelism 2] [--no-docs-check]
        [--min-score X] [--sweep] [--sweep-min-tokens N] [--png FILE.png]
        [--modes lance-docs,lance,...] [--storage-option KEY=VALUE ...]

OUT is what build_packed_datasets.py wrote (a directory or an s3:// URI); --db/--table
the corpus it was built from (default: the manifest's source). Paths, all yielding batches of --batch-size
blocks of the manifest's seq_len in one process (rank 0 of 1):

- lance-docs: the corpus table packed in the loader, as `train.py --pack` builds it
  (in-process; --transform-parallelism threads plus num_splits x --io-queue-depth
  I/O threads, num_splits = --batch-size);
- lance: the pre-packed blocks table through the same StreamingDataset, in-process;
- mosaic, parquet-random, parquet-seq: blocks_loaders.BlocksEpochs with --workers
  DataLoader worker processes (forkserver);
- lance-docs-unbounded, lance-unbounded: the two lance paths with no read-ahead bound
  (--loader-buffer-mb 0, lancedb's own behaviour), timed side by side with the bounded
  ones (--loader-buffer-mb, train.py's default unless told) to show the bound costs nothing.

Each repeat runs every mode once (interleaved, to spread machine noise); a run
iterates epochs 0, 1, ... until --min-tokens tokens have been consumed. Tokens are
block positions (seq_len per block, pads included). Steady-state tokens/s counts
only what came after the first batch. A separate untimed epoch per path hashes
every block and compares the multiset with the manifest's; it runs first, so
every format is read into the page cache before any timed run.

Worker processes come from a forkserver preloaded with torch and the project's
modules: Python 3.11's forkserver never preloads __main__, so each worker would
otherwise re-import torch (~5 s on 2 cores) at every epoch. --sweep runs the lance
paths over 16 settings, a quarter of --min-tokens each unless --sweep-min-tokens;
the JSON is rewritten after every sweep point ("complete": false until the end).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root

import torch  # noqa: E402

import blocks_loaders  # noqa: E402
import data  # noqa: E402
import storage  # noqa: E402
import train  # noqa: E402
from common import (TRAIN_FILTER, MultisetDigest, UserError, atomic_write, block_hashes, is_remote,  # noqa: E402
                    load_tokenizer)

MODES = ("lance-docs", "lance", "mosaic", "parquet-random", "parquet-seq", "lance-docs-unbounded",
         "lance-unbounded")
UNBOUNDED = "-unbounded"  # a lance mode with this suffix reads ahead without a bound
FORMAT = blocks_loaders.MODE_FORMAT  # the OUT subdirectory each blocks path reads
SEED = 42
MP_CONTEXT = "forkserver"  # lancedb is not fork-safe (DESIGN.md); the same as train.py's default
MIN_TOKENS, QUICK_MIN_TOKENS = 20_000_000, 300_000
SWEEP_MODES = ("lance-docs", "lance")
SWEEP_GRID = [(rbs, iqd, tp) for rbs in (8, 32, 64, 128) for iqd in (1, 2) for tp in (1, 2)]
QUICK_SWEEP_GRID = [(8, 1, 1), (32, 2, 2), (64, 4, 4)]
SWEEP_REPEATS = 1  # 32 runs already; rerun a point with the main flags to firm it up
TRAIN_DEFAULTS = train.parse_args([])  # the loader settings train.py runs with unless told otherwise
MOSAIC_CANONICAL_NODES = 8  # blocks_loaders.mosaic_blocks
# Imported once in the forkserver, so a worker process starts in ~1 s instead of
# re-importing torch (~5 s here) at every epoch: the benchmark times loaders, not imports.
FORKSERVER_PRELOAD = ["torch", "blocks_loaders", "data", "streaming"]

# Mosaic hands out read-only views of its shards; the collate warning about them is noise.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def base_mode(mode: str) -> str:
    """The path a mode reads: lance-docs-unbounded reads lance-docs' path, unbounded."""
    return mode.removesuffix(UNBOUNDED)


# ── The paths ───────────────────────────────────────────────────────────────────

class LanceEpochs:
    """train.py's in-process loader: a fresh StreamingDataset per epoch (the epoch reseeds
    the shuffle), built ahead for epoch 0 so that construction counts as setup. Its batches
    are made on train.py's prefetch thread (data.prefetched), or with `inline` on the
    thread that takes them, as train.py made them before it."""

    def __init__(self, make_dataset, args, inline: bool = False):
        self.make_dataset, self.args, self.inline = make_dataset, args, inline
        self.datasets = [make_dataset(0)]

    def epoch(self, e: int):
        while len(self.datasets) <= e:
            self.datasets.append(self.make_dataset(len(self.datasets)))
        batches = data.make_loader(self.datasets[e], self.args, torch.device("cpu"), self.args.batch_size)
        return batches if self.inline else prefetched_batches(batches)

    def stats(self) -> dict:
        """Seconds the loader's own threads spent (summed over threads): where the time went."""
        return {"fetch_s": round(sum(ds.fetch_time for ds in self.datasets), 3),
                "transform_s": round(sum(ds.transform_time for ds in self.datasets), 3)}


def prefetched_batches(batches):
    """`batches` made on a prefetch thread, as train.py's loop takes them; stopping early
    stops the thread."""
    prefetcher = data.prefetched(((0, None, batch) for batch in batches), torch.device("cpu"))
    try:
        for _, _, batch in prefetcher:
            yield batch
    finally:
        prefetcher.close()


class Bench:
    """The blocks, the corpus and the settings every run shares."""

    def __init__(self, opts):
        self.opts = opts
        formats = {"lance"} | {FORMAT[m] for m in opts.modes if m in FORMAT}  # lance: the reference
        self.manifests = {fmt: blocks_loaders.read_manifest(blocks_path(opts.blocks, fmt), fmt)
                          for fmt in sorted(formats)}
        self.manifest = self.manifests["lance"]
        for fmt, m in self.manifests.items():
            if m["multiset_hash"] != self.manifest["multiset_hash"] or m["seq_len"] != self.manifest["seq_len"]:
                raise UserError(f"{opts.blocks}/{fmt} holds other blocks than {opts.blocks}/lance; "
                                f"rebuild all formats in one build_packed_datasets.py run")
        self.seq_len, self.num_blocks = self.manifest["seq_len"], self.manifest["num_blocks"]
        if self.num_blocks < opts.batch_size:
            raise UserError(f"{opts.blocks} holds {self.num_blocks} blocks, fewer than --batch-size "
                            f"({opts.batch_size}): the lance paths need a block per split")
        source = self.manifest["source"]
        self.db = opts.db or source["db"]
        self.table_name = opts.table or source["table"]
        if opts.min_score is None:
            found = re.search(r"score >= ([-+0-9.eE]+)", source.get("filter", ""))
            opts.min_score = float(found.group(1)) if found else 1.0
        self.tok = load_tokenizer(self.manifest["tokenizer"])
        bases = {base_mode(m) for m in opts.modes}
        self.corpus = storage.connect_table(self.db, self.table_name) if "lance-docs" in bases else None
        self.blocks_table = blocks_loaders.open_lance_blocks(blocks_path(opts.blocks, "lance"))[0] \
            if "lance" in bases else None

    def train_args(self, read_batch_size: int, io_queue_depth: int, transform_parallelism: int,
                   shuffle_seed: int = SEED, buffer_mb: float | None = None):
        """train.py's own namespace for these loader settings, validated by train.check_args."""
        buffer_mb = self.opts.loader_buffer_mb if buffer_mb is None else buffer_mb
        args = train.parse_args([
            "--db", self.db, "--table", self.table_name, "--tokenizer", self.manifest["tokenizer"],
            "--seq-len", str(self.seq_len), "--batch-size", str(self.opts.batch_size), "--pack",
            "--min-score", repr(self.opts.min_score), "--shuffle-seed", str(shuffle_seed),
            "--read-batch-size", str(read_batch_size), "--io-queue-depth", str(io_queue_depth),
            "--transform-parallelism", str(transform_parallelism), "--loader-buffer-mb", str(buffer_mb),
            "--num-workers", "0"])  # the lance paths run in-process
        train.check_args(args, 1)
        return args

    def loader(self, mode: str, lance_settings: tuple[int, int, int] | None = None,
               num_splits: int | None = None, shuffle_seed: int = SEED):
        """An object whose .epoch(e) gives epoch e's batches; `num_splits=1` covers every block."""
        lance_settings = lance_settings or (self.opts.read_batch_size, self.opts.io_queue_depth,
                                            self.opts.transform_parallelism)
        num_splits = num_splits or self.opts.batch_size
        buffer_mb = 0 if mode.endswith(UNBOUNDED) else None
        mode = base_mode(mode)
        if mode == "lance-docs":
            args = self.train_args(*lance_settings, shuffle_seed=shuffle_seed, buffer_mb=buffer_mb)
            plan = data.plan_epoch(args, self.corpus, num_splits, args.batch_size)
            source = data.corpus_source(args, self.tok, TRAIN_FILTER, packed=True,
                                         blocks_per_epoch=plan.blocks_per_epoch)
            return LanceEpochs(lambda e: data.make_dataset(
                args, self.corpus, 0, 1, epoch=e, shuffle=True, num_splits=num_splits, **source), args,
                self.opts.inline)
        if mode == "lance":
            args = self.train_args(*lance_settings, shuffle_seed=shuffle_seed, buffer_mb=buffer_mb)
            transform = functools.partial(blocks_loaders.blocks_to_samples, seq_len=self.seq_len)
            return LanceEpochs(lambda e: data.make_dataset(
                args, self.blocks_table, 0, 1, epoch=e, shuffle=True, num_splits=num_splits,
                transform=transform), args, self.opts.inline)
        return blocks_loaders.BlocksEpochs(
            mode, blocks_path(self.opts.blocks, FORMAT[mode]), rank=0, world_size=1,
            batch_size=self.opts.batch_size, seed=SEED, num_workers=self.opts.workers,
            mp_context=MP_CONTEXT)


def blocks_path(out: str, fmt: str) -> str:
    """OUT/FMT for a local directory or an s3:// URI."""
    return f"{out.rstrip('/')}/{fmt}" if is_remote(out) else os.path.join(out, fmt)


def same_location(a: str, b: str) -> bool:
    return a == b if is_remote(a) or is_remote(b) else os.path.abspath(a) == os.path.abspath(b)


def release(loader) -> None:
    """Drop a loader before the next one exists: a Mosaic dataset frees its shared
    memory (/dev/shm) only when collected, and worker processes should be gone before
    timing resumes. No clean_stale_shared_memory(): it would also unlink the live
    shared memory of anyone else's Mosaic run on this machine."""
    del loader
    gc.collect()


# ── Timed runs ───────────────────────────────────────────────────────────────────────

def timed_run(bench: Bench, mode: str, min_tokens: int, lance_settings=None) -> dict:
    """Construct one loader and iterate fresh epochs until `min_tokens` tokens are consumed.

    `tokens_per_s` spans epoch boundaries (a new dataset or new worker processes,
    and the refill of the pipeline), which weigh heavily when an epoch is small;
    `epoch_first_batch_s` lists each epoch's wait for its first batch to show it.
    """
    gc.collect()
    t0 = time.perf_counter()
    loader = bench.loader(mode, lance_settings)
    setup_s = time.perf_counter() - t0
    tokens = first_tokens = epochs = 0
    epoch_first_batch_s, thread_s = [], []
    start = time.perf_counter()
    t_first = None
    while tokens < min_tokens:
        epoch_start, epoch_tokens = time.perf_counter(), 0
        epochs += 1
        it = iter(loader.epoch(epochs - 1))
        while True:
            cpu = time.thread_time()
            batch = next(it, None)
            if batch is None:
                break
            thread_s.append(time.thread_time() - cpu)
            ids = batch["input_ids"]
            ids.sum()  # touch every token: nothing is skipped lazily
            tokens += ids.numel()
            if epoch_tokens == 0:
                epoch_first_batch_s.append(round(time.perf_counter() - epoch_start, 4))
            epoch_tokens += ids.numel()
            if t_first is None:
                t_first, first_tokens = time.perf_counter(), tokens
            if tokens >= min_tokens:
                break
        end = time.perf_counter()
        del it
        if epoch_tokens == 0:
            raise RuntimeError(f"{mode}: epoch {epochs - 1} yielded no batch")
    steady = tokens > first_tokens  # else one batch was all: then count it, and its wait
    run = {"tokens_per_s": (tokens - first_tokens) / (end - t_first) if steady else tokens / (end - start),
           "first_batch_s": round(t_first - start, 4), "setup_s": round(setup_s, 4),
           "tokens": tokens, "epochs": epochs, "seconds": round(end - start, 3),
           "epoch_first_batch_s": epoch_first_batch_s,
           "thread_ms": round(1000 * statistics.median(thread_s[1:] or thread_s), 4)}
    if isinstance(loader, LanceEpochs):
        run.update(loader.stats())
    release(loader)
    return run


def summarize(runs: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "thread_ms": statistics.median(r["thread_ms"] for r in runs),
            "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
            "setup_s": statistics.median(r["setup_s"] for r in runs), "runs": runs}


def run_line(mode: str, run: dict, tag: str) -> str:
    extra = "".join(f"  {k} {run[k]:.2f}s" for k in ("fetch_s", "transform_s") if k in run)
    return (f"{tag} {mode:<15}{run['tokens_per_s']:>14,.0f} tok/s  first batch {run['first_batch_s']:.3f}s"
            f"  setup {run['setup_s']:.3f}s  ({run['tokens']:,} tokens, {run['epochs']} epoch(s), "
            f"{run['seconds']:.2f}s){extra}")


# ── Correctness: the blocks each path yields are the manifest's ──────────────────────

def check(bench: Bench, mode: str, reference: Counter | None = None) -> tuple[dict, Counter]:
    """Hash every block of one untimed epoch and compare with the manifest; returns the
    result and the blocks' names with their counts.

    The lance paths use one split (the loader drops the num_blocks % num_splits
    surplus); lance-docs then repacks exactly as the builder did. Mosaic may pad its
    epoch by repeating samples: it passes if, against `reference` (the names of a
    path that matched the manifest), no block is missing and the surplus are repeats.
    """
    m = bench.manifest
    expected = {"expected_blocks": m["num_blocks"], "expected_multiset_hash": m["multiset_hash"]}
    if base_mode(mode) == "lance-docs" and bench.opts.no_docs_check:
        return {"ok": None, **expected, "note": "--no-docs-check"}, Counter()
    if base_mode(mode) == "lance-docs":
        src = m["source"]
        same_source = (same_location(bench.db, src["db"])
                       and bench.table_name == src["table"] and bench.corpus.version == src["table_version"]
                       and data.data_filter(bench.train_args(1, 1, 1), TRAIN_FILTER) == src["filter"])
        if not same_source:
            return {"ok": None, **expected, "note": "corpus, table version or filter differ from the "
                    "blocks' source: nothing to compare"}, Counter()
    start = time.perf_counter()
    loader = bench.loader(mode, num_splits=1,
                          shuffle_seed=m["seed"] if base_mode(mode) == "lance-docs" else SEED)
    digest, names = MultisetDigest(), Counter()
    for batch in loader.epoch(0):
        hashes = block_hashes(batch["input_ids"].numpy())
        digest.add(hashes)
        names.update(hashes)
    release(loader)
    result = {"blocks": digest.count, "multiset_hash": digest.hexdigest(), **expected,
              "seconds": round(time.perf_counter() - start, 2)}
    result["ok"] = (digest.count, digest.hexdigest()) == (m["num_blocks"], m["multiset_hash"])
    if not result["ok"] and mode == "mosaic" and reference:
        missing, surplus = reference - names, names - reference
        result.update(missing=sum(missing.values()), repeated=sum(surplus.values()))
        result["ok"] = not missing and set(surplus) <= set(reference)
        if result["ok"]:
            result["note"] = (f"Mosaic padded its epoch with {result['repeated']} repeated block(s) "
                              f"(num_canonical_nodes={MOSAIC_CANONICAL_NODES}); none is missing")
    return result, names


def check_line(mode: str, c: dict) -> str:
    if c["ok"] is None:
        return f"check {mode}: skipped ({c['note']})"
    if c["ok"]:
        more = f"; {c['note']}" if "note" in c else ""
        return (f"check {mode}: ok ({c['expected_blocks']:,} blocks, multiset {c['expected_multiset_hash']}, "
                f"{c['seconds']:.1f} s{more})")
    return (f"check {mode}: MISMATCH: {c['blocks']:,} blocks (multiset {c['multiset_hash']}) vs the "
            f"manifest's {c['expected_blocks']:,} ({c['expected_multiset_hash']})"
            + (f"; {c['missing']:,} missing, {c['repeated']:,} repeated" if "missing" in c else ""))


# ── Report ───────────────────────────────────────────────────────────────────────────

def machine_info() -> dict:
    """What the numbers depend on, so a JSON file from another machine can be read."""
    from importlib.metadata import PackageNotFoundError, version

    def first(path: str, key: str) -> str | None:
        try:
            with open(path) as f:
                return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
        except OSError:
            return None

    mem_kb = first("/proc/meminfo", "MemTotal")
    versions = {}
    for pkg in ("torch", "lancedb", "pylance", "pyarrow", "numpy", "mosaicml-streaming"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "logical_cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "platform": platform.platform(), "python": platform.python_version(), **versions,
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def settings_of(bench: Bench, opts) -> dict:
    m, b = bench.manifest, opts.batch_size
    lance = {"num_splits": b, "read_batch_size": opts.read_batch_size,
             "io_queue_depth": opts.io_queue_depth, "io_threads": b * opts.io_queue_depth,
             "transform_parallelism": opts.transform_parallelism,
             "transform_threads": opts.transform_parallelism, "processes": 1,
             "loader": "data.make_loader: DataLoader(num_workers=0)", "shuffle_seed": SEED,
             "loader_buffer_mb": opts.loader_buffer_mb}
    workers = {"processes": 1 + opts.workers, "num_workers": opts.workers, "mp_context": MP_CONTEXT,
               "forkserver_preload": FORKSERVER_PRELOAD, "persistent_workers": False,
               "prefetch_factor": 4, "seed": SEED}
    return {
        "blocks": opts.blocks if is_remote(opts.blocks) else os.path.abspath(opts.blocks),
        "db": bench.db, "table": bench.table_name,
        "seq_len": bench.seq_len, "num_blocks": bench.num_blocks, "tokenizer": m["tokenizer"],
        "tokens_per_epoch": bench.num_blocks * bench.seq_len, "batch_size": b,
        "min_tokens": opts.min_tokens, "repeats": opts.repeats,
        "sweep_min_tokens": opts.sweep_min_tokens, "sweep_repeats": SWEEP_REPEATS, "quick": opts.quick,
        "min_score": opts.min_score, "tokens_counted": "block positions (seq_len per block, pads included)",
        "page_cache": "warm: the check epochs read every format before the timed runs",
        "modes": {"lance-docs": {**lance, "pack_sequences": bench.seq_len},
                  "lance": lance,
                  "lance-docs-unbounded": {**lance, "pack_sequences": bench.seq_len, "loader_buffer_mb": 0},
                  "lance-unbounded": {**lance, "loader_buffer_mb": 0},
                  "mosaic": {**workers, "num_canonical_nodes": MOSAIC_CANONICAL_NODES},
                  "parquet-random": workers, "parquet-seq": workers},
        "timed_modes": list(opts.modes),
    }


def mode_settings(mode: str, opts) -> str:
    if mode.startswith("lance"):
        bound = "unbounded" if mode.endswith(UNBOUNDED) else f"{opts.loader_buffer_mb:g} MiB"
        return (f"in-process: {opts.transform_parallelism} transform + {opts.batch_size * opts.io_queue_depth} "
                f"I/O threads (rbs {opts.read_batch_size}, iqd {opts.io_queue_depth}, read-ahead {bound})")
    return f"{opts.workers} worker process(es), {MP_CONTEXT}"


def print_table(results: list[dict], opts) -> None:
    print(f"\n{'mode':<15}{'tokens/s':>12}  {'min - max':<25}{'first batch s':>14}{'epoch start s':>14}"
          f"{'setup s':>9}{'thread ms':>10}  settings")
    for r in results:
        span = f"{r['min']:,.0f} - {r['max']:,.0f}"
        later = [s for run in r["runs"] for s in run["epoch_first_batch_s"][1:]]
        restart = f"{statistics.median(later):.3f}" if later else "-"
        print(f"{r['mode']:<15}{r['tokens_per_s']:>12,.0f}  {span:<25}{r['first_batch_s']:>14.3f}{restart:>14}"
              f"{r['setup_s']:>9.3f}{r['thread_ms']:>10.3f}  {mode_settings(r['mode'], opts)}")
    print("(epoch start s: median wait for the first batch of epochs after the first, inside tokens/s;\n"
          " thread ms: the median CPU ms per batch of the thread that takes the batches, as train.py's\n"
          " training thread: lance paths " + ("made inline, --inline)" if opts.inline else "made on the prefetch thread)"))
    by_mode = {r["mode"]: r["tokens_per_s"] for r in results}
    if "lance" in by_mode and "mosaic" in by_mode:
        print(f"lance / mosaic: {by_mode['lance'] / by_mode['mosaic']:.2f}x")
    if "lance-docs" in by_mode:
        print(f"lance-docs (the corpus packed in the loader, train.py --pack): {by_mode['lance-docs']:,.0f} tokens/s")
    for mode in ("lance-docs", "lance"):
        if mode in by_mode and mode + UNBOUNDED in by_mode:
            print(f"{mode} bounded at {opts.loader_buffer_mb:g} MiB / unbounded: "
                  f"{by_mode[mode] / by_mode[mode + UNBOUNDED]:.2f}x")


def run_sweep(bench: Bench, opts, save) -> list[dict]:
    """lance-docs and lance over read_batch_size x io_queue_depth x transform_parallelism;
    `save(sweep)` after every point, so a run cut short keeps what it measured."""
    grid = QUICK_SWEEP_GRID if opts.quick else SWEEP_GRID
    runs = {}

    def table() -> list[dict]:
        return sorted(({"read_batch_size": p[0], "io_queue_depth": p[1], "transform_parallelism": p[2],
                        "mode": mode, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                        "runs": rs} for (p, mode), rs in runs.items()), key=lambda s: -s["tokens_per_s"])

    for rep in range(SWEEP_REPEATS):
        for point in grid:
            for mode in SWEEP_MODES:
                run = timed_run(bench, mode, opts.sweep_min_tokens, point)
                runs.setdefault((point, mode), []).append(run)
                print(run_line(mode, run, f"[sweep {rep + 1}/{SWEEP_REPEATS} rbs {point[0]} iqd {point[1]} "
                                          f"tp {point[2]}]"), flush=True)
            save(table())
    sweep = table()
    print(f"\n{'mode':<12}{'read_batch':>11}{'io_depth':>9}{'tx_par':>7}{'tokens/s':>14}  runs")
    for s in sweep:
        print(f"{s['mode']:<12}{s['read_batch_size']:>11}{s['io_queue_depth']:>9}{s['transform_parallelism']:>7}"
              f"{s['tokens_per_s']:>14,.0f}  " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in s["runs"]))
    return sweep


def draw(results: list[dict], machine: dict, opts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in results]
    med = [r["tokens_per_s"] / 1e6 for r in results]
    err = [[(r["tokens_per_s"] - r["min"]) / 1e6 for r in results],
           [(r["max"] - r["tokens_per_s"]) / 1e6 for r in results]]
    fig, ax = plt.subplots(figsize=(9, 5))
    colors = {"lance": "#4c72b0", "mosaic": "#dd8452", "parquet": "#55a868"}
    ax.bar(modes, med, yerr=err, capsize=6, hatch=[".." if m.endswith(UNBOUNDED) else "" for m in modes],
           color=[colors[m.split("-")[0]] for m in modes])
    ax.tick_params(axis="x", labelsize=8, labelrotation=15)
    for x, r in enumerate(results):  # above the error bar, not on it
        ax.annotate(f"{r['tokens_per_s'] / 1e6:,.2f}", (x, r["max"] / 1e6), ha="center", va="bottom",
                    xytext=(0, 4), textcoords="offset points")
    ax.set_ylabel("tokens/s (millions; median, min-max bars)")
    ax.set_title(f"Loader-only throughput, {machine['cpu']} ({machine['affinity']} cores)\n"
                 f"batch {opts.batch_size} x {opts.seq_len} tokens, {opts.workers} workers; lance: "
                 f"rbs {opts.read_batch_size}, iqd {opts.io_queue_depth}, tp {opts.transform_parallelism}; "
                 f"{opts.repeats} repeat(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def options_or_exit(parse_args, argv):
    """A bench's options; a usage mistake ends it in one line, exit 2."""
    try:
        return parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def write_json(path: str, results: dict) -> None:
    """A bench's JSON through common.atomic_write: complete or absent."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(results, f, indent=2)

    atomic_write(path, dump)


# ── Main ─────────────────────────────────────────────────────────────────────────────

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", required=True, help="the OUT directory (or s3:// URI) build_packed_datasets.py wrote")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated paths to time (default: all)")
    p.add_argument("--db", default="", help="the corpus db (default: the manifest's source)")
    p.add_argument("--table", default="", help="the corpus table (default: the manifest's source)")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--png", default="", help="bar chart (default: --out with .png)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: --min-tokens {QUICK_MIN_TOKENS:,}, 1 repeat, a 3-point sweep")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of mosaic / parquet-*")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--min-tokens", type=int, default=None,
                   help=f"tokens per run (default {MIN_TOKENS:,}; --quick: {QUICK_MIN_TOKENS:,})")
    p.add_argument("--read-batch-size", type=int, default=TRAIN_DEFAULTS.read_batch_size)
    p.add_argument("--io-queue-depth", type=int, default=TRAIN_DEFAULTS.io_queue_depth)
    p.add_argument("--transform-parallelism", type=int, default=TRAIN_DEFAULTS.transform_parallelism)
    p.add_argument("--loader-buffer-mb", type=float, default=TRAIN_DEFAULTS.loader_buffer_mb,
                   help="read-ahead bound of the lance modes (the -unbounded ones have none)")
    p.add_argument("--no-docs-check", action="store_true",
                   help="skip lance-docs' check epoch (a whole pass of in-loader packing: "
                        "minutes on a big corpus)")
    p.add_argument("--min-score", type=float, default=None,
                   help="lance-docs quality cutoff (default: the manifest's source filter)")
    p.add_argument("--sweep", action="store_true", help="also sweep the lance loader settings")
    p.add_argument("--inline", action="store_true",
                   help="the lance paths' batches made on the thread that takes them (train.py before "
                        "its prefetch thread), to set thread ms side by side with the default")
    p.add_argument("--sweep-min-tokens", type=int, default=None,
                   help="tokens per sweep run (default: a quarter of --min-tokens; 32 runs)")
    storage.add_argument(p)
    opts = p.parse_args(argv)
    opts.modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    opts.repeats = opts.repeats if opts.repeats is not None else (1 if opts.quick else 3)
    opts.min_tokens = opts.min_tokens if opts.min_tokens is not None else (
        QUICK_MIN_TOKENS if opts.quick else MIN_TOKENS)
    opts.sweep_min_tokens = opts.sweep_min_tokens or max(opts.min_tokens // (1 if opts.quick else 4), 1)
    opts.png = opts.png or os.path.splitext(opts.out)[0] + ".png"
    return opts


def check_opts(opts) -> None:
    for flag, value in (("--batch-size", opts.batch_size), ("--workers", opts.workers),
                        ("--repeats", opts.repeats), ("--min-tokens", opts.min_tokens),
                        ("--sweep-min-tokens", opts.sweep_min_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    unknown = [m for m in opts.modes if m not in MODES]
    if unknown or not opts.modes:
        raise UserError(f"--modes takes a comma-separated subset of {','.join(MODES)} "
                        f"(got {','.join(opts.modes) or 'nothing'})")
    if opts.sweep and not set(SWEEP_MODES) <= set(opts.modes):
        raise UserError(f"--sweep times {' and '.join(SWEEP_MODES)}: keep them in --modes")
    if not is_remote(opts.blocks) and not os.path.isdir(opts.blocks):
        raise UserError(f"no blocks at {opts.blocks!r}; build them with "
                        f"`python build_packed_datasets.py --db DIR --table NAME --out {opts.blocks}`")


def bench_main(opts) -> int:
    started = time.perf_counter()
    check_opts(opts)
    bench = Bench(opts)
    opts.seq_len = bench.seq_len
    machine = machine_info()
    print(f"{machine['cpu']}, {machine['affinity']} cores, {machine['ram_gib']} GiB; "
          f"{bench.num_blocks:,} blocks x {bench.seq_len} tokens; batch {opts.batch_size}; "
          f"{opts.min_tokens:,} tokens per run; {opts.repeats} repeat(s)"
          + (f"; sweep: {opts.sweep_min_tokens:,} tokens per run" if opts.sweep else ""), flush=True)

    checks, reference = {}, None
    for mode in opts.modes:
        checks[mode], names = check(bench, mode, reference)
        if mode == "lance" and checks[mode]["ok"]:
            reference = names  # the stored blocks, verified: what Mosaic's epoch is held against
        print(check_line(mode, checks[mode]), flush=True)

    runs = {mode: [] for mode in opts.modes}
    for rep in range(opts.repeats):
        for mode in opts.modes:
            run = timed_run(bench, mode, opts.min_tokens)
            runs[mode].append(run)
            print(run_line(mode, run, f"[{rep + 1}/{opts.repeats}]"), flush=True)
    results = [{"mode": mode, **summarize(runs[mode]), "check": checks[mode]} for mode in opts.modes]
    print_table(results, opts)

    settings = settings_of(bench, opts)

    def save(sweep: list[dict], complete: bool = False) -> None:
        if hasattr(os, "getloadavg"):
            machine["loadavg_end"] = list(os.getloadavg())  # another user's load shows here
        write_json(opts.out, {"machine": machine, "settings": settings, "results": results, "sweep": sweep,
                              "complete": complete, "total_s": round(time.perf_counter() - started, 1)})

    save([], complete=not opts.sweep)
    draw(results, machine, opts, opts.png)
    if opts.sweep:
        save(run_sweep(bench, opts, save), complete=True)
    print(f"\nwrote {opts.out} and {opts.png} in {time.perf_counter() - started:.0f} s")
    bad = [mode for mode, c in checks.items() if c["ok"] is False]
    if bad:
        print(f"blocks mismatch in {', '.join(bad)}: these numbers compare different data", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> None:
    opts = parse_args(argv)
    mp.set_start_method(MP_CONTEXT, force=True)  # as train.py: before any dataset exists
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    try:
        storage.configure(opts.storage_option)
        code = bench_main(opts)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
