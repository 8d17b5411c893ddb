"""Checkpoints: written crash-safe, read without running code, resumed on any world size.

Layout: `<ckpt-dir>/step_XXXXXXXX.pt` holds rank 0's model, optimizer, loader state,
epoch and step; `step_XXXXXXXX_dsrankR.pt` holds rank R's loader state. Every file is
written to a temp name and renamed, and rank 0's file is written last, after it sees
every rank's: a step is complete or absent, so `--resume auto` never picks a torn one.
A write that fails on any rank (a full disk or quota, a --ckpt-dir made read-only or
removed) ends every rank with that rank's one-line StorageFault, and the step is
committed by no one.
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
from common import StorageFault, UserError, atomic_replace, out_of_space
from distributed import broadcast_from_main, elastic_attempt, first_fault

CKPT_NAME = re.compile(r"^step_(\d{8})\.pt$")
LOADER_FILE = re.compile(r"^step_(\d{8})_dsrank\d+\.pt$")
RESUME_IF_ANY = "if-any"  # --resume: the newest complete checkpoint if there is one, else a fresh start


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


class _KeepsWriteError:
    """The file torch.save writes to. torch reports a failed write only as a RuntimeError
    ("unexpected pos ..."), and takes a short write for a whole one: a buffered file
    writes all or raises, and the OSError's (errno, strerror) are kept, to raise it
    again. Not the exception itself: its traceback would hold this object, a cycle that
    keeps the training loop's frame, and so its loader workers, alive past the run."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        return self._kept(self.file.write, data)

    def flush(self):
        return self._kept(self.file.flush)

    def _kept(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            self.error = e.args
            raise


def atomic_save(obj, path: str) -> None:
    """torch.save through common.atomic_replace: fsynced and renamed, complete or absent;
    a failed write raises its OSError (ENOSPC, EDQUOT, EROFS...), not torch's RuntimeError."""

    def save(tmp):
        with open(tmp, "wb") as f:
            sink = _KeepsWriteError(f)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is None:
                    raise
                raise OSError(*sink.error) from None

    atomic_replace(path, save)


def save_checkpoint(ckpt_dir: str, rank: int, world_size: int, rank_payload: dict, main_payload,
                    keep_last: int = 0) -> str:
    """Every rank saves its loader state; rank 0's file, written last, commits the step.

    `main_payload` is a callable so only rank 0 pays for gathering model/optimizer state.
    After each write the ranks agree (`first_fault`) before going on, so a rank whose
    write failed ends them all at once; each then removes the file it wrote of this step.
    """
    step = rank_payload["opt_step"]
    path = checkpoint_path(ckpt_dir, step)
    # rank 0's lock, taken at the start, is gone if --ckpt-dir was removed or replaced since
    lost = rank == 0 and not os.path.isfile(os.path.join(ckpt_dir, CheckpointDirLock.FILE))
    end_on_fault(first_fault(lost_dir_fault(ckpt_dir, step) if lost else None, world_size))
    own, fault = None, None
    if rank:
        own = checkpoint_path(ckpt_dir, step, rank)
        with contextlib.suppress(OSError):  # the write says why if this fails
            os.makedirs(ckpt_dir, exist_ok=True)  # a node that does not share it fails below
        fault = save_or_fault(rank_payload, own, step, f"rank {rank}'s loader state")
    end_on_fault(first_fault(fault, world_size), own)
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
        fault = save_or_fault({**main_payload(), **rank_payload}, path, step, "the checkpoint")
    end_on_fault(first_fault(fault, world_size), own)
    if rank == 0:
        prune_checkpoints(ckpt_dir, keep_last)
    return path


def save_or_fault(payload: dict, path: str, step: int, what: str) -> str | None:
    """atomic_save; None, or the line of why the write failed (its temp file is gone by then)."""
    try:
        atomic_save(payload, path)
        return None
    except OSError as e:
        ckpt_dir = os.path.dirname(path)
        writing = f"{what} of step {step}, {path}"
        left, then = not_saved(ckpt_dir, step)
        full = out_of_space(e, ckpt_dir, writing, f"{left}: free space there or pass another --ckpt-dir, {then}",
                            tensor_bytes(payload))
        return str(full) if full else (f"cannot write {writing}: {e.strerror or e}; {left}: check that "
                                       f"--ckpt-dir is there and writable or pass another, {then}")


def lost_dir_fault(ckpt_dir: str, step: int) -> str:
    left, then = not_saved(ckpt_dir, step)
    return (f"--ckpt-dir {ckpt_dir} was removed or replaced during the run (its lock file "
            f"{CheckpointDirLock.FILE} is gone): {left}; restore it or pass another --ckpt-dir, {then}")


def end_on_fault(fault: str | None, own: str | None = None) -> None:
    """All ranks: a write failed on some rank, so this step will not be committed: remove
    this rank's file of it (`own`), then end with that rank's line."""
    if fault is None:
        return
    if own is not None:
        with contextlib.suppress(OSError):
            os.remove(own)
    raise StorageFault(fault)


def not_saved(ckpt_dir: str, step: int) -> tuple[str, str]:
    """What a failed save leaves, and what to do once the directory is fixed. The newest
    complete checkpoint is found by name: rank 0's file exists only once its step is committed."""
    try:
        names = sorted(n for n in os.listdir(ckpt_dir) if CKPT_NAME.match(n))
    except OSError:
        names = []
    if not names:
        return f"step {step} is not saved and there is no complete checkpoint", "then start the run again"
    return (f"step {step} is not saved and the newest complete checkpoint is {os.path.join(ckpt_dir, names[-1])}",
            "then --resume auto")


def tensor_bytes(payload) -> int:
    """The bytes of the tensors in `payload`, each storage once: what a checkpoint needs at least."""
    storages = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(payload)
    return sum(storages.values())


def prune_checkpoints(ckpt_dir: str, keep_last: int) -> None:
    """Drop torn temp files and all but the newest `keep_last` committed steps.

    Runs on rank 0 after a commit, when no rank is writing. The rank-0 file goes
    first, so a prune cut short leaves loose loader files, never a false checkpoint.
    """
    try:
        names = os.listdir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError):  # removed since the commit: the next save says so
        return
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


