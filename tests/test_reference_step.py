"""The optimizer step held to the reference: train.py's weights after 9 (rows) and 12 (packed)
optimizer steps equal those of a plain loop written here from ../shared/seed/train.py, trained on the
same batches, on the row and the packed paths.

The other tests compare the project's runs with each other (resume with straight, 2 ranks
with 1, workers with none), so a change every run shares is invisible to them: a clip of
1e12, no warmup, another weight decay, a loss not divided by --grad-accum. Nothing here
imports the project's step (train.batch_loss, lr_at, make_optimizer, train_loop): the loop
below computes the loss from the model's logits, its learning rate, clip and AdamW itself.
It takes the model (model.make_model) and the batches (data.train_batches, the loader) from
the project, and checks that they are the batches train.py trained on (--trace-samples).

The settings make every piece of the step count: the gradient norm is above 1.0 at some
steps and below it at others (so the clip clips, and dividing by --grad-accum changes which
steps it clips), warmup is 3 of the 9 or 12 steps, rows and blocks hold pads. Each piece removed from the plain
loop moves the weights by over 100 times the tolerance (`test_each_piece_of_the_step_counts`,
on the row path; measured on the packed one: 0.31 to 16).

Where the project departs from the reference on purpose (README "Differences from the
reference"), the loop follows the project, each departure named where it is:
- accumulation across epochs: one micro-step counter for the run, so every step sums exactly
  --grad-accum micro-batches (the reference resets it at each epoch, and a step after an
  epoch boundary sums the previous epoch's leftover micro-batch too). On the row path an
  epoch holds 3 micro-batches, so steps straddle epochs;
- the cosine horizon: the micro-batches of all epochs // --grad-accum, the steps actually
  run (the reference's is steps/epoch x epochs: on the row path 6 instead of 9, after which
  its learning rate would stay 0).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import train
from common import block_hashes, load_tokenizer
from conftest import docs_table, read_trace
from model import make_model


TOK = load_tokenizer("byte")
PAD = TOK.pad_token_id
SEQ_LEN = 64
BATCH = 4  # = num_splits
GRAD_ACCUM = 2
DOCS = 12  # rows: 3 micro-batches an epoch, so steps straddle epochs (packed: 4)
EPOCHS = 6
LR = 1e-2
WARMUP = 3
SEED = 1234  # train.py's, before make_model
MIN_STEPS = 8
# The gap between two runs' weights is the L2 norm of their difference over every parameter.
# train.py and the plain loop end bit for bit equal today (gap 0.0 on both paths). Float32
# noise carried through Adam is larger than the last bit: the same loop with its
# cross-entropy computed in float64 ends 2.8e-4 (rows) and 3.7e-4 (packed) away, most of it
# in the attention key biases, whose gradient is 0 but for round-off and which Adam's
# normalised step amplifies. The tolerance sits above that noise; each piece of the step
# removed is over 100 times further (the smallest, weight decay on the row path: 0.22).
TOLERANCE = 1e-3
FAR = 100 * TOLERANCE


@dataclasses.dataclass(frozen=True)
class Step:
    """The reference's optimizer step, piece by piece; each piece can be taken out."""

    clip: float | None = 1.0
    warmup: bool = True
    cosine: bool = True
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.1
    divide_by_grad_accum: bool = True
    mask_pads: bool = True


REFERENCE = Step()
WITHOUT = {
    "clip": Step(clip=None),
    "warmup": Step(warmup=False),
    "cosine": Step(cosine=False),
    "betas": Step(betas=(0.9, 0.999)),  # AdamW's defaults
    "weight decay": Step(weight_decay=0.0),
    "grad-accum division": Step(divide_by_grad_accum=False),
    "pad mask": Step(mask_pads=False),
}


def reference_lr(step: int, total: int, s: Step) -> float:
    """Linear warmup from LR/WARMUP to LR over WARMUP steps, then cosine to 0 at `total`."""
    warmup = WARMUP if s.warmup else 0
    if step < warmup:
        return LR * (step + 1) / warmup
    if not s.cosine:
        return LR
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return LR * 0.5 * (1 + math.cos(math.pi * progress))


def reference_loss(model, input_ids: torch.Tensor, s: Step) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets that are real tokens (pads left out)."""
    logits = model.logits(input_ids)[:, :-1]  # (B, T-1, V)
    targets = input_ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=PAD if s.mask_pads else -100)


def train_plainly(batches: list[torch.Tensor], s: Step, device=torch.device("cpu")):
    """The reference's loop over `batches` (input_ids, in order); returns the final weights
    and each step's gradient norm before the clip."""
    torch.manual_seed(SEED)
    model = make_model("tiny", TOK.vocab_size, SEQ_LEN).to(device)
    kwargs = dict(lr=LR, betas=s.betas, weight_decay=s.weight_decay)
    try:  # the reference: fused on CUDA, the plain AdamW where fused is refused
        opt = torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **kwargs)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), **kwargs)
    steps = len(batches) // GRAD_ACCUM  # departure: the horizon is the steps actually run
    norms = []
    for step in range(steps):
        # departure: micro-batches counted across epochs, GRAD_ACCUM of them in every step
        for input_ids in batches[step * GRAD_ACCUM:(step + 1) * GRAD_ACCUM]:
            loss = reference_loss(model, input_ids.to(device), s)
            (loss / GRAD_ACCUM if s.divide_by_grad_accum else loss).backward()
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, steps, s)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip if s.clip else math.inf)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), norms


