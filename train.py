"""Pretrain a GPT on a LanceDB table with the elastic StreamingDataset.

Training reads only the `input_ids` column, prefiltered by SQL, in a
deterministic order, optionally sequence-packed by the loader (--pack).

Usage
-----
python train.py --model tiny --steps 40                        # single process, CPU smoke

torchrun --nproc-per-node 8 train.py --model small --tokenizer hf:gpt2 \
    --pack --compile --batch-size 32 --grad-accum 2 --seq-len 1024 --epochs 1 \
    --num-splits 128 --io-queue-depth 1 --transform-parallelism 2 --num-workers 2

torchrun --nproc-per-node 4 train.py ... --batch-size 64 --resume auto   # any world size dividing num_splits
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import blocks_loaders
import preemption
import storage
from blocks_loaders import MODE_FORMAT
from ckpt_lock import CheckpointDirLock
from common import (
    DEFAULT_DB,
    DEFAULT_TABLE,
    TRAIN_FILTER,
    VAL_FILTER,
    UserError,
    block_hashes,
    check_table_tokenizer,
    connect_table,
    corpus_filter,
    is_remote,
    load_tokenizer,
    packed_token_count,
)
from model import MODEL_SIZES, make_model

# Dense (no sparsity) bf16 tensor-core peak per device, the dtype training runs in on
# CUDA. The first pattern found in torch.cuda.get_device_name() wins; a device not
# listed (and the CPU) reports MFU as n/a rather than a guess.
PEAK_BF16_FLOPS = (
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),  # SXM / HBM3 boards
    (r"\bH800\b.*\bPCIe\b", 756e12),
    (r"\bH800\b", 989e12),
    (r"\bG?H200\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bB200\b", 2250e12),
    (r"\bA100\b", 312e12),
    (r"\bA800\b", 312e12),
    (r"\bA10\b", 125e12),  # not the A10G, whose figure NVIDIA does not publish
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bMI300X\b", 1307e12),
)

CKPT_NAME = re.compile(r"^step_(\d{8})\.pt$")
# What torch's weights_only unpickler says, within its long multi-line refusal.
UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
WEIGHTS_ONLY_ERROR = re.compile(r"WeightsUnpickler error: \s*(\S[^\n]*)")

# Per rank. The loader's tokens/s on this project's benchmarks is flat from a few MiB up,
# and 256 MiB holds over a minute of a fast GPU's tokens as Arrow (README 'Bounded read-ahead').
DEFAULT_LOADER_BUFFER_MB = 256

# Settings that fix the sample order or the model: a resume must not change them.
RESUME_INVARIANTS = ("num_splits", "shuffle_seed", "seq_len", "pack", "doc_mask", "tokenizer",
                     "model", "min_score", "global_batch", "data")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--table", default=DEFAULT_TABLE)
    p.add_argument(
        "--tokenizer", default="byte", help="'byte' or 'hf:<model>' (vocab/pad/eos ids)"
    )
    p.add_argument("--model", default="tiny", choices=list(MODEL_SIZES))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="docs (or packed blocks, with --pack) per rank per micro-step",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="sequence packing in the loader: EOS-joined fixed-length blocks; "
        "resumable across world sizes",
    )
    p.add_argument(
        "--doc-mask",
        action="store_true",
        help="with --pack: each document of a packed block attends only within itself and "
        "its positions restart at 0 (FlexAttention on CUDA), from the loader's doc_ids",
    )
    p.add_argument(
        "--transform-queue-depth",
        type=int,
        default=0,
        help="cap on post-transform rows per split, in read batches "
        "(0 = loader default, unbounded; 16 avoids GC pauses on long runs)",
    )
    p.add_argument(
        "--loader-buffer-mb",
        type=float,
        default=DEFAULT_LOADER_BUFFER_MB,
        metavar="MB",
        help="most fetched-but-not-trained data each rank's lance loader holds, in MiB of "
        "Arrow (split between --num-workers); each split may always hold about two read "
        f"batches beyond it. 0 = no bound (lancedb 0.40's default, which reads ahead "
        f"until it holds the rank's whole epoch share). Default {DEFAULT_LOADER_BUFFER_MB:g}: "
        "see README 'Bounded read-ahead'",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="loader worker processes per rank (StreamingDataLoader); "
        "num_splits must be divisible by world_size * num_workers",
    )
    p.add_argument(
        "--mp-context",
        default="forkserver",
        choices=["forkserver", "spawn"],
        help="start method for --num-workers (never fork under CUDA)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode, e.g. max-autotune")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="stop after N optimizer steps (0 = full epochs)",
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument(
        "--lr-total-steps",
        type=int,
        default=0,
        help="cosine horizon; 0 = the computed total step count. Pin this "
        "when a run will be interrupted so schedules line up on resume",
    )
    p.add_argument(
        "--min-score",
        type=float,
        default=1.0,
        help="quality-score cutoff (SQL prefilter)",
    )
    p.add_argument(
        "--num-splits",
        type=int,
        default=0,
        help="elastic splits; 0 = one per global-batch slot",
    )
    p.add_argument("--shuffle-seed", type=int, default=42)
    p.add_argument(
        "--read-batch-size",
        type=int,
        default=64,
        help="rows per take per split (the reference's 8 made each take too small to "
        "amortise its cost: 2-3x fewer tokens/s, see README 'Loader settings')",
    )
    p.add_argument(
        "--io-queue-depth",
        type=int,
        default=1,
        help="I/O batches in flight per split (loader default 4)",
    )
    p.add_argument(
        "--transform-parallelism",
        type=int,
        default=2,
        help="transform threads per rank (loader default: cpu_count)",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--eval-every", type=int, default=0, help="eval every N steps (0 = only at end)"
    )
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--ckpt-dir", default="./checkpoints")
    p.add_argument("--resume", default="", help="checkpoint path, or 'auto' for latest")
    p.add_argument(
        "--keep-last",
        type=int,
        default=0,
        help="after each checkpoint, delete all but the newest N complete ones (0 = keep all)",
    )
    p.add_argument(
        "--metrics-file",
        default="",
        metavar="PATH",
        help="rank 0 writes JSON Lines here: a start record, one train record per "
        "--log-every step, one eval record per validation (plot_metrics.py draws them); "
        "a fresh run starts the file anew, --resume appends",
    )
    p.add_argument(
        "--trace-samples",
        default="",
        metavar="DIR",
        help="append one JSON line per optimizer step to DIR/rank{R}.jsonl with a hash "
        "of every sample the rank trained on (to check sample order across topologies)",
    )
    p.add_argument(
        "--blocks-mode",
        default="off",
        choices=["off", "lance", "mosaic", "parquet-random", "parquet-seq"],
        help="A/B harness: train on identical pre-packed 1024-token blocks via "
        "the lance loader, MosaicML streaming, Parquet random-take, or "
        "pre-shuffled Parquet shards read sequentially (build_packed_datasets.py)",
    )
    p.add_argument("--blocks-path", default="", help="blocks db dir / MDS dir or s3://")
    p.add_argument("--mosaic-cache", default=blocks_loaders.DEFAULT_MOSAIC_CACHE, metavar="DIR",
                   help="--blocks-mode mosaic from s3://: where each node caches the shards "
                   "(one subdirectory per dataset content hash, shared by the node's ranks)")
    storage.add_argument(p)
    p.add_argument(
        "--data-version",
        default="",
        metavar="N|latest",
        help="the table version to train on (the corpus table, or the --blocks-mode lance "
        "blocks table). Default: the newest at a fresh start, the checkpoint's on --resume, "
        "for the whole run whatever is appended meanwhile. N: version N. 'latest' on "
        "--resume: finish the checkpoint's epoch on its version, then read the newest",
    )
    p.add_argument(
        "--force-unlock",
        action="store_true",
        help="take over the --ckpt-dir lock of a run on another host that is gone "
        "(a lock of a dead process on this host is taken over without it)",
    )
    p.add_argument(
        "--stop-signals",
        default=preemption.DEFAULT_STOP_SIGNALS,
        metavar="SIG[,SIG]",
        help="signals that mean: finish the optimizer step, checkpoint it on every rank, exit 0 "
        "(Ctrl-C does the same once; a second Ctrl-C exits at once)",
    )
    p.add_argument(
        "--dist-timeout",
        type=int,
        default=600,
        metavar="SECONDS",
        help="how long a collective waits for a peer before the run ends with an error "
        "(a rank that died or hung); checkpoint saves and evals must fit in it",
    )
    p.add_argument(
        "--blocks-per-epoch",
        default="",
        help="packed block budget; default: exact value computed from the "
        "n_tokens column (production path). 'auto' uses the loader's sampler",
    )
    return p.parse_args(argv)


def check_args(args, world_size: int) -> int:
    """Refuse impossible settings before anything is read or written; returns num_splits."""
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--grad-accum", args.grad_accum, 1),
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
                        ("--loader-buffer-mb", args.loader_buffer_mb)):
        if value < 0:
            raise UserError(f"{flag} must not be negative (got {value})")
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
    global_batch = args.batch_size * world_size
    num_splits = args.num_splits or global_batch
    if num_splits % world_size:
        raise UserError(f"num_splits ({num_splits}) must be divisible by the world size ({world_size})")
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


def setup_distributed(timeout_s: int) -> tuple[int, int, torch.device]:
    """Rank, world size and device; a collective that waits longer than `timeout_s` for a
    peer fails instead of hanging the run."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world_size, device


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def rows_to_samples(batch: pa.RecordBatch, seq_len: int, pad_id: int) -> list[dict]:
    """Row mode: RecordBatch -> per-row dicts, each doc padded/truncated to seq_len.

    Module-level (bound with functools.partial) so it pickles into loader workers.
    """
    col = batch.column("input_ids")
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    ids = np.full((len(col), seq_len), pad_id, dtype=np.int64)
    lengths = np.minimum(np.diff(offsets), seq_len)
    for i, (start, n) in enumerate(zip(offsets[:-1], lengths)):
        ids[i, :n] = values[start:start + n]
    mask = np.arange(seq_len)[None, :] < lengths[:, None]
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    return [{"input_ids": ids_t[i], "loss_mask": mask_t[i]} for i in range(len(col))]


