"""What training reads is what the SQL prefilter promises, checked on the batches themselves:
no duplicate (`is_dup`), no validation row and no row under --min-score reaches a training
batch, and evaluation reads validation rows only. On rows, --pack, and --pack with loader
workers, in a real run of train.py (train.run, in-process).

Every document of the table is one token repeated, a token no other document uses, so any
piece of a batch (a padded row, or a packed block's segments between EOS tokens) names its
document, and so its category, whatever the packer cut. Each batch train.py computes a loss
on is recorded on its way into `train.batch_loss` (the real function still runs), as a
training batch or, with the model in eval mode, an evaluation batch. Reading the SQL string
back would not catch a filter that is well formed but wrong.
"""

import pytest
import torch

import train
from common import load_tokenizer
from conftest import docs_table


TOK = load_tokenizer("byte")
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
SEQ_LEN = 16
MIN_SCORE = 1.5  # above the default 1.0, so a filter that drops the flag lets the "low" rows in
# category -> (number of documents, split, is_dup, score)
CATEGORIES = {
    "train": (16, "train", False, 2.0),
    "train dup": (8, "train", True, 2.0),
    "train low": (8, "train", False, 1.2),
    "val": (8, "val", False, 2.0),
    "val dup": (4, "val", True, 2.0),
    "val low": (4, "val", False, 1.2),
}
LENGTHS = (5, 9, 14, 23, 31, 40)  # shorter and longer than a row; packed over block boundaries


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(db, token -> category): document i is token i repeated."""
    rows, category_of = [], {}
    for category, (count, split, is_dup, score) in CATEGORIES.items():
        for _ in range(count):
            token = len(rows)
            category_of[token] = category
            rows.append(([token] * LENGTHS[token % len(LENGTHS)], split, is_dup, score))
    docs, splits, dups, scores = zip(*rows)
    db = docs_table(tmp_path_factory.mktemp("train_filter") / "db", docs, scores=list(scores), dups=dups,
                    splits=splits)
    return db, category_of


def documents(input_ids: torch.Tensor) -> list[int]:
    """The documents in a batch: each row's pieces between EOS tokens, pads dropped, each
    piece one repeated token (the document's)."""
    found = []
    for row in input_ids.tolist():
        piece = []
        for token in [*row, EOS]:
            if token == EOS:
                if piece:
                    assert len(set(piece)) == 1, f"a piece mixes documents: {row}"
                    found.append(piece[0])
                piece = []
            elif token != PAD:
                piece.append(token)
    return found


@pytest.fixture(scope="module", params=["rows", "pack", "pack-2-workers"])
def reads(corpus, tmp_path_factory, request):
    """(category -> count of its documents' pieces in training batches, the same for evaluation)."""
    db, category_of = corpus
    root = tmp_path_factory.mktemp(f"filter_{request.param}")
    flags = {"rows": [], "pack": ["--pack"], "pack-2-workers": ["--pack", "--num-workers", 2]}[request.param]
    args = train.parse_args([str(a) for a in (
        "--db", db, "--model", "tiny", "--seq-len", SEQ_LEN, "--batch-size", 4, "--min-score", MIN_SCORE,
        "--eval-batches", 100, "--log-every", 1000, "--ckpt-every", 1000, "--ckpt-dir", root / "ck", *flags)])
    seen = {True: [], False: []}  # model.training -> documents
    real_batch_loss = train.batch_loss

    def recorded_batch_loss(model, batch, *rest, **kwargs):
        seen[model.training].extend(documents(batch["input_ids"]))
        return real_batch_loss(model, batch, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "batch_loss", recorded_batch_loss)
        assert train.run(args, None) == 0
    count = lambda docs: {c: sum(category_of[d] == c for d in docs) for c in CATEGORIES}  # noqa: E731
    return count(seen[True]), count(seen[False]), set(seen[True]), set(seen[False]), category_of


def test_training_batches_hold_only_training_rows_that_pass_the_filter(reads):
    trained, _, docs, _, category_of = reads
    assert {c: n for c, n in trained.items() if c != "train" and n} == {}, trained
    # the filter's rows do reach training: most of the allowed documents are there
    allowed = {d for d, c in category_of.items() if c == "train"}
    assert len(docs & allowed) >= 3 * len(allowed) // 4, sorted(docs)


def test_evaluation_reads_validation_rows_only(reads):
    _, evaluated, _, docs, category_of = reads
    assert {c: n for c, n in evaluated.items() if c != "val" and n} == {}, evaluated
    assert docs == {d for d, c in category_of.items() if c == "val"}  # every one, with --eval-batches 100
