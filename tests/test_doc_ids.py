"""The packed loader's doc_ids as train.py receives them (data.open_training_data ->
data.train_batches -> lancedb's packer), on a table of known documents.

--doc-mask trusts them to cut every block exactly where the data's documents end;
the model tests build doc_ids by hand, so only these catch a packer (or a loader path)
whose doc_ids are off by one, shared by two documents, or lost on the way.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import train
from common import load_tokenizer
from conftest import docs_table
from model import make_model

TOK = load_tokenizer("byte")
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
SEQ_LEN = 32
BATCH = 4  # = num_splits: each micro-batch is one cycle, row i from split i
# Documents that end anywhere in a block, and some over two blocks long, so that
# blocks start inside a document and some hold nothing but its middle.
LENGTHS = [3, 9, 17, 30, 31, 45, 80, 110]
DOCS = 48
# float32: the packed loss and the documents-alone loss differ by ~2e-6 (losses near 5.8)
LOSS_TOL = 1e-5




@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(db, the table's documents as token tuples): random ids, every document distinct."""
    rng = np.random.default_rng(0)
    docs = [tuple(rng.integers(0, 256, int(n)).tolist()) for n in rng.choice(LENGTHS, DOCS)]
    assert len(set(docs)) == DOCS
    return docs_table(tmp_path_factory.mktemp("doc_ids") / "db", docs), set(docs)


def packed_epoch(db, num_workers=0):
    """Epoch 0's micro-batches of a one-rank `--pack --doc-mask` run, built as train.py builds them."""
    args = train.parse_args(["--db", db, "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--pack",
                             "--doc-mask", "--num-workers", str(num_workers)])
    num_splits = train.check_args(args, 1)
    assert num_splits == BATCH
    cpu = torch.device("cpu")
    training = data.open_training_data(args, TOK, 0, 1, cpu, num_splits, args.batch_size)
    batches = [batch for _, _, batch in data.train_batches(args, training, 0, 1, cpu, num_splits, 0, None)]
    assert len(batches) == training.plan.micro_steps_per_epoch > 0
    return batches


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "2-workers"])
def epoch(corpus, request):
    return packed_epoch(corpus[0], request.param)


def real_length(ids):
    """Positions before the block's padding; the packer pads only at the end of a block."""
    n = int((ids != PAD).sum())
    assert (ids[n:] == PAD).all()
    return n


def per_split(batches):
    """split -> its blocks in order, each (input_ids, doc_ids)."""
    splits = {}
    for batch in batches:
        for i, (ids, doc_ids) in enumerate(zip(batch["input_ids"], batch["doc_ids"])):
            splits.setdefault(i, []).append((ids, doc_ids))
    return splits


def test_doc_ids_change_exactly_after_each_eos(epoch):
    """Within a block's real tokens a new id starts right after each EOS and nowhere else,
    and no two segments share an id (the mask compares ids, not neighbours)."""
    boundaries = 0
    for batch in epoch:
        assert batch["doc_ids"].shape == batch["input_ids"].shape == (BATCH, SEQ_LEN)
        for ids, doc_ids in zip(batch["input_ids"], batch["doc_ids"]):
            n = real_length(ids)
            if n == 0:  # all padding: a split that ran dry
                continue
            changes = [p for p in range(1, n) if doc_ids[p] != doc_ids[p - 1]]
            assert changes == [p for p in range(1, n) if ids[p - 1] == EOS], (ids.tolist(), doc_ids.tolist())
            assert len(set(doc_ids[:n].tolist())) == len(changes) + 1, doc_ids.tolist()
            boundaries += len(changes)
    assert boundaries >= DOCS // 2


def test_a_document_carried_into_the_next_block_is_its_first_segment(corpus, epoch):
    """Following each split's blocks in order: the EOS-ended pieces are the table's documents,
    and a document the previous block ended inside fills the next block's first segment,
    up to its EOS, with an id no later segment of that block has."""
    _, documents = corpus
    seen, continued, wholly_inside = [], 0, 0
    for blocks in per_split(epoch).values():
        carried = []  # the tokens so far of the document the previous block ended inside
        for ids, doc_ids in blocks:
            n = real_length(ids)
            row = ids[:n].tolist()
            if carried:
                end = row.index(EOS) + 1 if EOS in row else n
                assert set(doc_ids[:end].tolist()) == {int(doc_ids[0])}, doc_ids.tolist()
                assert int(doc_ids[0]) not in doc_ids[end:n].tolist(), doc_ids.tolist()
                continued += end < n
                wholly_inside += EOS not in row
            for token in row:
                if token == EOS:
                    seen.append(tuple(carried))
                    carried = []
                else:
                    carried.append(token)
        assert not carried or any(doc[:len(carried)] == tuple(carried) for doc in documents)  # cut by the budget
    assert set(seen) <= documents and len(seen) == len(set(seen)) > DOCS // 2
    assert continued > 0 and wholly_inside > 0  # both kinds of continuation were met


def loss_of_documents_alone(model, input_ids):
    """Mean next-token cross-entropy of packed blocks with each document run through the
    model by itself: the blocks are cut after each EOS (from the tokens, not doc_ids), and
    position p of a piece predicts the block's token p+1, as in training; pads are no target."""
    losses = []
    for row in input_ids:
        cuts = [0] + [p + 1 for p in range(len(row) - 1) if row[p] == EOS] + [len(row)]
        for start, end in zip(cuts, cuts[1:]):
            targets = row[start + 1:end + 1]  # the block's last position has none
            logits = model.logits(row[None, start:end])[0, :len(targets)]
            real = targets != PAD
            losses.append(F.cross_entropy(logits[real].float(), targets[real], reduction="none"))
    return torch.cat(losses).mean()


def test_doc_mask_loss_equals_each_document_run_alone(corpus):
    """train.batch_loss with --doc-mask, on the loader's own blocks, is the loss of their
    documents run one by one; without the mask it is not, by far more than the tolerance."""
    torch.manual_seed(0)
    model = make_model("tiny", TOK.vocab_size, SEQ_LEN).eval()
    cpu = torch.device("cpu")
    errors, gaps = [], []
    with torch.no_grad():
        for batch in packed_epoch(corpus[0]):
            alone = loss_of_documents_alone(model, batch["input_ids"])
            masked, _ = train.batch_loss(model, batch, cpu, TOK, doc_mask=True)
            unmasked, _ = train.batch_loss(model, batch, cpu, TOK, doc_mask=False)
            errors.append(abs(masked - alone).item())
            gaps.append(abs(unmasked - alone).item())
    print(f"measured: doc-mask loss vs documents alone: max {max(errors):.1e}; "
          f"unmasked: max {max(gaps):.1e} (tolerance {LOSS_TOL:.0e})")
    assert max(errors) <= LOSS_TOL, errors
    assert max(gaps) > 100 * LOSS_TOL, "the check could not tell a missing mask apart"
