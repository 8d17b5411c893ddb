"""The CUDA-only paths, verified the first time a GPU is at hand.

Nothing here can run on a CPU: bf16 autocast on CUDA, FlexAttention's backward (which
`--pack --doc-mask` trains with: "FlexAttention does not support backward on CPU"), the
fused AdamW, `--compile` with inductor's CUDA kernels, bit-exact resume on CUDA. Skipped
with a reason where CUDA is absent; `python bench/gpu_check.py` runs this file first, in a
time limit of 150 s: every train.py run here starts at once (the `runs` fixture) and the
in-process checks share what does not depend on the path they check (`doc_mask_truths`).

Tolerances of the document-mask checks. Every path is compared with one truth: the
float32 eager model through the explicit SDPA mask (`document_mask(..., flex=False)`, the
path the CPU tests prove equal to running each document alone). The discrepancy of a
path is the largest relative L2 error over the loss and every parameter's gradient.
- float32 paths (FlexAttention eager and compiled, each document alone): within
  FP32_TOL = 2e-3. They differ from the truth only in summation order (and TF32 where a
  kernel uses it: 10 mantissa bits, about 5e-4 per product), far below what a mask error
  does.
- bf16 autocast paths: bf16 keeps 8 mantissa bits (relative rounding 2^-9, about 2e-3 per
  op), so a bf16 path cannot match the float32 truth closely; it must be no further
  from it than BF16_SLACK = 2x the plain SDPA-mask path under the same autocast (a
  different kernel with another blocking), plus BF16_FLOOR = 1e-2.
- Each check shows it can fail: the same batch without the document mask (packed rows
  read as one causal sequence, positions not restarting) must be over 3x the tolerance
  away.
Calibrated on the CPU with bf16 autocast there (the SDPA-mask and alone paths, which do
run backward on a CPU; T = 100 and 1024): float32 alone 5e-7 to 9e-7, bf16 SDPA mask
8e-3 to 1e-2, bf16 alone 9e-3 to 1e-2, so a bf16 tolerance of 2.5e-2 to 2.9e-2; the
unmasked batch 1.3, fifty times that.
"""

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import train
from conftest import run_script
from model import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these check the CUDA-only paths (bf16 autocast, "
                                       "FlexAttention's backward, fused AdamW, --compile, bit-exact resume)")

FP32_TOL = 2e-3
BF16_SLACK, BF16_FLOOR = 2.0, 1e-2
LOSS = re.compile(r"^epoch \d+ step (\d+)/\d+ \| loss ([0-9.na]+) \|", re.M)


def packed_batch(T: int, seed: int = 0):
    """Two packed rows as lancedb's packer makes them: documents of random lengths, the
    first one a continuation of the previous block, the last one cut by the block's end.
    Returns (input_ids, doc_ids, loss_mask); the mask keeps the targets inside a
    document, so the packed loss is exactly the mean of the documents' own losses."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2):
        lengths, left = [], T
        while left:
            n = min(left, int(torch.randint(1, max(2, T // 3), (1,), generator=g)))
            lengths.append(n)
            left -= n
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    doc_ids = torch.stack(rows)
    input_ids = torch.randint(0, 256, doc_ids.shape, generator=g)
    loss_mask = torch.zeros_like(doc_ids, dtype=torch.bool)
    loss_mask[:, 1:] = doc_ids[:, 1:] == doc_ids[:, :-1]
    return input_ids, doc_ids, loss_mask


def alone_loss(model, input_ids, doc_ids, loss_mask):
    """The same loss with every document run by itself (positions from 0, no mask)."""
    total, count = 0.0, 0
    for b in range(input_ids.size(0)):
        for d in doc_ids[b].unique():
            ids = input_ids[b:b + 1, doc_ids[b] == d]
            if ids.size(1) < 2:
                continue
            logits = model.logits(ids)[0, :-1].float()
            total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
            count += ids.size(1) - 1
    assert count == int(loss_mask.sum())
    return total / count


def loss_and_grads(model, compute, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        loss = compute()
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def discrepancy(path, truth) -> float:
    """The largest relative L2 error over the loss and every parameter's gradient."""
    loss, grads = path
    ref_loss, ref_grads = truth
    errors = [float((loss - ref_loss).abs() / ref_loss.abs())]
    for name, ref in ref_grads.items():
        errors.append(float((grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)))
    return max(errors)


