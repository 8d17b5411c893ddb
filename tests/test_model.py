"""Tests for model.py: sizes, vocab padding, weight tying, the masked loss, and that tiny learns."""

import pytest
import torch
import torch.nn.functional as F

from model import MODEL_SIZES, GPTConfig, document_mask, make_model, segment_positions

GPT2_VOCAB = 50257

# Parameter counts of the released GPT-2 checkpoints (Hugging Face, vocab 50257, 1024
# positions), counting the tied wte/lm_head matrix once and including wpe. These are the
# "124M/355M/774M/1558M" of the model names, i.e. num_params(non_embedding=False).
GPT2_PARAMS = {
    "small": 124_439_808,
    "medium": 354_823_168,
    "large": 774_030_080,
    "xl": 1_557_611_200,
}
GPT2_NOMINAL = {"small": 124e6, "medium": 355e6, "large": 774e6, "xl": 1558e6}


def tiny_model(vocab_size=256, seq_len=64, seed=0):
    """A tiny model with a small vocabulary so tests stay fast on a CPU."""
    torch.manual_seed(seed)
    return make_model("tiny", vocab_size, seq_len)


@pytest.mark.parametrize("name", ["small", "medium", "large", "xl"])
def test_gpt2_sizes_match_published_counts(name):
    with torch.device("meta"):  # shapes only, no memory or init cost
        model = make_model(name, GPT2_VOCAB, 1024)
    n_layer, n_head, d_model = MODEL_SIZES[name]
    assert (model.cfg.n_layer, model.cfg.n_head, model.cfg.d_model) == (n_layer, n_head, d_model)
    total = model.num_params(non_embedding=False)
    # padding 50257 -> 50304 adds exactly 47 embedding rows; otherwise this is GPT-2
    assert total - 47 * d_model == GPT2_PARAMS[name]
    assert abs(total - GPT2_NOMINAL[name]) / GPT2_NOMINAL[name] < 0.02
    assert model.num_params() == total - 1024 * d_model


def test_vocab_padded_to_multiple_of_64():
    for vocab, padded in [(GPT2_VOCAB, 50304), (256, 256), (1, 64), (65, 128)]:
        with torch.device("meta"):
            model = make_model("tiny", vocab, 32)
        assert model.cfg.vocab_size == padded
        assert model.transformer.wte.weight.shape == (padded, 128)
        assert model.lm_head.weight.shape == (padded, 128)


def test_config_fields():
    model = tiny_model(vocab_size=100, seq_len=48)
    assert model.cfg == GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=48, vocab_size=128)


def test_weight_tying_shares_storage():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # tied weights are counted once
    assert model.num_params(non_embedding=False) == sum(
        p.numel() for p in {id(p): p for p in model.parameters()}.values()
    )


def test_gpt2_init():
    model = make_model("tiny", 256, 64)
    for name, p in model.named_parameters():
        if name.endswith(".bias") and "ln_" not in name:
            assert torch.all(p == 0), name
    std_proj = 0.02 / (2 * model.cfg.n_layer) ** 0.5
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert abs(proj.std().item() - std_proj) < 0.1 * std_proj
    assert abs(fc.std().item() - 0.02) < 0.002


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="tiny"):
        make_model("gigantic", 256, 64)


def test_overlong_input_raises():
    model = tiny_model(seq_len=16)
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len"):
        model(ids, torch.ones_like(ids, dtype=torch.bool))


def test_loss_matches_hand_computed_masked_cross_entropy():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 20), generator=g)
    mask = torch.rand(3, 20, generator=g) > 0.3
    with torch.no_grad():
        loss = model(ids, mask)
        logp = F.log_softmax(model.logits(ids).float(), dim=-1)  # (B, T, V)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    m = mask[:, 1:]
    expected = nll[m].sum() / m.sum()
    torch.testing.assert_close(loss, expected)
    assert model.logits(ids).shape == (3, 20, 256)


def test_masked_targets_do_not_change_loss():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 15:] = False  # trailing padding in row 0
    mask[1, 20:] = False  # trailing padding in row 1
    changed = ids.clone()
    changed[0, 15:] = torch.randint(0, 256, (9,), generator=g)
    changed[1, 20:] = torch.randint(0, 256, (4,), generator=g)
    assert not torch.equal(ids, changed)
    with torch.no_grad():
        a = model(ids, mask)
        b = model(changed, mask)
    # causal attention keeps the earlier logits fixed; any leak would move the loss by ~1e-2
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_all_masked_gives_zero_loss_with_working_backward():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 10))
    loss = model(ids, torch.zeros_like(ids, dtype=torch.bool))
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    grad = model.transformer.wte.weight.grad
    assert grad is not None and torch.all(grad == 0)


def test_tiny_learns_a_fixed_batch():
    model = tiny_model(seq_len=32)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (4, 32), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert losses[-1] < 0.7 * losses[0]


# ── Document masking (--doc-mask) ────────────────────────────────────────────────────

def packed_doc_ids(lengths, T):
    """doc_ids as lancedb's packer makes them: segment k spans lengths[k] positions,
    and a padded tail continues the last segment."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.cat([ids, ids[-1].repeat(T - len(ids))])


@pytest.mark.parametrize("layouts", [
    [[64], [1, 63]],                          # one document; a 1-token segment first
    [[10, 15, 39], [5, 5, 5, 5, 44]],         # several segments per row
    [[30, 2, 1, 20], [63]],                   # short segments, then a padded tail
])
def test_packed_row_gives_the_logits_of_its_segments_run_alone(layouts):
    """The property --doc-mask promises: packing changes nothing a document can see."""
    T = 64
    model = tiny_model(seq_len=T).eval()
    torch.manual_seed(1)
    input_ids = torch.randint(0, 256, (len(layouts), T))
    doc_ids = torch.stack([packed_doc_ids(lengths, T) for lengths in layouts])
    with torch.no_grad():
        packed = model.logits(input_ids, doc_ids)
        for b, lengths in enumerate(layouts):
            start = 0
            for length in lengths:
                alone = model.logits(input_ids[b:b + 1, start:start + length])[0]
                torch.testing.assert_close(packed[b, start:start + length], alone, rtol=1e-5, atol=1e-5)
                start += length


def test_without_doc_ids_the_model_is_the_plain_causal_one():
    """doc_ids=None takes the reference's path (causal SDPA, positions 0..T-1); a single
    segment spanning the row computes the same logits, and loss, through the explicit mask
    and segment positions."""
    model = tiny_model().eval()
    input_ids = torch.randint(0, 256, (2, 64))
    one_segment = torch.zeros_like(input_ids)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(input_ids, one_segment), model.logits(input_ids),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(input_ids, mask, one_segment), model(input_ids, mask),
                                   rtol=1e-5, atol=1e-5)


def test_segment_positions_restart_at_each_document():
    doc_ids = torch.stack([packed_doc_ids([3, 2, 3], 8), packed_doc_ids([8], 8)])
    assert segment_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_allows_what_the_sdpa_mask_allows():
    """The CUDA path's FlexAttention BlockMask and the CPU path's boolean mask agree
    (FlexAttention run eagerly on the CPU here)."""
    from torch.nn.attention.flex_attention import flex_attention

    T = 128
    doc_ids = torch.stack([packed_doc_ids([40, 1, 50, 37], T), packed_doc_ids([128], T)])
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 2, 4, T, 16).unbind(0)
    flex = flex_attention(q, k, v, block_mask=document_mask(doc_ids, flex=True))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids, flex=False))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_doc_ids_of_another_shape_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="doc_ids shape"):
        model.logits(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
