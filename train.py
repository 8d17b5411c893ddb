"""Pretrain a GPT on a LanceDB table with the elastic StreamingDataset.

Training reads only the `input_ids` column, prefiltered by SQL, in a
deterministic order, optionally sequence-packed by the loader (--pack).

Usage
-----
python train.py --model tiny --steps 40                        # single process, CPU smoke

torchrun --nproc-per-node 8 train.py --model small --tokenizer hf:gpt2 \\
    --pack --compile --batch-size 32 --grad-accum 2 --seq-len 1024 --epochs 1 \\
    --num-splits 128 --io-queue-depth 1 --transform-parallelism 2 --num-workers 2

torchrun --nproc-per-node 4 train.py ... --batch-size 64 --resume auto   # any world size dividing num_splits

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 8 --max-restarts 3 \\
    --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id run42 \\
    --rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5 \\
    train.py ... --global-batch-size 512 --batch-size 16 --num-splits 128 \\
    --resume if-any    # fault-tolerant: one command line for every attempt, on 1 or 2 nodes (README)
"""

# Reading order: the flags, one micro-step (`batch_loss`), then `train`: resume, data
# (data.py), model, `train_loop`, the last checkpoint (checkpoint.py) and the final eval.

from __future__ import annotations

import startup

startup.quiet_ctrl_c(__name__)  # first: a Ctrl-C while torch and lancedb import is one line

import argparse
import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import blocks_loaders
import checkpoint
import preemption
import prefetch
import storage
from blocks_loaders import MODE_FORMAT
from common import (DEFAULT_DB, DEFAULT_TABLE, VAL_FILTER, StorageFault, Tokenizer, UserError,
                    block_hashes, is_remote, load_tokenizer)
from data import (DEFAULT_LOADER_BUFFER_MB, TrainingData, WaitClock, check_validation_data, corpus_source,
                  data_filter, format_loader_stats, loader_free_batches, loader_stats, make_dataset,
                  open_training_data, prefetched, random_batches, read_ahead_line, slowest_share,
                  train_batches)
from distributed import elastic_attempt, first_fault, print0, replica_digests, setup_distributed
from metrics import (MetricsLog, RunRecords, TensorBoardLog, append_record, drop_records_after, record_fault,
                     summary_writer_class)
from model import MODEL_SIZES, make_model

# The loader workers' forkserver imports these once (forkserver_quiet first: Ctrl-C ignored
# while it imports torch).
FORKSERVER_PRELOAD = ["forkserver_quiet", "torch", "blocks_loaders", "data"]
# Dense bf16 tensor-core peak per device, the dtype training runs in on CUDA. Datasheets
# print the 2:4-sparse figure first (marked *); the dense one is half of it. The first
# pattern found in torch.cuda.get_device_name() wins, so a board's variants (PCIe, NVL)
# come before its plain name; a device not listed (and the CPU) reports MFU as n/a
# rather than a guess.
PEAK_BF16_FLOPS = (
    (r"\bH100\b.*\bPCIe\b", 756e12),  # H100 datasheet (2023), PCIe: 1,513 TFLOPS sparse
    (r"\bH100\b.*\bNVL\b", 835e12),  # H100 NVL product brief (2024), per GPU: 1,671 sparse
    (r"\bH100\b", 989e12),  # H100 datasheet, SXM5 (HBM3): 1,979 sparse
    (r"\bH800\b.*\bPCIe\b", 756e12),  # H800 datasheet, PCIe: 1,513 sparse
    (r"\bH800\b", 989e12),  # H800 datasheet, SXM5: 1,979 sparse
    (r"\bH200\b.*\bNVL\b", 835e12),  # H200 datasheet (2024), H200 NVL: 1,671 sparse
    (r"\bG?H200\b", 989e12),  # H200 datasheet, H200 SXM (and GH200's GPU): 1,979 sparse
    (r"\bH20\b", 148e12),  # H20 spec sheet: 296 sparse
    (r"\bB200\b", 2250e12),  # HGX B200 datasheet: 36 PFLOPS sparse for 8 GPUs, 2.25 dense each
    (r"\bA100\b", 312e12),  # A100 datasheet (40 and 80 GB, SXM and PCIe): 624 sparse
    (r"\bA800\b", 312e12),  # A800 datasheet: 624 sparse
    (r"\bA10\b", 125e12),  # A10 datasheet: 250 sparse; not the A10G, whose figure is unpublished
    (r"\bL40S\b", 362e12),  # L40S datasheet: 733 sparse
    (r"\bL40\b", 181e12),  # L40 datasheet: 362 sparse
    (r"\bL4\b", 121e12),  # L4 datasheet: 242 sparse
    (r"\bMI300X\b", 1307e12),  # AMD Instinct MI300X datasheet: 1,307.4 dense bf16 (2,614.9 sparse)
)


