"""Loader memory under a consumer slower than the loader, and loader start-up against rows and splits.

Usage:
    python bench/loader_memory.py --out FILE.json [--png FILE.png] [--quick] [--work DIR]
        [--budget-mb 16] [--tokens 20000000] [--tokens-per-s 300000] [--corpus-tokens 100000000]
        [--seq-len 1024] [--batch-size 32] [--read-batch-size 64] [--workers 2]
        [--startup-rows 200000,2000000,20000000] [--startup-splits 8,32]
        [--boundary-rows 300000] [--boundary-budget-mb 4] [--boundary-rows-per-s 15000]
        [--skip-memory] [--skip-startup] [--skip-boundary]

Part 1, memory. A corpus table of documents of 200-1,800 byte-tokenizer ids (--corpus-tokens
in all) is written straight with pyarrow into --work (default: a temporary directory, removed
at the end; a --work DIR is kept, and reused by a later run with the same corpus settings),
and build_packed_datasets.build packs it into --seq-len blocks in every format. Each path
below then runs in a fresh process that consumes its batches at a fixed pace, --tokens-per-s
(sleeping between batches: a GPU step that is slower than the loader), until --tokens tokens
(block or row positions, pads included):

- lance-docs: the corpus packed in the loader (`train.py --pack`);
- lance-rows: the corpus rows, one padded/truncated row per document (train.py's default);
- lance: the pre-packed blocks table through the same StreamingDataset;
  each of the three bounded at --budget-mb (`--loader-buffer-mb`) and unbounded
  (`--loader-buffer-mb 0`: lancedb 0.40's own read-ahead), all in-process (num_workers=0);
- lance-docs with `--num-workers --workers`, bounded (each worker holds budget / workers);
- mosaic, parquet-random, parquet-seq: blocks_loaders.BlocksEpochs with --workers DataLoader
  workers, for comparison. MosaicML bounds its memory with its own settings (predownload:
  samples fetched ahead per worker; cache_limit: bytes of shards kept in the local cache);
  over a local directory it downloads nothing and reads its shards from the page cache, which
  RSS does not count. Parquet-* read row groups on demand, a DataLoader prefetch of
  prefetch_factor (4) batches per worker ahead.

Every path is set up as bench/loaders.py sets it up (its Bench, with train.py's
make_dataset/make_loader), with --batch-size splits and batch rows, --read-batch-size, and
train.py's other loader defaults. The children fork from a forkserver that has imported
torch and the project once, so each starts in about a second and holds nothing of another's.
While a child runs, this process samples every 0.25 s the RSS of its whole process tree (the
child, the forkserver it starts for its loader workers, and the workers: VmRSS from
/proc/PID/status summed over descendants found through /proc/*/stat; pages that forked
processes share are counted once per process). After each batch, and after sleeping out its
pace, the child writes a JSON line: tokens consumed and, on the lance paths, lancedb's
counters unscanned_rows, raw_queue_depth, prefetch_queue_depth, consumed_rows, and
BoundedStreamingDataset.buffered_bytes (0 with workers: they hold their own). Read-ahead rows =
raw_queue_depth + prefetch_queue_depth: rows fetched and not yet consumed. With workers, lancedb
keeps one set of counters that each worker overwrites with its own: they are one worker's
(half the splits), and rows_total there is that worker's share.

Reported per path: achieved tokens/s; baseline RSS (the tree after setup, before the first
batch); peak RSS of the tree; RSS growth per million tokens (the least-squares slope of RSS
against tokens consumed, from the first batch to the last: ~0 when bounded); peak read-ahead
rows and buffered MiB; and rows fetched at the end (rows_total - unscanned_rows) against rows
consumed. The corpus must hold at least 10x --budget-mb of Arrow input_ids, or nothing runs. A
bounded split may always hold about two read batches beyond the consumer: the printed floor,
2 x splits x --read-batch-size rows, is what the budget cannot go below.

Part 2, start-up. Corpus tables of --startup-rows short documents (10-60 tokens) are written
the same way. For each size, --startup-splits split count, and the row and packed paths, a
fresh process times make_dataset + the first `next` (data.make_dataset, the
BoundedStreamingDataset train.py uses), and another the same through lancedb's own
StreamingDataset (same arguments minus buffer_bytes, lancedb.streaming.Permutation restored to
lancedb's), the latter only up to 2M rows (its per-split scans of the whole permutation take
30-55 s at 2M rows x 32 splits on 2 cores and grow with rows x splits: larger sizes are
skipped). A third
process times the permutation build alone (permutation_builder(table).filter(f)
.split_random(fixed=splits, seed).execute()). Each reports its peak RSS (ru_maxrss) and its
RSS just before the timed part (torch and lancedb imported, the table open): the table shows
the difference. One run each: on a busy machine, compare the ratios rather than the seconds.
lancedb's permutation builder sorts in a 100 MB memory pool unless
LANCEDB_PERM_BUILDER_MEMORY_LIMIT says otherwise, too little from about 6M rows: every
child sets it to 64 bytes a row (at least 100 MiB) when it is unset, as train.py does at
start-up (bounded_streaming.size_permutation_memory).

Part 3, an epoch boundary. train.py's own batch path (data.train_batches, made on the
prefetch thread) reads two epochs of a --boundary-rows table of rows (the start-up corpus's
documents, --seq-len 64), at --boundary-rows-per-s, with --boundary-budget-mb, in-process and
with --workers loader workers. Once an epoch's loader has asked for all of its rows, the
next epoch's loader is started beside it (its permutation, its workers, its read-ahead) while
this one drains: the table shows the peak RSS of the tree above its RSS at the first batch,
before that moment and from it to the end, the processes in the tree, and how long the two
overlapped, beside the bound the start-up line states.

--quick (a smoke run for the tests; its numbers are not worth reading): a 3M-token corpus of
512-token blocks, 8 splits, read batches of 8 rows, a 1 MiB budget, 0.5M tokens per path;
start-up at 20k and 200k rows; an epoch boundary on 8k rows, a 0.25 MiB budget, 4,000 rows/s. The full default run takes about
20 minutes on 2 CPU cores.

Output: three tables on stdout, JSON at --out ({"machine", "settings", "memory": [...],
"startup": [...], "boundary": [...], "complete", "total_s"}; each memory run keeps its RSS trace and lancedb's
counters, machine.loadavg_end shows another user's load) and a PNG of RSS against tokens
consumed, and of its growth since the first batch, one line per path (default: --out with
.png). A run that fails is reported, and the others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, BENCH)  # and bench/loaders.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

import build_packed_datasets  # noqa: E402
import data  # noqa: E402
import storage  # noqa: E402
import train  # noqa: E402
from common import (TRAIN_FILTER, ArgumentParser, UserError, check_out_dir, load_tokenizer,  # noqa: E402
                    synthetic_corpus)
from loaders import (FORKSERVER_PRELOAD, MP_CONTEXT, TRAIN_DEFAULTS, Bench, LanceEpochs, machine_info,  # noqa: E402
                     release, write_json)

FULL = {"corpus_tokens": 100_000_000, "seq_len": 1024, "tokens": 20_000_000, "budget_mb": 16.0,
        "batch_size": 32, "read_batch_size": TRAIN_DEFAULTS.read_batch_size,
        "startup_rows": "200000,2000000,20000000", "boundary_rows": 300_000,
        "boundary_budget_mb": 4.0, "boundary_rows_per_s": 15_000}
QUICK = {"corpus_tokens": 3_000_000, "seq_len": 512, "tokens": 500_000, "budget_mb": 1.0,
         "batch_size": 8, "read_batch_size": 8, "startup_rows": "20000,200000", "boundary_rows": 8_000,
         "boundary_budget_mb": 0.25, "boundary_rows_per_s": 4_000}
DOC_TOKENS = (200, 1800)  # the memory corpus's document lengths
STARTUP_DOC_TOKENS = (10, 60)
MIN_CORPUS_OVER_BUDGET = 10
PLAIN_MAX_ROWS = 2_000_000  # lancedb's own StreamingDataset: start-up grows with rows x splits
SAMPLE_S = 0.25
PSS_EVERY = 4  # samples: PSS costs ~15 ms a process to read
# (path, bounded, with --workers loader workers); the baselines always have --workers workers
LANCE_RUNS = [(path, bounded, False) for path in ("lance-docs", "lance-rows", "lance") for bounded in (True, False)] \
    + [("lance-docs", True, True)]
BASELINES = ("mosaic", "parquet-random", "parquet-seq")
COUNTERS = ("unscanned_rows", "raw_queue_depth", "prefetch_queue_depth", "consumed_rows")


# ── Process trees ────────────────────────────────────────────────────────────────────

def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, by the parent pids of /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # comm may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_memory(root: int, pss: bool = False) -> dict:
    """Memory of the process tree of `root` in MiB: VmRSS and RssAnon summed over its
    processes (pages that forked processes share count once per process), and with `pss`
    the proportional set size (shared pages split between their sharers: ~15 ms a process
    here, so sampled less often)."""
    keys = ("VmRSS", "RssAnon")
    total = {"rss_mib": 0.0, "anon_mib": 0.0, "pss_mib": 0.0 if pss else None, "processes": 0}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith(keys))}
            if pss and "VmRSS" in fields:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    fields["Pss"] = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):  # gone since the walk
            continue
        if "VmRSS" in fields:  # a zombie has none
            total["rss_mib"] += fields["VmRSS"] / 1024
            total["anon_mib"] += fields.get("RssAnon", 0) / 1024
            if pss:
                total["pss_mib"] += fields.get("Pss", 0) / 1024
            total["processes"] += 1
    return total


def kill_tree(root: int) -> None:
    kill_all(process_tree(root))


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Report:
    """A child's JSON lines, written as they happen (a crash keeps what came before)."""

    def __init__(self, path: str):
        self.file = open(path, "w")

    def __call__(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
        self.file.flush()


def read_report(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def in_child(target, spec: dict, report_path: str) -> None:
    """A child's body: `target(spec, report)`, any exception written to the report too."""
    report = Report(report_path)
    try:
        target(spec, report)
    except BaseException as e:
        report("error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        raise


def run_child(ctx, target, spec: dict, report_path: str, timeout_s: float, sample: bool) -> tuple:
    """Run `target` in a fresh forkserver child; returns (its report lines, exit code, and
    with `sample` the tree_memory of its tree every SAMPLE_S, each with its time "t")."""
    proc = ctx.Process(target=in_child, args=(target, spec, report_path), name=spec["name"])
    proc.start()
    deadline = time.monotonic() + timeout_s
    samples = []
    while proc.exitcode is None:
        if sample:
            memory = tree_memory(proc.pid, pss=len(samples) % PSS_EVERY == 0)
            samples.append({**memory, "t": time.monotonic()})  # after the walk: none counts a later state
        proc.join(SAMPLE_S)
        if proc.exitcode is None and time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.join()
            lines = read_report(report_path) if os.path.exists(report_path) else []
            return lines + [{"event": "error", "error": f"timed out after {timeout_s:.0f} s (killed)"}], \
                proc.exitcode, samples
    lines = read_report(report_path) if os.path.exists(report_path) else []
    return lines, proc.exitcode, samples


def child_error(lines: list[dict], exitcode) -> str | None:
    errors = [r["error"] for r in lines if r["event"] == "error"]
    if errors:
        return errors[-1]
    return None if exitcode == 0 else f"the child exited with code {exitcode} and no report of why"


# ── Part 1: paced memory runs ────────────────────────────────────────────────────────

class MemoryBench(Bench):
    """bench/loaders.py's paths, with a read-ahead budget, loader workers, and the row path."""

    def __init__(self, spec: dict):
        self.num_workers = spec["lance_workers"]
        self.pack = spec["mode"] != "lance-rows"
        super().__init__(SimpleNamespace(
            modes=["lance-docs" if spec["mode"] == "lance-rows" else spec["mode"]], blocks=spec["blocks"],
            db=spec["db"], table="corpus", min_score=None, batch_size=spec["batch_size"],
            loader_buffer_mb=spec["budget_mb"] or 0,
            workers=spec["workers"], read_batch_size=spec["read_batch_size"],
            io_queue_depth=TRAIN_DEFAULTS.io_queue_depth,
            transform_parallelism=TRAIN_DEFAULTS.transform_parallelism,
            inline=False))  # batches made on the prefetch thread, as train.py makes them

    def train_args(self, *settings, **named):
        args = super().train_args(*settings, **named)
        args.pack, args.num_workers = self.pack, self.num_workers
        train.check_args(args, 1)
        return args

    def loader(self, mode: str, *rest, **named):
        if mode != "lance-rows":
            return super().loader(mode, *rest, **named)
        o = self.opts
        args = self.train_args(o.read_batch_size, o.io_queue_depth, o.transform_parallelism)
        source = data.corpus_source(args, self.tok, TRAIN_FILTER, packed=False)
        return LanceEpochs(lambda e: data.make_dataset(args, self.corpus, 0, 1, epoch=e, shuffle=True,
                                                        num_splits=o.batch_size, **source), args, o.inline)

    def rows_total(self, mode: str) -> int:
        """Rows of the permutation the lance path reads (all splits of the rank)."""
        if mode == "lance":
            return self.blocks_table.count_rows()
        return self.corpus.count_rows(data.data_filter(self.train_args(1, 1, 1), TRAIN_FILTER))


def counters(ds) -> dict:
    found = {name: getattr(ds, name) for name in COUNTERS}
    found["buffered_bytes"] = getattr(ds, "buffered_bytes", None)
    return found


def memory_child(spec: dict, report: Report) -> None:
    """Set up one path, then consume its batches at spec['tokens_per_s'] up to spec['tokens']."""
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # for this child's own loader workers
    start = time.monotonic()
    bench = MemoryBench(spec)
    loader = bench.loader(spec["mode"])
    lance = isinstance(loader, LanceEpochs)
    ds = loader.datasets[0] if lance else None
    rows_total = bench.rows_total(spec["mode"]) // max(1, spec["lance_workers"]) if lance else None
    report("ready", setup_s=time.monotonic() - start, rows_total=rows_total, **tree_memory(os.getpid(), pss=True))
    batches = iter(loader.epoch(0))
    tokens, waited, t_first = 0, 0.0, None
    rate, goal = spec["tokens_per_s"], spec["tokens"]
    while tokens < goal:
        asked = time.monotonic()
        batch = next(batches, None)
        got = time.monotonic()
        if batch is None:
            report("epoch_end", tokens=tokens)
            break
        ids = batch["input_ids"]
        ids.sum()  # touch every token
        tokens += ids.numel()
        if t_first is None:
            t_first = got
            report("first", first_batch_s=got - asked)
        else:
            waited += got - asked
        pause = t_first + tokens / rate - time.monotonic()  # the "training step" this batch buys
        if pause > 0:
            time.sleep(pause)
        report("batch", tokens=tokens, waited_s=waited, **(counters(ds) if lance else {}))
    report("end", tokens=tokens, seconds=time.monotonic() - t_first,
           peak_buffered_bytes=getattr(ds, "peak_buffered_bytes", None) if lance else None)
    del batches
    release(loader)


def memory_runs(opts) -> list[dict]:
    runs = [{"name": f"{label}{' x%d workers' % opts.workers if workers else ''} "
                     f"{'bounded' if bounded else 'unbounded'}",
             "path": label, "mode": label, "bounded": bounded,
             "budget_mb": opts.budget_mb if bounded else 0, "lance_workers": opts.workers if workers else 0}
            for label, bounded, workers in LANCE_RUNS]
    runs += [{"name": mode, "path": mode, "mode": mode, "bounded": None, "budget_mb": None, "lance_workers": 0}
             for mode in BASELINES]
    for run in runs:
        run.update(blocks=opts.blocks, db=opts.corpus_db, batch_size=opts.batch_size, workers=opts.workers,
                   read_batch_size=opts.read_batch_size, tokens=opts.tokens, tokens_per_s=opts.tokens_per_s)
    return runs


def memory_result(spec: dict, lines: list[dict], exitcode, samples: list[dict]) -> dict:
    """One path's numbers from the child's report and the sampled RSS of its tree."""
    keep = ("name", "path", "mode", "bounded", "budget_mb", "lance_workers")
    result = {k: spec[k] for k in keep}
    error = child_error(lines, exitcode)
    by = {r["event"]: r for r in lines}
    batches = [r for r in lines if r["event"] == "batch"]
    if error:
        result["error"] = error
        if "traceback" in by.get("error", {}):
            result["traceback"] = by["error"]["traceback"]
    if "ready" not in by or not batches:
        return result
    ready, t_first = by["ready"], batches[0]["t"]
    t_end = by["end"]["t"] if "end" in by else batches[-1]["t"]
    t0 = ready["t"] - ready["setup_s"]
    times = np.array([t_first - 1e-9] + [r["t"] for r in batches])
    consumed = np.array([0] + [r["tokens"] for r in batches], dtype=float)
    run = sorted([ready] + [m for m in samples if m["t"] <= t_end], key=lambda m: m["t"])  # setup included
    trace = [{"t": round(m["t"] - t0, 3), "tokens": int(np.interp(m["t"], times, consumed, left=0)),
              **{k: None if m[k] is None else round(m[k], 1) for k in ("rss_mib", "anon_mib", "pss_mib")},
              "processes": m["processes"]} for m in run]
    during = [(p["tokens"], p["rss_mib"]) for p, m in zip(trace, run) if t_first <= m["t"] <= t_end]
    slope = None
    if len(during) >= 3 and len({x for x, _ in during}) >= 2:
        x, y = np.array(during, dtype=float).T
        slope = float(np.polyfit(x / 1e6, y, 1)[0])
    tokens = batches[-1]["tokens"]
    result.update(
        tokens=tokens, tokens_per_s=tokens / max(batches[-1]["t"] - t_first, 1e-9),
        setup_s=round(ready["setup_s"], 3), first_batch_s=round(by["first"]["first_batch_s"], 3),
        loader_wait_s=round(batches[-1]["waited_s"], 3), epoch_ended=("epoch_end" in by),
        baseline_rss_mib=round(ready["rss_mib"], 1), baseline_pss_mib=round(ready["pss_mib"], 1),
        **{f"peak_{k}": round(max(m[k] for m in run if m[k] is not None), 1)
           for k in ("rss_mib", "anon_mib", "pss_mib")},
        rss_mib_per_mtoken=None if slope is None else round(slope, 3), trace=trace)
    if ready["rows_total"] is not None:
        ahead = [r["raw_queue_depth"] + r["prefetch_queue_depth"] for r in batches]
        buffered = [r["buffered_bytes"] or 0 for r in batches]
        last = batches[-1]
        result.update(
            rows_total=ready["rows_total"], peak_read_ahead_rows=max(ahead),
            peak_buffered_mib=round(max(buffered) / 2**20, 2),
            budget_peak_mib=round((by.get("end", {}).get("peak_buffered_bytes") or 0) / 2**20, 2),
            rows_fetched=ready["rows_total"] - last["unscanned_rows"], rows_consumed=last["consumed_rows"],
            counters_scope=(f"one of {spec['lance_workers']} workers (each overwrites lancedb's shared counters)"
                            if spec["lance_workers"] else "the rank (in-process)"),
            counters=[{k: r[k] for k in ("tokens", *COUNTERS, "buffered_bytes")}
                      for r in batches[::max(1, len(batches) // 200)]])  # at most ~200 of them
    return result


def fmt(value, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_memory(results: list[dict], opts) -> None:
    print(f"\n{'path':<32}{'tokens/s':>10}{'base RSS':>10}{'peak RSS':>10}{'peak PSS':>10}{'MiB/Mtok':>10}"
          f"{'ahead rows':>12}{'buf MiB':>9}   fetched / consumed / total rows")
    for r in results:
        if "tokens" not in r:
            print(f"{r['name']:<32}  FAILED: {r.get('error')}")
            continue
        rows = (f"{r['rows_fetched']:,} / {r['rows_consumed']:,} / {r['rows_total']:,}" if "rows_total" in r else "-")
        buffered = r.get("peak_buffered_mib") if r["bounded"] and not r["lance_workers"] else None
        print(f"{r['name']:<32}{r['tokens_per_s']:>10,.0f}{r['baseline_rss_mib']:>10,.0f}{r['peak_rss_mib']:>10,.0f}"
              f"{r['peak_pss_mib']:>10,.0f}{fmt(r['rss_mib_per_mtoken'], '.2f'):>10}"
              f"{fmt(r.get('peak_read_ahead_rows')):>12}{fmt(buffered, '.1f'):>9}   {rows}"
              + (f"  FAILED: {r['error']}" if "error" in r else "")
              + ("  (the epoch ended before --tokens)" if r.get("epoch_ended") else ""))
    print(f"(MiB; pace {opts.tokens_per_s:,} tokens/s. base: the tree's RSS after setup, before the first batch; "
          f"RSS sums VmRSS over the tree's processes, PSS splits the pages they share; MiB/Mtok: least-squares "
          f"slope of RSS against tokens consumed; ahead: raw + prefetch rows, most seen after a paced step; buf: "
          f"BoundedStreamingDataset.buffered_bytes (in-process only); with workers the counters are one worker's)")


def draw(results: list[dict], machine: dict, opts, path: str) -> None:
    """RSS against tokens consumed from the first batch on, and its growth since then."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"lance-docs": "#4c72b0", "lance-rows": "#8172b3", "lance": "#c44e52", "mosaic": "#dd8452",
              "parquet-random": "#55a868", "parquet-seq": "#937860"}
    fig, (absolute, growth) = plt.subplots(1, 2, figsize=(14, 6))
    for r in results:
        points = [p for p in r.get("trace", ()) if p["tokens"] > 0]
        if not points:
            continue
        x = [p["tokens"] / 1e6 for p in points]
        y = [p["rss_mib"] for p in points]
        style = dict(ls={True: "-", False: "--", None: ":"}[r["bounded"]], color=colors.get(r["path"], "black"),
                     lw=2.4 if r["lance_workers"] else 1.6, marker="o" if r["lance_workers"] else None,
                     markevery=max(1, len(x) // 12), ms=4, label=r["name"])
        absolute.plot(x, y, **style)
        growth.plot(x, [v - y[0] for v in y], **style)
    absolute.set_ylabel("RSS of the loader's process tree (MiB)")
    absolute.set_ylim(bottom=0)
    growth.set_ylabel("RSS growth since the first batch (MiB)")
    for ax in (absolute, growth):
        ax.set_xlabel("tokens consumed (millions)")
        ax.grid(alpha=0.3)
    growth.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Loader memory under a {opts.tokens_per_s:,} tokens/s consumer; {machine['cpu']}, "
                 f"{machine['affinity']} cores, {machine['ram_gib']} GiB\n"
                 f"bounded: --loader-buffer-mb {opts.budget_mb:g} (solid); unbounded: lancedb's own read-ahead "
                 f"(dashed); other loaders (dotted); batch {opts.batch_size} x {opts.seq_len} tokens, read batch "
                 f"{opts.read_batch_size}; corpus {opts.corpus_mib:,.0f} MiB of input_ids\n"
                 f"RSS summed over the process tree: loader workers (and their forkserver) count the pages "
                 f"they share once each", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ── Part 2: start-up ─────────────────────────────────────────────────────────────────

def own_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def startup_child(spec: dict, report: Report) -> None:
    """Time one start-up: the permutation build alone, or make_dataset + the first batch."""
    rss_start = own_rss_mib()
    from bounded_streaming import size_permutation_memory

    size_permutation_memory(spec["rows"])  # as train.py does at start-up, for every impl
    table = storage.connect_table(spec["db"], "corpus")
    args = train.parse_args(["--db", spec["db"], "--seq-len", str(spec["seq_len"]),
                             "--batch-size", str(spec["splits"]), *(["--pack"] if spec["path"] == "packed" else [])])
    train.check_args(args, 1)
    where = data.data_filter(args, TRAIN_FILTER)
    result = {"rss_before_mib": own_rss_mib()}  # lancedb imported, the table open
    if spec["impl"] == "build":
        from lancedb.permutation import permutation_builder

        start = time.perf_counter()
        permutation_builder(table).filter(where).split_random(fixed=spec["splits"], seed=args.shuffle_seed).execute()
        result["build_s"] = time.perf_counter() - start
    else:
        start = time.perf_counter()
        plan = data.plan_epoch(args, table, spec["splits"], spec["splits"])
        result["plan_s"] = time.perf_counter() - start
        source = data.corpus_source(args, load_tokenizer("byte"), TRAIN_FILTER, packed=args.pack,
                                     blocks_per_epoch=plan.blocks_per_epoch)
        if spec["impl"] == "lancedb":
            use_lancedb_streaming()
        result["rss_before_mib"] = own_rss_mib()
        start = time.perf_counter()
        ds = data.make_dataset(args, table, 0, 1, epoch=0, shuffle=True, num_splits=spec["splits"], **source)
        result["make_dataset_s"] = time.perf_counter() - start
        result["dataset"] = type(ds).__name__
        batches = iter(data.make_loader(ds, args, torch.device("cpu"), spec["splits"]))
        next(batches)
        result["first_batch_s"] = time.perf_counter() - start
        del batches
        gc.collect()
    report("done", rss_start_mib=rss_start,
           peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **result)


def use_lancedb_streaming() -> None:
    """Make data.make_dataset build lancedb's own StreamingDataset (same arguments, no
    buffer_bytes) and undo bounded_streaming's rebinding of lancedb.streaming.Permutation."""
    import lancedb.streaming
    from lancedb.permutation import Permutation

    import bounded_streaming

    def plain(table, *, buffer_bytes=None, **kwargs):
        return lancedb.streaming.StreamingDataset(table, **kwargs)

    bounded_streaming.BoundedStreamingDataset = plain
    lancedb.streaming.Permutation = Permutation


def startup_runs(opts, rows: int, db: str) -> list[dict]:
    runs = []
    for splits in opts.startup_splits:
        common = dict(rows=rows, splits=splits, db=db, seq_len=opts.seq_len)
        runs.append({**common, "impl": "build", "path": None})
        for path in ("rows", "packed"):
            runs.append({**common, "impl": "bounded", "path": path})
            runs.append({**common, "impl": "lancedb", "path": path, "skip": rows > PLAIN_MAX_ROWS})
    for run in runs:
        run["name"] = f"startup {run['impl']}{' ' + run['path'] if run['path'] else ''} {rows} rows {run['splits']} splits"
    return runs


def print_startup(results: list[dict]) -> None:
    print(f"\n{'rows':>12}{'splits':>7}  {'path':<7}{'build s':>9}{'+MiB':>7}"
          f"{'bounded first s':>17}{'+MiB':>7}{'lancedb first s':>17}{'+MiB':>7}")
    cells = {(r["rows"], r["splits"], r["impl"], r["path"]): r for r in results}

    def cell(r, key) -> tuple[str, str]:
        if r is None:
            return "-", "-"
        if r.get("skipped"):
            return "skipped", "-"
        if "error" in r or key not in r:
            return "FAILED", "-"
        return f"{r[key]:.2f}", f"{r['peak_rss_mib'] - r['rss_before_mib']:,.0f}"

    for rows, splits in dict.fromkeys((r["rows"], r["splits"]) for r in results):
        build = cell(cells.get((rows, splits, "build", None)), "build_s")
        for path in ("rows", "packed"):
            bounded = cell(cells.get((rows, splits, "bounded", path)), "first_batch_s")
            plain = cell(cells.get((rows, splits, "lancedb", path)), "first_batch_s")
            print(f"{rows:>12,}{splits:>7}  {path:<7}{build[0]:>9}{build[1]:>7}{bounded[0]:>17}{bounded[1]:>7}"
                  f"{plain[0]:>17}{plain[1]:>7}")
    before = [r["rss_before_mib"] for r in results if "rss_before_mib" in r]
    print(f"(first s: make_dataset + the first batch, the permutation build included; build s: the permutation "
          f"alone; +MiB: peak RSS (ru_maxrss) above the process's RSS just before"
          + (f" ({min(before):,.0f}-{max(before):,.0f} MiB: torch, lancedb, the table open)" if before else "")
          + f"; lancedb: its own StreamingDataset, skipped above {PLAIN_MAX_ROWS:,} rows)")
    for r in results:
        if "error" in r:
            print(f"FAILED {r['name']}: {r['error']}")


# ── Part 3: an epoch boundary ────────────────────────────────────────────────────────

def boundary_child(spec: dict, report: Report) -> None:
    """train.py's own batch path (data.train_batches on the prefetch thread: the next epoch's
    loader started once this one has asked for all of its rows) over two epochs of rows at
    spec['rows_per_s']; reports the start-up line's bound, the batch at which the next
    epoch's start begins, and each epoch's first batch."""
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    cpu = torch.device("cpu")
    args = train.parse_args(["--db", spec["db"], "--seq-len", str(spec["seq_len"]), "--epochs", "2",
                             "--batch-size", str(spec["batch_size"]), "--loader-buffer-mb", str(spec["budget_mb"]),
                             "--num-workers", str(spec["workers"]), "--read-batch-size", str(spec["read_batch_size"])])
    num_splits = train.check_args(args, 1)
    source = data.open_training_data(args, load_tokenizer("byte"), 0, 1, cpu, num_splits, args.batch_size)
    report("ready", line=data.read_ahead_line(args), **tree_memory(os.getpid()))
    rows, t_first, epoch_seen, overlap = 0, None, -1, False
    with data.prefetched(data.train_batches(args, source, 0, 1, cpu, num_splits, 0, None), cpu) as batches:
        for epoch, position, batch in batches:
            rows += batch["input_ids"].shape[0]
            now = time.monotonic()
            if t_first is None:
                t_first = now
            if epoch != epoch_seen:
                epoch_seen = epoch
                report("epoch", epoch=epoch, rows=rows)
            if not overlap and epoch == 0 and position.dataset.unscanned_rows == 0:  # train_batches' signal
                overlap = True
                report("overlap", rows=rows)
            pause = t_first + rows / spec["rows_per_s"] - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    report("end", rows=rows)


def boundary_result(spec: dict, lines: list[dict], exitcode, samples: list[dict]) -> dict:
    """Peak RSS of the tree before the overlap and during it (from the next epoch's start to
    the end of the run), above the tree at the first batch, beside the budget."""
    result = {k: spec[k] for k in ("name", "workers", "budget_mb", "rows", "rows_per_s")}
    error = child_error(lines, exitcode)
    by = {r["event"]: r for r in lines}
    if error or not {"ready", "overlap", "end"} <= set(by):
        result["error"] = error or f"no epoch boundary seen (events: {sorted(by)})"
        return result
    first = next(r["t"] for r in lines if r["event"] == "epoch")
    steady = [m["rss_mib"] for m in samples if first <= m["t"] < by["overlap"]["t"]]
    during = [m for m in samples if by["overlap"]["t"] <= m["t"] <= by["end"]["t"]]
    base = min((m for m in samples if m["t"] >= first), key=lambda m: m["t"], default=None)
    if not steady or not during or base is None:
        result["error"] = "too few RSS samples around the boundary: raise --boundary-rows"
        return result
    peak = max(during, key=lambda m: m["rss_mib"])
    pss = [m["pss_mib"] for m in during if m["pss_mib"] is not None]
    steady_pss = [m["pss_mib"] for m in samples if first <= m["t"] < by["overlap"]["t"] and m["pss_mib"] is not None]
    result.update(steady_peak_pss_mib=round(max(steady_pss), 1) if steady_pss else None,
                  overlap_peak_pss_mib=round(max(pss), 1) if pss else None)
    result.update(line=by["ready"]["line"], first_batch_rss_mib=round(base["rss_mib"], 1),
                  steady_peak_rss_mib=round(max(steady), 1), overlap_peak_rss_mib=round(peak["rss_mib"], 1),
                  steady_above_first_mib=round(max(steady) - base["rss_mib"], 1),
                  overlap_above_first_mib=round(peak["rss_mib"] - base["rss_mib"], 1),
                  processes_steady=max(m["processes"] for m in samples if first <= m["t"] < by["overlap"]["t"]),
                  processes_overlap=peak["processes"],
                  overlap_s=round(next(r["t"] for r in lines if r["event"] == "epoch" and r["epoch"] == 1)
                                  - by["overlap"]["t"], 2))
    return result


def print_boundary(results: list[dict]) -> None:
    print(f"\n{'epoch boundary':<28}{'budget MiB':>11}{'first RSS':>11}{'steady +MiB':>12}{'overlap +MiB':>13}"
          f"{'processes':>11}{'overlap s':>10}")
    for r in results:
        if "error" in r:
            print(f"FAILED {r['name']}: {r['error']}")
            continue
        print(f"{r['name']:<28}{r['budget_mb']:>11g}{r['first_batch_rss_mib']:>11,.0f}{r['steady_above_first_mib']:>12,.0f}"
              f"{r['overlap_above_first_mib']:>13,.0f}{r['processes_steady']:>5} -> {r['processes_overlap']:<3}"
              f"{r['overlap_s']:>8.1f}")
    print("(+MiB: peak RSS of the tree above its RSS at the first batch, before the next epoch's start and from "
          "it on; pages the forked workers share count once per process. The start-up lines state:")
    for r in results:
        if "line" in r:
            print(f"  {r['name']}: {r['line']}")


# ── Corpora ──────────────────────────────────────────────────────────────────────────

def made(work: str, name: str, params: dict, make) -> str:
    """WORK/NAME made by `make(path)`, or kept from an earlier run with the same `params`."""
    path, stamp = os.path.join(work, name), os.path.join(work, f"{name}.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == params:
                print(f"reusing {path}", flush=True)
                return path
        os.remove(stamp)
    shutil.rmtree(path, ignore_errors=True)
    make(path)
    with open(stamp, "w") as f:
        json.dump(params, f)
    return path


def memory_corpus(opts) -> None:
    """The documents and their blocks in every format; sets opts.corpus_db and opts.blocks."""
    rows = opts.corpus_tokens // (sum(DOC_TOKENS) // 2)
    params = {"rows": rows, "doc_tokens": list(DOC_TOKENS), "seq_len": opts.seq_len, "seed": 0}

    def make(path):
        start = time.perf_counter()
        synthetic_corpus(os.path.join(path, "db"), rows, *DOC_TOKENS, seed=0)
        print(f"corpus: {rows:,} documents of {DOC_TOKENS[0]}-{DOC_TOKENS[1]} tokens in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        build_packed_datasets.build(os.path.join(path, "db"), "corpus", os.path.join(path, "blocks"),
                                    seq_len=opts.seq_len)

    root = made(opts.work, "memory", params, make)
    opts.corpus_db, opts.blocks = os.path.join(root, "db"), os.path.join(root, "blocks")


def startup_corpus(opts, rows: int) -> str:
    params = {"rows": rows, "doc_tokens": list(STARTUP_DOC_TOKENS), "seed": 1}
    return made(opts.work, f"startup_{rows}", params,
                lambda path: synthetic_corpus(path, rows, *STARTUP_DOC_TOKENS, seed=1, chunk_rows=1_000_000))


# ── Main ─────────────────────────────────────────────────────────────────────────────

def int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} takes comma-separated positive integers (got {text!r})")
    return values


def name_list(flag: str, text: str, known) -> list[str]:
    """A comma-separated choice of `known` names (at least one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"{flag} takes {', '.join(known)} (got {unknown or 'none'})")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--png", default="", help="RSS against tokens (default: --out with .png)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--work", default="", help="where the corpora go, kept (default: a temp dir, removed)")
    p.add_argument("--corpus-tokens", type=int, help=f"memory corpus size (default {FULL['corpus_tokens']:,})")
    p.add_argument("--seq-len", type=int, help=f"block length (default {FULL['seq_len']})")
    p.add_argument("--tokens", type=int, help=f"tokens each path consumes (default {FULL['tokens']:,})")
    p.add_argument("--tokens-per-s", type=int, default=300_000, help="the consumer's pace (default 300,000)")
    p.add_argument("--budget-mb", type=float, help=f"--loader-buffer-mb of the bounded runs "
                                                   f"(default {FULL['budget_mb']:g})")
    p.add_argument("--batch-size", type=int, help=f"splits and rows per batch (default {FULL['batch_size']})")
    p.add_argument("--read-batch-size", type=int, help=f"rows per read per split (default {FULL['read_batch_size']})")
    p.add_argument("--workers", type=int, default=2,
                   help="loader workers of the lance-docs workers run and of mosaic / parquet-* (default 2)")
    p.add_argument("--startup-rows", help=f"comma-separated table sizes (default {FULL['startup_rows']})")
    p.add_argument("--startup-splits", default="8,32", help="comma-separated split counts (default 8,32)")
    p.add_argument("--skip-memory", action="store_true", help="only the start-up part")
    p.add_argument("--skip-startup", action="store_true", help="leave out the start-up part")
    p.add_argument("--skip-boundary", action="store_true", help="leave out the epoch-boundary part")
    p.add_argument("--boundary-rows", type=int, help=f"documents of the epoch-boundary corpus "
                                                     f"(default {FULL['boundary_rows']:,})")
    p.add_argument("--boundary-budget-mb", type=float,
                   help=f"--loader-buffer-mb of the epoch-boundary runs (default {FULL['boundary_budget_mb']:g})")
    p.add_argument("--boundary-rows-per-s", type=int,
                   help=f"the epoch-boundary consumer's pace in rows (default {FULL['boundary_rows_per_s']:,})")
    opts = p.parse_args(argv)
    vars(opts).update({k: v for k, v in (QUICK if opts.quick else FULL).items() if getattr(opts, k) is None})
    opts.png = opts.png or os.path.splitext(opts.out)[0] + ".png"
    opts.work_given = bool(opts.work)  # kept at the end; a temporary one is removed
    return opts


def check_opts(opts) -> None:
    for flag, value, low in (("--corpus-tokens", opts.corpus_tokens, 1), ("--seq-len", opts.seq_len, 2),
                             ("--tokens", opts.tokens, 1), ("--tokens-per-s", opts.tokens_per_s, 1),
                             ("--batch-size", opts.batch_size, 1), ("--read-batch-size", opts.read_batch_size, 1),
                             ("--workers", opts.workers, 1), ("--boundary-rows", opts.boundary_rows, 1),
                             ("--boundary-rows-per-s", opts.boundary_rows_per_s, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low} (got {value})")
    if not (math.isfinite(opts.budget_mb) and opts.budget_mb > 0):
        raise UserError(f"--budget-mb must be a positive number (got {opts.budget_mb}); the unbounded "
                        f"runs come with every bounded one")
    if not (math.isfinite(opts.boundary_budget_mb) and opts.boundary_budget_mb > 0):
        raise UserError(f"--boundary-budget-mb must be a positive number (got {opts.boundary_budget_mb})")
    if opts.batch_size % opts.workers:
        raise UserError(f"--batch-size ({opts.batch_size}) must be a multiple of --workers ({opts.workers}): "
                        f"each loader worker owns whole splits")
    opts.startup_rows = int_list("--startup-rows", opts.startup_rows)
    opts.startup_splits = int_list("--startup-splits", opts.startup_splits)
    if opts.skip_memory and opts.skip_startup and opts.skip_boundary:
        raise UserError("--skip-memory, --skip-startup and --skip-boundary together leave nothing to run")
    for flag, path in (("--out", opts.out), ("--png", opts.png)):
        check_out_dir(flag, path)
    if opts.work and os.path.exists(opts.work) and not os.path.isdir(opts.work):
        raise UserError(f"--work {opts.work!r} is a file, not a directory")
    # The memory corpus: its Arrow input_ids (4 bytes a token and an offset a row) against the budget.
    docs = opts.corpus_tokens // (sum(DOC_TOKENS) // 2)
    opts.corpus_mib = 4 * (opts.corpus_tokens + docs) / 2**20
    if not opts.skip_memory and opts.corpus_mib < MIN_CORPUS_OVER_BUDGET * opts.budget_mb:
        raise UserError(f"the corpus ({opts.corpus_mib:,.1f} MiB of input_ids from --corpus-tokens "
                        f"{opts.corpus_tokens:,}) must be at least {MIN_CORPUS_OVER_BUDGET}x --budget-mb "
                        f"({opts.budget_mb:g}): raise --corpus-tokens or lower --budget-mb")
    epoch = min(opts.corpus_tokens, docs * opts.seq_len)  # packed paths, row path
    if not opts.skip_memory and opts.tokens > epoch // 2:
        raise UserError(f"--tokens ({opts.tokens:,}) must be at most half an epoch ({epoch:,} tokens on the "
                        f"shortest path), so that there is data left to read ahead; raise --corpus-tokens")
    if not opts.skip_memory and docs < opts.batch_size * opts.read_batch_size * 4:
        raise UserError(f"--corpus-tokens {opts.corpus_tokens:,} makes {docs:,} documents, too few for "
                        f"{opts.batch_size} splits of {opts.read_batch_size}-row reads")


def bench_main(opts) -> int:
    started = time.perf_counter()
    check_opts(opts)
    machine = machine_info()
    work = opts.work or tempfile.mkdtemp(prefix="loader_memory.")
    opts.work = os.path.abspath(work)
    os.makedirs(opts.work, exist_ok=True)
    # Every child forks from a forkserver that has imported torch and the project once; not
    # lancedb, whose import starts an event-loop thread that a fork would leave behind. The
    # project and bench/ go on the forkserver's path as train.py puts the project there (for
    # the children's own loader workers' forkserver too).
    train.project_on_workers_path(BENCH)
    ctx = mp.get_context(MP_CONTEXT)
    mp.set_forkserver_preload(["loaders"])
    settings = {k: getattr(opts, k) for k in (
        "quick", "corpus_tokens", "seq_len", "tokens", "tokens_per_s", "budget_mb", "batch_size",
        "read_batch_size", "workers", "startup_rows", "startup_splits", "boundary_rows", "boundary_budget_mb",
        "boundary_rows_per_s")}
    settings.update(io_queue_depth=TRAIN_DEFAULTS.io_queue_depth, doc_tokens=DOC_TOKENS,
                    transform_parallelism=TRAIN_DEFAULTS.transform_parallelism,
                    startup_doc_tokens=STARTUP_DOC_TOKENS, plain_lancedb_max_rows=PLAIN_MAX_ROWS,
                    corpus_mib=round(opts.corpus_mib, 1), sample_s=SAMPLE_S,
                    floor_rows=2 * opts.batch_size * opts.read_batch_size,
                    tokens_counted="batch positions (seq_len per row or block, pads included)")
    data = {"machine": machine, "settings": settings, "memory": [], "startup": [], "boundary": [],
            "complete": False}
    print(f"{machine['cpu']}, {machine['affinity']} cores, {machine['ram_gib']} GiB; work dir {opts.work}",
          flush=True)

    def save() -> None:
        data["total_s"] = round(time.perf_counter() - started, 1)
        if hasattr(os, "getloadavg"):
            machine["loadavg_end"] = list(os.getloadavg())  # another user's load shows here
        write_json(opts.out, data)

    try:
        if not opts.skip_memory:
            memory_corpus(opts)
            floor_mib = 2 * opts.batch_size * opts.read_batch_size * 4 * sum(DOC_TOKENS) / 2 / 2**20
            print(f"memory: {opts.tokens:,} tokens per path at {opts.tokens_per_s:,} tokens/s; budget "
                  f"{opts.budget_mb:g} MiB; corpus {opts.corpus_mib:,.0f} MiB of input_ids; floor of a bounded "
                  f"iterator: 2 x {opts.batch_size} splits x {opts.read_batch_size} rows (~{floor_mib:.1f} MiB)",
                  flush=True)
            timeout = 300 + 3 * opts.tokens / opts.tokens_per_s
            for spec in memory_runs(opts):
                report, begun = os.path.join(opts.work, "report.jsonl"), time.perf_counter()
                result = memory_result(spec, *run_child(ctx, memory_child, spec, report, timeout, sample=True))
                result["wall_s"] = round(time.perf_counter() - begun, 1)
                data["memory"].append(result)
                print(f"{spec['name']} ({result['wall_s']:.0f} s): " + (
                      f"FAILED: {result['error']}" if "error" in result else
                      f"{result['tokens_per_s']:,.0f} tokens/s, RSS {result['baseline_rss_mib']:,.0f} -> peak "
                      f"{result['peak_rss_mib']:,.0f} MiB, {fmt(result['rss_mib_per_mtoken'], '.2f')} MiB/Mtok, "
                      f"read-ahead <= {fmt(result.get('peak_read_ahead_rows'))} rows"), flush=True)
                save()
            print_memory(data["memory"], opts)
            draw(data["memory"], machine, opts, opts.png)
        if not opts.skip_startup:
            for rows in opts.startup_rows:
                db = startup_corpus(opts, rows)
                for spec in startup_runs(opts, rows, db):
                    keep = {k: spec[k] for k in ("name", "rows", "splits", "impl", "path")}
                    if spec.get("skip"):
                        data["startup"].append({**keep, "skipped": f"lancedb's own StreamingDataset only up "
                                                                   f"to {PLAIN_MAX_ROWS:,} rows"})
                        continue
                    report, begun = os.path.join(opts.work, "report.jsonl"), time.perf_counter()
                    lines, exitcode, _ = run_child(ctx, startup_child, spec, report, 1800, sample=False)
                    result = {**keep, **next((r for r in lines if r["event"] == "done"), {}),
                              "wall_s": round(time.perf_counter() - begun, 1)}
                    result.pop("event", None), result.pop("t", None)
                    error = child_error(lines, exitcode)
                    if error:
                        result["error"] = error
                    data["startup"].append(result)
                    print(f"{spec['name']}: " + (f"FAILED: {error}" if error else ", ".join(
                        f"{k} {result[k]:.2f}" for k in ("build_s", "first_batch_s", "rss_before_mib", "peak_rss_mib")
                        if k in result)),
                        flush=True)
                    save()
            print_startup(data["startup"])
        if not opts.skip_boundary:
            db = startup_corpus(opts, opts.boundary_rows)
            for workers in (0, opts.workers):
                spec = {"name": f"rows, {workers} workers", "db": db, "workers": workers, "rows": opts.boundary_rows,
                        "budget_mb": opts.boundary_budget_mb, "rows_per_s": opts.boundary_rows_per_s,
                        "seq_len": 64, "batch_size": opts.batch_size, "read_batch_size": opts.read_batch_size}
                report, begun = os.path.join(opts.work, "report.jsonl"), time.perf_counter()
                result = boundary_result(spec, *run_child(ctx, boundary_child, spec, report, 900, sample=True))
                result["wall_s"] = round(time.perf_counter() - begun, 1)
                data["boundary"].append(result)
                print(f"{spec['name']} across an epoch boundary ({result['wall_s']:.0f} s): " + (
                      f"FAILED: {result['error']}" if "error" in result else
                      f"+{result['steady_above_first_mib']:,.0f} MiB before it, +{result['overlap_above_first_mib']:,.0f} "
                      f"MiB during it"), flush=True)
                save()
            print_boundary(data["boundary"])
        data["complete"] = True
        save()
    finally:
        if not opts.work_given:
            shutil.rmtree(opts.work, ignore_errors=True)
    print(f"\nwrote {opts.out}" + ("" if opts.skip_memory else f" and {opts.png}")
          + f" in {time.perf_counter() - started:.0f} s")
    failed = [r["name"] for r in data["memory"] + data["startup"] + data["boundary"] if "error" in r]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> None:
    try:
        code = bench_main(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
