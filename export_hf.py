"""Export a train.py checkpoint as a Hugging Face GPT-2 model directory.

The model is GPT-2's architecture (learned positions, tied embeddings, tanh GELU,
pre-LayerNorm), so the weights map one to one onto `GPT2LMHeadModel`: the same names,
with the four projection matrices transposed (GPT-2's Conv1D stores them in x out).
The directory holds `config.json`, `model.safetensors`, `generation_config.json` and
the tokenizer, and loads with `AutoModelForCausalLM.from_pretrained(DIR)`.

- Vocabulary: the tokenizer's ids (its real tokens and the reserved PAD id). The rows
  train.py adds only to round the embedding up to a multiple of 64 are dropped: no
  target ever used them and sample.py never draws them, and dropping them keeps the
  model's vocabulary equal to the exported tokenizer's. Every kept id's logit is unchanged.
- Tokenizer: an `hf:` run's own tokenizer, with the EOS and PAD ids the run trained
  with (a PAD token is added where the run reserved a fresh id for it); the byte
  tokenizer as an equivalent `tokenizers` byte-level tokenizer (ids 0-255 are the
  bytes, 256 EOS, 257 PAD). Both encode with `split_special_tokens`, as training did:
  a literal "<|endoftext|>" in a text is text, never EOS.
- Generation: EOS starts a document (as in packed training) and ends one; PAD is
  suppressed, so greedy decoding equals `sample.py --temperature 0` up to seq_len tokens.
- The export is atomic: written to a temp directory beside --out, synced, then renamed.
  Running out of space (ENOSPC, or a quota's EDQUOT) is one `error:` line and exit 3
  (common.StorageFault); the temp directory goes and a previous export stays as it was.

Usage
-----
python export_hf.py --ckpt auto --out exported/tiny          # newest in ./checkpoints
python export_hf.py --ckpt checkpoints/step_00000040.pt --out exported/tiny --overwrite
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

from common import ArgumentParser, UserError, fsync_dir, fsync_path, load_hf_tokenizer, out_of_space
from sample import load_model

# Our projection name -> whether GPT-2's Conv1D stores it transposed (all nn.Linear weights do).
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BYTE_EOS, BYTE_PAD = "<|endoftext|>", "<|pad|>"
# Set on every exported tokenizer. split_special_tokens: encode as training did (a literal
# "<|endoftext|>" is text). model_input_names: no token_type_ids, which GPT-2 would embed
# with its token embedding and add to every position (PreTrainedTokenizerFast returns them).
SAVED_SETTINGS = {"split_special_tokens": True, "model_input_names": ["input_ids", "attention_mask"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True,
                   help="a checkpoint file (step_XXXXXXXX.pt), or 'auto' for the newest in --ckpt-dir")
    p.add_argument("--ckpt-dir", default="./checkpoints", help="where --ckpt auto looks")
    p.add_argument("--out", required=True, help="the model directory to write (its parent must exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it holds an earlier export")
    return p.parse_args(argv)


def check_out(out: str, overwrite: bool) -> None:
    """Refuse an --out that would lose data or cannot be made, before any work."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"--out {out!r}: no directory {parent!r}; create it first")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise UserError(f"--out {out!r} exists and is not empty; pass --overwrite to replace it")
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise UserError(f"--out {out!r} is not an earlier export (it has no config.json); "
                            f"--overwrite replaces only those: pick another --out")


def hf_config(model, tok, seq_len: int, provenance: dict):
    """GPT2Config for `model`: no dropout, LayerNorm eps 1e-5, tanh GELU, tied embeddings."""
    from transformers import GPT2Config

    cfg = model.cfg
    return GPT2Config(
        vocab_size=tok.vocab_size, n_positions=seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.d_model, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, architectures=["GPT2LMHeadModel"], torch_dtype="float32",
        lance_gpt_pretrain=provenance)


def hf_state_dict(model, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our weights under GPT2LMHeadModel's names: Conv1D weights transposed, the embedding
    trimmed to the tokenizer's `vocab_size`, lm_head left out (tied to wte on load)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.endswith(TRANSPOSED):
            tensor = tensor.t()
        if name == "transformer.wte.weight":
            tensor = tensor[:vocab_size]
        tensors[name] = tensor.detach().to(torch.float32).contiguous()
    return tensors


def hf_generation_config(tok):
    """EOS starts and ends a document; PAD is never generated (sample.py bans it too)."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, suppress_tokens=[tok.pad_token_id])


def byte_level_tokenizer(tok, seq_len: int):
    """The byte tokenizer as a `tokenizers` BPE with no merges over GPT-2's byte alphabet:
    each byte is one token whose id is the byte, then EOS (256) and PAD (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    alphabet = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BYTE_EOS, BYTE_PAD])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BYTE_EOS, eos_token=BYTE_EOS,
                                 pad_token=BYTE_PAD, clean_up_tokenization_spaces=False,
                                 model_max_length=seq_len, **SAVED_SETTINGS)
    check_special_ids(hf, tok)
    return hf


