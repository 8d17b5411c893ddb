"""Shared fixtures: the README smoke run (which also builds the demo corpus) and a runner for train.py."""

import contextlib
import fnmatch
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What common.load_hf_tokenizer sets in its process, set for the session before any warm
# server starts: a test that loads a tokenizer in-process would otherwise leave this process's
# import-time environment unlike the server's, and every later run would start cold
# (tests/warm_python.py). Nothing here downloads anyway.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process, as torchrun gives its ranks: the suite's 2 workers already
# fill the 2 cores with runs of several processes each, where a second thread per process only
# oversubscribes them and OpenMP's waiting threads spin (a 40-step tiny run on the busy machine:
# 92 s of CPU and 176 s of wall with torch's default 2 threads, 41 s and 82 s with 1). Set
# before any torch import here and before the warm servers start, so every run sees it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def readme_command(marker: str) -> str:
    """What follows `marker` on the first line of README.md that holds it."""
    for line in (REPO / "README.md").read_text().splitlines():
        if marker in line:
            return line.split(marker, 1)[1]
    raise AssertionError(f"README.md has no line holding {marker!r}")


# The quick start's run command, as the README gives it: `python train.py ...`.
SMOKE_COMMAND = readme_command("pip install -e . && python ").split()


# ── The project's own files, and what walking, copying or hashing the tree passes over ──

# Not the project's sources: version control, caches, build and run output, the GPU payload,
# virtual environments under the names people give them (any other directory holding
# pyvenv.cfg is one too, see not_source) and installed packages (`pip install --target`).
# Every walk, copy or hash of the tree uses this list.
NOT_SOURCE = (".git", ".venv", "venv", "*site-packages*", "*dist-packages*", "__pycache__", ".pytest_cache",
              "*.egg-info", "build", "dist", "data", "checkpoints", "runs", ".device", ".whl")


def not_source(directory, names) -> set[str]:
    """shutil.copytree's `ignore`: the names in `directory` that are not the project's sources
    (NOT_SOURCE, and a virtual environment whatever its name)."""
    return {name for name in names
            if any(fnmatch.fnmatch(name, pattern) for pattern in NOT_SOURCE)
            or os.path.isfile(os.path.join(directory, name, "pyvenv.cfg"))}


def is_project_file(path, root=REPO) -> bool:
    """`path` is one of the project's own files: under `root` and not inside anything
    not_source skips, such as a virtual environment or installed packages kept in the clone."""
    if not os.path.isabs(path):  # "<frozen runpy>", "<string>": no file at all
        return False
    root = Path(root).resolve()
    try:
        parts = Path(path).resolve().relative_to(root).parts
    except ValueError:
        return False
    directory = root
    for part in parts[:-1]:
        if not_source(directory, [part]):
            return False
        directory /= part
    return True


_FRAME = re.compile(r'File "([^"]+)", line \d+')  # not anchored: ranks share stderr, lines interleave


def frames_of_ours(stderr: str, root=REPO) -> list[str]:
    """The traceback frames in `stderr` that name one of the project's own files. torchrun's
    failure report is a traceback of torch's; in a clone that keeps its virtual environment
    inside, torch's path starts with the clone's too, and must not count as ours."""
    return [m[0].strip() for m in _FRAME.finditer(stderr) if is_project_file(m[1], root)]


# ── A warm interpreter for one-process runs (tests/warm_python.py) ──────────────────

# The scripts that import torch: their start-up is most of a short run's time.
WARM_SCRIPTS = {"train.py", "build_packed_datasets.py", "export_hf.py", "sample.py"}
_warm = {}
_warm_starting = threading.Lock()  # tests start runs from several threads (run_trains)


def warm_python() -> list[str] | None:
    """The command prefix that runs a script (or `-m MODULE`) in a fork of this test process's
    warm server (started at the first call, gone with this process); None under
    TESTS_COLD_START=1, which starts every run cold."""
    if os.environ.get("TESTS_COLD_START") == "1":
        return None
    with _warm_starting:
        return _warm_command()


