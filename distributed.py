"""The ranks of a run: torchrun's environment in, the few collectives the other files share.

train.py sets the process group up; data.py and checkpoint.py agree on table versions,
the --ckpt-dir lock and checkpoint commits through `barrier` and `broadcast_from_main`.
On one process (no torchrun) every call here is a no-op.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from dataclasses import dataclass

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
        timeout = datetime.timedelta(seconds=timeout_s)
        store = worker_group_store(rank, world_size, timeout)
        if store is not None:
            bound["store"] = store
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **bound)
    return rank, world_size, device


# The agent-store key under which rank 0 publishes its worker group's own store.
GROUP_STORE_KEY = "lance-gpt-pretrain/worker_group_store"
GROUP_STORE_CONNECT_S = 2.0  # per try: a stale address is refused at once, a live one answers in ms


def worker_group_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """A store of this worker group's own, under torchrun's agent; None elsewhere (env://).

    Why: torchrun (torch 2.5 and later) shares its agent's TCPStore with the workers
    (TORCHELASTIC_USE_AGENT_STORE=True) and no longer prefixes the workers' keys per
    attempt. A worker group the agent restarts (--max-restarts) or re-forms (--nnodes
    MIN:MAX) then reads the process-group keys the dead group left there, and gloo or NCCL
    connects to a dead peer's address: the restart fails ("Connection refused"), measured
    here with torch 2.14 (pytorch/pytorch issues 135712 and 167288). So rank 0 hosts a new
    store on a free port and publishes its address, with a nonce, in the agent's store; the
    other ranks connect to the address published there, re-reading it while it points to a
    store that is gone or is not the one with that nonce. Delete this once torchrun gives
    each worker group a fresh store (or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the
    agents, which does that today).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        nonce = uuid.uuid4().hex
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set("nonce", nonce)
        agent.set(GROUP_STORE_KEY, f"{own.port} {nonce}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        own_port, nonce = agent.get(GROUP_STORE_KEY).decode().split()
        own = listening(host, int(own_port)) and connect_store(host, int(own_port), nonce)
        if own:
            own.set_timeout(timeout)
            return own
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rank {rank} found no store of its worker group's rank 0 in torchrun's "
                                      f"agent store at {host}:{port} within {timeout.total_seconds():.0f} s")
        time.sleep(0.05)


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port: a dead group's store is refused at
    once here, where TCPStore's client would retry it (and log each try) for its timeout."""
    try:
        socket.create_connection((host, port), timeout=GROUP_STORE_CONNECT_S).close()
        return True
    except OSError:
        return False


def connect_store(host: str, port: int, nonce: str) -> dist.Store | None:
    """A client of the store at host:port if it is the one that holds `nonce`, else None."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=GROUP_STORE_CONNECT_S))
        return store if store.check(["nonce"]) and store.get("nonce").decode() == nonce else None
    except (RuntimeError, dist.DistError):  # not a TCPStore, or gone since
        return None


@dataclass(frozen=True)
class ElasticAttempt:
    """Which attempt of a torchrun run this process belongs to (TORCHELASTIC_*). The restart
    count is each node's agent's own: a node that joins later starts at 0."""

    run_id: str
    restart_count: int
    max_restarts: int

    def __str__(self) -> str:
        return f"torchrun attempt {self.restart_count} of run {self.run_id} (--max-restarts {self.max_restarts})"


def elastic_attempt() -> ElasticAttempt | None:
    """This process's torchrun attempt; None outside torchrun's agent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return ElasticAttempt(os.environ["TORCHELASTIC_RUN_ID"], int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                          int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)))


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
