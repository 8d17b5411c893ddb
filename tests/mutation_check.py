"""Do the tests still catch the bugs that matter? Apply named one-line bugs, one at a time, to
a copy of the tree and run the tests meant to catch each; report which fail (catch it) and
how long each took to fail. Not part of the default test command: it runs the slow
multi-rank tests once per bug (7.7 minutes for the first 17 bugs on 2 cores, and about as long
again for the baseline; the three added since, about a minute).

    python tests/mutation_check.py                     # every bug, then a baseline run
    python tests/mutation_check.py --only ddp-never-syncs --json /tmp/mutations.json

A test that fails on the unmutated copy would make every "caught" meaningless, so the
candidate tests also run once on the unmutated copy (the baseline), which must pass.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, not_source  # run as a script, tests/ is on sys.path


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str
    line: str  # the line as the tree has it (must occur exactly once) ...
    bug: str  # ... and what the bug puts in its place
    tests: tuple[str, ...]  # the tests meant to catch it


MUTATIONS = (
    Mutation("ddp-never-syncs", "DDP never all-reduces: no_sync() on every micro-step", "train.py",
             "        with trainable.no_sync() if world_size > 1 and not is_sync else contextlib.nullcontext():",
             "        with trainable.no_sync() if world_size > 1 else contextlib.nullcontext():",
             ("tests/test_grad_sync.py",)),
    Mutation("checkpoint-at-the-prefetch-thread", "a checkpoint records where the prefetch thread has read to, "
             "not the batch trained last", "data.py",
             "        return self._state",
             "        return self.dataset.state_dict()",
             ("tests/test_prefetch.py::test_prefetched_batches_and_positions_equal_inline_ones",
              "tests/test_train.py::test_exact_resume_matches_uninterrupted_run")),
    Mutation("resume-with-epoch-0-order", "a resume rebuilds its dataset with epoch 0's order", "data.py",
             "        self.dataset = source.dataset(epoch)",
             "        self.dataset = source.dataset(0 if loader_state is not None else epoch)",
             ("tests/test_resume_epochs.py",
              "tests/test_train.py::test_exact_resume_matches_uninterrupted_run")),
    Mutation("checkpoint-not-atomic", "a checkpoint written in place, without fsync and rename", "checkpoint.py",
             "    atomic_replace(path, save)",
             "    save(path)",
             ("tests/test_elastic.py::test_kill_inside_a_checkpoint_write_then_resume_auto",)),
    Mutation("merge-rank-0-only", "a resume merges only rank 0's loader state", "checkpoint.py",
             "    states = [ckpt[\"dataset\"]] + [read_checkpoint(checkpoint_path(ckpt_dir, step, r))[\"dataset\"]",
             "    states = [ckpt[\"dataset\"]] + 0 * [read_checkpoint(checkpoint_path(ckpt_dir, step, r))[\"dataset\"]",
             ("tests/test_resume_epochs.py",
              "tests/test_elastic.py::test_every_global_step_sees_the_same_samples_on_any_world_size")),
    Mutation("doc-mask-dropped", "--doc-mask never reaches the model", "train.py",
             "    doc_ids = batch[\"doc_ids\"].to(device, non_blocking=True) if doc_mask else None",
             "    doc_ids = None",
             ("tests/test_doc_ids.py::test_doc_mask_loss_equals_each_document_run_alone",
              "tests/test_train.py::test_doc_mask_reaches_the_model_and_is_pinned")),
    Mutation("clip-1e12", "the gradient clip raised from 1.0 to 1e12 (never clips)", "train.py",
             "        grad_norm = torch.nn.utils.clip_grad_norm_(trainable.parameters(), 1.0)",
             "        grad_norm = torch.nn.utils.clip_grad_norm_(trainable.parameters(), 1e12)",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("no-warmup", "no warmup: the peak learning rate from the first step", "train.py",
             "        return args.lr * (step + 1) / args.warmup_steps",
             "        return args.lr",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("no-cosine", "no cosine decay: the peak learning rate after warmup", "train.py",
             "    return args.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))",
             "    return args.lr",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("no-weight-decay", "AdamW's weight decay 0.1 -> 0.0", "train.py",
             "    kwargs = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))",
             "    kwargs = dict(lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("default-betas", "AdamW's betas (0.9, 0.95) -> its defaults (0.9, 0.999)", "train.py",
             "    kwargs = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))",
             "    kwargs = dict(lr=args.lr, weight_decay=0.1)",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("loss-not-divided-by-grad-accum", "each micro-step's loss not divided by --grad-accum", "train.py",
             "            (loss / args.grad_accum).backward()",
             "            loss.backward()",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("pads-in-loss", "the loss averages over pad targets too", "model.py",
             "        mask = loss_mask[:, 1:].float()  # (B, T-1)",
             "        mask = torch.ones_like(loss_mask[:, 1:]).float()  # (B, T-1)",
             ("tests/test_reference_step.py::test_train_py_ends_with_the_reference_loops_weights",)),
    Mutation("dups-let-in", "the filter lets duplicates (is_dup) through", "common.py",
             "    return f\"NOT is_dup AND score >= {min_score} AND ({split_filter})\"",
             "    return f\"score >= {min_score} AND ({split_filter})\"",
             ("tests/test_train_filter.py::test_training_batches_hold_only_training_rows_that_pass_the_filter",)),
    Mutation("val-rows-in-training", "the training filter lets validation rows through", "common.py",
             "TRAIN_FILTER = \"split = 'train'\"",
             "TRAIN_FILTER = \"split = 'train' OR split = 'val'\"",
             ("tests/test_train_filter.py::test_training_batches_hold_only_training_rows_that_pass_the_filter",)),
    Mutation("min-score-ignored", "--min-score ignored: the filter keeps the default cutoff 1.0", "data.py",
             "    return corpus_filter(args.min_score, split_filter)",
             "    return corpus_filter(1.0, split_filter)",
             ("tests/test_train_filter.py::test_training_batches_hold_only_training_rows_that_pass_the_filter",)),
    Mutation("eval-reads-training-rows", "evaluation reads the training split", "common.py",
             "VAL_FILTER = \"split = 'val'\"",
             "VAL_FILTER = \"split = 'train'\"",
             ("tests/test_train_filter.py::test_evaluation_reads_validation_rows_only",)),
    Mutation("evals-recompile", "the loop's evals run on the compiled module, which recompiles for eval mode "
             "and no-grad (blind before: the warm interpreter's TORCH_LOGS was the server's)", "train.py",
             "            val = validate(run, state, model)",
             "            val = validate(run, state, trainable)",
             ("tests/test_train.py::test_compiled_run_does_not_recompile_for_checkpoints_or_evals",)),
    Mutation("tok-s-without-accumulation", "tok/s leaves out --grad-accum's micro-steps", "train.py",
             "        tps = steps * args.batch_size * run.world_size * args.grad_accum * args.seq_len / elapsed",
             "        tps = steps * args.batch_size * run.world_size * args.seq_len / elapsed",
             ("tests/test_figures.py::test_tokens_per_s_is_the_samples_over_the_wall_clock",)),
    Mutation("tokens-seen-counts-pads", "tokens_seen counts every position, pads included", "train.py",
             "        return trainable(input_ids, mask, doc_ids), mask.sum()",
             "        return trainable(input_ids, mask, doc_ids), torch.ones_like(mask).sum()",
             ("tests/test_figures.py::test_tokens_seen_is_the_real_tokens_of_the_traced_samples",)),
    Mutation("data-wait-in-cpu-time", "data_wait counts the thread's CPU time, not the wall time blocked", "data.py",
             "            self.waited += time.perf_counter() - start",
             "            self.waited += time.thread_time() - cpu",
             ("tests/test_figures.py::test_data_wait_is_the_loader_stall_seen_from_outside",)),
    Mutation("mfu-over-one-device", "MFU divides every rank's tokens by one device's peak", "train.py",
             "        mfu = run.flops_per_token * tps / (run.world_size * run.peak_flops) if run.peak_flops else None",
             "        mfu = run.flops_per_token * tps / run.peak_flops if run.peak_flops else None",
             ("tests/test_figures.py::test_mfu_is_the_model_flops_at_the_outside_pace_over_the_given_peak",)),
)


def copy_tree(dest: Path, source: Path = REPO) -> Path:
    """The project's sources copied to `dest`/tree: not a virtual environment kept in the
    clone (a whole torch per bug), nor data, checkpoints or caches."""
    tree = dest / "tree"
    shutil.copytree(source, tree, ignore=not_source)
    return tree


def mutate(tree: Path, m: Mutation) -> None:
    path = tree / m.file
    lines = path.read_text().split("\n")
    found = [i for i, line in enumerate(lines) if line == m.line]
    if len(found) != 1:
        raise SystemExit(f"error: {m.name}: the line to mutate occurs {len(found)} times in {m.file}, "
                         f"not once; update MUTATIONS to the current code")
    lines[found[0]] = m.bug
    path.write_text("\n".join(lines))


def run_test(tree: Path, test: str, timeout: int) -> tuple[str, float]:
    """('caught' | 'passed' | 'timeout', seconds): pytest stops at the first failure (-x)."""
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
                              cwd=tree, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    seconds = time.perf_counter() - started
    if proc.returncode == 0:
        return "passed", seconds
    if proc.returncode == 1:
        return "caught", seconds
    raise SystemExit(f"error: pytest could not run {test} (exit {proc.returncode}):\n{proc.stdout[-2000:]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="these bugs only")
    p.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per test run")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = []
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        print(f"{'bug':<26} {'test':<80} {'result':>8} {'s':>6}", flush=True)
        for m in chosen:
            tree = copy_tree(Path(scratch) / m.name)
            mutate(tree, m)
            for test in m.tests:
                result, seconds = run_test(tree, test, args.timeout)
                results.append({"bug": m.name, "what": m.what, "test": test, "result": result,
                                "seconds": round(seconds, 1)})
                print(f"{m.name:<26} {test:<80} {result:>8} {seconds:6.0f}", flush=True)
            shutil.rmtree(tree)
        if not args.no_baseline:
            tree = copy_tree(Path(scratch) / "baseline")
            for test in sorted({t for m in chosen for t in m.tests}):
                result, seconds = run_test(tree, test, args.timeout)
                results.append({"bug": "none (baseline)", "what": "the unmutated tree", "test": test,
                                "result": result, "seconds": round(seconds, 1)})
                print(f"{'none (baseline)':<26} {test:<80} {result:>8} {seconds:6.0f}", flush=True)
    missed = sorted({r["bug"] for r in results if r["bug"] != "none (baseline)"}
                    - {r["bug"] for r in results if r["result"] == "caught"})
    broken = [r["test"] for r in results if r["bug"] == "none (baseline)" and r["result"] != "passed"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if missed or broken:
        print(f"uncaught bugs: {missed or 'none'}; tests failing unmutated: {broken or 'none'}")
        sys.exit(1)
    print("every bug is caught, and every test passes on the unmutated tree")


if __name__ == "__main__":
    main()
