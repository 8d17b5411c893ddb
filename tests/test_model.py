"""Tests for model.py: sizes, vocab padding, weight tying, the masked loss, and that tiny learns."""

import pytest
import torch
import torch.nn.functional as F

from model import MODEL_SIZES, GPTConfig, make_model

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
