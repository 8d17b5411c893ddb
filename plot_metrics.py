"""Plot one or more training runs from the JSON Lines that `train.py --metrics-file` writes.

One figure to read a run from: training loss and validation loss against tokens seen,
throughput against step, and MFU against step when the run measured it. Several files
are overlaid, one colour per run, labelled by file stem.

Usage
-----
python plot_metrics.py runs/a/metrics.jsonl --out a.png
python plot_metrics.py a.jsonl b.jsonl --out compare.png --title "tiny: 1 vs 2 ranks"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from common import ArgumentParser, UserError, atomic_write

# Suffixes for token counts and rates, largest first.
_SCALES = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")]


def format_count(n: float) -> str:
    """1234567 -> '1.23M': axes in tokens are unreadable as raw integers or 1e9 offsets."""
    for scale, suffix in _SCALES:
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _records(path: str):
    """The JSON objects of `path`, in file order. A crash can leave the last line cut short,
    so lines that do not parse as an object are skipped, as are blank ones."""
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"cannot read metrics file {path!r}: {e.strerror}") from None
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                yield rec


def load_metrics(path: str) -> dict:
    """{"train": [...], "eval": [...], "starts": [...]} from one metrics file.

    A resumed run appends to the same file and redoes the steps after its checkpoint:
    records past the step it resumed from belong to the lost attempt and are dropped,
    and a step logged twice keeps its last record. Train and eval come back in step
    order. Kinds this script does not know are ignored.
    """
    by_step = {"train": {}, "eval": {}}
    starts = []
    for rec in _records(path):
        kind = rec.get("kind")
        if kind == "start":
            starts.append(rec)
            resumed = rec.get("resumed_from_step")
            if isinstance(resumed, int):
                for records in by_step.values():
                    for step in [s for s in records if s > resumed]:
                        del records[step]
        elif kind in by_step and isinstance(rec.get("step"), int):
            by_step[kind][rec["step"]] = rec
    return {
        "train": [by_step["train"][s] for s in sorted(by_step["train"])],
        "eval": [by_step["eval"][s] for s in sorted(by_step["eval"])],
        "starts": starts,
    }


def start_facts(start: dict) -> dict[str, str]:
    """What a start record says about its run, each fact as a phrase: {"model": "tiny",
    "params": "834K params", "world_size": "2 ranks", ...}; keys it lacks are left out."""
    facts = {}
    if "model" in start:
        facts["model"] = str(start["model"])
    if isinstance(start.get("params"), (int, float)):
        facts["params"] = f"{format_count(start['params'])} params"
    if "world_size" in start:
        facts["world_size"] = f"{start['world_size']} rank{'s' if start['world_size'] != 1 else ''}"
    if "global_batch" in start and "seq_len" in start:
        facts["batch"] = f"batch {start['global_batch']}x{start['seq_len']}"
    if start.get("blocks_mode") not in (None, "off"):
        facts["blocks_mode"] = f"blocks {start['blocks_mode']}"
    if isinstance(start.get("time"), (int, float)):
        facts["time"] = f"started {time.strftime('%Y-%m-%d %H:%M', time.localtime(start['time']))}"
    return facts


def run_labels(paths: list[str], runs: list[dict]) -> list[str]:
    """One legend label per run: the file stem. Runs that share a stem (runs/*/metrics.jsonl)
    add what their first start records say differently ("2 ranks" vs "4 ranks"), and a #n
    where that is not enough."""
    stems = [Path(p).stem for p in paths]
    facts = [start_facts(run["starts"][0]) if run["starts"] else {} for run in runs]
    labels = list(stems)
    for stem in {s for s in stems if stems.count(s) > 1}:
        group = [i for i, s in enumerate(stems) if s == stem]
        keys = {k for i in group for k in facts[i]}
        differ = {k for k in keys if len({facts[i].get(k) for i in group}) > 1}
        for i in group:
            about = ", ".join(v for k, v in facts[i].items() if k in differ)
            labels[i] = f"{stem} ({about})" if about else stem
    counts, seen = Counter(labels), Counter()
    for i, label in enumerate(labels):
        if counts[label] > 1:
            seen[label] += 1
            labels[i] = f"{label} #{seen[label]}"
    return labels


def _column(records: list[dict], key: str, scale: float = 1.0) -> list[float]:
    """One field of every record as floats; missing or null values become NaN, which
    matplotlib leaves as gaps."""
    return [rec[key] * scale if isinstance(rec.get(key), (int, float)) else math.nan
            for rec in records]


def resume_steps(run: dict) -> list[int]:
    """The steps a run was resumed from (start records with resumed_from_step > 0)."""
    steps = [s.get("resumed_from_step") for s in run["starts"]]
    return [s for s in steps if isinstance(s, int) and s > 0]


def tokens_at(run: dict, step: int) -> float | None:
    """Tokens seen at `step`: from a record logged at that step, else step x tokens_per_step."""
    for rec in run["train"] + run["eval"]:
        if rec["step"] == step and isinstance(rec.get("tokens_seen"), (int, float)):
            return rec["tokens_seen"]
    for start in run["starts"]:
        if isinstance(start.get("tokens_per_step"), (int, float)):
            return step * start["tokens_per_step"]
    return None


def output_format(out: str) -> str:
    """The image format `out` asks for by its suffix (png when it has none); checked before
    any work so a bad --out leaves nothing behind."""
    out_dir = os.path.dirname(out) or "."
    if os.path.isdir(out):
        raise UserError(f"--out {out!r} is a directory; give an image file name (FILE.png)")
    if not os.path.isdir(out_dir):
        raise UserError(f"--out directory {out_dir!r} does not exist")
    fmt = Path(out).suffix[1:].lower() or "png"
    supported = FigureCanvasAgg.get_supported_filetypes()
    if fmt not in supported:
        raise UserError(f"--out {out!r}: cannot write .{fmt} files (use one of: {', '.join(sorted(supported))})")
    return fmt


def plot(paths: list[str], out: str, title: str | None = None) -> int:
    """Draw the runs in `paths` into one image at `out`, written atomically; returns the
    number of training points drawn."""
    if not paths:
        raise UserError("no metrics files given (python plot_metrics.py RUN.jsonl [MORE.jsonl ...] --out FILE.png)")
    fmt = output_format(out)
    runs = [load_metrics(p) for p in paths]
    for path, run in zip(paths, runs):
        if not run["train"]:
            raise UserError(f"{path!r} has no train records (is it a train.py --metrics-file?)")
    labels = run_labels(paths, runs)
    has_mfu = any(isinstance(rec.get("mfu"), (int, float)) for run in runs for rec in run["train"])

    fig = Figure(figsize=(10, 3.6 * (3 if has_mfu else 2)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3 if has_mfu else 2, 1)
    ax_loss, ax_tps = axes[0], axes[1]
    ax_mfu = axes[2] if has_mfu else None
    if ax_mfu is not None:
        ax_mfu.sharex(ax_tps)

    marked_resume = False
    for i, (run, label) in enumerate(zip(runs, labels)):
        color, train, evals = f"C{i}", run["train"], run["eval"]
        steps = [rec["step"] for rec in train]
        ax_loss.plot(_column(train, "tokens_seen"), _column(train, "loss"), color=color, lw=1.2,
                     label=label)
        vals = [rec for rec in evals if isinstance(rec.get("val_loss"), (int, float))]
        if vals:
            ax_loss.plot(_column(vals, "tokens_seen"), _column(vals, "val_loss"), "o", color=color,
                         ms=5, mec="black", mew=0.5)
        ax_tps.plot(steps, _column(train, "tokens_per_s"), color=color, lw=1.2)
        if ax_mfu is not None:
            ax_mfu.plot(steps, _column(train, "mfu", 100.0), color=color, lw=1.2)
        for step in resume_steps(run):
            tokens = tokens_at(run, step)
            if tokens is not None:
                ax_loss.axvline(tokens, color=color, ls="--", lw=1, alpha=0.35,
                                label=None if marked_resume else "resumed")
                marked_resume = True
            ax_tps.axvline(step, color=color, ls="--", lw=1, alpha=0.35)

    tokens_axis = FuncFormatter(lambda x, _: format_count(x))
    ax_loss.xaxis.set_major_formatter(tokens_axis)
    ax_loss.set_xlabel("tokens seen")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss (line: train, markers: validation)", fontsize=10)
    ax_tps.yaxis.set_major_formatter(tokens_axis)
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_title("throughput", fontsize=10)
    if ax_mfu is not None:
        ax_mfu.set_ylabel("MFU (%)")
        ax_mfu.set_title("model FLOPs utilization", fontsize=10)
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[1:]:  # from zero, so a dip reads as its true size
        ax.set_ylim(bottom=0)
    ax_loss.legend(fontsize=8)  # one legend: the colours are the same runs in every panel
    if title is None and len(runs) == 1:
        about = ", ".join(start_facts(runs[0]["starts"][0]).values()) if runs[0]["starts"] else ""
        title = f"{labels[0]}: {about}" if about else labels[0]
    if title:
        fig.suptitle(title)

    atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=110))
    return sum(len(run["train"]) for run in runs)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", metavar="RUN.jsonl", help="metrics files from train.py --metrics-file")
    p.add_argument("--out", required=True, metavar="FILE.png", help="image to write (its suffix picks the format)")
    p.add_argument("--title", default=None, metavar="T", help="figure title (default: the run's description, for one run)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        n_points = plot(args.files, args.out, args.title)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    n_runs = len(args.files)
    print(f"wrote {args.out} ({n_runs} run{'s' if n_runs != 1 else ''}, {n_points} train points)")


if __name__ == "__main__":
    main()