def data_filter(args, split_filter: str) -> str:
    return corpus_filter(args.min_score, split_filter)


def make_dataset(args, table, rank: int, world_size: int, *, epoch: int, shuffle: bool,
                 num_splits: int, **source):
    """lancedb's StreamingDataset with this run's loader settings, its read-ahead bounded
    by --loader-buffer-mb (bounded_streaming.py).

    `source` says which rows to read and how they become samples: `corpus_source`
    for the corpus table, a blocks transform for the pre-packed blocks table.
    """
    from bounded_streaming import BoundedStreamingDataset  # imports lancedb: not at module import

    return BoundedStreamingDataset(
        table,
        buffer_bytes=int(args.loader_buffer_mb * 2**20) or None,
        columns=["input_ids"],
        num_splits=num_splits,
        shuffle=shuffle,
        shuffle_seed=args.shuffle_seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        read_batch_size=args.read_batch_size,
        io_queue_depth=args.io_queue_depth,
        transform_parallelism=args.transform_parallelism,
        transform_queue_depth=args.transform_queue_depth or None,
        **source,
    )


def corpus_source(args, tok, split_filter: str, packed: bool = False, blocks_per_epoch=None) -> dict:
    """make_dataset's `source` for the corpus table: filtered rows, one per sample, or
    packed by the loader into EOS-joined blocks (pads, only where a split runs dry,
    are masked from the loss by id)."""
    source = dict(filter=data_filter(args, split_filter))
    if packed:
        source.update(pack_sequences=args.seq_len, eos_id=tok.eos_token_id,
                      pad_id=tok.pad_token_id, blocks_per_epoch=blocks_per_epoch)
    else:
        source.update(transform=functools.partial(rows_to_samples, seq_len=args.seq_len,
                                                  pad_id=tok.pad_token_id))
    return source


