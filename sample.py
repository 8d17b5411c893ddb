"""Sample text from a checkpoint written by train.py.

The model size, sequence length and tokenizer come from the checkpoint's config,
so a checkpoint is all it needs. Sampling is nanoGPT's: crop the context to the
model's seq_len, scale the last position's logits by 1/temperature, keep the top k,
draw with a seeded generator (the same seed gives the same text on the CPU).

Usage
-----
python sample.py --ckpt auto --prompt "The " --max-new-tokens 200      # newest in ./checkpoints
python sample.py --ckpt checkpoints/step_00000040.pt --temperature 0   # greedy
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

import torch

from checkpoint import newest_checkpoint, read_checkpoint
from common import UserError, load_tokenizer
from model import make_model

CONFIG_KEYS = ("model", "tokenizer", "seq_len")


def check_checkpoint(ckpt, path: str) -> dict:
    """The checkpoint's config, once it is known to hold what building the model needs."""
    if not isinstance(ckpt, dict) or "model" not in ckpt or not isinstance(ckpt.get("config"), dict) \
            or not all(key in ckpt["config"] for key in CONFIG_KEYS):
        raise UserError(f"{path!r} is not a checkpoint written by train.py (it needs 'model' "
                        f"weights and a 'config' naming {', '.join(CONFIG_KEYS)})")
    return ckpt["config"]


def read_model_checkpoint(path: str) -> dict:
    """A checkpoint that holds what building the model needs (sampling needs no loader
    state, so unlike a resume the other ranks' files are not read)."""
    ckpt = read_checkpoint(path)
    check_checkpoint(ckpt, path)
    return ckpt


def load_model(path_or_auto: str, ckpt_dir: str, device: torch.device):
    """(model in eval mode on `device`, tokenizer, checkpoint path, config) for a checkpoint
    path or, for "auto", the newest one in `ckpt_dir`."""
    if path_or_auto == "auto":
        found = newest_checkpoint(ckpt_dir, read_model_checkpoint)
        if found is None:
            raise UserError(f"--ckpt auto: no readable checkpoint in {ckpt_dir!r}; "
                            f"pass --ckpt-dir where train.py wrote them, or --ckpt PATH")
        path, ckpt = found
    else:
        path, ckpt = path_or_auto, read_model_checkpoint(path_or_auto)
    config = ckpt["config"]
    try:
        tok = load_tokenizer(config["tokenizer"])
    except UserError as e:
        raise UserError(f"checkpoint {path!r} was trained with tokenizer "
                        f"{config['tokenizer']!r}, which cannot be loaded: {e}") from None
    try:
        model = make_model(config["model"], tok.vocab_size, config["seq_len"])
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {path!r} does not fit model {config['model']!r} with the "
                        f"{tok.vocab_size}-id vocabulary of {config['tokenizer']!r}: "
                        f"{str(e).splitlines()[0]}") from None
    return model.to(device).eval(), tok, path, config


@torch.no_grad()
def generate(model, tok, prompt_ids, max_new_tokens, temperature, top_k, generator) -> list[int]:
    """Up to `max_new_tokens` sampled ids after `prompt_ids`; when an EOS ends the text
    early it is the last id returned. temperature 0 is greedy; top_k None keeps all.

    PAD and the ids that only pad the embedding up to a multiple of 64 are never drawn.
    """
    model.eval()
    device = model.lm_head.weight.device
    seq_len = model.cfg.seq_len
    banned = torch.zeros(model.cfg.vocab_size, dtype=torch.bool, device=device)
    banned[tok.vocab_size:] = True
    banned[tok.pad_token_id] = True
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else contextlib.nullcontext()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    new = []
    for _ in range(max_new_tokens):
        context = ids[:, -seq_len:]  # (1, <= seq_len)
        with autocast:
            logits = model.logits(context)[:, -1, :].float()  # (1, vocab_size)
        logits = logits.masked_fill(banned, -math.inf)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits = logits.masked_fill(logits < v[:, [-1]], -math.inf)
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (1, 1)
        ids = torch.cat((ids, next_id), dim=1)
        new.append(next_id.item())
        if new[-1] == tok.eos_token_id:
            break
    return new


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True,
                   help="a checkpoint file (step_XXXXXXXX.pt), or 'auto' for the newest in --ckpt-dir")
    p.add_argument("--ckpt-dir", default="./checkpoints")
    p.add_argument("--prompt", default="", help="text to continue; empty starts a new document")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample only from the k likeliest tokens")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    return p.parse_args(argv)


def check_args(args) -> torch.device:
    """Refuse impossible settings before the checkpoint is read; returns the device."""
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be at least 1 (got {args.top_k})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (got {args.temperature})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: CUDA is not available here; pass --device cpu")
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def sample(args) -> None:
    device = check_args(args)
    model, tok, path, config = load_model(args.ckpt, args.ckpt_dir, device)
    # Packed training puts an EOS before every document, so an empty prompt starts one.
    prompt_ids = tok.encode([args.prompt])[0] if args.prompt else []
    prompt_ids = prompt_ids or [tok.eos_token_id]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new = generate(model, tok, prompt_ids, args.max_new_tokens, args.temperature, args.top_k,
                   generator)
    at_eos = new[-1] == tok.eos_token_id
    text_ids = new[:-1] if at_eos else new
    print(args.prompt + tok.decode(text_ids), flush=True)
    stop = "stopped at EOS" if at_eos else f"stopped at --max-new-tokens {args.max_new_tokens}"
    print(f"sampled {len(text_ids)} tokens from {path} ({config['model']}, {config['tokenizer']}; "
          f"{stop})", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        sample(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