def _warm_command() -> list[str]:
    if "command" not in _warm:
        import atexit
        import tempfile

        sock = os.path.join(tempfile.mkdtemp(prefix="warm-"), "sock")  # short: an AF_UNIX path fits in 108 bytes
        server = subprocess.Popen([sys.executable, str(REPO / "tests" / "warm_python.py"), "serve", sock],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        if server.stdout.readline().strip() != "ready":
            server.kill()
            raise RuntimeError(f"tests/warm_python.py did not start (exit {server.wait()})")
        atexit.register(lambda: (server.stdin.close(), server.wait()))
        _warm.update(command=[sys.executable, str(REPO / "tests" / "warm_python.py"), sock],
                     registry=os.path.join(os.path.dirname(sock), "runs"), server=server.pid)
    return _warm["command"]


def warm_run_of(client):
    """The pid of the run that the warm client `client` started (the server records it), or None."""
    if "registry" not in _warm:
        return None
    try:
        with open(os.path.join(_warm["registry"], str(client))) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def script_command(script, *args, cold=False) -> list[str]:
    """`python SCRIPT ARGS`, through the warm interpreter where SCRIPT imports torch and the
    test does not ask for a cold start (`cold`: it signals the run, or finds its processes)."""
    path = str(REPO / script)
    warm = None if cold or Path(script).name not in WARM_SCRIPTS else warm_python()
    return [*(warm or [sys.executable]), path, *map(str, args)]


def run_script(script, *args, cwd, timeout=600, env=None, cold=False):
    """Run one of the project's scripts as a user would (`env`: variables added to ours);
    returns the CompletedProcess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(script_command(script, *args, cold=cold), cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_user_error(proc, *fragments):
    """A user mistake ends in exit 2 and one `error:` line on stderr, never a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def save_bpe(directory, texts, special_tokens, **named):
    """A real byte-level BPE tokenizer (vocab 300) trained on `texts` and saved as a local HF
    directory with only the given special tokens; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tk, **named).save_pretrained(str(directory))
    return tk.get_vocab_size()


def docs_table(db, docs, *, scores=None, dups=None, splits=None) -> str:
    """A byte-tokenizer corpus table 'corpus' in `db` whose rows are `docs` (token id lists)
    in order: row i has id i and digest i; every row scores 2.0, is no duplicate and is a
    training row unless `scores`, `dups` or `splits` say otherwise per row. Returns `db`."""
    import lancedb
    import pyarrow as pa

    from common import corpus_schema, load_tokenizer

    n = len(docs)
    table = pa.table({
        "id": pa.array(range(n), pa.int64()), "text": [""] * n,
        "input_ids": pa.array(docs, pa.list_(pa.int32())), "n_tokens": pa.array(map(len, docs), pa.int32()),
        "score": pa.array(scores or [2.0] * n, pa.float32()), "is_dup": list(dups or [False] * n),
        "split": list(splits or ["train"] * n),
        "digest": pa.array([i.to_bytes(16, "little") for i in range(n)], pa.binary(16)),
    }, schema=corpus_schema(load_tokenizer("byte")))
    lancedb.connect(str(db)).create_table("corpus", table)
    return str(db)


def made_once(tmp_path_factory, name, make):
    """`make(directory)` run once per test run, in a fresh `directory`; returns (its result,
    directory). Under pytest-xdist the workers share one: the first to ask makes it, under a
    file lock, and leaves its result as JSON for the others (so it must be JSON-able)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        directory = tmp_path_factory.mktemp(name)
        return make(directory), directory
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the run's directory, above each worker's own
    directory, result = shared / name, shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.exists():
            directory.mkdir()
            result.write_text(json.dumps(make(directory)))
    return json.loads(result.read_text()), directory


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`python train.py --model tiny --steps 40` in a fresh directory: builds the default demo db there."""
    def smoke(cwd):
        proc = run_script(*SMOKE_COMMAND, cwd=cwd, cold=True)  # exactly as the README says
        return {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    done, cwd = made_once(tmp_path_factory, "smoke", smoke)
    return subprocess.CompletedProcess(**done), cwd


@pytest.fixture(scope="session")
def demo_db(smoke_run):
    proc, cwd = smoke_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(cwd / "data" / "lancedb")


# Blocks for the A/B harness, built once from the demo corpus: 64-token blocks, several
# Parquet files, and row groups that do not divide them.
BLOCKS_SEQ_LEN = 64


@pytest.fixture(scope="session")
def blocks_dir(demo_db, tmp_path_factory):
    """OUT of build_packed_datasets.py (all four formats) over the demo corpus."""
    import build_packed_datasets

    def build(out):
        build_packed_datasets.build(demo_db, "corpus", str(out), seq_len=BLOCKS_SEQ_LEN,
                                    blocks_per_file=10_000, seq_row_group_blocks=300)

    return made_once(tmp_path_factory, "blocks", build)[1]


def read_trace(trace_dir):
    """rank -> its --trace-samples records in file order (a line cut short by a kill is dropped)."""
    traces = {}
    for f in sorted(Path(trace_dir).glob("rank*.jsonl")):
        lines = f.read_text().split("\n")[:-1]  # only newline-terminated lines
        traces[int(f.stem[len("rank"):])] = [json.loads(line) for line in lines]
    return traces


def state_equal(a, b):
    """Bit for bit: tensors of the same dtype and values, containers of equal items."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


# ── Processes: train.py under torchrun, and killing whole process trees ──────────────

def train_command(nproc, *args, cold=True, torchrun=None):
    """`python train.py ...` for one rank, `python -m torch.distributed.run ... train.py ...` for
    more or where `torchrun` gives the agent's flags (default `--standalone`); warm unless `cold`
    (see script_command): torchrun's agent then runs in the warm interpreter, and starts each
    rank through it (`--no-python`)."""
    args = [str(a) for a in args]
    if nproc == 1 and torchrun is None:
        return script_command("train.py", *args, cold=cold)
    warm = None if cold else warm_python()
    return [*(warm or [sys.executable]), "-m", "torch.distributed.run", *map(str, torchrun or ["--standalone"]),
            "--nproc-per-node", str(nproc), *(["--no-python", *warm] if warm else []), str(REPO / "train.py"), *args]


def _proc_stat(pid):
    """(state, ppid, session) of a live pid from /proc/<pid>/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[3])


def _all_pids():
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_tree(root):
    """`root` and all its live descendants (by ppid), parents before children.

    torchrun starts its workers in sessions of their own, so a process group or
    session does not cover them; the parent links do, as long as nobody has died yet.
    A warm client's run counts as its child (tests/warm_python.py: the server's child).
    """
    children = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat:
            children.setdefault(stat[1], []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        if _proc_stat(pid):
            tree.append(pid)
        todo.extend(children.get(pid, ()))
        run = warm_run_of(pid)
        if run and (stat := _proc_stat(run)) and stat[1] == _warm["server"]:  # not a reused pid
            todo.append(run)
    return tree


def is_alive(pid):
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def kill_tree(root, first=()):
    """SIGSTOP the whole tree of `root` (so nothing forks or writes on), then SIGKILL it all.

    Stopping first freezes the tree where it stands: a killed parent's children
    would be re-parented and vanish from the walk. `first`: pids known to be in the
    tree (from an earlier process_tree), stopped before the walk to act sooner.
    Returns every pid it signalled.
    """
    import signal

    frozen = [pid for pid in first if is_alive(pid)]
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    while True:
        new = [pid for pid in process_tree(root) if pid not in frozen]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen.extend(new)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return frozen


def wait_gone(pids, timeout=20.0):
    """Wait until none of `pids` is alive (zombies count as dead); returns the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def pids_mentioning(fragment):
    """Live processes whose command line contains `fragment` (e.g. a run's unique ckpt dir)."""
    found = []
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if fragment in cmdline and is_alive(pid):
            found.append(pid)
    return found