def gap(a: dict, b: dict) -> float:
    """L2 norm of the weight difference (lm_head is tied to wte: counted once)."""
    assert a.keys() == b.keys() and a
    return torch.cat([(a[k].double() - b[k].double()).flatten() for k in a if k != "lm_head.weight"]).norm().item()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """DOCS training documents of random byte ids, 16 to 127 tokens: rows shorter than
    SEQ_LEN are padded, longer ones cut."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, int(rng.integers(SEQ_LEN // 4, 2 * SEQ_LEN))).tolist() for _ in range(DOCS)]
    return docs_table(tmp_path_factory.mktemp("reference_step") / "db", docs)


@dataclasses.dataclass
class TrainedRun:
    path: str  # "rows" or "pack"
    weights: dict  # train.py's final checkpoint
    batches: list  # the input_ids of every micro-batch the loader yields, in order
    epochs: list  # each micro-batch's epoch
    steps: int


@pytest.fixture(scope="module", params=["rows", "pack"])
def run(db, tmp_path_factory, request):
    """train.py's run, and the batches it trained on, read through its loader."""
    root = tmp_path_factory.mktemp(f"reference_{request.param}")
    argv = [str(a) for a in (
        "--db", db, "--model", "tiny", "--seq-len", SEQ_LEN, "--batch-size", BATCH, "--grad-accum", GRAD_ACCUM,
        "--epochs", EPOCHS, "--lr", LR, "--warmup-steps", WARMUP, "--log-every", 1000, "--ckpt-every", 1000,
        "--ckpt-dir", root / "ck", "--trace-samples", root / "trace",
        *(["--pack"] if request.param == "pack" else []))]
    train.main(argv)
    trace = read_trace(root / "trace")[0]
    steps = len(trace)
    assert steps >= MIN_STEPS and [r["step"] for r in trace] == list(range(1, steps + 1))
    weights = torch.load(root / "ck" / f"step_{steps:08d}.pt", weights_only=True)["model"]

    args = train.parse_args(argv)
    num_splits = train.check_args(args, 1)
    cpu = torch.device("cpu")
    training = data.open_training_data(args, TOK, 0, 1, cpu, num_splits, args.batch_size)
    epochs, batches = zip(*[(epoch, batch["input_ids"])
                            for epoch, _, batch in data.train_batches(args, training, 0, 1, cpu, num_splits, 0, None)])
    assert len(batches) // GRAD_ACCUM == steps
    trained_on = [name for record in trace for name in record["samples"]]
    assert trained_on == [name for b in batches[:steps * GRAD_ACCUM] for name in block_hashes(b.numpy())], \
        "the loader's batches are not those train.py trained on"
    return TrainedRun(request.param, weights, list(batches), list(epochs), steps)


@pytest.fixture(scope="module")
def reference(run):
    return train_plainly(run.batches, REFERENCE)


def test_train_py_ends_with_the_reference_loops_weights(run, reference):
    weights, _ = reference
    assert (apart := gap(weights, run.weights)) <= TOLERANCE, f"train.py ends {apart:.3g} from the reference loop"


def test_the_run_exercises_every_piece_of_the_step(run, reference):
    """The clip clips at some steps and not at others, warmup is shorter than the run,
    steps straddle epochs, and there are pads to mask: otherwise a piece could be wrong
    and the weights still agree."""
    _, norms = reference
    assert any(n > 1.0 for n in norms) and any(n < 1.0 for n in norms), norms
    assert WARMUP < run.steps
    assert len(set(run.epochs)) == EPOCHS
    if run.path == "rows":  # a step sums micro-batches of two epochs
        assert any(run.epochs[i] != run.epochs[i + 1] for i in range(0, len(run.epochs) - 1, GRAD_ACCUM))
    assert sum(int((b == PAD).sum()) for b in run.batches) > 0


@pytest.mark.parametrize("run", ["rows"], indirect=True)  # the packed path's gaps are larger but for one
@pytest.mark.parametrize("piece", WITHOUT)
def test_each_piece_of_the_step_counts(run, piece):
    """The plain loop without `piece` ends far from train.py: the comparison sees it."""
    weights, _ = train_plainly(run.batches, WITHOUT[piece])
    assert (apart := gap(weights, run.weights)) > FAR, f"without the {piece}, the weights move only {apart:.3g}"