# ── Flags ─────────────────────────────────────────────────────────────────────


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help as the manual: the module docstring as written, each flag's default after its
    help (left out where it says nothing: off switches and empty strings)."""

    def _get_help_string(self, action):
        if action.default in (None, False, "", argparse.SUPPRESS) or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)s)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_data_flags(p.add_argument_group("data"))
    add_model_flags(p.add_argument_group("model"))
    add_optimization_flags(p.add_argument_group("optimization"))
    add_loader_flags(p.add_argument_group("loader (lancedb StreamingDataset)"))
    add_checkpoint_flags(p.add_argument_group("checkpoints and resume"))
    add_distributed_flags(p.add_argument_group("distributed"))
    add_ab_flags(p.add_argument_group("A/B harness (pre-packed blocks, build_packed_datasets.py)"))
    add_observability_flags(p.add_argument_group("observability"))
    args = p.parse_args(argv)
    args.num_workers_note = resolve_num_workers(args)
    if args.grad_accum is None and not args.global_batch_size:
        args.grad_accum = 1  # with --global-batch-size, check_args derives it from the world size
    return args


def workers_flag(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer or 'auto' (got {text!r})") from None


# --num-workers auto, measured with bench/loader_step.py (README 'Batches made off the
# training thread'): lancedb's packer is Python, so in the training process it holds the
# GIL the step's kernel launches need; in a worker process it does not. The row and blocks
# transforms are numpy, for which a worker adds only the trip between processes. Below 4
# cores a rank has no core to spare for a worker beside the training thread and lancedb's.
AUTO_WORKERS_PACKED = 2
AUTO_WORKERS_MIN_CORES = 4


def resolve_num_workers(args) -> str:
    """--num-workers auto, made a number in place from this rank's share of the cores (under
    torchrun, LOCAL_WORLD_SIZE ranks share the node); returns how it was chosen."""
    if args.num_workers != "auto":
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores_per_rank = cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    splits_per_rank = (args.num_splits or args.batch_size * world_size) // world_size
    args.num_workers = 0
    if not args.pack or args.blocks_mode != "off":
        return "auto: 0, the transform is numpy (no --pack)"
    if cores_per_rank < AUTO_WORKERS_MIN_CORES:
        return f"auto: 0, {cores_per_rank} core(s) for this rank (a worker needs {AUTO_WORKERS_MIN_CORES})"
    args.num_workers = next((n for n in range(AUTO_WORKERS_PACKED, 0, -1) if splits_per_rank % n == 0), 0)
    return f"auto: {args.num_workers}, --pack with {cores_per_rank} cores for this rank"


def add_data_flags(g) -> None:
    g.add_argument("--db", default=DEFAULT_DB, metavar="DIR|s3://...",
                   help="LanceDB database holding the corpus table (prepare_data.py); the default one "
                   "is built from the demo corpus on first use")
    g.add_argument("--table", default=DEFAULT_TABLE, help="the corpus table in --db")
    g.add_argument("--tokenizer", default="byte", metavar="byte|hf:NAME",
                   help="'byte', or 'hf:<model name or local dir>'; must be the one the table was "
                   "prepared with (vocab, pad and eos ids)")
    g.add_argument("--min-score", type=float, default=1.0,
                   help="quality-score cutoff of the SQL prefilter (score >= it)")
    g.add_argument("--data-version", default="", metavar="N|latest",
                   help="the table version to train on (the corpus table, or the --blocks-mode lance "
                   "blocks table). Default: the newest at a fresh start, the checkpoint's on --resume, "
                   "for the whole run whatever is appended meanwhile. N: version N. 'latest' on "
                   "--resume: finish the checkpoint's epoch on its version, then read the newest")
    storage.add_argument(g)


def add_model_flags(g) -> None:
    g.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size (model.py)")
    g.add_argument("--seq-len", type=int, default=512,
                   help="tokens per sample: a document cut or padded to it, or a packed block")
    g.add_argument("--pack", action="store_true",
                   help="sequence packing in the loader: EOS-joined fixed-length blocks; "
                   "resumable across world sizes")
    g.add_argument("--doc-mask", action="store_true",
                   help="with --pack: each document of a packed block attends only within itself and "
                   "its positions restart at 0 (FlexAttention on CUDA), from the loader's doc_ids")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default="default", help="torch.compile mode, e.g. max-autotune")
    g.add_argument("--deterministic", action="store_true",
                   help="torch's deterministic algorithms (and cuBLAS's fixed workspace): on CUDA a "
                   "resumed run repeats an uninterrupted one bit for bit, at a cost in tok/s "
                   "(README 'GPU check'); the CPU is deterministic without it")


def add_optimization_flags(g) -> None:
    g.add_argument("--batch-size", type=int, default=8,
                   help="docs (or packed blocks, with --pack) per rank per micro-step")
    g.add_argument("--grad-accum", type=int, default=None,
                   help="micro-steps per optimizer step (default 1); with --global-batch-size it is "
                   "derived instead")
    g.add_argument("--global-batch-size", type=int, default=0, metavar="N",
                   help="samples (packed blocks with --pack) per optimizer step over all ranks, whatever "
                   "the world size: --grad-accum is derived as N / (--batch-size x ranks), so a group "
                   "torchrun restarts or re-forms on another number of ranks trains the same steps. "
                   "Each epoch then ends on a whole step, and --num-splits defaults to --batch-size "
                   "(README 'Fault-tolerant runs')")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training split")
    g.add_argument("--steps", type=int, default=0, help="stop after N optimizer steps (0 = full epochs)")
    g.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=200, help="linear warmup, then cosine decay")
    g.add_argument("--lr-total-steps", type=int, default=0,
                   help="cosine horizon; 0 = the computed total step count. Pin this when a run will "
                   "be interrupted so schedules line up on resume")


def add_loader_flags(g) -> None:
    g.add_argument("--num-splits", type=int, default=0,
                   help="elastic splits; 0 = one per global-batch slot (with --global-batch-size: "
                   "--batch-size)")
    g.add_argument("--shuffle-seed", type=int, default=42, help="seed of each epoch's split order")
    g.add_argument("--read-batch-size", type=int, default=64,
                   help="rows per take per split. The reference's 8 is too few to amortise a take's "
                   "cost: 64 gave 1.36x the tokens/s on the corpus table (--pack) and 4.85x on the "
                   "blocks table (README 'Loader settings')")
    g.add_argument("--io-queue-depth", type=int, default=1,
                   help="I/O batches in flight per split (loader default 4)")
    g.add_argument("--transform-parallelism", type=int, default=2,
                   help="transform threads per rank (loader default: cpu_count)")
    g.add_argument("--transform-queue-depth", type=int, default=0,
                   help="cap on post-transform rows per split, in read batches (0 = loader default, "
                   "unbounded; 16 avoids GC pauses on long runs)")
    g.add_argument("--loader-buffer-mb", type=float, default=DEFAULT_LOADER_BUFFER_MB, metavar="MB",
                   help="most fetched-but-not-trained data each rank's lance loader holds, in MiB of "
                   "Arrow (split between --num-workers); each split may always hold about two read "
                   "batches beyond it. 0 = no bound (lancedb 0.40's default, which reads ahead until "
                   "it holds the rank's whole epoch share). See README 'Bounded read-ahead'")
    g.add_argument("--num-workers", type=workers_flag, default="auto", metavar="N|auto",
                   help="loader worker processes per rank (StreamingDataLoader); num_splits must be "
                   "divisible by world_size * num_workers. auto: with --pack, 2 (or 1, as num_splits "
                   "allows) where the rank has at least 4 cores, else 0; without --pack, 0 (README "
                   "'Batches made off the training thread')")
    g.add_argument("--mp-context", default="forkserver", choices=["forkserver", "spawn"],
                   help="start method for --num-workers (never fork under CUDA)")
    g.add_argument("--blocks-per-epoch", default="", metavar="N|auto",
                   help="packed block budget; default: exact value computed from the n_tokens column "
                   "(production path). 'auto' uses the loader's sampler")


def add_checkpoint_flags(g) -> None:
    g.add_argument("--ckpt-dir", default="./checkpoints",
                   help="where checkpoints go: a filesystem every node sees (local, NFS, Lustre)")
    g.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N optimizer steps")
    g.add_argument("--keep-last", type=int, default=0,
                   help="after each checkpoint, delete all but the newest N complete ones (0 = keep all)")
    g.add_argument("--resume", default="", metavar="PATH|auto|if-any",
                   help="checkpoint path; 'auto' for the newest complete one in --ckpt-dir (refused where "
                   "there is none); 'if-any' for the same, or a fresh start where there is none: one "
                   "command line for the first start and every restart (torchrun --max-restarts, a "
                   "requeued job). Without --resume, a --ckpt-dir that holds checkpoints is refused")
    g.add_argument("--force-unlock", action="store_true",
                   help="take over the --ckpt-dir lock of a run on another host that is gone "
                   "(a lock of a dead process on this host is taken over without it)")


def add_distributed_flags(g) -> None:
    g.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                   help="how long a collective waits for a peer before the run ends with an error "
                   "(a rank that died or hung); checkpoint saves and evals must fit in it")
    g.add_argument("--stop-signals", default=preemption.DEFAULT_STOP_SIGNALS, metavar="SIG[,SIG]",
                   help="signals that mean: finish the optimizer step, checkpoint it on every rank, "
                   "exit 0 (Ctrl-C does the same once; a second Ctrl-C exits at once)")


def add_ab_flags(g) -> None:
    g.add_argument("--blocks-mode", default="off",
                   choices=["off", "lance", "mosaic", "parquet-random", "parquet-seq"],
                   help="train on identical pre-packed blocks via the lance loader, MosaicML "
                   "streaming, Parquet random-take, or pre-shuffled Parquet shards read sequentially")
    g.add_argument("--blocks-path", default="", metavar="DIR|s3://...",
                   help="the blocks: build_packed_datasets.py's OUT/<format> directory")
    g.add_argument("--mosaic-cache", default=blocks_loaders.DEFAULT_MOSAIC_CACHE, metavar="DIR",
                   help="--blocks-mode mosaic from s3://: where each node caches the shards "
                   "(one subdirectory per dataset content hash, shared by the node's ranks)")


def add_observability_flags(g) -> None:
    g.add_argument("--log-every", type=int, default=10, help="a log line every N optimizer steps")
    g.add_argument("--eval-every", type=int, default=0, help="eval every N steps (0 = only at end)")
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank per eval")
    g.add_argument("--metrics-file", default="", metavar="PATH",
                   help="rank 0 writes JSON Lines here: a start record, one train record per "
                   "--log-every step, one eval record per validation (plot_metrics.py draws them); "
                   "a fresh run starts the file anew, --resume appends")
    g.add_argument("--tensorboard", default="", metavar="DIR",
                   help="rank 0 writes the metrics file's scalars to DIR as TensorBoard event files, "
                   "keyed by optimizer step (view with `tensorboard --logdir DIR`); a resumed run "
                   "continues the curves, a fresh run into the same DIR replaces them")
    g.add_argument("--peak-tflops", type=float, default=0.0, metavar="T",
                   help="the dense peak of one device, in TFLOPS, that MFU divides by (default: the "
                   "bf16 datasheet figure for the GPUs train.PEAK_BF16_FLOPS lists; a device not "
                   "listed, the CPU included, has no MFU unless this gives it)")
    g.add_argument("--loader-free", type=int, default=0, metavar="N",
                   help="benchmark the training step alone: draw N micro-batches once, keep them on the "
                   "device and cycle over them, so no loader runs in the loop (bench/gpu_check.py's "
                   "ceiling, which the fed run's tok/s is compared with); writes no checkpoint; needs --steps")
    g.add_argument("--random-ids", type=int, default=0, metavar="VOCAB",
                   help="with --loader-free: the model has a VOCAB-id vocabulary and the pool holds "
                   "uniform random ids drawn on the device, not the loader's batches: the step at a "
                   "shape no tokenizer here has (bench/gpu_check.py's GPT-2 124M ceiling: --model small "
                   "--random-ids 50304); the corpus still plans the run and gives the final eval")
    g.add_argument("--trace-samples", default="", metavar="DIR",
                   help="append one JSON line per optimizer step to DIR/rank{R}.jsonl with a hash of "
                   "every sample the rank trained on (to check sample order across topologies)")


def check_args(args, world_size: int) -> int:
    """Refuse impossible settings before anything is read or written; returns num_splits.
    Sets --grad-accum where --global-batch-size derives it."""
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--grad-accum", 1 if args.grad_accum is None else args.grad_accum, 1),
                             ("--seq-len", args.seq_len, 2), ("--epochs", args.epochs, 1),
                             ("--log-every", args.log_every, 1), ("--ckpt-every", args.ckpt_every, 1),
                             ("--read-batch-size", args.read_batch_size, 1),
                             ("--io-queue-depth", args.io_queue_depth, 1),
                             ("--transform-parallelism", args.transform_parallelism, 1),
                             ("--dist-timeout", args.dist_timeout, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low} (got {value})")
    for flag, value in (("--steps", args.steps), ("--num-splits", args.num_splits),
                        ("--num-workers", args.num_workers), ("--eval-every", args.eval_every),
                        ("--eval-batches", args.eval_batches), ("--warmup-steps", args.warmup_steps),
                        ("--lr-total-steps", args.lr_total_steps), ("--keep-last", args.keep_last),
                        ("--transform-queue-depth", args.transform_queue_depth),
                        ("--loader-buffer-mb", args.loader_buffer_mb), ("--loader-free", args.loader_free),
                        ("--random-ids", args.random_ids), ("--global-batch-size", args.global_batch_size),
                        ("--peak-tflops", args.peak_tflops)):
        if value < 0:
            raise UserError(f"{flag} must not be negative (got {value})")
    args.grad_accum = derived_grad_accum(args, world_size)
    if args.loader_free and not args.steps:
        raise UserError(f"--loader-free {args.loader_free} cycles over its pool for ever, so no epoch ends: "
                        f"pass --steps N")
    if args.loader_free and args.resume:
        raise UserError("--loader-free benchmarks the step on batches it keeps on the device and writes no "
                        "checkpoint: it cannot --resume")
    if args.random_ids and not args.loader_free:
        raise UserError("--random-ids fills --loader-free's pool: pass --loader-free N with it")
    if args.doc_mask and not args.pack:
        raise UserError("--doc-mask needs --pack: only the loader's packed blocks carry the "
                        "document boundaries (doc_ids) it masks by")
    if args.blocks_mode != "off":
        if not args.blocks_path:
            raise UserError(f"--blocks-mode {args.blocks_mode} needs --blocks-path: the "
                            f"OUT/{MODE_FORMAT[args.blocks_mode]} directory that "
                            f"build_packed_datasets.py wrote")
        if args.pack:
            raise UserError("--pack packs the corpus table in the loader and --blocks-mode trains on "
                            "blocks packed already: pass one of them")
        if args.data_version and args.blocks_mode != "lance":
            raise UserError(f"--data-version: --blocks-mode {args.blocks_mode} reads files, not a table; "
                            f"the manifest's content hash pins them")
        if args.resume and args.blocks_mode != "lance":
            raise UserError(f"--blocks-mode {args.blocks_mode} keeps no loader state, so it cannot "
                            f"--resume; --blocks-mode off and lance resume mid-epoch")
    if is_remote(args.ckpt_dir):
        raise UserError(f"--ckpt-dir {args.ckpt_dir!r}: checkpoints go to a filesystem path (local, or "
                        f"shared by every node such as NFS or Lustre), not to object storage")
    if args.data_version not in ("", "latest") and not args.data_version.isdigit():
        raise UserError(f"--data-version must be a version number or 'latest' (got {args.data_version!r})")
    if args.tensorboard:
        summary_writer_class()  # the optional package imports, or the run is refused here
    global_batch = args.batch_size * world_size
    num_splits = args.num_splits or (args.batch_size if args.global_batch_size else global_batch)
    if num_splits % world_size:
        default = "" if args.num_splits or not args.global_batch_size else \
            " (with --global-batch-size it defaults to --batch-size: pass --num-splits, a multiple of every world size the run may have)"
        raise UserError(f"num_splits ({num_splits}) must be divisible by the world size ({world_size}){default}")
    baseline = args.blocks_mode in blocks_loaders.BASELINE_MODES  # plain DataLoader workers
    if not baseline and args.num_workers and num_splits % (world_size * args.num_workers):
        raise UserError(
            f"num_splits ({num_splits}) must be divisible by world_size x "
            f"num_workers ({world_size} x {args.num_workers})"
        )
    if global_batch % num_splits != 0:
        raise UserError(
            f"global batch ({global_batch} = {args.batch_size} x {world_size} ranks) "
            f"must be a multiple of num_splits ({num_splits}) so optimizer steps "
            f"align with loader cycles."
        )
    return num_splits


def derived_grad_accum(args, world_size: int) -> int:
    """--grad-accum, or with --global-batch-size the micro-steps that make one optimizer step
    of that many samples on this world size (refused where they cannot)."""
    if not args.global_batch_size:
        return args.grad_accum
    if args.grad_accum is not None:
        raise UserError("--global-batch-size derives --grad-accum from the world size: pass one of them")
    micro = args.batch_size * world_size
    if args.global_batch_size % micro:
        raise UserError(f"--global-batch-size {args.global_batch_size} is not a multiple of --batch-size "
                        f"{args.batch_size} x {world_size} rank(s) = {micro} samples per micro-step: pass a "
                        f"--global-batch-size or --batch-size that makes it one on every world size the run "
                        f"may have")
    return args.global_batch_size // micro


# ── One step ──────────────────────────────────────────────────────────────────

def check_vocabulary(input_ids: torch.Tensor, tok) -> None:
    """Ids outside the vocabulary are refused on the CPU, where a GPU would die in a device assert."""
    lowest, highest = (int(x) for x in torch.aminmax(input_ids)) if input_ids.numel() else (0, 0)
    if lowest < 0 or highest >= tok.vocab_size:
        bad = lowest if lowest < 0 else highest
        raise UserError(f"the data holds token id {bad}, outside the {tok.vocab_size}-id vocabulary of "
                        f"--tokenizer {tok.spec}: pass the tokenizer the data was prepared with")


def batch_loss(trainable, batch, device, tok, doc_mask: bool = False):
    """Mean next-token loss of a batch and its real-token count. With `doc_mask`, a packed
    batch's doc_ids keep its documents apart."""
    input_ids = batch["input_ids"]
    if input_ids.device.type == "cpu":  # --loader-free's batches on the device were checked there
        check_vocabulary(input_ids, tok)
    input_ids = input_ids.to(device, non_blocking=True).long()
    if "loss_mask" in batch:
        mask = batch["loss_mask"].to(device, non_blocking=True)
    else:  # packed blocks carry doc_ids; pads are identified by id
        mask = input_ids != tok.pad_token_id
    doc_ids = batch["doc_ids"].to(device, non_blocking=True) if doc_mask else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return trainable(input_ids, mask, doc_ids), mask.sum()


