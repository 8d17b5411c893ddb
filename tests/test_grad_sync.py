"""Ranks train one model: a 2-rank run ends with the weights of a 1-rank run of the same
global batch, and of 1 rank with twice the gradient accumulation; every rank holds the same
weights. Under real torchrun (gloo), on the row and the packed paths.

The tolerance is measured against what a missing all-reduce does: a run that saw half of
each step's batch, as one rank does when its gradients are never averaged with the other's.
"""

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import torch

from common import LEGACY_SCHEMA
from conftest import run_trains
from distributed import weights_digest

pytestmark = pytest.mark.slow  # trains or ingests in processes of its own: `-m "not slow"` leaves it out

STEPS = 6
SEQ_LEN = 64
# Every document is longer than a row, so each row (and each packed block) holds SEQ_LEN real
# tokens: a micro-batch's mean loss then weighs every sample alike, and averaging two ranks'
# means equals one mean over both halves.
DOC_TOKENS = (SEQ_LEN + 1, 3 * SEQ_LEN)
COMMON = ["--model", "tiny", "--seq-len", SEQ_LEN, "--num-splits", 2, "--steps", STEPS, "--lr", "3e-3",
          "--warmup-steps", 1, "--log-every", STEPS, "--eval-batches", 1]
# name -> (ranks, --batch-size, --grad-accum); all but "half" take 4 samples per optimizer step
RUNS = {"2 ranks": (2, 2, 1), "1 rank": (1, 4, 1), "1 rank, accum 2": (1, 2, 2), "half": (1, 2, 1)}
# The gap between two runs is the L2 norm of their weight difference over every parameter.
# Between runs of one global batch it is float32 round-off (batch 2 vs 4 matmuls, gloo's
# sum vs accumulation) carried through 6 Adam steps: 6.6e-5 measured on the row path, a few
# elements that Adam's m/sqrt(v) amplifies where a gradient is near 0. To a run without
# the all-reduce it is about 6.
SAME = 1e-3


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """72 documents of random byte ids (every id seen), 64 for training and 8 for validation."""
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 256, rng.integers(*DOC_TOKENS)).tolist() for _ in range(72)]
    table = pa.table({
        "id": pa.array(range(72), pa.int64()), "text": [""] * 72,
        "input_ids": pa.array(docs, pa.list_(pa.int32())), "n_tokens": pa.array(map(len, docs), pa.int32()),
        "score": pa.array([2.0] * 72, pa.float32()), "is_dup": [False] * 72,
        "split": ["train"] * 64 + ["val"] * 8}, schema=LEGACY_SCHEMA)
    path = tmp_path_factory.mktemp("sync") / "db"
    lancedb.connect(str(path)).create_table("corpus", table)
    return str(path)


def final_weights(db, root, path):
    """name -> the step-STEPS checkpoint of each run in RUNS, all run side by side."""
    jobs = []
    for name, (ranks, batch, accum) in RUNS.items():
        ck = root / name.replace(" ", "_").replace(",", "")
        jobs.append((ranks, ["--db", db, *COMMON, "--batch-size", batch, "--grad-accum", accum,
                             "--ckpt-dir", ck, *(["--pack"] if path == "pack" else [])]))
    procs = run_trains(jobs, cwd=root)
    for proc in procs:
        assert proc.returncode == 0 and f"final: opt_step={STEPS} " in proc.stdout, proc.stdout + proc.stderr
    return {name: torch.load(args[args.index("--ckpt-dir") + 1] / f"step_{STEPS:08d}.pt", weights_only=True)
            for name, (_, args) in zip(RUNS, jobs)}


def gap(a: dict, b: dict) -> float:
    """L2 norm of the weight difference (lm_head is tied to wte: counted once)."""
    assert a.keys() == b.keys() and a
    return torch.cat([(a[k].double() - b[k].double()).flatten() for k in a if k != "lm_head.weight"]).norm().item()


@pytest.mark.parametrize("path", ["row", "pack"])
def test_ranks_train_one_model(db, tmp_path, path):
    ckpts = final_weights(db, tmp_path, path)
    two = ckpts["2 ranks"]
    gaps = {name: gap(two["model"], ckpts[name]["model"]) for name in RUNS if name != "2 ranks"}
    assert gaps["1 rank"] <= SAME and gaps["1 rank, accum 2"] <= SAME, gaps
    # what a missing all-reduce does is orders of magnitude above the tolerance and the gaps
    assert gaps["half"] > 1000 * SAME and gaps["half"] > 10_000 * max(gaps["1 rank"], gaps["1 rank, accum 2"]), gaps
    # the runs trained: the weights moved well past the tolerance from where they started
    torch.manual_seed(1234)
    from model import make_model

    start = make_model("tiny", 258, SEQ_LEN).state_dict()
    assert gap(start, two["model"]) > 1000 * SAME, "the runs barely trained"

    # Rank 1's weights: each rank's digest, gathered when the checkpoint was saved, equal
    # rank 0's, and rank 0's is that of the weights the checkpoint holds.
    digests = torch.tensor(two["replica_digests"], dtype=torch.float64)
    assert digests.shape[0] == 2 and torch.equal(digests[1], digests[0])
    torch.testing.assert_close(digests[0], weights_digest(two["model"].values()), rtol=1e-12, atol=0)
    assert len(ckpts["1 rank"]["replica_digests"]) == 1
