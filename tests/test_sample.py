"""sample.py on a tiny checkpoint trained here: the CLI, determinism, EOS, PAD, user errors."""

import contextlib
import io
import json
import re
import shutil
import subprocess

import pytest
import torch

import prepare_data
import sample
import train
from conftest import assert_user_error, run_script

SUBJECTS = ["The cat", "The old dog", "A little bird", "The farmer", "My friend", "The teacher"]
ACTIONS = ["walked to the river", "sat by the window", "read a long book", "cooked a warm meal",
           "planted some seeds", "watched the rain", "sang a quiet song", "cleaned the house",
           "fed the hungry ducks", "painted a blue door"]
COLORS = ["red", "grey", "gold", "pink", "dark"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def story(i):
    """A short distinct document of simple English that scores as prose (>= 10 words)."""
    return (f"{SUBJECTS[i % 6]} {ACTIONS[i % 10]} in the morning. Later the sky turned "
            f"{COLORS[i % 5]} and {NUMBERS[i // 6]} friends went home to rest.")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Batch-1 decoding of the tiny model gains nothing from more threads, and on a busy
    2-core machine a second intra-op thread makes each step several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt_dir(one_thread, tmp_path_factory):
    """30 steps of the tiny model, packed (so EOS is learned), on 60 stories: step_00000030.pt."""
    tmp = tmp_path_factory.mktemp("sample")
    docs = tmp / "stories.jsonl"
    docs.write_text("".join(json.dumps({"text": story(i)}) + "\n" for i in range(60)))
    db, ckdir = str(tmp / "db"), str(tmp / "ck")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        prepare_data.ingest([str(docs)], db, "corpus", "byte", min_chars=10)
        train.main(["--db", db, "--model", "tiny", "--seq-len", "64", "--batch-size", "4",
                    "--pack", "--epochs", "10", "--steps", "30", "--lr", "3e-3",
                    "--warmup-steps", "3", "--log-every", "10", "--ckpt-dir", ckdir])
    assert "final: opt_step=30 " in out.getvalue(), out.getvalue()
    return tmp / "ck"


def run_main(capsys, *args):
    """sample.main in-process: (stdout, stderr lines)."""
    sample.main([*map(str, args)])
    captured = capsys.readouterr()
    return captured.out, captured.err.strip().splitlines()


def test_cli_continues_the_prompt(ckpt_dir):
    proc = run_script("sample.py", "--ckpt", "auto", "--ckpt-dir", ckpt_dir, "--prompt", "The ",
                      "--max-new-tokens", 40, "--seed", 3, cwd=ckpt_dir.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("The ") and len(proc.stdout.rstrip("\n")) > len("The ")
    summary = re.fullmatch(r"sampled (\d+) tokens from (\S+) \(tiny, byte; stopped at "
                           r"(EOS|--max-new-tokens 40)\)", proc.stderr.strip())
    assert summary, proc.stderr
    assert summary[2].endswith("step_00000030.pt")
    assert int(summary[1]) == 40 or summary[3] == "EOS"


def test_a_seed_fixes_the_text_and_greedy_ignores_it(ckpt_dir, capsys):
    common = ["--ckpt", ckpt_dir / "step_00000030.pt", "--prompt", "The ", "--max-new-tokens", 30,
              "--temperature", 1.0]
    first, _ = run_main(capsys, *common, "--seed", 3)
    again, _ = run_main(capsys, *common, "--seed", 3)
    other, _ = run_main(capsys, *common, "--seed", 4)
    assert first.startswith("The ") and len(first.rstrip("\n")) > len("The ")  # text was sampled
    assert first == again
    assert other != first
    greedy = ["--ckpt", ckpt_dir / "step_00000030.pt", "--prompt", "The ", "--temperature", 0,
              "--max-new-tokens", 10]
    greedy_one, greedy_two = (run_main(capsys, *greedy, "--seed", seed)[0] for seed in (1, 2))
    assert greedy_one.startswith("The ") and len(greedy_one.rstrip("\n")) > len("The ")
    assert greedy_two == greedy_one


def biased(model, boost):
    """Patch `model.logits` so the last position's logits get `boost(context_len)` added."""
    logits = model.logits

    def patched(ids):
        out = logits(ids).clone()
        out[:, -1] += boost(ids.size(1))
        return out

    model.logits = patched
    return model


def test_generation_stops_at_eos(ckpt_dir, capsys, monkeypatch):
    """EOS forced as the 5th token: generate ends on it, and main neither prints nor counts it."""
    model, tok, _, _ = sample.load_model("auto", str(ckpt_dir), torch.device("cpu"))
    prompt = tok.encode(["The "])[0]
    eos_bonus = torch.zeros(model.cfg.vocab_size)
    eos_bonus[tok.eos_token_id] = 1e4

    def boost(n):
        return eos_bonus if n >= len(prompt) + 4 else torch.zeros_like(eos_bonus)

    gen = torch.Generator().manual_seed(0)
    new = sample.generate(biased(model, boost), tok, prompt, 100, 1.0, None, gen)
    assert len(new) == 5 and new[-1] == tok.eos_token_id and tok.eos_token_id not in new[:-1]

    load = sample.load_model

    def load_biased(*args):
        model, *rest = load(*args)
        return (biased(model, boost), *rest)

    monkeypatch.setattr(sample, "load_model", load_biased)
    out, err = run_main(capsys, "--ckpt", "auto", "--ckpt-dir", ckpt_dir, "--prompt", "The ",
                        "--max-new-tokens", 100, "--seed", 0)
    assert out == "The " + tok.decode(new[:-1]) + "\n"
    assert err[-1].startswith("sampled 4 tokens from ") and err[-1].endswith("; stopped at EOS)")


def test_pad_and_vocab_padding_are_never_sampled(ckpt_dir):
    """Even with PAD and the ids above the real vocabulary made overwhelmingly likely."""
    model, tok, _, _ = sample.load_model("auto", str(ckpt_dir), torch.device("cpu"))
    assert model.cfg.vocab_size > tok.vocab_size  # 258 padded up to 320
    bonus = torch.zeros(model.cfg.vocab_size)
    bonus[tok.vocab_size:] = 1e4
    bonus[tok.pad_token_id] = 1e4
    biased(model, lambda n: bonus)
    banned = {tok.pad_token_id, *range(tok.vocab_size, model.cfg.vocab_size)}
    for temperature, top_k in ((0, None), (2.0, None), (1.0, 5)):
        new = sample.generate(model, tok, [tok.eos_token_id], 30, temperature, top_k,
                              torch.Generator().manual_seed(0))
        assert new and not banned & set(new), (temperature, top_k, new)


def test_a_prompt_longer_than_seq_len_is_cropped(ckpt_dir, capsys):
    prompt = " ".join(story(i) for i in range(3))  # ~270 bytes > seq_len 64
    out, err = run_main(capsys, "--ckpt", ckpt_dir / "step_00000030.pt", "--prompt", prompt,
                        "--max-new-tokens", 5)
    assert out.startswith(prompt) and err[-1].startswith("sampled ")


def test_auto_skips_an_unreadable_newer_checkpoint(ckpt_dir, tmp_path, capsys):
    shutil.copy(ckpt_dir / "step_00000030.pt", tmp_path)
    (tmp_path / "step_00000040.pt").write_bytes(b"torn")
    out, err = run_main(capsys, "--ckpt", "auto", "--ckpt-dir", tmp_path, "--max-new-tokens", 3)
    assert err[0].startswith(f"warning: skipping checkpoint {tmp_path / 'step_00000040.pt'}: ")
    assert "step_00000030.pt" in err[-1]


def error_cases():
    cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    return [
        pytest.param(lambda ck, tmp: ["--ckpt", tmp / "nope.pt"], "does not exist", id="missing"),
        pytest.param(lambda ck, tmp: ["--ckpt", "auto", "--ckpt-dir", tmp], "--ckpt auto: no readable",
                     id="auto-empty-dir"),
        pytest.param(lambda ck, tmp: ["--ckpt", write(tmp / "x.pt", b"not a checkpoint")],
                     "cannot read checkpoint", id="unreadable"),
        pytest.param(lambda ck, tmp: ["--ckpt", save(tmp / "x.pt", {"weights": torch.zeros(2)})],
                     "is not a checkpoint written by train.py", id="not-train-py"),
        pytest.param(lambda ck, tmp: ["--ckpt", retokenized(ck, tmp / "x.pt")],
                     "was trained with tokenizer 'hf:", id="tokenizer-gone"),
        pytest.param(lambda ck, tmp: ["--ckpt", ck, "--top-k", 0], "--top-k must be at least 1",
                     id="top-k"),
        pytest.param(lambda ck, tmp: ["--ckpt", ck, "--max-new-tokens", 0],
                     "--max-new-tokens must be at least 1", id="max-new-tokens"),
        pytest.param(lambda ck, tmp: ["--ckpt", ck, "--temperature", -1],
                     "--temperature must be a finite number >= 0", id="temperature"),
        pytest.param(lambda ck, tmp: ["--ckpt", ck, "--device", "cuda"], "CUDA is not available",
                     id="no-cuda", marks=cuda),
    ]


def write(path, data):
    path.write_bytes(data)
    return path


def save(path, obj):
    torch.save(obj, path)
    return path


def retokenized(ckpt, path):
    """The checkpoint with a tokenizer directory that no longer exists."""
    obj = torch.load(ckpt, map_location="cpu", weights_only=True)
    obj["config"]["tokenizer"] = f"hf:{path.parent / 'deleted-tokenizer'}"
    return save(path, obj)


@pytest.mark.parametrize("make_args, fragment", error_cases())
def test_user_errors_are_one_line(ckpt_dir, tmp_path, capsys, make_args, fragment):
    args = make_args(ckpt_dir / "step_00000030.pt", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        sample.main([*map(str, args)])
    captured = capsys.readouterr()
    assert_user_error(subprocess.CompletedProcess(args, exit_info.value.code, captured.out,
                                                  captured.err), fragment)
    assert captured.out == ""