@functools.cache
def doc_mask_truths(T: int) -> tuple:
    """The model, the packed batch and the paths both the eager and the compiled check compare
    against, computed once per T: only FlexAttention's own paths differ between the two."""
    torch.manual_seed(0)
    model = make_model("tiny", 256, T).cuda()
    ids, doc_ids, mask = (t.cuda() for t in packed_batch(T))
    truth = loss_and_grads(model, lambda: model(ids, mask, doc_ids, flex=False), bf16=False)
    fp32_alone = loss_and_grads(model, lambda: alone_loss(model, ids, doc_ids, mask), bf16=False)
    bf16 = {
        "sdpa": loss_and_grads(model, lambda: model(ids, mask, doc_ids, flex=False), bf16=True),
        "alone": loss_and_grads(model, lambda: alone_loss(model, ids, doc_ids, mask), bf16=True),
    }
    unmasked = loss_and_grads(model, lambda: model(ids, mask), bf16=False)
    return model, (ids, doc_ids, mask), truth, fp32_alone, bf16, unmasked


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("T", [100, 1024])
def test_doc_mask_flex_attention_matches_the_sdpa_mask_and_documents_alone(T, compiled):
    model, (ids, doc_ids, mask), truth, fp32_alone, bf16_shared, unmasked = doc_mask_truths(T)
    run = torch.compile(model) if compiled else model

    fp32 = {"flex": loss_and_grads(model, lambda: run(ids, mask, doc_ids, flex=True), bf16=False),
            "alone": fp32_alone}
    bf16 = {"sdpa": bf16_shared["sdpa"],
            "flex": loss_and_grads(model, lambda: run(ids, mask, doc_ids, flex=True), bf16=True),
            "alone": bf16_shared["alone"]}

    errors = {f"fp32 {k}": discrepancy(v, truth) for k, v in fp32.items()}
    errors.update({f"bf16 {k}": discrepancy(v, truth) for k, v in bf16.items()})
    bf16_tol = BF16_SLACK * errors["bf16 sdpa"] + BF16_FLOOR
    print(f"measured: doc-mask T={T} {'compiled' if compiled else 'eager'}: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (bf16 tolerance {bf16_tol:.1e})")
    assert errors["fp32 flex"] <= FP32_TOL and errors["fp32 alone"] <= FP32_TOL, errors
    assert errors["bf16 flex"] <= bf16_tol and errors["bf16 alone"] <= bf16_tol, errors
    assert discrepancy(unmasked, truth) > 3 * bf16_tol, "the check could not tell a missing mask apart"


def test_fused_adamw_is_used_and_steps():
    model = make_model("tiny", 256, 64).cuda()
    opt = train.make_optimizer(model, train.parse_args([]), torch.device("cuda"))
    assert opt.defaults.get("fused") is True
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(ids, torch.ones_like(ids, dtype=torch.bool)).backward()
    opt.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert sum(not torch.equal(a, b) for a, b in zip(before, after)) == len(before)


RESUME_PATHS = {"rows": [], "pack-doc-mask": ["--pack", "--doc-mask"]}


def compiled_doc_mask_run(db, cwd):
    return run_script("train.py", "--db", db, "--model", "tiny", "--pack", "--doc-mask", "--compile",
                      "--seq-len", "256", "--batch-size", "8", "--steps", "40", "--log-every", "5",
                      "--warmup-steps", "5", "--ckpt-every", "10", "--eval-every", "20", "--eval-batches", "2",
                      "--ckpt-dir", cwd / "ck", cwd=cwd, env={"TORCH_LOGS": "recompiles"})


