"""Multi-node, simulated on one machine: two torchrun "nodes" (one process each) meet through a
c10d rendezvous on 127.0.0.1, train and checkpoint together; resumed as one node with two
processes, every step trains on the samples of a straight two-rank run. A node whose
--ckpt-dir is not the others' fails at the first checkpoint with one clear line.
"""

import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, frames_of_ours, free_port, kill_tree, read_trace
from test_elastic import CKPT, HALF, STEPS, final_step, flags, per_step, resumed_from, train_ok

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

TIMEOUT = 150  # per run: a hang fails the test instead of blocking CI


def node_command(node_rank, port, run_id, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, str(REPO / "train.py"), *map(str, args)]


def run_two_nodes(args0, args1, *, cwd, timeout=TIMEOUT):
    """Start both "nodes" at once, each torchrun in a session of its own with its own argv;
    wait for both. Past `timeout` every process tree is killed and the test fails.
    Returns the two CompletedProcesses (node 0, node 1)."""
    port, run_id = free_port(), f"mn-{uuid.uuid4().hex[:12]}"
    # torchrun sets OMP_NUM_THREADS=1 only for more than one process per node; two "nodes"
    # sharing a small CI machine each with a full thread pool run about 10x slower.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(node_command(node, port, run_id, *args), cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for node, args in enumerate((args0, args1))]
    deadline = time.monotonic() + timeout
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc.pid)
        logs = [show(finished) for finished in done]
        for proc in procs[len(done):]:
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                out, err = "", "(output lost: the pipes stayed open after the kill)"
            logs.append(show(subprocess.CompletedProcess(proc.args, proc.returncode, out, err)))
        pytest.fail(f"two-node run did not finish within {timeout}s\n" + "\n".join(logs))
    return done


def show(proc):
    return f"$ {' '.join(proc.args)}\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def multinode_runs(demo_db, tmp_path_factory):
    """Side by side: two nodes x 1 process to step 10 (checkpoint at 10), and the reference,
    one node x 2 processes straight to step 20. Then the two-node run resumes as one node x 2."""
    root = tmp_path_factory.mktemp("multinode")
    ck, trace = root / "ck", root / "trace"
    nodes = flags(demo_db, 2, "row", "--steps", HALF, "--ckpt-every", HALF, "--ckpt-dir", ck,
                  "--trace-samples", trace)
    reference = flags(demo_db, 2, "row", "--steps", STEPS, "--ckpt-dir", root / "ck-ref",
                      "--trace-samples", root / "trace-ref")
    with ThreadPoolExecutor(2) as pool:
        two_nodes = pool.submit(run_two_nodes, nodes, nodes, cwd=root)
        ref = pool.submit(train_ok, 2, *reference, cwd=root, timeout=TIMEOUT)
        two_nodes = two_nodes.result()
        ref.result()  # train_ok: exit 0
    for node in two_nodes:
        assert node.returncode == 0, show(node)
    files = sorted(p.name for p in ck.iterdir())
    resumed = train_ok(2, *flags(demo_db, 2, "row", "--steps", STEPS, "--resume", "auto", "--ckpt-dir", ck,
                                 "--trace-samples", trace), cwd=root, timeout=TIMEOUT)
    return {"nodes": two_nodes, "files_at_half": files, "resumed": resumed, "ck": ck,
            "trace": trace, "trace_ref": root / "trace-ref"}


def test_two_nodes_train_checkpoint_and_resume_on_one_node(multinode_runs):
    runs = multinode_runs
    ranks_out = [node.stdout for node in runs["nodes"] if "final: opt_step=" in node.stdout]
    assert len(ranks_out) == 1 and final_step(ranks_out[0]) == HALF  # rank 0 prints, on either node
    assert {f"step_{HALF:08d}.pt", f"step_{HALF:08d}_dsrank1.pt"} <= set(runs["files_at_half"]), \
        runs["files_at_half"]
    assert resumed_from(runs["resumed"].stdout) == str(runs["ck"] / f"step_{HALF:08d}.pt")
    assert final_step(runs["resumed"].stdout) == STEPS

    traces = read_trace(runs["trace"])
    assert {rank: [r["step"] for r in records] for rank, records in traces.items()} == \
        {0: list(range(1, STEPS + 1)), 1: list(range(1, STEPS + 1))}
    got, want = per_step(traces), per_step(read_trace(runs["trace_ref"]))
    assert sorted(want) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], f"step {step}: two nodes (then one) differ from one node"


def test_a_ckpt_dir_not_shared_by_every_node_fails_at_the_first_checkpoint(demo_db, tmp_path):
    """Each node gets its own --ckpt-dir, as two hosts with local disks would see one path."""
    common = ["--steps", 2, "--ckpt-every", 2, "--trace-samples", tmp_path / "trace"]
    nodes = run_two_nodes(flags(demo_db, 2, "row", *common, "--ckpt-dir", tmp_path / "ck-node0"),
                          flags(demo_db, 2, "row", *common, "--ckpt-dir", tmp_path / "ck-node1"),
                          cwd=tmp_path)
    for node in nodes:
        assert node.returncode != 0, show(node)
        errors = [line for line in node.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "is not shared by all ranks" in errors[0], show(node)
        assert "step_00000002_dsrank1.pt" in errors[0] and "NFS" in errors[0], errors
        assert not frames_of_ours(node.stderr), show(node)
    # nothing committed on either node: no rank-0 file, so --resume auto finds no checkpoint
    # (node 0's directory, which its lock created and the run left empty, is gone)
    for d in ("ck-node0", "ck-node1"):
        names = sorted(p.name for p in (tmp_path / d).iterdir()) if (tmp_path / d).exists() else []
        assert not [n for n in names if CKPT.match(n)], names
