"""Validation loss per token budget: padded rows vs --pack vs --pack --doc-mask.

Usage:
    python bench/learning.py [--db DIR --table NAME] [--out FILE.json] [--png FILE.png]
        [--quick] [--seeds 3] [--steps 150] [--seq-len 256] [--batch-size 8] [--lr 1e-3]
        [--eval-batches 16]

The tiny model trains for the same budget of positions (steps x batch x seq_len: what
a fixed GPU budget buys) on the same corpus under three variants:

- row: each document one row, padded or truncated to seq_len (train.py's default);
- pack: documents EOS-joined into full blocks by the loader (`--pack`);
- pack+doc-mask: the same blocks, each document attending only within itself with
  positions restarting at 0 (`--pack --doc-mask`).

Every run calls `train.main` in this process (one rank, no loader workers; its log is
swallowed, its errors are not). Each of --seeds seeds is a `--shuffle-seed`, the data
order; the model's initialization is fixed inside train.py (torch.manual_seed), so it
is the same in every run. Runs interleave (each seed runs all three variants before
the next seed) to spread machine noise over the variants. The learning rate warms up
over steps/10 steps and decays (cosine) to 0 at the last step.

Measured per run, from its --metrics-file: the final val loss (the end-of-run eval
over --eval-batches batches of validation documents, each a padded row from position
0: the same measurement for every variant), tokens/s (the median of the train records
after the first, which includes start-up; positions, pads included), real tokens (the
final tokens_seen: non-pad tokens trained on) and the pad share (1 - real tokens /
budget). Per variant: the val loss's mean, min, max and std over seeds, the median
tokens/s, the mean pad share.

Without --db the demo corpus (stdlib docstrings, ~6.3K documents) is built into a
temporary directory first (~10 s). The full run takes about 10 minutes on 2 CPU
cores; --quick (1 seed, 4 steps of 4 x 64 tokens) checks the plumbing in seconds and
measures nothing worth reading.

Output: a table on stdout, a recommendation line, JSON at --out
({"machine", "settings", "results": [{"variant", "val_loss_mean", "val_loss_min",
"val_loss_max", "val_loss_std", "tokens_per_s", "pad_share", "real_tokens", "runs"}],
"recommendation", "total_s"}) and a PNG of both (default: --out with .png).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not a package: import the project's modules from the root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # and loaders.machine_info

import data  # noqa: E402
import storage  # noqa: E402
import train  # noqa: E402
from common import (DEFAULT_TABLE, TRAIN_FILTER, VAL_FILTER, ArgumentParser, UserError, atomic_write,  # noqa: E402
                    check_out_dir, table_tokenizer)
from loaders import machine_info, write_json  # noqa: E402

VARIANTS = {"row": [], "pack": ["--pack"], "pack+doc-mask": ["--pack", "--doc-mask"]}
MODEL = "tiny"
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "learning.json")
# Full run: ~10 min on 2 CPU cores (the tiny model runs ~7K positions/s there).
# --quick: the plumbing only, in seconds. A flag given explicitly wins over either.
FULL = {"seeds": 3, "steps": 150, "seq_len": 256, "batch_size": 8, "lr": 1e-3, "eval_batches": 16}
QUICK = {"seeds": 1, "steps": 4, "seq_len": 64, "batch_size": 4, "lr": 1e-3, "eval_batches": 2}


# ── One run ──────────────────────────────────────────────────────────────────────────

def train_argv(opts, variant: str, seed: int, ckpt_dir: str, metrics: str) -> list[str]:
    """train.py's command line for one run: the budget, schedule and eval all variants share."""
    return ["--db", opts.db, "--table", opts.table, "--tokenizer", opts.tokenizer, "--model", MODEL,
            "--seq-len", str(opts.seq_len), "--batch-size", str(opts.batch_size),
            "--steps", str(opts.steps), "--lr", repr(opts.lr), "--warmup-steps", str(opts.warmup_steps),
            "--lr-total-steps", str(opts.steps), "--shuffle-seed", str(seed),
            "--log-every", str(opts.log_every), "--eval-every", "0", "--eval-batches", str(opts.eval_batches),
            "--ckpt-every", str(opts.steps), "--ckpt-dir", ckpt_dir, "--metrics-file", metrics,
            "--num-workers", "0", *VARIANTS[variant]]


def read_metrics(path: str) -> dict[str, list[dict]]:
    """kind -> the records of that kind in a train.py --metrics-file."""
    records: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            records.setdefault(record["kind"], []).append(record)
    return records