def resume_run(db, cwd, path: str, deterministic: bool, split: bool):
    """The straight 8-step run (`split` False), or the run cut at step 4 and resumed to step 8;
    returns the checkpoint directory that holds step 8."""
    common = ["--db", db, "--model", "tiny", "--seq-len", "128", "--batch-size", "4", "--grad-accum", "2",
              "--warmup-steps", "2", "--lr-total-steps", "8", "--log-every", "2", "--eval-batches", "1",
              *RESUME_PATHS[path], *(["--deterministic"] if deterministic else [])]
    ck = cwd / f"{path}-{'split' if split else 'straight'}-{deterministic}"
    legs = [["--steps", "4", "--ckpt-every", "4"], ["--steps", "8", "--resume", "auto"]] if split \
        else [["--steps", "8"]]
    for leg in legs:
        proc = run_script("train.py", *common, "--ckpt-dir", ck, *leg, cwd=cwd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return ck


@pytest.fixture(scope="module", autouse=True)
def runs(demo_db, tmp_path_factory):
    """Every train.py run of this file, started together before the first check, each chain
    on a thread of its own: the tiny runs share the GPU, and the in-process checks run
    meanwhile. Sequential, their start-ups and compiles were most of this file's time. Running
    side by side changes no bit of a --deterministic run (no kernel reads another process)."""
    cwd = tmp_path_factory.mktemp("cuda_runs")
    chains = {"compiled": (compiled_doc_mask_run, demo_db, cwd)}
    chains.update({(path, deterministic, split): (resume_run, demo_db, cwd, path, deterministic, split)
                   for path in RESUME_PATHS for deterministic in (True, False) for split in (False, True)})
    with ThreadPoolExecutor(max_workers=len(chains)) as pool:
        yield {key: pool.submit(*chain) for key, chain in chains.items()}


def test_compiled_doc_mask_run_learns_without_recompiling(runs):
    """--compile --pack --doc-mask, the path that trains through FlexAttention's backward:
    the loss is finite and falls, and after the first step nothing compiles again (not
    the checkpoint's probe, not the evals: they run on the uncompiled module)."""
    proc = runs["compiled"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(loss) for _, loss in LOSS.findall(proc.stdout)]
    assert len(losses) == 8 and torch.isfinite(torch.tensor(losses)).all(), proc.stdout
    assert losses[-1] < losses[0], losses
    recompiles = [line for line in proc.stderr.splitlines() if "Recompiling" in line]
    assert not recompiles, "\n".join(recompiles)


@pytest.mark.parametrize("path", list(RESUME_PATHS))
def test_resume_on_one_gpu_repeats_the_uninterrupted_run(runs, path):
    """With --deterministic a run cut at step 4 and resumed ends with the uninterrupted run's
    weights, bit for bit. Without it the difference is measured and printed (not asserted)."""

    def weights_gap(deterministic):
        straight, split = (runs[path, deterministic, cut].result() for cut in (False, True))
        a = torch.load(straight / "step_00000008.pt", weights_only=True)["model"]
        b = torch.load(split / "step_00000008.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and a
        return max(float((a[k].float() - b[k].float()).abs().max()) for k in a), \
            all(torch.equal(a[k], b[k]) for k in a)

    gap, bitwise = weights_gap(deterministic=True)
    loose_gap, loose_bitwise = weights_gap(deterministic=False)
    print("measured: " + json.dumps({"resume": path, "deterministic_max_abs_diff": gap,
                                     "deterministic_bitwise": bitwise, "default_max_abs_diff": loose_gap,
                                     "default_bitwise": loose_bitwise}))
    assert bitwise, f"--deterministic resume differs from the straight run by up to {gap:.3e}"


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loop_receives_pinned_batches(demo_db, workers):
    """Every batch the training loop takes is pinned, also when it was re-formed from the
    workers' batches: a copy from pageable memory syncs the stream before it starts, and
    the GPU then idles between steps (what slowed the H200's step with --num-workers)."""
    import data
    from common import load_tokenizer

    args = train.parse_args(["--db", demo_db, "--pack", "--seq-len", "64", "--batch-size", "4",
                             "--num-workers", str(workers)])
    num_splits = train.check_args(args, 1)
    device = torch.device("cuda", 0)
    tok = load_tokenizer("byte")
    source = data.open_training_data(args, tok, 0, 1, device, num_splits, args.batch_size)
    batches = data.prefetched(data.train_batches(args, source, 0, 1, device, num_splits, 0, None), device)
    try:
        for _, (_, _, batch) in zip(range(3), batches):
            assert all(value.is_pinned() for value in batch.values()), {k: v.is_pinned() for k, v in batch.items()}
    finally:
        batches.close()