def make_loader(ds, args, device: torch.device, splits_per_rank: int):
    """Training micro-batches: in-process (num_workers=0) or lancedb's consumer-
    committed StreamingDataLoader with worker processes, yielding the same batches."""
    pin = device.type == "cuda"
    if args.num_workers == 0:
        return DataLoader(ds, batch_size=args.batch_size, num_workers=0, pin_memory=pin)
    from lancedb.streaming import StreamingDataLoader

    # Not fork: ranks have CUDA + lancedb's async runtime initialised, and
    # forked workers can deadlock (lancedb warns about exactly this).
    loader = StreamingDataLoader(
        ds,
        batch_size=args.batch_size // args.num_workers,
        num_workers=args.num_workers,
        multiprocessing_context=args.mp_context,
        pin_memory=pin,
        worker_init_fn=preemption.ignore_interrupts,
    )
    return interleave_workers(loader, args.num_workers, splits_per_rank // args.num_workers)


def read_ahead_line(args) -> str:
    """The start-up line that states how much a rank's lance loader may read ahead."""
    import bounded_streaming

    if bounded_streaming.PROBLEM is not None:
        return (f"loader: read-ahead NOT bounded: {bounded_streaming.PROBLEM} (bounded_streaming.py), "
                f"so lancedb reads ahead without limit (upstream issue #3694)")
    if not args.loader_buffer_mb:
        return "loader: read-ahead not bounded (--loader-buffer-mb 0)"
    workers = f", {args.loader_buffer_mb / args.num_workers:g} MiB per worker" if args.num_workers else ""
    return (f"loader: read-ahead at most {args.loader_buffer_mb:g} MiB per rank{workers} "
            f"(--loader-buffer-mb), plus about two read batches per split")


def interleave_workers(loader, num_workers: int, splits_per_worker: int):
    """One batch from each worker -> the batch an in-process loader would have made.

    Worker w owns a contiguous run of the rank's splits and yields whole cycles over
    them; the in-process loader yields each cycle over all of the rank's splits. So the
    samples of a training step, and their order, do not depend on --num-workers.
    """
    batches = iter(loader)
    while group := list(itertools.islice(batches, num_workers)):
        yield {key: torch.stack([b[key].unflatten(0, (-1, splits_per_worker)) for b in group],
                                dim=1).flatten(0, 2)  # (cycles, workers, splits, T) -> (B, T)
               for key in group[0]}


def batch_loss(trainable, batch, device, tok, doc_mask: bool = False):
    """Mean next-token loss of a batch and its real-token count. Ids outside the
    vocabulary are refused here, on the CPU, where a GPU would die in a device assert.
    With `doc_mask`, a packed batch's doc_ids keep its documents apart."""
    input_ids = batch["input_ids"]
    lowest, highest = (int(x) for x in torch.aminmax(input_ids)) if input_ids.numel() else (0, 0)
    if lowest < 0 or highest >= tok.vocab_size:
        bad = lowest if lowest < 0 else highest
        raise UserError(f"the data holds token id {bad}, outside the {tok.vocab_size}-id vocabulary of "
                        f"--tokenizer {tok.spec}: pass the tokenizer the data was prepared with")
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
    if table is None or table.count_rows(data_filter(args, VAL_FILTER)) < world_size:
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


def check_validation_data(args, data, world_size: int) -> None:
    """--eval-every needs a validation row for every rank; say so before training."""
    if not args.eval_every:
        return
    if data.table is None:
        raise UserError(f"--eval-every {args.eval_every}: --blocks-mode {args.blocks_mode} trains on "
                        f"blocks, which have no validation split; drop --eval-every")
    val_filter = data_filter(args, VAL_FILTER)
    val_rows = data.table.count_rows(val_filter)
    if val_rows < world_size:
        found = "no validation rows pass" if not val_rows else f"only {val_rows} validation rows pass"
        raise UserError(f"--eval-every {args.eval_every}: {found} the filter ({val_filter}), and each "
                        f"of the {world_size} ranks needs one; prepare the corpus with "
                        f"--val-fraction above 0, lower --min-score, or drop --eval-every")


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


def flops_per_token(model) -> float:
    """nanoGPT-style estimate: 6N + 12 * n_layer * d_model * seq_len."""
    cfg = model.cfg
    return 6 * model.num_params() + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """This device's dense bf16 peak (None where unknown, the CPU included) and what it is."""
    if device.type != "cuda":
        return None, f"n/a on {device.type}"
    name = torch.cuda.get_device_name(device)
    peak = peak_bf16_flops(name)
    if peak is None:
        return None, f"n/a: no bf16 peak known for {name!r} (train.PEAK_BF16_FLOPS)"
    return peak, f"{peak / 1e12:,.0f} TFLOPS bf16 peak per {name}"


def peak_bf16_flops(device_name: str) -> float | None:
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_name)), None)


class SampleTrace:
    """Per-rank record of which samples fed each optimizer step (--trace-samples).

    Each sample is named by the first 16 hex digits of BLAKE2b over its input_ids as
    little-endian int32, so traces from any topology can be compared from outside.
    """

    def __init__(self, directory: str, rank: int):
        os.makedirs(directory, exist_ok=True)
        self.file = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", buffering=1)
        self.rank = rank
        self.pending: list[str] = []

    def add(self, input_ids: torch.Tensor) -> None:
        self.pending.extend(block_hashes(input_ids.numpy()))

    def commit(self, step: int, epoch: int) -> None:
        self.file.write(json.dumps({"step": step, "rank": self.rank, "epoch": epoch,
                                    "samples": self.pending}) + "\n")
        self.pending = []


class MetricsLog:
    """--metrics-file: one JSON object per line, flushed as written, so a crash leaves
    whole records (and at worst one torn last line, which plot_metrics.py skips).

    The file is opened, and the run's start record written, with the first record of
    a trained step: a run refused at its first batch leaves no file behind.
    """

    def __init__(self, path: str, append: bool, **start):
        self.path, self.append, self.start = path, append, start
        self.file = None

    def write(self, kind: str, **fields) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.file = open(self.path, "a" if self.append else "w", buffering=1)
            self._line("start", self.start)
        self._line(kind, fields)

    def _line(self, kind: str, fields: dict) -> None:
        self.file.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **fields}) + "\n")


@dataclass
class EpochPlan:
    """How much one epoch holds, computed from the table before training."""

    train_rows: int
    blocks_per_epoch: int | str | None  # packed only: int, or "auto"
    micro_steps_per_epoch: int