def one_run(opts, variant: str, seed: int) -> dict:
    """Train one variant in-process and summarize its metrics file.

    train.py's log is swallowed; on a crash it goes to stderr before the traceback.
    A user error inside train.main has printed its one `error:` line and raises
    SystemExit(2), which ends this script too.
    """
    with tempfile.TemporaryDirectory(prefix="learning-") as tmp:
        metrics_path = os.path.join(tmp, "metrics.jsonl")
        log = io.StringIO()
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):
                train.main(train_argv(opts, variant, seed, os.path.join(tmp, "ckpt"), metrics_path))
        except Exception:
            sys.stderr.write(log.getvalue())
            raise
        seconds = time.perf_counter() - start
        records = read_metrics(metrics_path)
    logged, final_eval = records.get("train", []), records["eval"][-1]
    if not logged or logged[-1]["step"] != opts.steps or \
            records["start"][0]["tokens_per_step"] * opts.steps != opts.budget:
        raise RuntimeError(f"{variant} seed {seed} did not train {opts.steps} steps of "
                           f"{opts.batch_size} x {opts.seq_len} positions: {records['start']}, {logged[-1:]}")
    rates = [r["tokens_per_s"] for r in logged[1:]] or [logged[0]["tokens_per_s"]]  # the first includes start-up
    real = final_eval["tokens_seen"]
    return {"variant": variant, "shuffle_seed": seed, "val_loss": final_eval["val_loss"],
            "tokens_per_s": statistics.median(rates), "real_tokens": real, "pad_share": 1 - real / opts.budget,
            "final_train_loss": logged[-1]["loss"], "loss_curve": [[r["step"], r["loss"]] for r in logged],
            "seconds": round(seconds, 2)}


