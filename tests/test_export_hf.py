"""export_hf.py: checkpoints of real runs load in transformers with the same logits and the
same greedy text; the tokenizers encode and decode like ours; bad input is one line."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import export_hf
import prepare_data
import sample
import train
from common import load_tokenizer
from conftest import REPO, assert_user_error, run_script, save_bpe

# float32 logits of the exported model against model.logits on the same ids. Measured
# 6e-7 (max abs) on 512 positions; a transposed or misnamed weight moves them by > 0.1.
LOGIT_ATOL = 1e-5

WORDS = ["river", "window", "garden", "morning", "quiet", "yellow", "kitchen", "market", "winter",
         "letter", "bridge", "forest"]

# Text a tokenizer must round-trip: accents, emoji, control characters, and the special
# tokens' spellings, which training reads as text.
TEXTS = ["The cat sat.", "héllo wörld", "emoji 🙂 and 中文", "tabs\tand\nnew lines\r\n",
         "a literal <|endoftext|> and <|pad|> stay text", "", "   leading spaces", "</s> <pad> [SEP]"]


def story(i):
    """A distinct short document that scores as prose."""
    return (f"The {WORDS[i % 12]} was {WORDS[(i // 12) % 12]} in the {WORDS[(i * 7) % 12]}. "
            f"Every day {i} we walked past the {WORDS[(i * 5 + 1) % 12]} again and again.")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Batch-1 decoding of the tiny model gains nothing from a second intra-op thread, and
    on a busy 2-core machine it makes each step several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_tiny(tmp, tokenizer, *extra):
    """A few steps of the tiny model on 60 stories; returns the checkpoint directory."""
    docs = tmp / "stories.jsonl"
    docs.write_text("".join(json.dumps({"text": story(i)}) + "\n" for i in range(60)))
    db, ckpt_dir = str(tmp / "db"), str(tmp / "ck")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        prepare_data.ingest([str(docs)], db, "corpus", tokenizer, min_chars=10)
        train.main(["--db", db, "--tokenizer", tokenizer, "--model", "tiny", "--seq-len", "64",
                    "--batch-size", "4", "--epochs", "10", "--steps", "20", "--lr", "3e-3",
                    "--warmup-steps", "2", "--log-every", "10", "--ckpt-dir", ckpt_dir, *extra])
    assert "final: opt_step=20 " in out.getvalue(), out.getvalue()
    return tmp / "ck"


@pytest.fixture(scope="module")
def bpe_spec(tmp_path_factory):
    """A BPE tokenizer whose only special token is EOS: the run reserves a fresh PAD id."""
    directory = tmp_path_factory.mktemp("bpe")
    save_bpe(directory, [story(i) for i in range(60)] + TEXTS, ["<|endoftext|>"],
             eos_token="<|endoftext|>")
    return f"hf:{directory}"


@pytest.fixture(scope="module")
def doc_mask_ckpt(bpe_spec, tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("doc_mask"), bpe_spec, "--pack", "--doc-mask")


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("byte"), "byte")


def export(ckpt_dir, out, *extra):
    proc = run_script("export_hf.py", "--ckpt", "auto", "--ckpt-dir", ckpt_dir, "--out", out, *extra,
                      cwd=out.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def load_hf(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model.eval(), AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("which", ["byte_ckpt", "doc_mask_ckpt"])
def test_export_has_the_same_logits_and_greedy_text(which, request, tmp_path):
    ckpt_dir = request.getfixturevalue(which)
    out = tmp_path / "hf"
    proc = export(ckpt_dir, out)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temp directory left beside it
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} \
        <= set(os.listdir(out))
    ours, tok, _, config = sample.load_model("auto", str(ckpt_dir), torch.device("cpu"))
    assert ("--doc-mask" in proc.stdout) == config["doc_mask"]
    hf, hf_tok = load_hf(out)
    assert hf.config.vocab_size == tok.vocab_size < ours.cfg.vocab_size  # padding rows trimmed
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, len(hf_tok)) == \
        (tok.eos_token_id, tok.pad_token_id, tok.vocab_size)

    ids = torch.randint(0, tok.vocab_size, (3, config["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.logits(ids)[..., :tok.vocab_size]
        got = hf(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=LOGIT_ATOL)
    assert expected.std() > 0.5  # trained logits, not a degenerate zero model

    for prompt in ["The ", "Every garden", ""]:
        prompt_ids = tok.encode([prompt])[0] or [tok.eos_token_id]
        assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == tok.encode([prompt])[0]
        want = sample.generate(ours, tok, prompt_ids, 24, 0, None, None)
        got = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                          max_new_tokens=24, do_sample=False)[0, len(prompt_ids):].tolist()
        assert got == want, prompt


def readme_snippet(out) -> str:
    """The README's five transformers lines, pointed at `out`."""
    text = (REPO / "README.md").read_text()
    start = text.index("```python\nfrom transformers import AutoModelForCausalLM")
    block = text[start + len("```python\n"):text.index("```", start + 3)]
    assert block.count("\n") == 5 and "exported/tiny" in block, block
    return block.replace('"exported/tiny"', repr(str(out)))