def evaluate(model, args, table, rank, world_size, device, tok) -> float | None:
    """Mean val loss over up to --eval-batches batches per rank; None if there are none.

    One split per rank: the validation split is small, and its order does not
    matter, so it need not share the training split layout.
    """
    if table is None:
        return None
    with storage.read_faults(table):
        if table.count_rows(data_filter(args, VAL_FILTER)) < world_size:
            return None  # the loader needs a row per split
    ds = make_dataset(args, table, rank, world_size, epoch=0, shuffle=False, num_splits=world_size,
                      **corpus_source(args, tok, VAL_FILTER))
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=0)
    model.eval()
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= args.eval_batches:
                break
            loss, _ = batch_loss(model, batch, device, tok)
            losses.append(loss.float())
    model.train()
    stats = torch.stack([torch.stack(losses).sum(), torch.tensor(float(len(losses)), device=device)]) \
        if losses else torch.zeros(2, device=device)
    if world_size > 1:
        dist.all_reduce(stats)
    return (stats[0] / stats[1]).item() if stats[1] > 0 else None


def format_val(val: float | None, args) -> str:
    if val is not None:
        return f"{val:.4f}"
    return "n/a (--blocks-mode has no validation split)" if args.blocks_mode != "off" \
        else "n/a (empty validation split)"


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(total - args.warmup_steps, 1)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def make_optimizer(model, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as the reference: fused on CUDA, the default implementation where fused is
    refused (the CPU, or a build or dtype without the fused kernel)."""
    kwargs = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(model.parameters(), **kwargs)


def flops_per_token(model) -> float:
    """nanoGPT-style estimate: 6N + 12 * n_layer * d_model * seq_len."""
    cfg = model.cfg
    return 6 * model.num_params() + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def peak_flops(device: torch.device, given_tflops: float = 0.0) -> tuple[float | None, str]:
    """This device's dense peak (--peak-tflops, else its bf16 datasheet figure; None where
    unknown, the CPU included) and what it is."""
    if given_tflops:
        return given_tflops * 1e12, f"{given_tflops:,g} TFLOPS peak per device (--peak-tflops)"
    if device.type != "cuda":
        return None, f"n/a on {device.type}"
    name = torch.cuda.get_device_name(device)
    peak = peak_bf16_flops(name)
    if peak is None:
        return None, f"n/a: no bf16 peak known for {name!r} (train.PEAK_BF16_FLOPS)"
    return peak, f"{peak / 1e12:,.0f} TFLOPS bf16 peak per {name}"


def peak_bf16_flops(device_name: str) -> float | None:
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_name)), None)


# ── What a run records ────────────────────────────────────────────────────────

class SampleTrace:
    """Per-rank record of which samples fed each optimizer step (--trace-samples).

    Each sample is named by the first 16 hex digits of BLAKE2b over its input_ids as
    little-endian int32, so traces from any topology can be compared from outside.
    A write that fails leaves whole records and sets `fault`; the run then stops. A run
    traces on from the step it starts at: records of later steps, which an attempt that died
    after its last checkpoint left, are dropped first (metrics.drop_records_after).
    """

    def __init__(self, directory: str, rank: int, world_size: int, start_step: int):
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        fault = None
        try:
            os.makedirs(directory, exist_ok=True)
            if rank == 0:
                drop_records_after(directory, start_step)
        except OSError as e:
            fault = record_fault("--trace-samples", directory, e)
        fault = first_fault(fault, world_size)  # every rank reopens only once rank 0 is done
        try:
            if fault:
                raise StorageFault(fault)
            self.file = open(self.path, "ab", buffering=0)
        except OSError as e:
            raise StorageFault(record_fault("--trace-samples", self.path, e)) from None
        self.rank = rank
        self.pending: list[str] = []
        self.fault: str | None = None

    def add(self, input_ids: torch.Tensor) -> None:
        self.pending.extend(block_hashes(input_ids.numpy()))

    def commit(self, step: int, epoch: int) -> None:
        if self.fault is None:
            try:
                append_record(self.file, {"step": step, "rank": self.rank, "epoch": epoch, "samples": self.pending})
            except OSError as e:
                self.fault = record_fault("--trace-samples", self.path, e)
        self.pending = []


def log_line(tag: str, epoch: int, step: int, total_steps: int, loss: float, tokens_per_s: float,
             mfu: float | None, data_wait: float, thread_ms: float, mem_gib: float | None,
             stats: dict | None) -> str:
    """The reference's fields first, in its order (epoch, step, loss, tok/s, mfu, q, fetch/tx),
    so a tool that parses its lines still works; this project's data_wait, the training
    thread's CPU per step on getting batches (`loader`), and mem after them."""
    return (f"{tag}epoch {epoch} step {step}/{total_steps} | loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | "
            f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'}" + format_loader_stats(stats)
            + f" | data_wait {data_wait:.1%} | loader {thread_ms:.1f}ms"
            + ("" if mem_gib is None else f" | mem {mem_gib:.1f} GiB"))


