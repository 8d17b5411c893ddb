"""
A GPT-2 style language model and the table of sizes we train.

Kept close to nanoGPT's model.py (and GPT-2's parameter names) so that it is easy
to read and easy to compare against the reference. There is no dropout: training
must be deterministic so that a resumed run matches an uninterrupted one bit for bit
(on CUDA with train.py --deterministic; see README 'GPU check').
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

# name -> (n_layer, n_head, d_model); small..xl are the GPT-2 124M/350M/774M/1558M shapes
MODEL_SIZES = {
    "tiny": (4, 4, 128),
    "small": (12, 12, 768),
    "medium": (24, 16, 1024),
    "large": (36, 20, 1280),
    "xl": (48, 25, 1600),
}

VOCAB_MULTIPLE = 64


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int  # padded up to a multiple of VOCAB_MULTIPLE


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position only sees itself and the past."""

    def __init__(self, cfg):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = cfg.n_head
        self.d_model = cfg.d_model
        # query, key and value projections for all heads, in one matmul
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        # output projection back into the residual stream
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, doc_mask=None):
        """`doc_mask`: None for plain causal attention, else what `document_mask` built
        (a FlexAttention BlockMask, or a (B, 1, T, T) boolean mask for SDPA)."""
        B, T, C = x.size()  # batch, sequence length, d_model
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)  # each (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if doc_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        elif isinstance(doc_mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask)
        else:
            y = flex_attention(q, k, v, block_mask=doc_mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


def flex_attention(q, k, v, block_mask):
    """FlexAttention runs fused only when compiled: inside a torch.compile'd model the
    plain function is traced into the model's graph, in eager mode it is compiled once
    on first use (not at import: that would load the compiler into every process)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if torch.compiler.is_compiling():
        return flex(q, k, v, block_mask=block_mask)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def segment_positions(doc_ids):
    """Position ids that restart at 0 where `doc_ids` changes: (B, T) -> (B, T)."""
    T = doc_ids.size(1)
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


def document_mask(doc_ids, flex=None):
    """Causal attention within one document segment of each packed row.

    On CUDA (or `flex=True`) a FlexAttention BlockMask, which also lets the kernel skip
    the blocks no query may see; elsewhere an explicit (B, 1, T, T) boolean mask for SDPA.
    """
    B, T = doc_ids.shape
    if not (doc_ids.device.type == "cuda" if flex is None else flex):
        causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
        return (same_doc & causal)[:, None]

    from torch.nn.attention.flex_attention import create_block_mask

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(doc_causal, B, None, T, T, device=doc_ids.device)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, with GPT-2's tanh GELU."""

    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = self.c_fc(x)  # (B, T, 4C)
        x = self.gelu(x)
        return self.c_proj(x)  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: normalise, transform, add back to the residual."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, doc_mask=None):
        x = x + self.attn(self.ln_1(x), doc_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and tied input/output embeddings."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.d_model),
        ))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # weight tying saves vocab_size * d_model parameters and helps small models
        self.lm_head.weight = self.transformer.wte.weight

        self.apply(self._init_weights)
        # scale residual projections so the residual stream's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        """GPT-2 initialisation, so training starts from the same place as the reference."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count as nanoGPT reports it: tied weights once, positions excluded by default."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields tied weights once
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def logits(self, input_ids, doc_ids=None, flex=None):
        """Next-token logits for every position, (B, T) -> (B, T, vocab_size).

        `doc_ids` (B, T), the packed loader's document index per position: each
        document segment of a row then attends only within itself and its positions
        restart at 0, so a packed row gives exactly the logits of its segments run
        one by one. None: one causal sequence per row (the reference's behaviour).
        `flex` picks the mask's kind (see `document_mask`; None: FlexAttention on CUDA).
        """
        B, T = input_ids.size()
        if T > self.cfg.seq_len:
            raise ValueError(
                f"input has {T} tokens but the model's seq_len is {self.cfg.seq_len}"
            )
        if doc_ids is None:
            pos = torch.arange(T, dtype=torch.long, device=input_ids.device)  # (T,)
            doc_mask = None
        else:
            if doc_ids.shape != input_ids.shape:
                raise ValueError(
                    f"doc_ids shape {tuple(doc_ids.shape)} does not match "
                    f"input_ids shape {tuple(input_ids.shape)}"
                )
            pos = segment_positions(doc_ids)  # (B, T)
            doc_mask = document_mask(doc_ids, flex)
        tok_emb = self.transformer.wte(input_ids)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C) or (B, T, C)
        x = tok_emb + pos_emb  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, doc_mask)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)

    def forward(self, input_ids, loss_mask, doc_ids=None, flex=None):
        """Mean next-token cross-entropy over the positions whose target is a real token."""
        if loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"loss_mask shape {tuple(loss_mask.shape)} does not match "
                f"input_ids shape {tuple(input_ids.shape)}"
            )
        logits = self.logits(input_ids, doc_ids, flex)[:, :-1]  # (B, T-1, vocab_size)
        targets = input_ids[:, 1:]  # (B, T-1)
        mask = loss_mask[:, 1:].float()  # (B, T-1)
        # float32 cross-entropy even under autocast: bf16 log-softmax over a big vocab is lossy
        losses = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            reduction="none",
        ).view_as(mask)  # (B, T-1)
        # clamp keeps an all-masked batch at a zero loss that still backpropagates, not NaN
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def make_model(name, vocab_size, seq_len):
    """Build a named GPT size, padding the vocabulary to a matmul-friendly multiple of 64."""
    if name not in MODEL_SIZES:
        raise ValueError(
            f"unknown model size {name!r}; known sizes: {', '.join(MODEL_SIZES)}"
        )
    n_layer, n_head, d_model = MODEL_SIZES[name]
    padded_vocab = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg = GPTConfig(
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        seq_len=seq_len,
        vocab_size=padded_vocab,
    )
    return GPT(cfg)
