"""Ingest throughput of prepare_data.py against --workers, for the byte tokenizer and a local BPE.

Usage:
    python bench/ingest.py [--out bench/results/ingest.json] [--png FILE.png] [--input PATH ...]
        [--text-field text] [--docs N] [--workers 1,2,4] [--tokenizers byte,bpe] [--repeats 3]
        [--bpe-vocab 8192] [--bpe-sample-mb 4] [--timeout-s 1800]
    python bench/ingest.py --ray [NODES|ADDRESS] [--docs N] [--tokenizers byte,bpe] [--repeats 2]

--ray compares `prepare_data.py --ray` with `--workers N` (N: the cluster's CPUs) on the same
input, interleaved, best of --repeats, and checks the two tables are equal: on a local cluster of
NODES (default 2) nodes of 1 CPU each on 127.0.0.1, or on the cluster at ADDRESS. It reports
tokens/s, the ratio, the driver's peak RSS (its own VmHWM, and again on a quarter of the input)
and CPU, and the peak RSS of this machine's Ray worker processes; JSON at
bench/results/ingest_ray.json. About 5 minutes on 2 cores.

Each run is the whole command `python prepare_data.py INPUT --db TMP --table corpus --mode
overwrite --tokenizer T --workers N` into a fresh temporary db, for N = 1 and the powers of two
up to the cores this process may use, plus that count (len(os.sched_getaffinity(0)): 1,2 on 2
cores; 1,2,4,...,64 on 64), and T = byte (heuristic quality scores: no --score-field) and
hf:DIR, a byte-level BPE of --bpe-vocab tokens trained here (tokenizers, nothing downloaded) on
about --bpe-sample-mb of the corpus, spread over all of it. Runs are interleaved (each repeat
runs every tokenizer x workers once) and each point keeps its fastest of --repeats.

The corpus, unless --input (jsonl / jsonl.gz / txt / parquet files or directories, as
prepare_data reads them): --docs documents cut from the stdlib's .py sources (tests included,
bench/stdlib_corpus.py's sorted walk; ~46,000 documents, ~31 MB with Python 3.11), each a run of
consecutive paragraphs (split at blank lines) of at least 400 characters: code, comments and
docstrings, median ~540 bytes. Read in under a second, where parsing out docstrings takes a
minute; for those, `python bench/stdlib_corpus.py D.jsonl --docstrings` and --input D.jsonl.
Documents are cycled when --docs asks for more (the repeats are still tokenized and written,
flagged is_dup). The default --docs gives every worker of the largest count 8 chunks of
prepare_data's --batch-size lines: 24,000 (~16 MB) up to 3 cores, 8,000 a core beyond.
The whole default run takes about 4 minutes on 2 cores.

Per run: wall seconds of the command (Python start-up, imports and worker start included: about
a second or two, so speedups flatten on a corpus that takes few seconds), docs and tokens counted
from the table afterwards (count_rows, the sum of n_tokens), and the peak RSS of the process tree
(prepare_data and its workers: loader_memory.tree_memory, VmRSS summed, every 50 ms from a thread
of this process, which costs it ~4 ms of one core each time). Reported: tokens/s, docs/s, input
MB/s (bytes of the input files), tokens/s per worker, speedup over --workers 1 of the same
tokenizer and efficiency (speedup / workers; 1.0 is linear), peak RSS (highest of the repeats),
and prepare_data's own summary line, as printed. Tokens/s of byte and BPE are not comparable
(a BPE token is ~4 bytes of text): compare MB/s or docs/s across tokenizers. The tables must
hold the same docs and tokens whatever --workers; if not, the bench says so and exits 1.

Output: the table on stdout, JSON at --out ({"machine", "settings", "results": one per tokenizer
x workers with all its runs, "complete", "total_s"}), and a PNG (default: --out with .png):
tokens/s against workers per tokenizer with ideal linear scaling dashed, and peak RSS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

import lancedb  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

import stdlib_corpus  # noqa: E402
from common import UserError  # noqa: E402
from loader_memory import kill_tree, tree_memory  # noqa: E402
from loaders import machine_info, write_json  # noqa: E402
import prepare_data  # noqa: E402
from prepare_data import DEFAULT_BATCH_SIZE, DEFAULT_MIN_CHARS, resolve_inputs  # noqa: E402

SAMPLE_S = 0.05
STARTUP_DOCS = 100  # the start-up run's input: the corpus's first documents
CHUNKS_PER_WORKER = 8
MIN_DOCS = 96_000  # about the 94,521-document, 70 MB corpus
DOC_CHARS = 400  # paragraphs of a source file are joined until a document has this many
EOS = "<|endoftext|>"
RESULTS = os.path.join(BENCH, "results", "ingest.json")


def worker_counts(cores: int) -> list[int]:
    counts = [n for n in (2 ** k for k in range(cores.bit_length())) if n < cores]
    return counts + [cores]


# ── Corpus and tokenizer ─────────────────────────────────────────────────────────────

def write_corpus(path: str, n: int) -> dict:
    """n documents cut from the stdlib's .py sources as jsonl (cycled if there are fewer)."""
    files = stdlib_corpus.python_files([sysconfig.get_paths()["stdlib"]], {"__pycache__", "site-packages"})
    docs, doc = [], ""
    for name in files:
        with open(name, "rb") as f:
            for para in re.split(r"\n\s*\n", f.read().decode("utf-8", errors="replace")):
                doc = f"{doc}\n\n{para}" if doc else para
                if len(doc) >= DOC_CHARS:
                    docs.append(doc)
                    doc = ""
        if len(doc.strip()) >= DEFAULT_MIN_CHARS:  # a file's tail is a document of its own
            docs.append(doc)
        doc = ""
        if len(docs) >= n:
            break
    if not docs:
        raise UserError("found no stdlib sources to build a corpus from; pass --input")
    distinct = min(len(docs), n)
    with open(path, "w") as f:
        for text in itertools.islice(itertools.cycle(docs[:distinct]), n):
            f.write(json.dumps({"text": text}) + "\n")
    return {"source": "stdlib .py sources cut at blank lines", "docs": n, "distinct_docs": distinct}