# ── Training ──────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Run:
    """What stays fixed while a run trains, shared by the functions of the loop."""

    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    tok: Tokenizer
    data: TrainingData
    config: dict  # the settings a checkpoint pins (checkpoint.run_config)
    num_splits: int
    total_steps: int  # the LR schedule's horizon and the log line's step target
    flops_per_token: float
    peak_flops: float | None  # the device's bf16 peak: None where unknown, so no MFU
    metrics: RunRecords | None  # rank 0 only: --metrics-file and --tensorboard

    @property
    def tag(self) -> str:
        return f"[{self.args.blocks_mode}] " if self.args.blocks_mode != "off" else ""


@dataclass
class TrainState:
    """Where the run is. The counters stay on the device, so no step waits on a sync for them."""

    epoch: int
    opt_step: int
    tokens: torch.Tensor  # real tokens trained on; rank 0 also carries the resumed runs' count
    nonfinite: torch.Tensor  # losses and gradient norms that came out NaN or inf
    last_saved: int  # the newest checkpointed step, -1 before the first
    val_losses: dict = field(default_factory=dict)  # opt_step -> val loss: the end may fall on an eval


def train(args, rank: int, world_size: int, device: torch.device,
          stop: preemption.StopSignals | None = None) -> int:
    num_splits = check_args(args, world_size)
    with checkpoint.checkpoint_dir_lock(args.ckpt_dir, args.force_unlock, rank, world_size):
        return train_locked(args, rank, world_size, device, num_splits, stop)