def session_pids(sid):
    """Live processes of session `sid` (a run started with start_new_session=True and its
    helpers); for a warm client, of its run's session too (the run's own pid)."""
    sids = {sid, warm_run_of(sid)}
    return [pid for pid in _all_pids() if (s := _proc_stat(pid)) and s[2] in sids and is_alive(pid)]


def sigint_at_default() -> None:
    """Popen's preexec_fn for a child a test sends Ctrl-C: a shell starts a foreground job with
    SIGINT at its default, whatever this test process inherited (under pytest-xdist a worker
    ignored it after some earlier test, and a Python child then ignores Ctrl-C for good)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_train(nproc, *args, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cold=True, torchrun=None,
                env=None):
    """Popen of train.py (torchrun for nproc > 1, or with `torchrun`'s flags) in a session of its
    own; cold, for the tests that signal it or walk its processes, unless `cold` is False.
    `env`: variables added to ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(train_command(nproc, *args, cold=cold, torchrun=torchrun), cwd=cwd, env=env,
                            stdout=stdout, stderr=stderr, text=True, start_new_session=True)


def run_train(nproc, *args, cwd, timeout=300, cold=False):
    """Run train.py on `nproc` ranks to the end; a run past `timeout` has its whole tree
    killed and fails the test (CompletedProcess otherwise, any exit code). Warm unless `cold`
    (see train_command)."""
    proc = start_train(nproc, *args, cwd=cwd, cold=cold)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        main_exited = proc.poll() is not None
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # an orphan outside the tree holds the pipes
            out, err = "", "(output lost: the pipes stayed open after the kill)"
        pytest.fail(f"train.py on {nproc} rank(s) did not finish within {timeout}s "
                    f"({'the main process exited but a child kept its output open' if main_exited else 'still running'})"
                    f"\n$ {' '.join(train_command(nproc, *args))}\n{out}\n{err}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid  # == its session id (start_new_session) where it ran cold
    return done


def run_trains(jobs, *, cwd, timeout=300, cold=False):
    """Run several independent train.py jobs, each `(nproc, args)`, at the same time (their
    start-up and teardown overlap); returns their CompletedProcesses in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_train, nproc, *args, cwd=cwd, timeout=timeout, cold=cold)
                   for nproc, args in jobs]
        return [f.result() for f in futures]


# ── A real S3 API on 127.0.0.1 (moto's server) for the s3:// paths ──────────────────

def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on a free local port; yields the AWS_* environment that
    points the project (lancedb, pyarrow, boto3) at it. Buckets are made by the tests."""
    import socket

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc.pid)
            pytest.fail(f"the moto S3 server did not start on port {port}")
        time.sleep(0.2)
    yield {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ALLOW_HTTP": "true"}
    kill_tree(proc.pid)


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """This module's tests and the processes they start use the local S3 server."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.items():
            mp.setenv(key, value)
        for key in ("AWS_ENDPOINT", "AWS_PROFILE", "AWS_SESSION_TOKEN", "S3_ENDPOINT_URL"):
            mp.delenv(key, raising=False)
        yield s3_server


def make_bucket(name):
    import boto3

    boto3.client("s3").create_bucket(Bucket=name)
    return name


# ── A small filesystem that fills up: tmpfs mounts for the disk-full tests ─────────

@pytest.fixture
def small_fs(tmp_path):
    """`small_fs(name, size_bytes)` -> a directory on a tmpfs of that size, mounted under
    tmp_path and unmounted after the test; skipped with the reason where this process may
    not mount (CI runs as root and may)."""
    mounted = []

    def mount(name: str, size_bytes: int) -> Path:
        where = tmp_path / name
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({(proc.stderr or proc.stdout).strip() or proc.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def pytest_collection_modifyitems(items):
    """The slow modules first (in their order; each module's tests keep theirs): under
    pytest-xdist the quick ones then fill the workers' last minutes, instead of one worker
    finishing a long module alone while the others idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
