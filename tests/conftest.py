"""Shared fixtures: the README smoke run (which also builds the demo corpus) and a runner for train.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def readme_command(prefix: str) -> str:
    """The quick-start line of README.md that starts with `prefix`, minus the prefix."""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(prefix):
            return line[len(prefix):]
    raise AssertionError(f"README.md has no line starting with {prefix!r}")


# The quick start's run command, as the README gives it: `python train.py ...`.
SMOKE_COMMAND = readme_command("pip install -e . && python ").split()


def run_script(script, *args, cwd, timeout=600):
    """Run one of the project's scripts as a user would; returns the CompletedProcess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc, *fragments):
    """A user mistake ends in exit 2 and one `error:` line on stderr, never a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`python train.py --model tiny --steps 40` in a fresh directory: builds the default demo db there."""
    cwd = tmp_path_factory.mktemp("smoke")
    proc = run_script(*SMOKE_COMMAND, cwd=cwd)
    return proc, cwd


@pytest.fixture(scope="session")
def demo_db(smoke_run):
    proc, cwd = smoke_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(cwd / "data" / "lancedb")