def train_locked(args, rank: int, world_size: int, device: torch.device, num_splits: int,
                 stop: preemption.StopSignals | None) -> int:
    """The run: resume, data, model, the loop, the last checkpoint and the final eval.
    Returns the exit code of a run that ends without an error: 1 where a node's agent died."""
    global_batch = args.batch_size * world_size
    tok = load_tokenizer(args.tokenizer)
    path, ckpt, loader_state = (None, None, None) if args.loader_free else \
        checkpoint.resume_point(args.resume, args.ckpt_dir, rank, world_size)

    data = open_training_data(args, tok, rank, world_size, device, num_splits, global_batch,
                              *((ckpt.get("data_version"), ckpt["epoch"]) if ckpt else ()))
    check_validation_data(args, data, world_size)
    config = checkpoint.run_config(args, num_splits, global_batch, data.identity)
    if ckpt is not None:
        checkpoint.check_resume_config(ckpt.get("config", {}), config, path)

    tok = run_vocabulary(args, tok)  # after the corpus is opened: it checks the tokenizer it was made with
    torch.manual_seed(1234)
    model = make_model(args.model, tok.vocab_size, args.seq_len).to(device)
    print0(f"model={args.model} params={model.num_params():,} pack={args.pack} world_size={world_size} "
           f"global_batch={global_batch} num_splits={num_splits} compile={args.compile} "
           f"num_workers={args.num_workers}"
           + (f" ({args.num_workers_note})" if args.num_workers_note else "")
           + (f" grad_accum={args.grad_accum} (--global-batch-size {args.global_batch_size} / {global_batch})"
              if args.global_batch_size else "")
           + (" doc_mask=True" if args.doc_mask else "")
           + (f" blocks_mode={args.blocks_mode}" if args.blocks_mode != "off" else ""))
    opt = make_optimizer(model, args, device)
    state = TrainState(epoch=0, opt_step=0, tokens=torch.zeros((), dtype=torch.int64, device=device),
                       nonfinite=torch.zeros((), dtype=torch.int64, device=device), last_saved=-1)
    if ckpt is not None:
        restore(model, opt, state, ckpt, path, args, tok, rank)
    removed = checkpoint.remove_uncommitted(args.ckpt_dir) if rank == 0 and not args.loader_free else []
    print0(start_line(args, path, state, removed))
    # `model` stays the plain module: checkpoints save its keys (no _orig_mod.), and the
    # checkpoint's probe and the evals run on it, since under --compile a no-grad or eval
    # call would compile the whole model once more. Only the training step runs `trainable`.
    compiled = torch.compile(model, mode=args.compile_mode) if args.compile else model
    trainable = DDP(compiled, device_ids=[device.index] if device.type == "cuda" else None) \
        if world_size > 1 else compiled

    horizon = total_steps(args, data)
    peak, peak_note = peak_flops(device, args.peak_tflops)
    announce(args, data, horizon, peak_note)
    metrics = open_metrics(args, rank, world_size, model, resumed_step=state.opt_step, resumed=ckpt is not None)
    run = Run(args, rank, world_size, device, tok, data, config, num_splits, horizon, flops_per_token(model),
              peak, metrics)
    trace = SampleTrace(args.trace_samples, rank, world_size, state.opt_step) if args.trace_samples else None
    try:
        # Every way out closes the pipeline (bounded), and only after a stop's checkpoint is on disk.
        with batch_pipeline(run, state, loader_state, stop) as batches:
            stopped, last = train_loop(run, state, model, trainable, opt, batches, stop, trace)
            if last is not None and state.opt_step != state.last_saved and not args.loader_free:  # always resumable
                save(run, state, model, opt, *last)
        end_on_record_fault(run, state, trace)
        saved = checkpoint.checkpoint_path(args.ckpt_dir, state.opt_step)
        if stopped == preemption.AGENT_LOST:
            print0(f"{run.tag}stopped at step {state.opt_step}: torchrun's agent on a node died, so that node "
                   f"leaves the run; saved {saved}; the agents left start the run again from it without that "
                   f"node (--max-restarts), or continue with --resume auto")
            return 1
        if stopped:
            why = (stop and stop.requested) or "a stop signal on another rank"
            if state.last_saved != state.opt_step:  # stopped while waiting for the first batch of a new run
                print0(f"{run.tag}stopped by {why} before the first step: nothing was trained, so nothing is saved")
                return 0
            print0(f"{run.tag}stopped by {why} at step {state.opt_step}: saved {saved}; continue with --resume auto")
            return 0
        val = validate(run, state, model)
        seen = checked_tokens(state, world_size)
        end_on_record_fault(run, state)
        print0(f"{run.tag}final: opt_step={state.opt_step} tokens_seen={seen:,} val_loss={format_val(val, args)}")
        return 0
    finally:  # rank 0's records: every one is flushed already; this ends the TensorBoard writer's thread
        if metrics:
            metrics.close()