def test_readme_snippet_prints_what_sample_prints(doc_mask_ckpt, tmp_path):
    """The README's five lines, run as a user would, print what `sample.py --temperature 0`
    prints, with no warning about missing or unexpected weights."""
    out = tmp_path / "hf"
    export(doc_mask_ckpt, out)
    cli = run_script("sample.py", "--ckpt", "auto", "--ckpt-dir", doc_mask_ckpt, "--prompt", "The ",
                     "--temperature", "0", "--max-new-tokens", "50", cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    hf = subprocess.run([sys.executable, "-c", readme_snippet(out)], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert hf.returncode == 0, hf.stderr
    assert hf.stdout == cli.stdout and len(cli.stdout.strip()) > len("The ")
    assert not any(word in hf.stderr for word in ("newly initialized", "not used", "missing")), hf.stderr


def test_byte_tokenizer_encodes_and_decodes_like_ours():
    ours = load_tokenizer("byte")
    hf = export_hf.byte_level_tokenizer(ours, seq_len=64)
    assert [hf(t, add_special_tokens=False)["input_ids"] for t in TEXTS] == ours.encode(TEXTS)
    assert set(hf("x")) == {"input_ids", "attention_mask"}
    rng = torch.Generator().manual_seed(0)
    cases = [torch.randint(0, 258, (n,), generator=rng).tolist() for n in (1, 5, 40, 200)]
    cases += [[0xE2, 0x82], [104, 0xFF, 105, 256, 0xC3, 0xA9, 257], [0xF0, 0x9F, 0x99, 0x82, 0x80]]
    for ids in cases:
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids


@pytest.mark.parametrize("special, named", [
    (["<|endoftext|>"], dict(eos_token="<|endoftext|>")),  # PAD: a fresh id past the vocabulary
    (["<|endoftext|>"], dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")),  # GPT-2's PAD = EOS
    (["</s>", "<pad>"], dict(eos_token="</s>", pad_token="<pad>")),  # PAD of its own
    (["[SEP]"], dict(sep_token="[SEP]")),  # no EOS: the separator joins documents
])
def test_hf_tokenizer_keeps_the_ids_the_run_trained_with(special, named, tmp_path):
    save_bpe(tmp_path, [story(i) for i in range(30)] + TEXTS, special, **named)
    ours = load_tokenizer(f"hf:{tmp_path}")
    hf = export_hf.run_tokenizer(ours, seq_len=64)
    hf.save_pretrained(tmp_path / "out")
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (saved.eos_token_id, saved.pad_token_id, len(saved)) == \
        (ours.eos_token_id, ours.pad_token_id, ours.vocab_size)
    encoded = ours.encode(TEXTS)
    assert [saved(t, add_special_tokens=False)["input_ids"] for t in TEXTS] == encoded
    assert set(saved("x")) == {"input_ids", "attention_mask"}  # GPT-2 would embed token_type_ids
    for ids in encoded:
        with_specials = [ours.eos_token_id] + ids + [ours.pad_token_id, ours.eos_token_id]
        assert saved.decode(with_specials, skip_special_tokens=True) == ours.decode(with_specials)


def test_overwrite_replaces_and_stale_temp_directories_go(byte_ckpt, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export
    (out / "old.txt").write_text("an earlier export's file")
    stale = tmp_path / ".hf.tmp-999999999"  # an export killed before its rename (no such pid)
    stale.mkdir()
    refused = run_script("export_hf.py", "--ckpt", "auto", "--ckpt-dir", byte_ckpt, "--out", out,
                         cwd=tmp_path)
    assert_user_error(refused, "exists and is not empty", "--overwrite")
    assert sorted(os.listdir(out)) == ["config.json", "old.txt"]
    export(byte_ckpt, out, "--overwrite")
    assert "old.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o044) == oct(0o044 & ~current_umask())


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Payload:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


BAD_CHECKPOINTS = {
    "missing": (None, "does not exist"),
    "foreign": ({"weights": torch.zeros(3)}, "is not a checkpoint written by train.py"),
    "crafted": (Payload(), "could run code"),
    "truncated": (b"PK\x03\x04 not a whole zip", "cannot read checkpoint"),
}


@pytest.mark.parametrize("kind", BAD_CHECKPOINTS)
def test_bad_checkpoints_are_one_line_and_write_nothing(kind, tmp_path):
    content, fragment = BAD_CHECKPOINTS[kind]
    ckpt = tmp_path / "step_00000001.pt"
    if isinstance(content, bytes):
        ckpt.write_bytes(content)
    elif content is not None:
        with open(ckpt, "wb") as f:
            torch.save(content, f)
    before = set(os.listdir(tmp_path))
    proc = run_script("export_hf.py", "--ckpt", ckpt, "--out", tmp_path / "hf", cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert set(os.listdir(tmp_path)) == before  # no model directory, no temp one, no "pwned"


def not_an_export(tmp):
    (tmp / "hf").mkdir()
    (tmp / "hf" / "step_00000001.pt").write_text("say, the checkpoints themselves")


@pytest.mark.parametrize("setup, extra, fragment", [
    (lambda tmp: None, [], "no readable checkpoint"),  # --ckpt auto in an empty directory
    (lambda tmp: (tmp / "hf").write_text("a file"), [], "is not a directory"),
    (not_an_export, ["--overwrite"], "is not an earlier export"),
])
def test_bad_outputs_are_one_line(setup, extra, fragment, tmp_path):
    setup(tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = run_script("export_hf.py", "--ckpt", "auto", "--ckpt-dir", tmp_path, "--out", tmp_path / "hf",
                      *extra, cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_missing_out_parent_is_one_line(byte_ckpt, tmp_path):
    proc = run_script("export_hf.py", "--ckpt", "auto", "--ckpt-dir", byte_ckpt,
                      "--out", tmp_path / "no" / "hf", cwd=tmp_path)
    assert_user_error(proc, "create it first")
    assert os.listdir(tmp_path) == []