def run_tokenizer(tok, seq_len: int):
    """The run's `hf:` tokenizer with the EOS and PAD ids it trained with."""
    hf = load_hf_tokenizer(tok.spec[len("hf:"):])
    if hf.eos_token_id != tok.eos_token_id:  # the run fell back to the separator
        hf.eos_token = hf.convert_ids_to_tokens(tok.eos_token_id)
    if hf.pad_token_id != tok.pad_token_id:  # the run reserved a fresh id above the vocabulary
        vocab = hf.get_vocab()
        name = next(n for n in (f"<|pad{i or ''}|>" for i in range(len(vocab) + 1)) if n not in vocab)
        hf.add_special_tokens({"pad_token": name})
    hf.model_max_length = seq_len
    for name, value in SAVED_SETTINGS.items():
        setattr(hf, name, value)
        hf.init_kwargs[name] = value  # what save_pretrained writes to tokenizer_config.json
    check_special_ids(hf, tok)
    return hf


def check_special_ids(hf, tok) -> None:
    got = (len(hf), hf.eos_token_id, hf.pad_token_id)
    want = (tok.vocab_size, tok.eos_token_id, tok.pad_token_id)
    if got != want:
        raise UserError(f"the exported tokenizer of {tok.spec!r} does not match the one the run "
                        f"trained with: (vocabulary, EOS, PAD) {got} instead of {want}")


def write_model_dir(directory: str, model, tok, config: dict, provenance: dict) -> None:
    from safetensors.torch import save_file

    seq_len = config["seq_len"]
    weights = os.path.join(directory, "model.safetensors")
    save_file(hf_state_dict(model, tok.vocab_size), weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors writes 0600; the rest of the export is shared
    hf_config(model, tok, seq_len, provenance).save_pretrained(directory)
    hf_generation_config(tok).save_pretrained(directory)
    hf_tok = byte_level_tokenizer(tok, seq_len) if tok.spec == "byte" else run_tokenizer(tok, seq_len)
    hf_tok.save_pretrained(directory)


def replace_directory(out: str, write, needed: int | None = None) -> None:
    """`write(tmp)` into a fresh directory beside `out`, fsync it, then rename it to `out`:
    the export is complete or absent. An old `out` is renamed away first and removed last.
    Running out of space (`needed`: bytes the export takes, where known) is a StorageFault."""
    parent, name = os.path.split(os.path.abspath(out))
    remove_stale(parent, name)
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    old = os.path.join(parent, f".{name}.old-{os.getpid()}")
    try:
        os.mkdir(tmp)
        write(tmp)
        for entry in os.listdir(tmp):
            fsync_path(os.path.join(tmp, entry))
        fsync_dir(tmp)
        if os.path.isdir(out) and os.listdir(out):
            os.rename(out, old)
        os.replace(tmp, out)
        fsync_dir(parent)
    except BaseException as e:
        if os.path.isdir(old) and not os.path.exists(out):
            os.rename(old, out)  # cut short between the two renames: the previous export goes back
        shutil.rmtree(tmp, ignore_errors=True)  # before out_of_space measures what is free
        kept = (f"the previous export in {out!r} is as it was" if os.path.isdir(out) and os.listdir(out)
                else "nothing was written")
        if fault := out_of_space(e, parent, f"the export {out!r}",
                                 f"free space there or use another --out, then run again; {kept}", needed):
            raise fault from None
        if isinstance(e, OSError):
            raise UserError(f"cannot write {out!r}: {e.strerror or e}") from None
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale(parent: str, name: str) -> None:
    """Temp and old directories of exports to `name` that were killed (their pid is gone)."""
    for entry in os.listdir(parent):
        for kind in (".tmp-", ".old-"):
            prefix = f".{name}{kind}"
            pid = entry[len(prefix):]
            if entry.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def export(args) -> str:
    check_out(args.out, args.overwrite)
    model, tok, path, config = load_model(args.ckpt, args.ckpt_dir, torch.device("cpu"))
    provenance = {"checkpoint": os.path.basename(path), "model": config["model"],
                  "tokenizer": config["tokenizer"], "doc_mask": bool(config.get("doc_mask", False)),
                  "pack": bool(config.get("pack", False))}
    n_params = sum(p.numel() for p in model.parameters()) - \
        (model.cfg.vocab_size - tok.vocab_size) * model.cfg.d_model
    replace_directory(args.out, lambda tmp: write_model_dir(tmp, model, tok, config, provenance),
                      needed=4 * n_params)  # the float32 weights; the rest is kilobytes
    print(f"exported {path} ({config['model']}, {n_params:,} parameters, vocabulary {tok.vocab_size}, "
          f"tokenizer {config['tokenizer']}) to {args.out}")
    if provenance["doc_mask"]:
        print("note: trained with --doc-mask; one document per sequence behaves as in training, "
              "packed sequences would need per-document positions and masks that GPT-2 does not build")
    return args.out


def main(argv=None) -> None:
    try:
        export(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