def read_texts(paths: list[str], text_field: str):
    """Every document's text of the inputs, read and parsed by prepare_data itself (bad
    lines skipped, as it skips them; no length filter)."""
    opts = prepare_data.RowOptions("byte", text_field)
    for chunk in prepare_data.read_chunks(paths, text_field, None, DEFAULT_BATCH_SIZE):
        yield from (text for text, _ in prepare_data.PARSERS[chunk.kind](chunk, opts, Counter()))


def train_bpe(directory: str, paths: list[str], opts) -> dict:
    """A byte-level BPE (GPT-2's pre-tokenizer, EOS <|endoftext|>) trained on every k-th
    document, k chosen for about --bpe-sample-mb of input, saved as a local HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    step = max(1, round(sum(map(os.path.getsize, paths)) / (opts.bpe_sample_mb * 1e6)))
    sample = list(itertools.islice(read_texts(paths, opts.text_field), 0, None, step))
    t0 = time.perf_counter()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=opts.bpe_vocab, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS).save_pretrained(directory)
    return {"vocab": tk.get_vocab_size(), "sample_docs": len(sample),
            "sample_mb": round(sum(len(t.encode()) for t in sample) / 1e6, 2),
            "train_s": round(time.perf_counter() - t0, 1)}


# ── Runs ─────────────────────────────────────────────────────────────────────────────

def ray_workers_memory() -> dict:
    """VmRSS summed over this machine's Ray worker processes (titled `ray::...`), in MiB."""
    total = {"rss_mib": 0.0, "processes": 0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read(5).startswith(b"ray::"):
                    continue
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
        total["rss_mib"] += rss / 1024
        total["processes"] += 1
    return total


def run_once(inputs: list[str], spec: str, workers: int, db: str, opts, keep: bool = False,
             ray: str | None = None) -> dict:
    """One prepare_data.py run into a fresh db: wall seconds, peak RSS of its tree (and with
    `ray`, the cluster's address, of this machine's Ray workers), its table."""
    shutil.rmtree(db, ignore_errors=True)
    engine = ["--ray", ray] if ray else ["--workers", str(workers)]
    cmd = [sys.executable, os.path.join(REPO, "prepare_data.py"), *inputs, "--db", db, "--table", "corpus",
           "--mode", "overwrite", "--tokenizer", spec, *engine, "--text-field", opts.text_field]
    peak = {"rss_mib": 0.0, "processes": 0, "ray_workers_rss_mib": 0.0}
    done = threading.Event()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO)

        def sample() -> None:
            while not done.is_set():
                memory = tree_memory(proc.pid)
                peak["rss_mib"] = max(peak["rss_mib"], memory["rss_mib"])
                peak["processes"] = max(peak["processes"], memory["processes"])
                if ray:
                    peak["ray_workers_rss_mib"] = max(peak["ray_workers_rss_mib"],
                                                      ray_workers_memory()["rss_mib"])
                done.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            rc = proc.wait(opts.timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            rc = proc.wait()
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    run = {"wall_s": round(wall, 3), "peak_rss_mib": round(peak["rss_mib"], 1),
           "peak_processes": peak["processes"], "rc": rc,
           "summary": next((ln for ln in stdout.splitlines() if ln.startswith("wrote ")), None),
           "main_process": main_process(stdout), "stdout": stdout.strip()[-2000:]}
    if ray:
        run["ray_workers_peak_rss_mib"] = round(peak["ray_workers_rss_mib"], 1)
        driver = re.search(r"driver: peak RSS (\d+) MiB, ([\d.]+) s of CPU", stdout)
        run["driver_peak_rss_mib"] = int(driver[1]) if driver else None
        run["driver_cpu_s"] = float(driver[2]) if driver else None
    if rc != 0:
        run["error"] = (stderr.strip().splitlines() or [f"exit code {rc}"])[-1][-2000:]
        return run
    table = lancedb.connect(db).open_table("corpus")
    run["docs"] = table.count_rows()
    run["tokens"] = pc.sum(table.search().select(["n_tokens"]).limit(None).to_arrow()["n_tokens"]).as_py()
    if not keep:
        shutil.rmtree(db, ignore_errors=True)
    return run


MAIN_LINE = re.compile(r"main process while writing: ([\d.]+) s of CPU in ([\d.]+) s: reading input "
                       r"([\d.]+) s, waiting for workers ([\d.]+) s, ids and dedup ([\d.]+) s")


def main_process(stdout: str) -> dict | None:
    """prepare_data's account of its main process (printed when it ran worker processes)."""
    m = MAIN_LINE.search(stdout)
    keys = ("cpu_s", "writing_s", "read_s", "wait_s", "dedup_s")
    return dict(zip(keys, map(float, m.groups()))) if m else None


def ceiling_process(files: list[str], spec: str, text_field: str, share: int, shares: int, barrier,
                    results) -> None:
    """The per-chunk work of prepare_data's workers (prepare_data.chunk_rows) on every
    `shares`-th chunk, started with its peers at the barrier: no main process, no IPC."""
    chunks = list(itertools.islice(prepare_data.read_chunks(files, text_field, None, DEFAULT_BATCH_SIZE),
                                   share, None, shares))
    prepare_data.start_worker(prepare_data.RowOptions(spec, text_field))
    barrier.wait()
    start = time.perf_counter()
    tokens = sum(prepare_data.chunk_rows(chunk).tokens for chunk in chunks)
    results.put((tokens, time.perf_counter() - start))


def ceiling(files: list[str], spec: str, processes: int, opts) -> dict:
    """Tokens/s of `processes` independent processes doing the workers' work side by side:
    what this machine allows for that work, whatever the coordination around it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=ceiling_process, args=(files, spec, opts.text_field, i, processes, barrier, results))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    done = [results.get(timeout=opts.timeout_s) for _ in procs]
    for proc in procs:
        proc.join()
    tokens, seconds = sum(t for t, _ in done), max(s for _, s in done)
    return {"processes": processes, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds)}


def append_run(table_rows: int, db: str, new_input: str, spec: str, workers: int, opts) -> dict:
    """Time `prepare_data.py NEW --mode append` onto the table in `db` (reads its digests)."""
    cmd = [sys.executable, os.path.join(REPO, "prepare_data.py"), new_input, "--db", db, "--table", "corpus",
           "--mode", "append", "--tokenizer", spec, "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=opts.timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise UserError(f"the append onto {table_rows} rows failed: {proc.stderr.strip()[-500:]}")
    return {"table_rows": table_rows, "append_s": round(wall, 2),
            "summary": next((ln for ln in proc.stdout.splitlines() if ln.startswith("wrote ")), None)}


def append_runs(inputs: list[str], files: list[str], work: str, opts) -> list[dict]:
    """An append of STARTUP_DOCS new documents onto (a) the bench corpus's table, against its
    fresh ingest, and (b) a synthetic table of --append-rows rows (common.synthetic_corpus:
    random digests), whose fresh ingest is not run but scaled from (a)'s docs/s."""
    from common import synthetic_corpus

    new_input = os.path.join(work, "new.jsonl")
    with open(new_input, "w") as f:
        for i, text in enumerate(itertools.islice(read_texts(files, opts.text_field), STARTUP_DOCS)):
            f.write(json.dumps({"text": f"new document {i}: {text}"}) + "\n")
    db, workers = os.path.join(work, "append-db"), max(opts.workers)
    fresh = run_once(inputs, "byte", workers, db, opts, keep=True)
    if fresh["rc"] != 0:
        raise UserError(f"the fresh ingest for the append test failed: {fresh.get('error')}")
    rows = [dict(append_run(fresh["docs"], db, new_input, "byte", workers, opts), fresh_ingest_s=fresh["wall_s"])]
    shutil.rmtree(db, ignore_errors=True)
    if opts.append_rows:
        synthetic_corpus(db, opts.append_rows, 1, 8)
        run = append_run(opts.append_rows, db, new_input, "byte", workers, opts)
        run["fresh_ingest_s_estimate"] = round(opts.append_rows * fresh["wall_s"] / fresh["docs"], 1)
        rows.append(run)
        shutil.rmtree(db, ignore_errors=True)
    return rows


def write_startup_input(path: str, files: list[str], text_field: str) -> None:
    with open(path, "w") as f:
        for text in itertools.islice(read_texts(files, text_field), STARTUP_DOCS):
            f.write(json.dumps({"text": text}) + "\n")


def summarize(tokenizer: str, workers: int, runs: list[dict], startups: list[dict], base: dict | None,
              input_mb: float) -> dict:
    point = {"tokenizer": tokenizer, "workers": workers, "runs": runs, "startup_runs": startups}
    good = [r for r in runs if r["rc"] == 0]
    if not good:
        return {**point, "error": runs[-1].get("error")}
    best = min(good, key=lambda r: r["wall_s"])
    tps = best["tokens"] / best["wall_s"]
    startup = min((r["wall_s"] for r in startups if r["rc"] == 0), default=None)
    if startup is not None and startup < best["wall_s"]:
        point.update(startup_s=startup, steady_tokens_per_s=round(best["tokens"] / (best["wall_s"] - startup)))
    point.update(wall_s=best["wall_s"], docs=best["docs"], tokens=best["tokens"], tokens_per_s=round(tps),
                 docs_per_s=round(best["docs"] / best["wall_s"]), input_mb_per_s=round(input_mb / best["wall_s"], 2),
                 tokens_per_s_per_worker=round(tps / workers),
                 peak_rss_mib=max(r["peak_rss_mib"] for r in good), summary=best["summary"],
                 main_process=best.get("main_process"),
                 same_table=len({(r["docs"], r["tokens"]) for r in good}) == 1)
    base = base or (point if workers == 1 else None)
    if base and "tokens_per_s" in base:
        point["same_table"] &= (base["docs"], base["tokens"]) == (best["docs"], best["tokens"])
        point["speedup"] = round(tps / base["tokens_per_s"], 3)
        point["efficiency"] = round(point["speedup"] / workers, 3)
        if "steady_tokens_per_s" in point and "steady_tokens_per_s" in base:
            point["steady_speedup"] = round(point["steady_tokens_per_s"] / base["steady_tokens_per_s"], 3)
    return point


def print_table(results: list[dict]) -> None:
    print(f"\n{'tokenizer':<10}{'workers':>8}{'wall s':>8}{'start s':>8}{'tokens/s':>11}{'steady':>11}"
          f"{'docs/s':>8}{'MB/s':>6}{'tok/s/worker':>13}{'speedup':>8}{'steady':>7}{'effic.':>7}"
          f"{'peak RSS':>9}   runs (wall s)")
    for r in results:
        if "error" in r:
            print(f"{r['tokenizer']:<10}{r['workers']:>8}  failed: {r['error']}")
            continue
        runs = ", ".join(f"{x['wall_s']:.1f}" if x["rc"] == 0 else "failed" for x in r["runs"])
        print(f"{r['tokenizer']:<10}{r['workers']:>8}{r['wall_s']:>8.2f}{fmt(r.get('startup_s'), '.2f', 8)}"
              f"{r['tokens_per_s']:>11,}{fmt(r.get('steady_tokens_per_s'), ',')}{r['docs_per_s']:>8,}"
              f"{r['input_mb_per_s']:>6.2f}{r['tokens_per_s_per_worker']:>13,}{fmt(r.get('speedup'), '.2f', 8, 'x')}"
              f"{fmt(r.get('steady_speedup'), '.2f', 7, 'x')}{fmt(r.get('efficiency'), '.2f', 7)}"
              f"{r['peak_rss_mib']:>9,.0f}   {runs}" + ("" if r["same_table"] else "   TABLE DIFFERS"))
    print("(start s: the same command over the first 100 docs; steady: tokens / (wall - start); "
          "speedup and effic. (speedup / workers) against --workers 1; peak RSS in MiB, the process tree)")
    print(f"\n{'tokenizer':<10}{'workers':>8}{'ceiling tok/s':>14}{'ceiling x':>10}{'of ceiling':>11}"
          f"   main process while writing (s): CPU / wall, reading, waiting for workers, ids and dedup")
    for r in results:
        if "error" in r:
            continue
        c, m = r["ceiling"], r.get("main_process")
        share = fmt(r["speedup"] / c["speedup"] if r.get("speedup") else None, ".0%", 11)
        main = (f"{m['cpu_s']:.1f} / {m['writing_s']:.1f}, {m['read_s']:.1f}, {m['wait_s']:.1f}, {m['dedup_s']:.1f}"
                if m else "- (in-process)")
        print(f"{r['tokenizer']:<10}{r['workers']:>8}{c['tokens_per_s']:>14,}{c['speedup']:>9.2f}x{share}   {main}")
    print("(ceiling: the workers' per-chunk work, prepare_data.chunk_rows, in that many independent processes "
          "side by side, no main process: what this machine allows; of ceiling: speedup / ceiling speedup)")


def print_appends(appends: list[dict]) -> None:
    print(f"\n{'table rows':>12}{'append s':>10}{'fresh ingest s':>16}   (an append of {STARTUP_DOCS} new docs; "
          f"it reads only the table's digest column)")
    for a in appends:
        fresh = (f"{a['fresh_ingest_s']:.1f}" if "fresh_ingest_s" in a
                 else f"~{a['fresh_ingest_s_estimate']:,.0f} (scaled)")
        print(f"{a['table_rows']:>12,}{a['append_s']:>10.2f}{fresh:>16}")


def fmt(value, spec: str, width: int = 11, unit: str = "") -> str:
    return ("-" if value is None else format(value, spec) + unit).rjust(width)


def draw(results: list[dict], machine: dict, settings: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax, mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, tok in enumerate(dict.fromkeys(r["tokenizer"] for r in results)):
        pts = [r for r in results if r["tokenizer"] == tok and "tokens_per_s" in r]
        if not pts:
            continue
        color, ns = f"C{i}", [r["workers"] for r in pts]
        ax.plot(ns, [r["tokens_per_s"] / 1e6 for r in pts], "o-", color=color, label=tok)
        one = next((r for r in pts if r["workers"] == 1), None)
        if one:
            ax.plot(ns, [one["tokens_per_s"] * n / 1e6 for n in ns], "--", color=color, alpha=0.5,
                    label=f"{tok}: linear")
        mem.plot(ns, [r["peak_rss_mib"] for r in pts], "o-", color=color, label=tok)
    counts = sorted({r["workers"] for r in results})
    ax.set_yscale("log")  # byte and BPE tokens/s are ~10x apart; linear scaling is a slope of 1
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    mem.set_ylim(bottom=0)
    for a, label in ((ax, "tokens/s (millions, best of repeats; log)"), (mem, "peak RSS of the process tree (MiB)")):
        a.set_xscale("log", base=2)
        a.set_xticks(counts, [str(n) for n in counts])
        a.set_xlabel("prepare_data.py --workers")
        a.set_ylabel(label)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    corpus = settings["corpus"]
    fig.suptitle(f"prepare_data.py ingest, {machine['cpu']} ({machine['affinity']} cores); {corpus.get('docs', '?')} docs, "
                 f"{corpus['mb']:.1f} MB; BPE vocab {settings['bpe'].get('vocab', '-')}; "
                 f"best of {settings['repeats']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ── Main ─────────────────────────────────────────────────────────────────────────────

def parse_args(argv=None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=RESULTS, help="results JSON (default: bench/results/ingest.json)")
    p.add_argument("--png", default="", help="plot (default: --out with .png)")
    p.add_argument("--input", nargs="+", default=None, help="jsonl / txt / parquet files or directories "
                   "(default: --docs documents cut from the stdlib's sources)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--docs", type=int, default=max(MIN_DOCS, CHUNKS_PER_WORKER * DEFAULT_BATCH_SIZE * cores),
                   help="documents of the default corpus (default: %(default)s here)")
    p.add_argument("--workers", default=",".join(map(str, worker_counts(cores))),
                   help="comma-separated --workers counts (default: %(default)s here)")
    p.add_argument("--tokenizers", default="byte,bpe", help="comma-separated subset of byte,bpe")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the fastest counts")
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--bpe-sample-mb", type=float, default=4.0, help="text the BPE is trained on")
    p.add_argument("--timeout-s", type=float, default=1800, help="a run longer than this is killed")
    p.add_argument("--ray", nargs="?", const="2", default=None, metavar="NODES|ADDRESS",
                   help="compare prepare_data.py --ray with --workers N (N: the cluster's CPUs) "
                   "instead: on a local cluster of NODES nodes of 1 CPU each on 127.0.0.1 (default 2), "
                   "or on the cluster at ADDRESS; writes bench/results/ingest_ray.json")
    p.add_argument("--append-rows", type=int, default=10_000_000,
                   help="rows of the synthetic table an append is timed on (0: skip it)")
    opts = p.parse_args(argv)
    opts.workers = [int(n) for n in opts.workers.split(",") if n.strip()]
    opts.tokenizers = [t.strip() for t in opts.tokenizers.split(",") if t.strip()]
    if opts.ray and opts.out == RESULTS:
        opts.out = os.path.join(BENCH, "results", "ingest_ray.json")
    opts.png = opts.png or os.path.splitext(opts.out)[0] + ".png"
    if not opts.workers or min(opts.workers) < 1 or opts.repeats < 1 or opts.docs < 1:
        p.error("--workers, --repeats and --docs take positive numbers")
    if not opts.tokenizers or set(opts.tokenizers) - {"byte", "bpe"}:
        p.error("--tokenizers takes a comma-separated subset of byte,bpe")
    return opts


def bench_main(opts, work: str) -> int:
    started = time.perf_counter()
    machine = machine_info()
    if opts.input:
        inputs, corpus = [os.path.abspath(p) for p in opts.input], {"source": "--input"}
    else:
        inputs = [os.path.join(work, "corpus.jsonl")]
        corpus = write_corpus(inputs[0], opts.docs)
    files = resolve_inputs(inputs, Counter())
    corpus.update(inputs=inputs, mb=round(sum(map(os.path.getsize, files)) / 1e6, 2))
    bpe = train_bpe(os.path.join(work, "bpe"), files, opts) if "bpe" in opts.tokenizers else {}
    specs = {"byte": "byte", "bpe": f"hf:{os.path.join(work, 'bpe')}"}
    settings = {"corpus": corpus, "bpe": bpe, "workers": opts.workers, "tokenizers": opts.tokenizers,
                "repeats": opts.repeats, "corpus_s": round(time.perf_counter() - started, 1)}
    print(f"{machine['cpu']}, {machine['affinity']} cores, {machine['ram_gib']} GiB; corpus {corpus['mb']} MB "
          f"({corpus.get('docs', '?')} docs); BPE {bpe or '-'}; workers {opts.workers}; {opts.repeats} repeat(s)",
          flush=True)

    startup_input = os.path.join(work, "startup.jsonl")
    write_startup_input(startup_input, files, opts.text_field)
    runs = {(t, n): [] for t in opts.tokenizers for n in opts.workers}
    startups = {key: [] for key in runs}
    db = os.path.join(work, "db")
    for rep in range(opts.repeats):
        for (tok, n), done in runs.items():
            start = run_once([startup_input], specs[tok], n, db, opts)
            startups[tok, n].append(start)
            run = run_once(inputs, specs[tok], n, db, opts)
            done.append(run)
            print(f"[{rep + 1}/{opts.repeats}] {tok:<5} --workers {n:<3} {run['wall_s']:7.2f} s "
                  f"(start-up {start['wall_s']:.2f} s)  peak {run['peak_rss_mib']:,.0f} MiB  "
                  f"{run.get('summary') or run.get('error')}", flush=True)
    results = []
    for tok in opts.tokenizers:
        base = None
        ceilings = {n: ceiling(files, specs[tok], n, opts) for n in sorted({1, *opts.workers})}
        for n in sorted(opts.workers):
            point = summarize(tok, n, runs[tok, n], startups[tok, n], base, corpus["mb"])
            base = point if n == 1 else base
            point["ceiling"] = dict(ceilings[n], speedup=round(
                ceilings[n]["tokens_per_s"] / ceilings[1]["tokens_per_s"], 3))
            results.append(point)
    print_table(results)
    appends = append_runs(inputs, files, work, opts)
    print_appends(appends)
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = list(os.getloadavg())
    write_json(opts.out, {"machine": machine, "settings": settings, "results": results, "appends": appends,
                          "complete": True,
                          "total_s": round(time.perf_counter() - started, 1)})
    draw(results, machine, settings, opts.png)
    print(f"\nwrote {opts.out} and {opts.png} in {time.perf_counter() - started:.0f} s")
    bad = [r for r in results if "error" in r or not r["same_table"]]
    if bad:
        names = ", ".join(f"{r['tokenizer']} x{r['workers']}" for r in bad)
        print(f"failed or differing tables: {names}", file=sys.stderr)
    return 1 if bad else 0


RAY_STORE = 200 << 20  # object store per node of the local cluster


def local_cluster(nodes: int):
    """A Ray cluster of `nodes` nodes of 1 CPU each on 127.0.0.1 (ray.cluster_utils)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep 127.0.0.1 (tests/test_ray_ingest.py)
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, object_store_memory=RAY_STORE, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster


def ray_main(opts, work: str) -> int:
    """--ray: prepare_data.py --ray against --workers N on the same input, interleaved, best of
    --repeats; the same table required; the driver's peak RSS at a quarter of the input too."""
    started = time.perf_counter()
    machine = machine_info()
    cluster = local_cluster(int(opts.ray)) if opts.ray.isdigit() else None
    address = cluster.address if cluster else opts.ray
    try:
        import ray

        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        cpus, nodes = int(ray.cluster_resources()["CPU"]), sum(n["Alive"] for n in ray.nodes())
        ray.shutdown()
        inputs = [os.path.join(work, "corpus.jsonl")]
        corpus = write_corpus(inputs[0], opts.docs)
        quarter = [os.path.join(work, "quarter.jsonl")]
        write_corpus(quarter[0], opts.docs // 4)
        corpus["mb"] = round(os.path.getsize(inputs[0]) / 1e6, 2)
        bpe = train_bpe(os.path.join(work, "bpe"), inputs, opts) if "bpe" in opts.tokenizers else {}
        specs = {"byte": "byte", "bpe": f"hf:{os.path.join(work, 'bpe')}"}
        print(f"{machine['cpu']}, {machine['affinity']} cores; Ray: {nodes} nodes, {cpus} CPUs; corpus "
              f"{corpus['mb']} MB ({opts.docs} docs); {opts.repeats} repeat(s)", flush=True)
        runs = {(t, e): [] for t in opts.tokenizers for e in ("workers", "ray")}
        for rep in range(opts.repeats):
            for (tok, engine), done in runs.items():
                db = os.path.join(work, f"db-{engine}")
                run = run_once(inputs, specs[tok], cpus, db, opts, keep=True,
                               ray=address if engine == "ray" else None)
                done.append(run)
                print(f"[{rep + 1}/{opts.repeats}] {tok:<5} {engine:<7} {run['wall_s']:7.2f} s  "
                      f"{run.get('summary') or run.get('error')}", flush=True)
            for tok in opts.tokenizers:  # the same table: compared on the last repeat's
                a, b = (lancedb.connect(os.path.join(work, f"db-{e}")).open_table("corpus").to_arrow()
                        for e in ("workers", "ray"))
                runs[tok, "ray"][-1]["same_table"] = a.equals(b)
        results = []
        for tok in opts.tokenizers:
            best = {e: min(runs[tok, e], key=lambda r: r["wall_s"]) for e in ("workers", "ray")}
            point = {"tokenizer": tok, "nodes": nodes, "cpus": cpus, "runs": runs[tok, "workers"] + runs[tok, "ray"]}
            for e, run in best.items():
                point[e] = {"wall_s": run["wall_s"], "tokens_per_s": round(run["tokens"] / run["wall_s"]),
                            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs[tok, e])}
            point["ray"].update(driver_peak_rss_mib=best["ray"].get("driver_peak_rss_mib"),
                                workers_peak_rss_mib=max(r["ray_workers_peak_rss_mib"] for r in runs[tok, "ray"]))
            point["ray_over_workers"] = round(point["ray"]["tokens_per_s"] / point["workers"]["tokens_per_s"], 3)
            point["same_table"] = all(r.get("same_table", True) for r in runs[tok, "ray"])
            results.append(point)
        small = run_once(quarter, "byte", cpus, os.path.join(work, "db-quarter"), opts, ray=address)
        driver = {"docs": {opts.docs // 4: small.get("driver_peak_rss_mib"),
                           opts.docs: min(runs[opts.tokenizers[0], "ray"], key=lambda r: r["wall_s"])
                           .get("driver_peak_rss_mib")}}
    finally:
        if cluster:
            cluster.shutdown()
    print(f"\n| tokenizer | engine | wall s | tokens/s | ray / workers | driver peak RSS MiB | "
          f"Ray workers' peak RSS MiB | same table |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['tokenizer']} | --workers {cpus} | {r['workers']['wall_s']:.1f} | "
              f"{r['workers']['tokens_per_s']:,} | 1.00x | {r['workers']['peak_rss_mib']:,.0f} (tree) | - | - |")
        print(f"| {r['tokenizer']} | --ray ({nodes} nodes) | {r['ray']['wall_s']:.1f} | "
              f"{r['ray']['tokens_per_s']:,} | {r['ray_over_workers']:.2f}x | "
              f"{r['ray']['driver_peak_rss_mib']} | {r['ray']['workers_peak_rss_mib']:,.0f} | {r['same_table']} |")
    print(f"driver peak RSS (byte) against documents: {driver['docs']}")
    write_json(opts.out, {"machine": machine, "settings": {"corpus": corpus, "bpe": bpe, "repeats": opts.repeats,
                                                          "ray": {"nodes": nodes, "cpus": cpus, "address": opts.ray}},
                          "results": results, "driver_rss_vs_docs": driver, "complete": True,
                          "total_s": round(time.perf_counter() - started, 1)})
    print(f"wrote {opts.out} in {time.perf_counter() - started:.0f} s")
    return 0 if all(r["same_table"] for r in results) else 1


def main(argv=None) -> None:
    opts = parse_args(argv)
    prepare_data.without_torch()  # as prepare_data.py's own command line: the ceiling's tokenizers load fast
    try:
        with tempfile.TemporaryDirectory(prefix="ingest-bench-") as work:
            code = ray_main(opts, work) if opts.ray else bench_main(opts, work)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    main()
