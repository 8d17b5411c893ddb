"""The project's own files against what a clone may also hold: a virtual environment inside
it (`.venv`, `venv`, or any name), installed packages, data and caches. A "no traceback of
ours" check and the mutation check's copy of the tree must both tell them apart, and CI must
meet that layout: it runs the README's test command, which makes .venv inside the clone."""

import os
import shutil
import subprocess

import mutation_check
from conftest import REPO, frames_of_ours, is_project_file


def make_clone(root):
    """A clone as a newcomer has it: sources, a venv under each usual name and one under
    another, packages installed with --target, a demo db and caches; returns the venv files."""
    for path in ("train.py", "common.py", "tests/conftest.py", "bench/loaders.py", "data/lancedb/x.lance",
                 "__pycache__/train.cpython-311.pyc", "lance_gpt_pretrain.egg-info/PKG-INFO",
                 "lib/site-packages/six.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("")
    installed = []
    for venv in (".venv", "venv", "py311"):
        (root / venv).mkdir()
        (root / venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
        run = root / venv / "lib/python3.11/site-packages/torch/distributed/run.py"
        run.parent.mkdir(parents=True)
        run.write_text("")
        installed.append(run)
    return installed


def torchrun_report(run_py, ours=None):
    """torchrun's ChildFailedError report as it reaches stderr, after the ranks' own lines;
    with `ours`, a rank's traceback through that file first."""
    rank = f'Traceback (most recent call last):\n  File "{ours}", line 7, in <module>\n    main()\nOSError\n' if ours else ""
    return (f"error: no space left on the device (ENOSPC) writing ...\n{rank}"
            "Traceback (most recent call last):\n"
            '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
            f'  File "{run_py}", line 905, in main\n    run(args)\n'
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            "train.py FAILED\n  exitcode  : 3 (pid: 123)\n")


def test_torchrun_in_a_venv_inside_the_clone_is_not_a_traceback_of_ours(tmp_path):
    for run_py in make_clone(tmp_path):
        assert frames_of_ours(torchrun_report(run_py), root=tmp_path) == []
        assert frames_of_ours(torchrun_report(run_py, ours=tmp_path / "train.py"), root=tmp_path) == \
            [f'File "{tmp_path / "train.py"}", line 7']
    # ranks share stderr: one rank's frame may land in the middle of another's line
    interleaved = f'error: no space left on  File "{tmp_path / "common.py"}", line 7, in <module>\nthe device\n'
    assert frames_of_ours(interleaved, root=tmp_path) == [f'File "{tmp_path / "common.py"}", line 7']


def test_project_files_are_the_sources_only(tmp_path):
    make_clone(tmp_path)
    for ours in ("train.py", "tests/conftest.py", "bench/loaders.py"):
        assert is_project_file(str(tmp_path / ours), root=tmp_path), ours
    for other in ("lib/site-packages/six.py", "data/lancedb/x.lance", "__pycache__/train.cpython-311.pyc",
                  "<frozen runpy>"):
        assert not is_project_file(str(tmp_path / other) if "<" not in other else other, root=tmp_path), other
    assert not is_project_file(os.__file__, root=tmp_path)
    assert is_project_file(str(REPO / "train.py"))


def test_the_mutation_check_copies_the_sources_and_no_venv(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    make_clone(clone)
    tree = mutation_check.copy_tree(tmp_path / "copy", clone)
    copied = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert copied == ["bench/loaders.py", "common.py", "tests/conftest.py", "train.py"]


QUICK_START = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python train.py ",
               "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && "
               "python -m pytest -q -n 2 --dist loadscope")


def test_the_quick_start_makes_its_venv_inside_the_clone():
    """Each command works on its own on a fresh machine, PEP 668 or not: neither installs
    outside .venv, and the test command does not count on the run command's .venv."""
    installs = [line for line in (REPO / "README.md").read_text().splitlines() if "pip install -e " in line]
    assert installs[0].startswith(QUICK_START[0]) and installs[1] == QUICK_START[1], installs[:2]


def fake_ci(tmp_path, readme_line, exits):
    """.ci/run in a copy holding only it and a README with `readme_line`, against stand-ins for
    python3 (makes .venv), pip and python (exit as `exits` says): (exit code, stderr)."""
    clone, bin_dir = tmp_path / "clone", tmp_path / "bin"
    (clone / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", clone / ".ci" / "run")
    (clone / "README.md").write_text(f"## Quick start\n\n```\n{readme_line}\n```\n")
    bin_dir.mkdir()
    stand_ins = {"python3": 'mkdir -p .venv/bin && : > .venv/bin/activate && : > .venv/pyvenv.cfg',
                 "pip": f"exit {exits['pip']}", "python": f"echo \"$@\" >> {tmp_path}/ran; exit {exits['pytest']}"}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CI": "true"}
    proc = subprocess.run(["bash", str(clone / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


def test_ci_runs_the_readme_test_command_and_fails_when_it_does(tmp_path):
    assert fake_ci(tmp_path, QUICK_START[1], {"pip": 0, "pytest": 0}) == (0, "")
    assert (tmp_path / "ran").read_text() == "-m pytest -q -n 2 --dist loadscope\n" and (tmp_path / "clone" / ".venv").is_dir()
    code, err = fake_ci(tmp_path / "again", QUICK_START[1], {"pip": 1, "pytest": 0})
    assert code == 1 and not (tmp_path / "again" / "ran").exists(), err  # a failed install is not a pass
    code, err = fake_ci(tmp_path / "none", QUICK_START[1], {"pip": 0, "pytest": 5})
    assert code == 5, err  # pytest collected no test


def test_ci_refuses_a_clone_with_a_venv_or_a_readme_without_the_command(tmp_path):
    code, err = fake_ci(tmp_path / "old", "pip install -e '.[test]' && python -m pytest -q", {"pip": 0, "pytest": 0})
    assert code == 1 and "README has no test command" in err, err
    fake_ci(tmp_path / "twice", QUICK_START[1], {"pip": 0, "pytest": 0})
    proc = subprocess.run(["bash", str(tmp_path / "twice" / "clone" / ".ci" / "run")], capture_output=True, text=True)
    assert proc.returncode == 1 and "already has .venv" in proc.stderr, proc.stderr