def run_vocabulary(args, tok: Tokenizer) -> Tokenizer:
    """The tokenizer, widened to --random-ids' vocabulary where asked: the model is built for
    it, and its ids pass the vocabulary check. Narrower would lose the eval's corpus ids."""
    if not args.random_ids:
        return tok
    if args.random_ids < tok.vocab_size:
        raise UserError(f"--random-ids {args.random_ids} is smaller than the {tok.vocab_size}-id vocabulary "
                        f"of --tokenizer {tok.spec}, whose ids the final eval reads")
    return dataclasses.replace(tok, vocab_size=args.random_ids, spec=f"{tok.spec} (--random-ids {args.random_ids})")


def restore(model, opt, state: TrainState, ckpt: dict, path: str, args, tok, rank: int) -> None:
    """The checkpoint's weights, optimizer and progress, refused in one line where the model differs."""
    try:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"checkpoint {path!r} does not fit --model {args.model} with a "
                        f"{tok.vocab_size}-id vocabulary: {str(e).splitlines()[0]}") from None
    state.epoch, state.opt_step = ckpt["epoch"], ckpt["opt_step"]
    state.last_saved = state.opt_step
    if rank == 0:  # the count is global: rank 0 carries it
        state.tokens += ckpt.get("tokens_seen", 0)


def start_line(args, path: str | None, state: TrainState, removed: list[str]) -> str:
    """What the run starts from: a fresh start or the checkpoint it resumed, torchrun's attempt
    (the same command line starts every attempt), and what a dead attempt left that was removed."""
    if path is not None:
        line = f"resumed from {path} (epoch {state.epoch}, opt step {state.opt_step})"
    elif args.loader_free:
        line = "started fresh (--loader-free writes no checkpoint)"
    else:
        line = f"started fresh in {args.ckpt_dir}" + \
            (f" (--resume {args.resume}: no checkpoint there)" if args.resume == checkpoint.RESUME_IF_ANY else "")
    attempt = elastic_attempt()
    if attempt is not None:
        line += f", {attempt}"
    if removed:
        steps = sorted({int(name[len("step_"):][:8]) for name in removed})
        line += (f"; removed {len(removed)} file(s) of step(s) {', '.join(map(str, steps))}, which no "
                 f"checkpoint committed")
    return line


