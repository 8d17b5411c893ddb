"""preemption.StepGate on two real gloo ranks: GO once both hold a step's batches, HALT for
both when one gives way first, and a peer that never counts in ends the wait at the store's
timeout as one error the training script reports as lost contact, with nothing from c10d
on stderr (a blocking store `get` past its timeout printed a socket warning of its own)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, free_port

pytestmark = pytest.mark.slow  # processes of its own

TIMEOUT_S = 3
RANK_PROGRAM = f"""
import datetime, sys, time
sys.path.insert(0, {str(REPO)!r})
import torch.distributed as dist
import preemption

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={TIMEOUT_S}))
rank = dist.get_rank()
gate = preemption.StepGate(7, 2, rank)
print("step 0", gate.ready(0), flush=True)
if rank == 1:
    print("step 1 gives way", gate.gives_way(1, preemption.STOP), flush=True)
dist.barrier()
if rank == 0:
    print("step 1 seen by a rank without a wish", gate.gives_way(1, 0), flush=True)
    print("step 1", gate.ready(1), flush=True)
    start = time.monotonic()
    try:
        gate.ready(2)
    except Exception as e:
        print("step 2", round(time.monotonic() - start, 1), preemption.describe_comm_failure(e), flush=True)
else:
    time.sleep({TIMEOUT_S} + 3)  # never counts in for step 2; leaves once rank 0 is done
"""


def test_the_gate_lets_both_through_halts_both_and_times_out_in_one_error(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_PROGRAM)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [proc.communicate(timeout=120) for proc in ranks]
    for proc, (out, err) in zip(ranks, outs):
        assert proc.returncode == 0, out + err
    (out0, err0), (out1, _) = outs
    assert out1.splitlines() == ["step 0 True", "step 1 gives way True"]
    lines = out0.splitlines()
    assert lines[:3] == ["step 0 True", "step 1 seen by a rank without a wish True", "step 1 False"], out0
    waited, why = lines[3].split(" ", 3)[2:]
    assert TIMEOUT_S <= float(waited) < TIMEOUT_S + 2, lines[3]
    assert why.startswith(f"timed out after {TIMEOUT_S} s waiting for every rank"), why
    assert err0.strip() == "", err0