def load_resume(resume: str, ckpt_dir: str) -> tuple[str, dict, dict | None] | None:
    """--resume PATH, 'auto' (the newest complete step in `ckpt_dir`) or 'if-any' (the same,
    None where there is none), as (path, rank 0's checkpoint, the loader state merged over its
    ranks). Without --resume (`resume` empty): None, refused where `ckpt_dir` holds checkpoints."""
    if not resume:
        newest = newest_committed(ckpt_dir)
        if newest is not None:
            raise UserError(f"--ckpt-dir {ckpt_dir} already holds checkpoints (the newest is {newest}): pass "
                            f"--resume auto to continue that run (or --resume {RESUME_IF_ANY}, which starts "
                            f"fresh where there is none), or another --ckpt-dir for a new run")
        return None
    if resume not in ("auto", RESUME_IF_ANY):
        return (resume, *load_checkpoint(resume))
    found = newest_checkpoint(ckpt_dir, load_checkpoint)
    if found is None:
        if resume == RESUME_IF_ANY:
            return None
        raise UserError(f"--resume auto: no complete checkpoint in {ckpt_dir!r} (--resume {RESUME_IF_ANY} "
                        f"starts fresh there)")
    path, (ckpt, loader_state) = found
    return path, ckpt, loader_state


def resume_point(resume: str, ckpt_dir: str, rank: int, world_size: int) -> tuple[str | None, dict | None, dict | None]:
    """`load_resume` as rank 0 decides it, on every rank: (path, checkpoint, merged loader state),
    or Nones for a fresh start. One rank decides, so all of them start from the same step
    even while files come and go; a rank that cannot read the chosen checkpoint (a --ckpt-dir
    that is not shared) ends every rank with its line."""
    chosen, decided = None, None
    if rank == 0:
        try:
            chosen = load_resume(resume, ckpt_dir)
            decided = chosen[0] if chosen else None
        except UserError as e:  # or its StorageFault: every rank raises the same kind
            decided = e
    decided = broadcast_from_main(decided, world_size)
    if isinstance(decided, UserError):
        raise decided
    fault = None
    if decided is not None and rank != 0:
        try:
            chosen = (decided, *load_checkpoint(decided))
        except UserError as e:
            fault = f"rank {rank}: {e}"
    fault = first_fault(fault, world_size)
    if fault:
        raise UserError(fault)
    return chosen if chosen else (None, None, None)


def newest_committed(ckpt_dir: str) -> str | None:
    """The newest step in `ckpt_dir` whose rank-0 file is there (committed), by name; None if none."""
    try:
        names = sorted(n for n in os.listdir(ckpt_dir) if CKPT_NAME.match(n))
    except OSError:
        return None
    return os.path.join(ckpt_dir, names[-1]) if names else None


def remove_uncommitted(ckpt_dir: str) -> list[str]:
    """Rank 0, holding the lock, before anything is written: remove what an attempt that died
    left of steps it never committed (temp files, loader-state files with no rank-0 file), so
    nothing torn stays beside the checkpoints. Returns the names removed."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    committed = {m.group(1) for m in map(CKPT_NAME.match, names) if m}
    removed = []
    for name in sorted(names):
        loose = LOADER_FILE.match(name)
        if ".pt.tmp" in name or (loose and loose.group(1) not in committed):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(ckpt_dir, name))
                removed.append(name)
    return removed


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
    lock = CheckpointDirLock(ckpt_dir, force_unlock, elastic_attempt()) if rank == 0 else None
    refused = None
    if lock is not None:
        try:
            warning = lock.acquire()
            if warning:
                print(warning, file=sys.stderr, flush=True)
        except UserError as e:  # or its StorageFault: every rank raises the same kind
            refused = e
    refused = broadcast_from_main(refused, world_size)
    if refused:
        raise refused
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
