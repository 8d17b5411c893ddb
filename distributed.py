"""The ranks of a run: torchrun's environment in, the few collectives the other files share.

train.py sets the process group up; data.py and checkpoint.py agree on table versions,
the --ckpt-dir lock and checkpoint commits through `barrier` and `broadcast_from_main`.
On one process (no torchrun) every call here is a no-op.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def setup_distributed(timeout_s: int) -> tuple[int, int, torch.device]:
    """Rank, world size and device; a collective that waits longer than `timeout_s` for a
    peer fails instead of hanging the run.

    The device is set before the process group exists, and handed to NCCL as `device_id`,
    the documented order: NCCL then binds each rank's communicator to its own GPU at
    once, instead of guessing it at the first collective.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        backend, bound = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **bound)
    return rank, world_size, device


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def broadcast_from_main(value, world_size: int):
    """Rank 0's `value` on every rank (so all ranks agree while a table changes under them)."""
    box = [value]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def first_fault(fault: str | None, world_size: int) -> str | None:
    """Every rank's fault (None: none) gathered: the lowest rank's, on every rank, so all
    of them end together with the same line rather than some waiting on the others."""
    faults = [fault]
    if world_size > 1:
        faults = [None] * world_size
        dist.all_gather_object(faults, fault)
    return next((f for f in faults if f is not None), None)


def print0(*args, **kwargs) -> None:
    """print, flushed, on rank 0 only: every rank computes the same run-level lines."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def weights_digest(tensors) -> torch.Tensor:
    """(n, 2) float64: each tensor's sum and L2 norm. DDP keeps every rank's weights bit for
    bit equal (the same initial broadcast, the same all-reduced gradients, the same
    optimizer), so the digests are equal too; a rank that missed an all-reduce is not."""
    return torch.stack([torch.stack([t.detach().sum(dtype=torch.float64),
                                     torch.linalg.vector_norm(t.detach(), dtype=torch.float64)])
                        for t in tensors])


def replica_digests(model, world_size: int) -> torch.Tensor:
    """(world_size, n, 2): every rank's `weights_digest` of `model`, on every rank."""
    mine = weights_digest(model.state_dict().values())
    if world_size == 1:
        return mine[None]
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered)