def summarize(variant: str, runs: list[dict]) -> dict:
    losses = [r["val_loss"] for r in runs]
    return {"variant": variant, "flags": " ".join(VARIANTS[variant]) or "(none)",
            "val_loss_mean": statistics.fmean(losses), "val_loss_min": min(losses), "val_loss_max": max(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "pad_share": statistics.fmean(r["pad_share"] for r in runs),
            "real_tokens": round(statistics.fmean(r["real_tokens"] for r in runs)), "runs": runs}


# ── Report ───────────────────────────────────────────────────────────────────────────

def print_table(results: list[dict]) -> None:
    print(f"\n{'variant':<15}{'val loss mean':>14}  {'min - max':<17}{'tokens/s':>10}{'pad share':>11}"
          f"{'real tokens':>13}")
    for r in results:
        span = f"{r['val_loss_min']:.4f} - {r['val_loss_max']:.4f}"
        print(f"{r['variant']:<15}{r['val_loss_mean']:>14.4f}  {span:<17}{r['tokens_per_s']:>10,.0f}"
              f"{r['pad_share']:>11.1%}{r['real_tokens']:>13,}")


def recommend(results: list[dict], opts) -> str:
    """The variant with the lowest mean val loss, and whether the seeds resolve it."""
    best, runner_up = sorted(results, key=lambda r: r["val_loss_mean"])[:2]
    fastest = max(results, key=lambda r: r["tokens_per_s"])
    b, n = best["val_loss_mean"], runner_up["val_loss_mean"]
    if opts.seeds == 1:
        verdict = (f"{best['variant']}: lowest val loss ({b:.4f}; next {runner_up['variant']} {n:.4f}); "
                   f"one seed, so the seed spread is unmeasured: run --seeds 3 before trusting it")
    elif best["val_loss_max"] >= runner_up["val_loss_min"]:
        verdict = (f"{best['variant']}: lowest mean val loss ({b:.4f}), but {runner_up['variant']} ({n:.4f}) "
                   f"is within the seed spread (ranges {best['val_loss_min']:.4f}-{best['val_loss_max']:.4f} "
                   f"and {runner_up['val_loss_min']:.4f}-{runner_up['val_loss_max']:.4f} overlap): "
                   f"{opts.seeds} seeds do not separate them at this budget")
    else:
        verdict = (f"{best['variant']}: lowest mean val loss ({b:.4f}), clearly below {runner_up['variant']} "
                   f"({n:.4f}): every seed's loss is lower at the same {opts.budget:,}-position budget")
    if fastest is not best:
        verdict += (f"; it runs at {best['tokens_per_s'] / fastest['tokens_per_s']:.0%} of "
                    f"{fastest['variant']}'s tokens/s")
    return verdict


def draw(results: list[dict], machine: dict, opts, path: str) -> None:
    """Two panels: each seed's val loss with the variant's mean, and tokens/s per variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rate = fig.subplots(1, 2)
    names = [r["variant"] for r in results]
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    for x, (r, color) in enumerate(zip(results, colors)):
        runs = r["runs"]
        offsets = [(i - (len(runs) - 1) / 2) * 0.08 for i in range(len(runs))]  # seeds side by side
        ax_loss.scatter([x + o for o in offsets], [run["val_loss"] for run in runs], color=color, zorder=3,
                        label="one seed" if x == 0 else None)
        ax_loss.hlines(r["val_loss_mean"], x - 0.3, x + 0.3, color="black", linewidth=2,
                       label="mean" if x == 0 else None)
        ax_loss.annotate(f"{r['val_loss_mean']:.4f}", (x + 0.3, r["val_loss_mean"]), va="center",
                         xytext=(3, 0), textcoords="offset points", fontsize=8)
        ax_rate.bar(x, r["tokens_per_s"], color=color, width=0.6)
        ax_rate.scatter([x + o for o in offsets], [run["tokens_per_s"] for run in runs], color="black",
                        s=12, zorder=3)
    ax_loss.set_xticks(range(len(names)), names)
    ax_loss.set_xlim(-0.6, len(names) - 0.3)
    ax_loss.set_ylabel("final val loss (lower is better)")
    ax_loss.set_title("val loss per seed (data order) and mean", fontsize=10)
    ax_loss.legend(fontsize=8)
    ax_rate.set_xticks(range(len(names)), names)
    ax_rate.set_ylabel("tokens/s (positions, pads included; median)")
    ax_rate.set_title("throughput (bar: median, dots: runs)", fontsize=10)
    fig.suptitle(f"{MODEL} model, {opts.steps} steps x {opts.batch_size} x {opts.seq_len} = {opts.budget:,} "
                 f"positions per run, {opts.seeds} seed(s); {machine['cpu']} ({machine['affinity']} cores, "
                 f"gpu: {machine['gpu']})", fontsize=9)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


# ── Main ─────────────────────────────────────────────────────────────────────────────

def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default="", help="the corpus db (default: build the demo corpus in a temp dir)")
    p.add_argument("--table", default=DEFAULT_TABLE)
    p.add_argument("--out", default=DEFAULT_OUT, help="results JSON (default: bench/results/learning.json)")
    p.add_argument("--png", default="", help="the figure (default: --out with .png)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--seeds", type=int, help=f"shuffle seeds 1..N (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {FULL['steps']})")
    p.add_argument("--seq-len", type=int, help=f"default {FULL['seq_len']}")
    p.add_argument("--batch-size", type=int, help=f"rows or blocks per step (default {FULL['batch_size']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {FULL['lr']})")
    p.add_argument("--eval-batches", type=int,
                   help=f"validation batches of --batch-size documents (default {FULL['eval_batches']})")
    opts = p.parse_args(argv)
    for key, value in (QUICK if opts.quick else FULL).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.png = opts.png or os.path.splitext(opts.out)[0] + ".png"
    return opts


def check_opts(opts) -> None:
    for flag, value, low in (("--seeds", opts.seeds, 1), ("--steps", opts.steps, 1),
                             ("--seq-len", opts.seq_len, 2), ("--batch-size", opts.batch_size, 1),
                             ("--eval-batches", opts.eval_batches, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low} (got {value})")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise UserError(f"--lr must be a positive number (got {opts.lr})")
    for flag, path in (("--out", opts.out), ("--png", opts.png)):
        check_out_dir(flag, path)
    if opts.db and not os.path.isdir(opts.db):
        raise UserError(f"no LanceDB database at {opts.db!r}; create one with "
                        f"`python prepare_data.py INPUT --db {opts.db} --table {opts.table}`")


def check_corpus(opts) -> dict:
    """Refuse a corpus the runs could not finish on (too few steps in an epoch, no
    validation split) before the first run; returns what the settings record of it."""
    table = storage.connect_table(opts.db, opts.table)
    recorded = table_tokenizer(table)
    opts.tokenizer = recorded["tokenizer"] if recorded else "byte"
    for variant in VARIANTS:
        args = train.parse_args(train_argv(opts, variant, 1, "unused", "unused"))
        num_splits = train.check_args(args, 1)
        plan = data.plan_epoch(args, table, num_splits, args.batch_size)
        if plan.micro_steps_per_epoch < opts.steps:
            raise UserError(f"{variant}: an epoch of {opts.table!r} holds {plan.micro_steps_per_epoch} steps of "
                            f"{opts.batch_size} x {opts.seq_len}, fewer than --steps {opts.steps}: every "
                            f"variant must see new data for the whole budget; lower --steps or --batch-size")
    val_filter = data.data_filter(args, VAL_FILTER)
    val_docs = table.count_rows(val_filter)
    if val_docs == 0:
        raise UserError(f"no validation documents in {opts.table!r} pass the filter ({val_filter}); "
                        f"prepare the corpus with --val-fraction above 0")
    return {"db": os.path.abspath(opts.db), "table": opts.table, "tokenizer": opts.tokenizer,
            "table_version": table.version, "train_docs": table.count_rows(data.data_filter(args, TRAIN_FILTER)),
            "val_docs": val_docs, "val_docs_evaluated": min(val_docs, opts.eval_batches * opts.batch_size),
            "min_score": args.min_score}


def bench_main(opts) -> None:
    started = time.perf_counter()
    check_opts(opts)
    opts.budget = opts.steps * opts.batch_size * opts.seq_len
    opts.warmup_steps = max(1, round(opts.steps / 10))
    opts.log_every = max(1, opts.steps // 10)  # >= 5 train records from 5 steps on
    with tempfile.TemporaryDirectory(prefix="learning-corpus-") as tmp:
        corpus_note = f"given: {opts.db}"
        if not opts.db:
            import prepare_data

            opts.db = os.path.join(tmp, "lancedb")
            print(f"no --db: building the demo corpus (stdlib docstrings) in {opts.db} (~10 s)",
                  file=sys.stderr, flush=True)
            prepare_data.build_demo(opts.db, opts.table, "byte")
            corpus_note = "demo corpus (prepare_data.build_demo, byte tokenizer), built in a temp dir"
        corpus = {"source": corpus_note, **check_corpus(opts)}
        machine = machine_info()
        seeds = list(range(1, opts.seeds + 1))
        print(f"{machine['cpu']}, {machine['affinity']} cores, gpu: {machine['gpu']}; {opts.table}: "
              f"{corpus['train_docs']:,} train docs, {corpus['val_docs_evaluated']} of {corpus['val_docs']} val "
              f"docs evaluated; {MODEL} model, {opts.steps} steps x {opts.batch_size} x {opts.seq_len} = "
              f"{opts.budget:,} positions per run; {len(seeds)} seed(s) x {len(VARIANTS)} variants", flush=True)

        runs = {variant: [] for variant in VARIANTS}
        total = len(seeds) * len(VARIANTS)
        for i, (seed, variant) in enumerate(((s, v) for s in seeds for v in VARIANTS), 1):
            run = one_run(opts, variant, seed)
            runs[variant].append(run)
            print(f"[{i}/{total}] {variant} seed {seed}: val {run['val_loss']:.3f}, "
                  f"{run['tokens_per_s']:,.0f} tok/s, pad {run['pad_share']:.1%} ({run['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)

    results = [summarize(variant, runs[variant]) for variant in VARIANTS]
    print_table(results)
    recommendation = recommend(results, opts)
    print(f"recommendation: {recommendation}")
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = list(os.getloadavg())  # another user's load shows here
    settings = {
        "model": MODEL, "model_init": "fixed inside train.py (torch.manual_seed(1234)): the same in every run",
        "seeds": seeds, "seed_varies": "--shuffle-seed, the data order",
        "variants": {v: " ".join(flags) or "(none: one padded/truncated row per document)"
                     for v, flags in VARIANTS.items()},
        "order": "interleaved: for each seed, every variant", "steps": opts.steps,
        "batch_size": opts.batch_size, "seq_len": opts.seq_len,
        "budget_positions": opts.budget, "lr": opts.lr, "warmup_steps": opts.warmup_steps,
        "lr_total_steps": opts.steps, "schedule": "linear warm-up, cosine decay to 0 at the last step",
        "log_every": opts.log_every, "eval_batches": opts.eval_batches,
        "eval": "end of run only: padded validation rows from position 0, the same for every variant",
        "tokens_per_s": "median of the train records after the first; positions, pads included",
        "pad_share": "1 - real (non-pad) tokens trained on / budget_positions",
        "corpus": corpus, "quick": opts.quick, "in_process": "train.main, 1 rank, --num-workers 0",
    }
    write_json(opts.out, {"machine": machine, "settings": settings, "results": results,
                          "recommendation": recommendation, "total_s": round(time.perf_counter() - started, 1)})
    draw(results, machine, opts, opts.png)
    print(f"\nwrote {opts.out} and {opts.png} in {time.perf_counter() - started:.0f} s")


def main(argv=None) -> None:
    try:
        bench_main(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
