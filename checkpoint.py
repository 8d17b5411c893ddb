"""Checkpoints: written crash-safe, read without running code, resumed on any world size.

Layout: `<ckpt-dir>/step_XXXXXXXX.pt` holds rank 0's model, optimizer, loader state,
epoch and step; `step_XXXXXXXX_dsrankR.pt` holds rank R's loader state. Every file is
written to a temp name and renamed, and rank 0's file is written last, after it sees
every rank's: a step is complete or absent, so `--resume auto` never picks a torn one.
On resume the ranks' loader states are merged (`StreamingDataset.merge_state_dicts`),
so a run goes on with another world size dividing num_splits, while the settings
that fix the sample order or the model (`RESUME_INVARIANTS`) must stay the same.

The --ckpt-dir lock itself lives in ckpt_lock.py (holder identity and liveness checks,
tested on their own); here rank 0 takes it for every rank of the run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import storage
from ckpt_lock import CheckpointDirLock
from common import UserError, atomic_write
from distributed import barrier, broadcast_from_main

CKPT_NAME = re.compile(r"^step_(\d{8})\.pt$")


# What torch's weights_only unpickler says, within its long multi-line refusal: "Unsupported
# global: GLOBAL x.y", or for a module it blocks outright (os, subprocess...) "Trying to
# load unsupported GLOBAL posix.system whose module posix is blocked."
UNSAFE_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)")


WEIGHTS_ONLY_ERROR = re.compile(r"WeightsUnpickler error: \s*(\S[^\n]*)")


# Settings that fix the sample order or the model: a resume must not change them.
RESUME_INVARIANTS = ("num_splits", "shuffle_seed", "seq_len", "pack", "doc_mask", "tokenizer",
                     "model", "min_score", "global_batch", "data")


def checkpoint_path(ckpt_dir: str, step: int, rank: int = 0) -> str:
    suffix = f"_dsrank{rank}" if rank else ""
    return os.path.join(ckpt_dir, f"step_{step:08d}{suffix}.pt")


def atomic_save(obj, path: str) -> None:
    """torch.save through common.atomic_write: fsynced and renamed, complete or absent."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


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


def newest_checkpoint(ckpt_dir: str, load: Callable[[str], object]) -> tuple[str, object] | None:
    """The newest step in `ckpt_dir` that `load(path)` reads, as (path, what it returned);
    steps it refuses with a UserError are skipped with a warning. None where none loads."""
    names = sorted((n for n in os.listdir(ckpt_dir) if CKPT_NAME.match(n)), reverse=True) \
        if os.path.isdir(ckpt_dir) else []
    for name in names:
        path = os.path.join(ckpt_dir, name)
        try:
            return path, load(path)
        except UserError as e:
            print(f"warning: skipping checkpoint {path}: {e}", file=sys.stderr)
    return None


def load_resume(resume: str, ckpt_dir: str) -> tuple[str, dict, dict | None]:
    """--resume PATH or 'auto' (the newest complete step in `ckpt_dir`), as
    (path, rank 0's checkpoint, the loader state merged over its ranks)."""
    if resume != "auto":
        return (resume, *load_checkpoint(resume))
    found = newest_checkpoint(ckpt_dir, load_checkpoint)
    if found is None:
        raise UserError(f"--resume auto: no complete checkpoint in {ckpt_dir!r}")
    path, (ckpt, loader_state) = found
    return path, ckpt, loader_state


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


@contextlib.contextmanager
def checkpoint_dir_lock(ckpt_dir: str, force_unlock: bool, rank: int, world_size: int):
    """Rank 0 holds --ckpt-dir's lock for the run, for all its ranks; a refusal reaches every
    rank, so none waits on a peer that is leaving."""
    lock = CheckpointDirLock(ckpt_dir, force_unlock) if rank == 0 else None
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