def plan_epoch(args, table, num_splits: int, global_batch: int) -> EpochPlan:
    train_filter = data_filter(args, TRAIN_FILTER)
    train_rows, total_tokens = packed_token_count(table, train_filter)
    if train_rows == 0:
        raise UserError(f"no training rows pass the filter ({train_filter}): "
                        f"{why_no_training_rows(table, args.min_score)}")
    if train_rows < num_splits:
        raise UserError(
            f"only {train_rows} training rows pass the filter ({train_filter}) but "
            f"num_splits is {num_splits}: every split needs at least one row; lower "
            f"--min-score, --num-splits or --batch-size, or add data"
        )
    cycles_per_batch = global_batch // num_splits
    if not args.pack:
        cycles = train_rows // num_splits
        return EpochPlan(train_rows, None, -(-cycles // cycles_per_batch))
    exact = total_tokens // args.seq_len
    exact -= exact % num_splits
    if args.blocks_per_epoch == "auto":
        blocks_per_epoch = "auto"
    elif args.blocks_per_epoch:
        try:
            blocks_per_epoch = int(args.blocks_per_epoch)
        except ValueError:
            raise UserError(f"--blocks-per-epoch must be an integer or 'auto' (got {args.blocks_per_epoch!r})") from None
        if blocks_per_epoch <= 0 or blocks_per_epoch % num_splits:
            raise UserError(f"--blocks-per-epoch ({blocks_per_epoch}) must be a positive multiple of num_splits ({num_splits})")
    else:  # exact budget from the materialized token counts
        blocks_per_epoch = exact
    if blocks_per_epoch == 0:
        raise UserError(
            f"the training split holds {total_tokens:,} tokens, less than one "
            f"{args.seq_len}-token block per split ({num_splits} splits); lower --num-splits or --seq-len"
        )
    sized = exact if blocks_per_epoch == "auto" else blocks_per_epoch
    return EpochPlan(train_rows, blocks_per_epoch, -(-(sized // num_splits) // cycles_per_batch))


def why_no_training_rows(table, min_score: float) -> str:
    """What to change when the filter leaves nothing: the split, or the score cutoff."""
    import pyarrow.compute as pc

    candidates = f"NOT is_dup AND ({TRAIN_FILTER})"  # the training filter without its score cutoff
    rows = table.count_rows(candidates)
    if rows == 0:
        return "the table has no non-duplicate rows with split = 'train'; re-run prepare_data.py"
    scores = table.search().where(candidates).select(["score"]).limit(rows).to_arrow()
    best = pc.max(scores.column("score")).as_py()
    return f"the best training score is {best:.3f}, below --min-score {min_score}; lower --min-score"


@dataclass
class TrainingData:
    """Where a run's training samples come from, epoch by epoch.

    The corpus table (rows or --pack) and the lance blocks table give a lancedb
    StreamingDataset per epoch, whose state checkpoints carry, read at one pinned table
    `version`; the other --blocks-mode baselines give plain batches and no state.
    With --data-version latest on a resume, `newer` holds what epochs from `newer_epoch`
    on read: the same source at the newest version.
    """

    plan: EpochPlan
    identity: str  # what the samples are; a checkpoint pins it
    table: object | None = None  # the corpus table, for validation
    dataset: Callable[[int], object] | None = None
    baseline: object | None = None  # blocks_loaders.BlocksEpochs
    version: dict | None = None  # {"version", "timestamp"} of the table read; checkpoints record it
    newer: TrainingData | None = None
    newer_epoch: int = 0

    def at(self, epoch: int) -> TrainingData:
        """What epoch `epoch` reads."""
        return self.newer if self.newer is not None and epoch >= self.newer_epoch else self


def open_training_data(args, tok, rank: int, world_size: int, device, num_splits: int,
                       global_batch: int, saved: dict | None = None, epoch: int = 0) -> TrainingData:
    """The run's samples; `saved` is the resumed checkpoint's data version (None on a fresh
    start) and `epoch` the epoch it resumes in."""
    if args.blocks_mode == "off":
        ensure_demo_corpus(args, rank == 0, world_size)
        where = f"table {args.table!r} in {args.db!r}"
        open_table = functools.partial(connect_table, args.db, args.table)
        check_table_tokenizer(open_table(), tok, f"the {where}")

        def source(table) -> TrainingData:
            plan = plan_epoch(args, table, num_splits, global_batch)
            corpus = corpus_source(args, tok, TRAIN_FILTER, args.pack, plan.blocks_per_epoch)
            return TrainingData(plan, "corpus", table, dataset=lambda epoch: make_dataset(
                args, table, rank, world_size, epoch=epoch, shuffle=True, num_splits=num_splits,
                **corpus))
    else:
        manifest = blocks_loaders.read_manifest(args.blocks_path, MODE_FORMAT[args.blocks_mode])
        check_blocks_manifest(args, tok, manifest)
        identity = f"blocks:{manifest['content_hash'][:16]}"
        num_blocks = manifest["num_blocks"]
        if args.blocks_mode != "lance":
            baseline = blocks_loaders.BlocksEpochs(
                args.blocks_mode, args.blocks_path, rank=rank, world_size=world_size,
                batch_size=args.batch_size, seed=args.shuffle_seed, num_workers=args.num_workers,
                mp_context=args.mp_context, pin_memory=device.type == "cuda",
                mosaic_cache=args.mosaic_cache)
            plan = EpochPlan(num_blocks, None, -(-baseline.blocks_per_rank // args.batch_size))
            return TrainingData(plan, identity, baseline=baseline)
        if num_blocks < num_splits:
            raise UserError(f"{args.blocks_path!r} holds {num_blocks} blocks, fewer than num_splits "
                            f"({num_splits}); lower --num-splits or --batch-size")
        where = f"blocks table at {args.blocks_path!r}"
        open_table = lambda: blocks_loaders.open_lance_blocks(args.blocks_path)[0]  # noqa: E731
        cycles = num_blocks // num_splits
        plan = EpochPlan(num_blocks, None, -(-cycles // (global_batch // num_splits)))
        transform = functools.partial(blocks_loaders.blocks_to_samples, seq_len=args.seq_len)

        def source(table) -> TrainingData:
            return TrainingData(plan, identity, dataset=lambda epoch: make_dataset(
                args, table, rank, world_size, epoch=epoch, shuffle=True, num_splits=num_splits,
                transform=transform))

    latest = open_table()
    newest = broadcast_from_main(table_version(latest, latest.version), world_size)
    if saved is None:
        version = newest if args.data_version in ("", "latest") else \
            pinned_version(open_table, int(args.data_version), where, f"--data-version {args.data_version}")
    else:
        if args.data_version not in ("", "latest") and int(args.data_version) != saved["version"]:
            raise UserError(f"--data-version {args.data_version}: the checkpoint trained on version "
                            f"{saved['version']} of the {where}; drop --data-version to keep reading "
                            f"it, or pass --data-version latest to move to the newest at the next epoch")
        version = pinned_version(open_table, saved["version"], where, "the checkpoint", saved)
    data = source(checked_out(open_table(), version))
    data.version = version
    if rank == 0:
        print(f"data: {where}, version {version['version']} ({version['timestamp']})", flush=True)
    if saved is not None and args.data_version == "latest":
        if newest["version"] == version["version"]:
            message = f"data: --data-version latest: version {version['version']} of the {where} is the newest"
        else:
            data.newer, data.newer_epoch = source(checked_out(latest, newest)), epoch + 1
            data.newer.version = newest
            message = (f"data: --data-version latest: epoch {epoch} finishes on version "
                       f"{version['version']} of the {where}, epochs from {epoch + 1} read version "
                       f"{newest['version']}")
        if rank == 0:
            print(message, flush=True)
    return data


def table_version(table, version: int) -> dict:
    """{"version", "timestamp"} of one of `table`'s versions: the timestamp tells that version
    apart from a same-numbered one of a table dropped and made anew."""
    for entry in table.list_versions():
        if entry["version"] == version:
            return {"version": version, "timestamp": entry["timestamp"].isoformat()}
    raise ValueError(f"Version {version} not found")


def pinned_version(open_table, version: int, where: str, whose: str, saved: dict | None = None) -> dict:
    """Version `version` of the table, refused in one line when it no longer exists, or
    (for a checkpoint's) exists but was written at another time than the one `saved`."""
    table = open_table()
    try:
        found = table_version(table, version)
    except ValueError:
        kept = sorted(v["version"] for v in table.list_versions())
        have = f"it has versions {kept[0]}..{kept[-1]}" if kept else "it has no versions"
        if saved is None:
            raise UserError(f"{whose}: the {where} has no version {version} ({have})") from None
        raise UserError(f"{whose} trained on version {version} of the {where}, which no longer exists "
                        f"(cleaned up by optimize; {have}): the run cannot go on with the same data; "
                        f"start a new run in another --ckpt-dir") from None
    if saved is not None and found["timestamp"] != saved["timestamp"]:
        raise UserError(f"{whose} trained on version {version} of the {where} written at "
                        f"{saved['timestamp']}, but that version now dates from {found['timestamp']}: "
                        f"the table was made anew; start a new run in another --ckpt-dir")
    return found


def checked_out(table, version: dict):
    """`table` pinned at `version` for every read of the run: lancedb's StreamingDataset
    records it in its permutation, so loader workers read it too, whatever is appended,
    deleted or overwritten meanwhile."""
    table.checkout(version["version"])
    return table


def broadcast_from_main(value, world_size: int):
    """Rank 0's `value` on every rank (so all ranks agree while a table changes under them)."""
    box = [value]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_blocks_manifest(args, tok, manifest: dict) -> None:
    """The blocks must be this run's length and tokenizer (ids beyond the vocabulary
    would crash the embedding; another length would cut blocks apart)."""
    if manifest["seq_len"] != args.seq_len:
        raise UserError(f"the blocks at {args.blocks_path!r} hold {manifest['seq_len']} tokens; "
                        f"pass --seq-len {manifest['seq_len']}")
    built = (manifest["vocab_size"], manifest["eos_id"], manifest["pad_id"])
    if built != (tok.vocab_size, tok.eos_token_id, tok.pad_token_id):
        raise UserError(f"the blocks at {args.blocks_path!r} were tokenized with "
                        f"{manifest['tokenizer']!r}, not {tok.spec!r}; pass --tokenizer {manifest['tokenizer']}")


def train_batches(args, data: TrainingData, rank, world_size, device, num_splits, start_epoch,
                  loader_state):
    """Micro-batches across epochs as (epoch, dataset or None, batch); resumes mid-epoch from loader_state."""
    for epoch in range(start_epoch, args.epochs):
        source = data.at(epoch)
        if source.baseline is not None:
            for batch in source.baseline.epoch(epoch):
                yield epoch, None, batch
            continue
        ds = source.dataset(epoch)
        if loader_state is not None:
            try:
                ds.load_state_dict(loader_state)
            except ValueError as e:
                raise UserError(f"the checkpoint's loader state does not fit this run: {e}") from None
            loader_state = None
        for batch in make_loader(ds, args, device, num_splits // world_size):
            yield epoch, ds, batch


class WaitClock:
    """Wall seconds the training loop spent blocked on its next batch: the share of a
    log interval spent here says at a glance whether the loader starves the device."""

    def __init__(self):
        self.waited = 0.0

    def timed(self, batches):
        """`batches`, with the time each `next` takes added to `waited`; closing it
        closes `batches` (and so stops their loader workers)."""
        it = iter(batches)
        try:
            while True:
                start = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                self.waited += time.perf_counter() - start
                yield item
        finally:
            if isinstance(it, Generator):
                it.close()


# ── Checkpoints ───────────────────────────────────────────────────────────────


def checkpoint_path(ckpt_dir: str, step: int, rank: int = 0) -> str:
    suffix = f"_dsrank{rank}" if rank else ""
    return os.path.join(ckpt_dir, f"step_{step:08d}{suffix}.pt")


def atomic_save(obj, path: str) -> None:
    """torch.save to a temp name, fsync, rename: the file is complete or absent."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(ckpt_dir: str, rank: int, world_size: int, rank_payload: dict, main_payload,
                    keep_last: int = 0) -> str:
    """Every rank saves its loader state; rank 0's file, written last, commits the step.

    `main_payload` is a callable so only rank 0 pays for gathering model/optimizer state.
    """
    step = rank_payload["opt_step"]
    os.makedirs(ckpt_dir, exist_ok=True)  # on every rank: a node that does not share it fails below
    barrier(world_size)
    if rank:
        atomic_save(rank_payload, checkpoint_path(ckpt_dir, step, rank))
    barrier(world_size)
    path = checkpoint_path(ckpt_dir, step)
    # Before it commits, rank 0 must see every rank's file; all ranks learn what it misses.
    unseen = [[r for r in range(1, world_size) if not os.path.exists(checkpoint_path(ckpt_dir, step, r))]
              if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(unseen, src=0)
    if unseen[0]:
        raise UserError(f"--ckpt-dir {ckpt_dir!r} is not shared by all ranks (rank 0 does not see "
                        f"{os.path.basename(checkpoint_path(ckpt_dir, step, unseen[0][0]))}): multi-node "
                        f"training needs --ckpt-dir on a filesystem every node sees (e.g. NFS, Lustre)")
    if rank == 0:
        atomic_save({**main_payload(), **rank_payload}, path)
    barrier(world_size)
    if rank == 0:
        prune_checkpoints(ckpt_dir, keep_last)
    return path


def prune_checkpoints(ckpt_dir: str, keep_last: int) -> None:
    """Drop torn temp files and all but the newest `keep_last` committed steps.

    Runs on rank 0 after a commit, when no rank is writing. The rank-0 file goes
    first, so a prune cut short leaves loose loader files, never a false checkpoint.
    """
    names = os.listdir(ckpt_dir)
    for name in names:
        if ".pt.tmp" in name:
            os.remove(os.path.join(ckpt_dir, name))
    if not keep_last:
        return
    steps = sorted(int(m.group(1)) for m in map(CKPT_NAME.match, names) if m)
    for step in steps[:-keep_last]:
        os.remove(checkpoint_path(ckpt_dir, step))
        prefix = os.path.basename(checkpoint_path(ckpt_dir, step))[:-len(".pt")] + "_dsrank"
        for name in names:
            if name.startswith(prefix):
                os.remove(os.path.join(ckpt_dir, name))


def read_checkpoint(path: str) -> dict:
    """A checkpoint's contents, unpickled with weights_only=True: tensors and plain containers
    only, so a checkpoint from elsewhere cannot run code here (train.py and sample.py)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path!r} does not exist") from None
    except pickle.UnpicklingError as e:
        if found := UNSAFE_GLOBAL.search(str(e)):
            raise UserError(f"refusing checkpoint {path!r}: unpickling it would call '{found.group(1)}', "
                            f"which could run code; train.py writes only tensors and plain "
                            f"containers") from None
        why = WEIGHTS_ONLY_ERROR.search(str(e))
        raise UserError(f"cannot read checkpoint {path!r}: "
                        f"{why.group(1) if why else storage.first_line(e)}") from None
    except Exception as e:  # truncated or not a checkpoint at all
        raise UserError(f"cannot read checkpoint {path!r}: {storage.first_line(e)}") from None


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """Rank 0's checkpoint and the loader state merged over every rank that wrote it."""
    from lancedb.streaming import StreamingDataset

    ckpt = read_checkpoint(path)
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "dataset", "opt_step"} <= ckpt.keys():
        raise UserError(f"{path!r} is not a checkpoint written by train.py")
    step, saved_world = ckpt["opt_step"], ckpt.get("world_size", 1)
    if ckpt["dataset"] is None:  # a --blocks-mode baseline: weights only
        return ckpt, None
    ckpt_dir = os.path.dirname(path)
    states = [ckpt["dataset"]] + [read_checkpoint(checkpoint_path(ckpt_dir, step, r))["dataset"]
                                  for r in range(1, saved_world)]
    try:
        return ckpt, StreamingDataset.merge_state_dicts(states)
    except ValueError as e:
        raise UserError(f"checkpoint {path!r} has inconsistent loader states: {e}") from None


def newest_complete_checkpoint(ckpt_dir: str) -> tuple[str, dict, dict]:
    """The newest step whose files all load, as (path, checkpoint, merged loader state);
    incomplete or unreadable ones are skipped with a warning."""
    names = sorted((n for n in os.listdir(ckpt_dir) if CKPT_NAME.match(n)), reverse=True) \
        if os.path.isdir(ckpt_dir) else []
    for name in names:
        path = os.path.join(ckpt_dir, name)
        try:
            return (path, *load_checkpoint(path))
        except UserError as e:
            print(f"warning: skipping checkpoint {path}: {e}", file=sys.stderr)
    raise UserError(f"--resume auto: no complete checkpoint in {ckpt_dir!r}")


def run_config(args, num_splits: int, global_batch: int, data: str) -> dict:
    """The settings a checkpoint pins. global_batch counts the samples of one optimizer
    step, so a resume may trade --batch-size, ranks and --grad-accum against each other."""
    return dict(num_splits=num_splits, shuffle_seed=args.shuffle_seed, seq_len=args.seq_len,
                pack=args.pack, doc_mask=args.doc_mask, tokenizer=args.tokenizer, model=args.model,
                min_score=args.min_score, global_batch=global_batch * args.grad_accum, data=data)


def check_resume_config(saved: dict, current: dict, path: str) -> None:
    for key in RESUME_INVARIANTS:
        if key in saved and saved[key] != current[key]:
            why = " (batch size x ranks x grad accum)" if key == "global_batch" else ""
            raise UserError(
                f"cannot resume from {path}: it was trained with {key}={saved[key]!r}, "
                f"this run has {key}={current[key]!r}{why}"
            )


# ── Main ──────────────────────────────────────────────────────────────────────


def ensure_demo_corpus(args, is_main: bool, world_size: int) -> None:
    """The default db is built from the demo corpus on first use; any other db must exist."""
    if args.db != DEFAULT_DB:
        return
    if is_main:
        import prepare_data

        if prepare_data.open_existing(args.db, args.table) is None:
            print(f"no corpus at {args.db} (table {args.table}): building the demo corpus there "
                  f"(python prepare_data.py --demo)", flush=True)
            prepare_data.build_demo(args.db, args.table, args.tokenizer)
    barrier(world_size)


@contextlib.contextmanager
def checkpoint_dir_lock(args, rank: int, world_size: int):
    """Rank 0 holds --ckpt-dir's lock for the run, for all its ranks; a refusal reaches every
    rank, so none waits on a peer that is leaving."""
    lock = CheckpointDirLock(args.ckpt_dir, args.force_unlock) if rank == 0 else None
    refused = None
    if lock is not None:
        try:
            warning = lock.acquire()
            if warning:
                print(warning, file=sys.stderr, flush=True)
        except UserError as e:
            refused = str(e)
    refused = broadcast_from_main(refused, world_size)
    if refused:
        raise UserError(refused)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def train(args, rank: int, world_size: int, device: torch.device,
          stop: preemption.StopSignals | None = None) -> None:
    num_splits = check_args(args, world_size)
    with checkpoint_dir_lock(args, rank, world_size):
        train_locked(args, rank, world_size, device, num_splits, stop)


def train_locked(args, rank: int, world_size: int, device: torch.device, num_splits: int,
                 stop: preemption.StopSignals | None) -> None:
    is_main = rank == 0
    global_batch = args.batch_size * world_size
    tok = load_tokenizer(args.tokenizer)
    ckpt, loader_state = None, None
    if args.resume:
        if args.resume == "auto":
            path, ckpt, loader_state = newest_complete_checkpoint(args.ckpt_dir)
        else:
            path = args.resume
            ckpt, loader_state = load_checkpoint(path)
    data = open_training_data(args, tok, rank, world_size, device, num_splits, global_batch,
                              *((ckpt.get("data_version"), ckpt["epoch"]) if ckpt else ()))
    check_validation_data(args, data, world_size)
    plan = data.plan
    config = run_config(args, num_splits, global_batch, data.identity)
    if ckpt is not None:
        check_resume_config(ckpt.get("config", {}), config, path)

    torch.manual_seed(1234)
    model = make_model(args.model, tok.vocab_size, args.seq_len).to(device)
    fpt = flops_per_token(model)
    peak, peak_note = peak_flops(device)
    if is_main:
        print(
            f"model={args.model} params={model.num_params():,} pack={args.pack} "
            + ("doc_mask=True " if args.doc_mask else "")
            + f"world_size={world_size} global_batch={global_batch} "
            f"num_splits={num_splits} compile={args.compile} "
            f"num_workers={args.num_workers}"
            + (f" blocks_mode={args.blocks_mode}" if args.blocks_mode != "off" else "")
        )
    opt = make_optimizer(model, args, device)
    start_epoch, opt_step, tokens_seen = 0, 0, 0
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise UserError(f"checkpoint {path!r} does not fit --model {args.model} with a "
                            f"{tok.vocab_size}-id vocabulary: {str(e).splitlines()[0]}") from None
        start_epoch, opt_step = ckpt["epoch"], ckpt["opt_step"]
        tokens_seen = ckpt.get("tokens_seen", 0) if is_main else 0  # global: rank 0 carries it
        if is_main:
            print(f"resumed from {path} (epoch {start_epoch}, opt step {opt_step})")
    raw_model = model
    if args.compile:
        model = torch.compile(model, mode=args.compile_mode)
    trainable = model
    if world_size > 1:
        trainable = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    if is_main and args.pack:
        print(f"blocks_per_epoch: {plan.blocks_per_epoch}")
    total_micro = sum(data.at(epoch).plan.micro_steps_per_epoch for epoch in range(args.epochs))
    steps_per_epoch = max(plan.micro_steps_per_epoch // args.grad_accum, 1)
    total_steps = args.lr_total_steps or args.steps or max(total_micro // args.grad_accum, 1)
    metrics = None
    if is_main:
        print(
            f"train {'rows (post-filter)' if args.blocks_mode == 'off' else 'blocks'}: "
            f"{plan.train_rows:,}  ~steps/epoch: "
            f"{steps_per_epoch:,}  target steps: {total_steps:,}"
        )
        kept = f"keeping the newest {args.keep_last}" if args.keep_last else "keeping all"
        print(f"checkpoints: {args.ckpt_dir} every {args.ckpt_every} steps and at the end, {kept}")
        if args.blocks_mode in ("off", "lance"):
            print(read_ahead_line(args))
        print(f"mfu: {peak_note}")
        if args.metrics_file:
            print(f"metrics: {args.metrics_file}")
            metrics = MetricsLog(
                args.metrics_file, append=ckpt is not None, model=args.model,
                params=model.num_params(), world_size=world_size,
                global_batch=global_batch * args.grad_accum, seq_len=args.seq_len,
                tokens_per_step=global_batch * args.grad_accum * args.seq_len,
                blocks_mode=args.blocks_mode, pack=args.pack, resumed_from_step=opt_step)

    tokens = torch.tensor(tokens_seen, dtype=torch.int64, device=device)
    nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # counted on device: no per-step sync
    t_last, step_last = time.perf_counter(), opt_step
    last_saved = opt_step if ckpt is not None else -1
    epoch, ds, trained = start_epoch, None, False
    tag = f"[{args.blocks_mode}] " if args.blocks_mode != "off" else ""

    def checked_tokens() -> int:
        """All ranks: real tokens trained on (this run and the runs it resumes), after
        refusing to go on if any rank's loss or gradient norm went NaN or inf."""
        totals = torch.stack([tokens, nonfinite])
        if world_size > 1:
            dist.all_reduce(totals)
        if totals[1]:
            good = f"the newest checkpoint, step {last_saved}, is the last good one" \
                if last_saved > 0 else "no checkpoint was written"
            raise UserError(f"the loss became NaN or inf by step {opt_step}; nothing was saved after "
                            f"it and {good}: lower --lr or check the data, then --resume")
        return int(totals[0])

    def save(epoch: int, ds, batch) -> None:
        nonlocal nonfinite
        with torch.no_grad():  # the weights about to be saved, on the last batch:
            probe, _ = batch_loss(model, batch, device, tok, args.doc_mask)  # a step can wreck them
        nonfinite = nonfinite + ~torch.isfinite(probe)
        seen = checked_tokens()
        rank_payload = {"dataset": ds.state_dict() if ds is not None else None, "epoch": epoch,
                        "opt_step": opt_step}
        path = save_checkpoint(args.ckpt_dir, rank, world_size, rank_payload, lambda: {
            "model": raw_model.state_dict(),
            "optimizer": opt.state_dict(),
            "tokens_seen": seen,
            "world_size": world_size,
            "config": config,
            "data_version": data.at(epoch).version,
        }, args.keep_last)
        if is_main:
            print(f"  saved {path}")

    evaluated = {}  # opt_step -> val loss: the end of a run may fall on an --eval-every step

    def validate(epoch: int) -> float | None:
        if opt_step not in evaluated:
            evaluated[opt_step] = evaluate(model, args, data.at(epoch).table, rank, world_size, device, tok)
            seen = checked_tokens()
            if metrics:
                metrics.write("eval", step=opt_step, epoch=epoch, tokens_seen=seen,
                              val_loss=evaluated[opt_step])
        return evaluated[opt_step]

    done = bool(args.steps) and opt_step >= args.steps
    clock = WaitClock()
    batches = clock.timed(() if done else train_batches(args, data, rank, world_size, device,
                                                        num_splits, start_epoch, loader_state))
    waited_last = 0.0
    trace = SampleTrace(args.trace_samples, rank) if args.trace_samples else None
    vote = preemption.StopVote(world_size, device)
    stopped = False
    micro = 0
    for epoch, ds, batch in batches:
        trained = True
        if trace:
            trace.add(batch["input_ids"])
        is_sync = (micro + 1) % args.grad_accum == 0
        ctx = (
            trainable.no_sync()
            if (world_size > 1 and not is_sync)
            else contextlib.nullcontext()
        )
        with ctx:
            loss, real_tokens = batch_loss(trainable, batch, device, tok, args.doc_mask)
            (loss / args.grad_accum).backward()
        micro += 1
        tokens += real_tokens  # device accumulators: no per-step sync
        nonfinite += ~torch.isfinite(loss.detach())
        if not is_sync:
            continue

        for g in opt.param_groups:
            g["lr"] = lr_at(opt_step, total_steps, args)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable.parameters(), 1.0)
        nonfinite += ~torch.isfinite(grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_step += 1
        if trace:
            trace.commit(opt_step, epoch)

        if opt_step % args.log_every == 0:
            seen = checked_tokens()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_last
            data_wait = slowest_share(clock.waited - waited_last, dt, world_size, device)
            if is_main:
                tps = (opt_step - step_last) * global_batch * args.grad_accum * args.seq_len / dt
                mfu = fpt * tps / (world_size * peak) if peak else None
                stats = loader_stats(ds)
                mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                print(
                    f"{tag}epoch {epoch} step {opt_step}/{total_steps} | "
                    f"loss {loss.item():.4f} | {tps:,.0f} tok/s | "
                    f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'} | data_wait {data_wait:.1%}"
                    + (f" | mem {mem:.1f} GiB" if mem is not None else "") + format_loader_stats(stats),
                    flush=True,
                )
                if metrics:
                    metrics.write("train", step=opt_step, epoch=epoch, loss=loss.item(),
                                  lr=opt.param_groups[0]["lr"], tokens_per_s=tps, mfu=mfu,
                                  data_wait=data_wait, max_mem_gib=mem, tokens_seen=seen, loader=stats)
            t_last, step_last, waited_last = time.perf_counter(), opt_step, clock.waited

        if opt_step % args.ckpt_every == 0:
            save(epoch, ds, batch)
            last_saved = opt_step
        if args.eval_every and opt_step % args.eval_every == 0:
            val = validate(epoch)
            if is_main:
                print(f"  val loss @ step {opt_step}: {format_val(val, args)}", flush=True)
        if vote.stop_now(stop is not None and stop.requested is not None):
            stopped = True
            break
        if args.steps and opt_step >= args.steps:
            break
    batches.close()  # stops loader workers now, not at interpreter exit
    vote.settle()
    if trained and opt_step != last_saved:  # the end of the run is always resumable
        save(epoch, ds, batch)
    if stopped:
        if is_main:
            why = stop.requested or "a stop signal on another rank"
            print(f"{tag}stopped by {why} at step {opt_step}: saved "
                  f"{checkpoint_path(args.ckpt_dir, opt_step)}; continue with --resume auto", flush=True)
        return

    val = validate(epoch)
    seen = checked_tokens()
    if is_main:
        print(
            f"{tag}final: opt_step={opt_step} tokens_seen={seen:,} "
            f"val_loss={format_val(val, args)}",
            flush=True,
        )


def slowest_share(waited: float, elapsed: float, world_size: int, device: torch.device) -> float:
    """The largest share of `elapsed` that any rank spent waiting for data: one starved
    rank stalls every rank at the next gradient all-reduce."""
    share = torch.tensor(waited / elapsed if elapsed > 0 else 0.0, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
    return float(share)


def loader_stats(ds) -> dict | None:
    """The lancedb loader's queue and timing counters, where the source has them."""
    if ds is None:
        return None
    return dict(unscanned_rows=ds.unscanned_rows, raw_queue_depth=ds.raw_queue_depth,
                prefetch_queue_depth=ds.prefetch_queue_depth, consumed_rows=ds.consumed_rows,
                fetch_s=round(ds.fetch_time, 3), transform_s=round(ds.transform_time, 3))


def format_loader_stats(stats: dict | None) -> str:
    if stats is None:
        return ""
    return (f" | q {stats['unscanned_rows']}/{stats['raw_queue_depth']}/"
            f"{stats['prefetch_queue_depth']}/{stats['consumed_rows']} | "
            f"fetch {stats['fetch_s']:.1f}s tx {stats['transform_s']:.1f}s")


def make_optimizer(model, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as the reference: fused on CUDA, the default implementation elsewhere."""
    kwargs = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(model.parameters(), **kwargs)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mp_context == "forkserver":
        # Loader workers fork from a server that has torch and the project imported
        # (Python <3.12 never preloads __main__): ~0.2 s per worker instead of ~5 s,
        # paid again every epoch. Nothing there has started lancedb's runtime.
        mp.set_forkserver_preload(["torch", "blocks_loaders", "train"])
    if args.num_workers:
        # Before any StreamingDataset exists: its shared-memory stats are
        # created in the *default* mp context, so make that the same
        # (non-fork) context the DataLoader workers will use.
        mp.set_start_method(args.mp_context, force=True)
    try:
        signals = preemption.parse_signals(args.stop_signals)
    except ValueError as e:
        print(f"error: --stop-signals {args.stop_signals!r}: {e}", file=sys.stderr)
        sys.exit(2)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: never outlive its agent
        preemption.exit_with_parent()
    with preemption.StopSignals(signals) as stop:
        world_size, code = run(args, stop)
    baseline_ran = code == 0 and args.blocks_mode in blocks_loaders.BASELINE_MODES
    if world_size > 1 or args.num_workers or baseline_ran:
        # Teardown at interpreter exit can hang, or abort ("terminate called without
        # an active exception"), when loader threads and workers, lancedb's runtime
        # and the process group finalize in arbitrary order, and after an error peers
        # may be blocked in a collective; everything is flushed and checkpointed by
        # now, so leave without running finalizers. (A baseline refused at the start
        # has no loader workers yet: it exits normally, also when called in-process.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def run(args, stop: preemption.StopSignals) -> tuple[int, int]:
    """Train on this rank; returns (world size, exit code), each way a run can end told
    in one line."""
    rank, world_size, device = setup_distributed(args.dist_timeout)
    torch.set_float32_matmul_precision("high")
    code = 0
    try:
        storage.configure(args.storage_option)
        train(args, rank, world_size, device, stop)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted by a second Ctrl-C: the step in progress is not checkpointed; the newest "
              "complete checkpoint is intact (--resume auto)", file=sys.stderr)
        code = 130
    except Exception as e:
        why = preemption.describe_comm_failure(e) if world_size > 1 else None
        if why is None:
            raise
        print(f"error: rank {rank} lost contact with the other ranks ({why}): one died, or hung for "
              f"more than --dist-timeout {args.dist_timeout} s; the newest complete checkpoint is "
              f"intact (--resume auto)", file=sys.stderr)
        code = 1
    if world_size > 1 and code == 0:
        dist.destroy_process_group()
    return world_size, code

if __name__ == "__main__":
    main()