def total_steps(args, data: TrainingData) -> int:
    """The schedule's horizon: --lr-total-steps, else --steps, else every epoch's micro-steps
    (each epoch's own: a --data-version latest resume may read a bigger table later)."""
    total_micro = sum(data.at(epoch).plan.micro_steps_per_epoch for epoch in range(args.epochs))
    return args.lr_total_steps or args.steps or max(total_micro // args.grad_accum, 1)


def announce(args, data: TrainingData, horizon: int, peak_note: str) -> None:
    """The start-up lines: what an epoch holds, where checkpoints go, how MFU is measured."""
    plan = data.plan
    if args.pack:
        print0(f"blocks_per_epoch: {plan.blocks_per_epoch}")
    steps_per_epoch = max(plan.micro_steps_per_epoch // args.grad_accum, 1)
    print0(f"train {'rows (post-filter)' if args.blocks_mode == 'off' else 'blocks'}: {plan.train_rows:,}  "
           f"~steps/epoch: {steps_per_epoch:,}  target steps: {horizon:,}")
    kept = f"keeping the newest {args.keep_last}" if args.keep_last else "keeping all"
    print0(f"checkpoints: {args.ckpt_dir} every {args.ckpt_every} steps and at the end, {kept}")
    if args.blocks_mode in ("off", "lance"):
        print0(read_ahead_line(args))
    print0(f"mfu: {peak_note}")


def open_metrics(args, rank: int, world_size: int, model, resumed_step: int,
                 resumed: bool) -> RunRecords | None:
    """Rank 0's --metrics-file, whose start record says what one step is, and --tensorboard;
    None where neither is asked for."""
    if rank != 0:
        return None
    sinks = []
    if args.metrics_file:
        print0(f"metrics: {args.metrics_file}")
        step_batch = args.batch_size * world_size * args.grad_accum
        sinks.append(MetricsLog(args.metrics_file, append=resumed, model=args.model, params=model.num_params(),
                                world_size=world_size, global_batch=step_batch, seq_len=args.seq_len,
                                tokens_per_step=step_batch * args.seq_len, blocks_mode=args.blocks_mode,
                                pack=args.pack, resumed_from_step=resumed_step))
    if args.tensorboard:
        print0(f"tensorboard: {args.tensorboard}")
        sinks.append(TensorBoardLog(args.tensorboard, resumed_step))
    return RunRecords(sinks) if sinks else None


def train_loop(run: Run, state: TrainState, model, trainable, opt, source,
               stop: preemption.StopSignals | None, trace: SampleTrace | None) -> tuple[bool, tuple | None]:
    """Optimizer steps from the resumed one to --steps or the end of the last epoch, on the
    (epoch, loader position, micro-batch)s of `source` (batch_pipeline).

    Returns why the ranks' stop vote ended the loop (0: it did not; preemption.STOP: a stop
    signal or a record write that failed; preemption.AGENT_LOST), and the last (epoch,
    loader position, batch) trained on, which the final checkpoint records (None when
    nothing was trained).
    """
    args, device, world_size = run.args, run.device, run.world_size
    clock = WaitClock()
    interval = Interval(time.perf_counter(), state.opt_step, 0.0, 0.0)
    vote = preemption.StopVote(world_size, device)
    last, micro = None, 0
    for epoch, position, batch in clock.timed(source):
        state.epoch, last = epoch, (epoch, position, batch)
        if trace:
            trace.add(batch["input_ids"])
        is_sync = (micro + 1) % args.grad_accum == 0
        with trainable.no_sync() if world_size > 1 and not is_sync else contextlib.nullcontext():
            loss, real_tokens = batch_loss(trainable, batch, device, run.tok, args.doc_mask)
            (loss / args.grad_accum).backward()
        micro += 1
        state.tokens += real_tokens  # device accumulators: no per-step sync
        state.nonfinite += ~torch.isfinite(loss.detach())
        if not is_sync:
            continue

        for g in opt.param_groups:
            g["lr"] = lr_at(state.opt_step, run.total_steps, args)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable.parameters(), 1.0)
        state.nonfinite += ~torch.isfinite(grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.opt_step += 1
        if trace:
            trace.commit(state.opt_step, epoch)

        if state.opt_step % args.log_every == 0:
            interval = log_progress(run, state, interval, clock, loss, opt.param_groups[0]["lr"], position)
        if state.opt_step % args.ckpt_every == 0 and not args.loader_free:
            interval = interval.excluding(save(run, state, model, opt, epoch, position, batch))
        if args.eval_every and state.opt_step % args.eval_every == 0:
            started = time.perf_counter()
            val = validate(run, state, model)
            seconds = time.perf_counter() - started
            interval = interval.excluding(seconds)
            print0(f"  val loss @ step {state.opt_step}: {format_val(val, args)} ({seconds:.1f} s, not in tok/s)")
        if vote.stop_now(max(stop.wish if stop else 0,
                             preemption.STOP if unwritten_records(run, trace) is not None else 0)):
            break
        if args.steps and state.opt_step >= args.steps:
            break
    if getattr(source, "interrupted", False):  # a step called off before any rank began it
        vote.agree(stop.wish if stop else 0)
    vote.settle()
    return vote.reason, last


@contextlib.contextmanager
def batch_pipeline(run: Run, state: TrainState, loader_state, stop: preemption.StopSignals | None):
    """The loop's (epoch, loader position, micro-batch)s, closed on the way out whatever the
    way: made ahead on a thread that owns the loaders (prefetch.Prefetcher, whose close is
    bounded), or --loader-free's pool kept on the device; none once --steps is reached.

    A stop that comes while the loop waits for a step's batches (an unreachable store
    retrying, an epoch's workers starting) ends the wait: that step is not begun. With
    several ranks a StepGate makes that hold for all of them, whichever rank waits and
    whichever got the signal.
    """
    args = run.args
    if args.steps and state.opt_step >= args.steps:
        yield ()
        return
    if args.random_ids:
        yield random_batches(args.loader_free, args.batch_size, args.seq_len, args.random_ids, run.device)
        return
    items = train_batches(args, run.data, run.rank, run.world_size, run.device, run.num_splits,
                          state.epoch, loader_state, micro_steps_into_epoch(run, state))
    if args.loader_free:
        pool = loader_free_batches(items, args.loader_free, run.device, lambda ids: check_vocabulary(ids, run.tok))
        with contextlib.closing(pool):
            yield pool
        return
    wish = (lambda: stop.wish) if stop is not None else (lambda: 0)
    gate = preemption.StepGate(state.opt_step, run.world_size, run.rank) if run.world_size > 1 else None
    stop_waiting = (lambda step: gate.gives_way(step, wish())) if gate else (lambda step: bool(wish()))
    with prefetched(items, run.device, stop_waiting=stop_waiting, step_items=args.grad_accum, gate=gate) as batches:
        yield batches


def micro_steps_into_epoch(run: Run, state: TrainState) -> int:
    """The micro-batches of the resumed epoch trained before, on this world size, where epochs
    end on whole optimizer steps (--global-batch-size): the steps since the epoch began."""
    before = sum(run.data.at(epoch).plan.micro_steps_per_epoch for epoch in range(state.epoch))
    return max(state.opt_step - before // run.args.grad_accum, 0) * run.args.grad_accum


@dataclass(frozen=True)
class Interval:
    """The start of a --log-every interval: tok/s, MFU and data_wait are measured over it.
    Checkpoints and evals inside it are moved out of it (`excluding`): they are not training."""

    time: float
    step: int
    waited: float  # the WaitClock's totals then
    thread_s: float

    def excluding(self, seconds: float) -> Interval:
        return dataclasses.replace(self, time=self.time + seconds)


def log_progress(run: Run, state: TrainState, since: Interval, clock: WaitClock, loss, lr: float,
                 position) -> Interval:
    """The log line and the metrics record of the interval that ends now; returns the next one."""
    args = run.args
    seen = checked_tokens(state, run.world_size)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - since.time
    data_wait = slowest_share(clock.waited - since.waited, elapsed, run.world_size, run.device)
    if run.rank == 0:
        steps = state.opt_step - since.step
        tps = steps * args.batch_size * run.world_size * args.grad_accum * args.seq_len / elapsed
        mfu = run.flops_per_token * tps / (run.world_size * run.peak_flops) if run.peak_flops else None
        thread_ms = 1000 * (clock.thread_s - since.thread_s) / steps
        counters = loader_stats(position)
        mem = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else None
        print(log_line(run.tag, state.epoch, state.opt_step, run.total_steps, loss.item(), tps, mfu,
                       data_wait, thread_ms, mem, counters), flush=True)
        if run.metrics:
            run.metrics.write("train", step=state.opt_step, epoch=state.epoch, loss=loss.item(), lr=lr,
                              tokens_per_s=tps, mfu=mfu, data_wait=data_wait, max_mem_gib=mem,
                              tokens_seen=seen, loader={**(counters or {}), "thread_ms_per_step": round(thread_ms, 4)})
    return Interval(time.perf_counter(), state.opt_step, clock.waited, clock.thread_s)


def checked_tokens(state: TrainState, world_size: int) -> int:
    """All ranks: real tokens trained on (this run and the runs it resumes), after
    refusing to go on if any rank's loss or gradient norm went NaN or inf."""
    totals = torch.stack([state.tokens, state.nonfinite])
    if world_size > 1:
        dist.all_reduce(totals)
    if totals[1]:
        raise UserError(f"the loss became NaN or inf by step {state.opt_step}; nothing was saved after "
                        f"it and {last_good(state)}: lower --lr or check the data, then --resume")
    return int(totals[0])


def checked_replicas(model, state: TrainState, world_size: int) -> list:
    """All ranks: every rank's weights digest (distributed.weights_digest), after refusing to
    save if any rank's weights differ from rank 0's: DDP keeps them bit for bit equal."""
    digests = replica_digests(model, world_size)
    apart = [r for r in range(1, world_size) if not torch.equal(digests[r], digests[0])]
    if apart:
        raise UserError(f"rank {apart[0]}'s weights differ from rank 0's at step {state.opt_step}: the ranks "
                        f"no longer train one model (a gradient all-reduce was skipped); nothing was saved "
                        f"after it and {last_good(state)}")
    return digests.cpu().tolist()


def end_on_record_fault(run: Run, state: TrainState, trace: SampleTrace | None = None) -> None:
    """All ranks: a record that could not be written on any rank (--metrics-file, --trace-samples)
    ends the run with its line. The loop stopped every rank at one step for it, like a stop
    signal, and that step is checkpointed by now: nothing trained is lost."""
    fault = first_fault(unwritten_records(run, trace), run.world_size)
    if fault:
        saved = ", which is checkpointed" if state.last_saved == state.opt_step else f"; {last_good(state)}"
        raise StorageFault(f"{fault}; the run stopped at step {state.opt_step}{saved}: fix that, then --resume auto")


def unwritten_records(run: Run, trace: SampleTrace | None) -> str | None:
    """Why this rank's records stopped being written (a full disk), if they did."""
    return (run.metrics.fault if run.metrics else None) or (trace.fault if trace else None)


def last_good(state: TrainState) -> str:
    return f"the newest checkpoint, step {state.last_saved}, is the last good one" \
        if state.last_saved > 0 else "no checkpoint was written"


def save(run: Run, state: TrainState, model, opt, epoch: int, position, batch) -> float:
    """Checkpoint this step on every rank, once the weights are known to be finite (the
    loss of the last batch is computed again on the weights about to be saved) and the
    same on every rank (`checked_replicas`). Returns the seconds it took.

    `model` is the uncompiled module (see train_locked): no recompile for the probe.
    """
    started = time.perf_counter()
    with torch.no_grad():
        probe, _ = batch_loss(model, batch, run.device, run.tok, run.args.doc_mask)
    state.nonfinite += ~torch.isfinite(probe)
    seen = checked_tokens(state, run.world_size)
    digests = checked_replicas(model, state, run.world_size)
    rank_payload = {"dataset": position.state_dict() if position is not None else None, "epoch": epoch,
                    "opt_step": state.opt_step}
    path = checkpoint.save_checkpoint(run.args.ckpt_dir, run.rank, run.world_size, rank_payload, lambda: {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "tokens_seen": seen,
        "world_size": run.world_size,
        "replica_digests": digests,  # every rank's weights, summed: equal, or nothing is saved
        "config": run.config,
        "data_version": run.data.at(epoch).version,
    }, run.args.keep_last)
    state.last_saved = state.opt_step
    seconds = time.perf_counter() - started
    print0(f"  saved {path} ({seconds:.1f} s, not in tok/s)")
    return seconds


def validate(run: Run, state: TrainState, model) -> float | None:
    """The val loss at this step, evaluated once (and recorded) however often it is asked.
    On the uncompiled module: eval mode and no grad would recompile a compiled one."""
    if state.opt_step not in state.val_losses:
        state.val_losses[state.opt_step] = evaluate(model, run.args,
                                                    run.data.at(state.epoch).table, run.rank, run.world_size,
                                                    run.device, run.tok)
        seen = checked_tokens(state, run.world_size)
        if run.metrics:
            run.metrics.write("eval", step=state.opt_step, epoch=state.epoch, tokens_seen=seen,
                              val_loss=state.val_losses[state.opt_step])
    return state.val_losses[state.opt_step]


# ── Entry point ───────────────────────────────────────────────────────────────


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mp_context == "forkserver":
        # Loader workers fork from a server that has torch and the project imported
        # (Python <3.12 never preloads __main__): ~0.2 s per worker instead of ~5 s,
        # paid again every epoch. Nothing there has started lancedb's runtime.
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
        project_on_workers_path()
    if args.num_workers:
        # Before any StreamingDataset exists: its shared-memory stats are
        # created in the *default* mp context, so make that the same
        # (non-fork) context the DataLoader workers will use.
        mp.set_start_method(args.mp_context, force=True)
    try:
        signals = preemption.parse_signals(args.stop_signals)
    except ValueError as e:
        tell(f"error: --stop-signals {args.stop_signals!r}: {e}")
        sys.exit(2)
    agent = preemption.exit_with_parent() if "TORCHELASTIC_RUN_ID" in os.environ else None  # never outlive it
    with preemption.StopSignals(signals, agent) as stop:
        code = run(args, stop)
    leave(code, skip_finalizers=finalizers_may_hang(args, code) or prefetch.still_running())


def project_on_workers_path(*more: str) -> None:
    """This project's directory (and `more`) first on the loader workers' import path, at
    start-up. Python's forkserver (3.11, 3.12) starts in the working directory and does not
    take the parent's sys.path, so a ./data folder there (as ML projects have) hid data.py
    from the workers: they died on an ImportError (and a preload it cannot find is skipped)."""
    first = [os.path.dirname(os.path.abspath(__file__)), *more]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    os.environ["PYTHONPATH"] = os.pathsep.join([*first, *paths])


def run(args, stop: preemption.StopSignals) -> int:
    """Train on this rank; returns the exit code, each way a run can end told in one line:
    0 done or stopped by a signal (checkpointed), 1 a peer lost (or a node's torchrun agent,
    checkpointed), 2 a user error, 3 a storage fault (common.StorageFault), 130 a second Ctrl-C."""
    rank, world_size, device = setup_distributed(args.dist_timeout)
    torch.set_float32_matmul_precision("high")
    if args.deterministic:
        use_deterministic_algorithms()
    code = 0
    try:
        storage.configure(args.storage_option)
        code = train(args, rank, world_size, device, stop)
    except UserError as e:  # a StorageFault too: exit 3
        tell(f"error: {e}{retry_note(e.exit_code)}")
        code = e.exit_code
    except KeyboardInterrupt:
        tell("interrupted by a second Ctrl-C: what was not checkpointed yet is lost; the newest "
             "complete checkpoint is intact (--resume auto)")
        code = 130
    except Exception as e:
        why = preemption.describe_comm_failure(e) if world_size > 1 else None
        if why is None:  # a bug or a CUDA OOM: its traceback; its pipeline is closed by now, as on every way out
            traceback.print_exc()
        else:
            tell(f"error: rank {rank} lost contact with the other ranks ({why}): one died, or hung for "
                 f"more than --dist-timeout {args.dist_timeout} s; the newest complete checkpoint is "
                 f"intact (--resume auto)")
        code = 1
    if world_size > 1 and code == 0:
        dist.destroy_process_group()
    return code


def tell(line: str) -> None:
    """`line` on stderr in one write: the ranks of a node share it, and print's separate write
    of the newline let another rank's line in between (two errors ran into one line)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def retry_note(code: int) -> str:
    """torchrun's agent retries a user error as it would a crash, up to --max-restarts: each
    attempt's line then says which it is, so the same line again reads as the same mistake."""
    attempt = elastic_attempt()
    if code != 2 or attempt is None or attempt.max_restarts == 0:
        return ""
    return f" [{attempt}: the agent retries a user error too, until --max-restarts is spent]"


def use_deterministic_algorithms() -> None:
    """--deterministic. cuBLAS reads its workspace setting when its first handle is made,
    so this runs before any matmul. Ops with no deterministic kernel warn rather than
    stop the run: the warning names them, and the resume test measures what is left."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def finalizers_may_hang(args, code: int) -> bool:
    """Whether this process must leave without running finalizers.

    Teardown at interpreter exit can hang, or abort ("terminate called without an active
    exception"), when loader threads and workers, lancedb's runtime and the process group
    finalize in arbitrary order, and after an error peers may be blocked in a collective.
    A baseline refused at the start has no loader workers yet: it exits normally, also
    when called in-process.
    """
    baseline_ran = code == 0 and args.blocks_mode in blocks_loaders.BASELINE_MODES
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 or bool(args.num_workers) or baseline_ran


def leave(code: int, skip_finalizers: bool) -> None:
    """Exit with `code`; everything is flushed and checkpointed by now."""
    if skip_finalizers:
        sys.stdout.flush()
        sys.stderr.flush()
        release_semaphores()
        os._exit(code)
    if code:
        sys.exit(code)


def release_semaphores() -> None:
    """Unlink the named semaphores of this process's multiprocessing objects (loader queues
    and events) that are still alive, as multiprocessing's exit handler would: os._exit skips
    it, and the resource tracker then prints a "leaked semaphore objects" warning after the
    run's last line. Only finalizers of priority >= 0 run (no thread or child is joined), and
    the loader workers are stopped by now (prefetch.Prefetcher.close, or their loop ended)."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)


if __name__ == "__main__":
    main()
