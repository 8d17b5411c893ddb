"""A warm interpreter for the tests' runs of the project's scripts (and torchrun's).

Every `python train.py ...` the suite starts spends about 5 s of CPU importing torch,
torch._dynamo (the optimizer's first step imports it) and lancedb's dependencies before its
first line of its own; the run itself often takes a fraction of that, and the suite starts
hundreds. This server imports those once and forks a child per run, which then runs the
script as `python SCRIPT ARGS` would: its own argv, working directory, environment, stdin,
stdout and stderr, session, default signal handlers, `__name__ == "__main__"`, exit code
(or death by signal), atexit handlers and non-daemon threads joined at exit.

Not preloaded: lancedb itself, whose import starts an event-loop thread that a fork would
leave dead in the child (its dependencies, pyarrow, pandas and lance-namespace's models, are
safe). The server runs nothing of torch's, so no thread pool exists to be forked.

What differs from a cold start, and why the suite keeps cold starts where it matters:
- a warning printed while importing the preloaded modules would go to the server's stderr,
  not the run's: the server refuses to start if its preload prints anything;
- the run's process is a child of the server, not of the client, in a session of its own:
  the server records each client's run in runs/CLIENT_PID beside its socket, which
  conftest's process_tree and session_pids follow. Its command line, environment block
  (/proc/PID/environ) and parent are the server's: tests that find processes by those, or
  whose run must outlive or notice its parent, start their runs cold;
- library state set from the environment at import time is the server's, except
  OMP_NUM_THREADS (torchrun sets it for its ranks), which the child applies to torch. So a
  run whose environment differs from the server's in a variable read at import time
  (`IMPORT_TIME`: TORCH_LOGS, TORCHINDUCTOR_*, TORCHDYNAMO_*, HF_*, PYTHONHASHSEED and the
  other PYTHON* settings that -X options mirror, ...) is run cold by its client (it execs the
  interpreter; the server writes the environment its imports saw beside its socket): a test
  that sets TORCH_LOGS sees its logs.
- the server forks: its preload must leave no thread of Python's running and CUDA
  uninitialised, or it refuses to start. (torch's and pyarrow's own native threads, an
  idle pool and jemalloc's, are re-made or not needed in a fork: their libraries' atfork
  handlers see to it.)

    python tests/warm_python.py serve SOCKET    the server (conftest starts one per test process)
    python tests/warm_python.py SOCKET (SCRIPT | -m MODULE) [ARGS...]   one run: this client passes its
        stdio, directory and environment to the server, relays signals to the run, and exits
        as the run did; killed, it takes the run (its whole process group) with it.
"""

import contextlib
import io
import json
import os
import signal
import socket
import struct
import sys

# Environment variables read when a library is imported (or the interpreter starts), which a
# forked run would see as the server saw them: prefixes, and the exceptions the child handles.
IMPORT_TIME = ("TORCH_LOGS", "TORCH_COMPILE", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_SHOW_", "PYTORCH_",
               "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "ARROW_", "NUMPY_", "MKL_", "OPENBLAS_",
               "KMP_", "GOMP_")
HANDLED_BY_THE_CHILD = {"PYTHONUNBUFFERED", "PYTHONPATH", "OMP_NUM_THREADS"}

# Not torch.distributed.run itself: run as `-m` after an import, runpy warns on stderr.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.launcher.api", "numpy", "pyarrow",
           "pyarrow.dataset", "pyarrow.parquet", "pyarrow.compute", "pandas", "pydantic", "lance_namespace",
           "tokenizers", "transformers", "tqdm")


def send_msg(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0  # the fds ride on the first bytes
    sock.sendall(payload[sent:])


def recv_msg(sock, maxfds=0):
    """One length-prefixed JSON message (and up to `maxfds` file descriptors); None at EOF."""
    head, fds = b"", []
    while len(head) < 4:
        if maxfds:
            chunk, got, _, _ = socket.recv_fds(sock, 4 - len(head), maxfds)
            fds += got
        else:
            chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    size, data = struct.unpack("!I", head)[0], b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return (json.loads(data), fds) if maxfds else json.loads(data)


# ── The server ───────────────────────────────────────────────────────────────────────

def preload():
    """Import PRELOAD (what is installed of it); fail if anything is printed meanwhile."""
    import importlib

    real = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = captured = io.StringIO()
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    finally:
        sys.stdout, sys.stderr = real
    if captured.getvalue():
        raise SystemExit(f"warm_python: importing {', '.join(PRELOAD)} printed:\n{captured.getvalue()}")
    # A run imports the project's modules from its script's directory; none may be here already.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = {name[:-3] for name in os.listdir(repo) if name.endswith(".py")} & set(sys.modules)
    if ours:
        raise SystemExit(f"warm_python: the preload imported modules named as the project's: {sorted(ours)}")
    import threading

    import torch

    if torch.cuda.is_initialized():
        raise SystemExit("warm_python: the preload initialised CUDA, which a forked run cannot use")
    if threading.active_count() != 1:
        raise SystemExit(f"warm_python: the preload left threads running, which a fork would not copy "
                         f"(but their locks): {[t.name for t in threading.enumerate()]}")


def import_time_differences(env: dict, server_env: dict) -> list[str]:
    """The variables read at import time whose value in a run's `env` is not the one the
    server's imports saw (`server_env`)."""
    names = {name for name in (*env, *server_env) if name.startswith(IMPORT_TIME)} - HANDLED_BY_THE_CHILD
    return sorted(name for name in names if env.get(name) != server_env.get(name))


def serve(path):
    import selectors
    import traceback

    imported_with = {name: value for name, value in os.environ.items() if name.startswith(IMPORT_TIME)}
    preload()
    with open(path + ".env.tmp", "w") as f:
        json.dump(imported_with, f)
    os.replace(path + ".env.tmp", path + ".env")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    registry = os.path.join(os.path.dirname(path), "runs")  # client pid -> its run's pid, for the tests
    os.makedirs(registry, exist_ok=True)
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    sel.register(sys.stdin, selectors.EVENT_READ, ("parent", None))  # EOF: the test process is gone
    runs = {}  # pid -> (client socket or None once it is gone, pidfd)

    def kill_run(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the run and what it started in its session
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a run killed before its setsid

    def start_run(conn):
        got = recv_msg(conn, maxfds=3)
        if got is None:
            conn.close()
            return
        request, fds = got
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sel.close()
            listener.close()
            for other, pidfd in runs.values():  # nothing of the other runs stays open in this one
                os.close(pidfd)
                if other is not None:
                    other.close()
            run_child(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        entry = os.path.join(registry, str(request["client"]))
        with open(entry + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(entry + ".tmp", entry)  # kept after the run: a test looks for what it left
        runs[pid] = (conn, os.pidfd_open(pid))
        sel.register(runs[pid][1], selectors.EVENT_READ, ("exited", pid))
        sel.register(conn, selectors.EVENT_READ, ("client", pid))
        with contextlib.suppress(OSError):  # a client gone by now is seen as gone next
            send_msg(conn, {"pid": pid})

    def run_exited(pid):
        conn, pidfd = runs.pop(pid)
        _, status = os.waitpid(pid, 0)
        sel.unregister(pidfd)
        os.close(pidfd)
        if conn is not None:
            sel.unregister(conn)
            with contextlib.suppress(OSError):
                send_msg(conn, {"status": status})
            conn.close()

    def client_gone(pid):
        """The client's end is readable: it sends nothing after its request, so it closed
        (it died): the run goes with it."""
        conn, pidfd = runs[pid]
        sel.unregister(conn)
        conn.close()
        runs[pid] = (None, pidfd)
        kill_run(pid)

    while True:
        for key, _ in sel.select():
            kind, pid = key.data
            try:
                if kind == "parent":
                    if not os.read(sys.stdin.fileno(), 1):
                        for pid in runs:
                            kill_run(pid)
                        return
                elif kind == "accept":
                    conn, _ = listener.accept()
                    try:
                        start_run(conn)
                    except OSError:  # the client died while asking: nothing was started
                        conn.close()
                elif pid in runs and (kind == "exited" or runs[pid][0] is not None):  # not handled earlier in this batch
                    (run_exited if kind == "exited" else client_gone)(pid)
            except Exception:  # the server serves on: one run's trouble is that run's
                traceback.print_exc()


def run_child(conn, request, fds):
    """In the forked child: become `python SCRIPT ARGS` (or `python -m MODULE ARGS`) and run it
    to the end."""
    import atexit
    import runpy
    import threading

    os.setsid()  # a session and process group of its own, as the client's Popen asked
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by OpenMP when torch loaded, in the server: as then
        import torch

        torch.set_num_threads(int(threads))
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), errors="strict")
    sys.stdout = io.TextIOWrapper(io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  write_through=unbuffered, line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  errors="backslashreplace", write_through=True, line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    argv = request["argv"]
    code, by_signal = 0, None
    if argv[0] == "-m":  # python -m MODULE ARGS: runpy's own entry for it
        sys.argv, first = ["-m", *argv[2:]], runpy._run_module_as_main.__code__.co_filename
        sys.path[0] = os.getcwd()
        run = lambda: runpy._run_module_as_main(argv[1])  # noqa: E731
    else:
        script = first = os.path.abspath(argv[0])
        sys.argv = argv
        sys.path[0] = os.path.dirname(script)
        if not os.path.isfile(script):
            print(f"{sys.executable}: can't open file {argv[0]!r}: [Errno 2] No such file or directory",
                  file=sys.stderr)
            os._exit(2)
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra  # as the interpreter puts $PYTHONPATH after the script's directory
    try:
        run()
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        report(first)
        by_signal = signal.SIGINT
    except BaseException:
        report(first)
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    if by_signal:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code)


def report(first):
    """Print the exception being handled as the interpreter would: its traceback starts at the
    first frame of file `first` (the script, or runpy's for -m), without this module's."""
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename != first:
        tb = tb.tb_next
    if tb is not None:
        value = value.with_traceback(tb)
    sys.excepthook(kind, value, value.__traceback__)


def exit_code(code):
    """What the interpreter exits with for SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ── The client ───────────────────────────────────────────────────────────────────────

def client(path, argv):
    with open(path + ".env") as f:
        if import_time_differences(dict(os.environ), json.load(f)):  # the server's imports saw other values
            os.execv(sys.executable, [sys.executable, *argv])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    send_msg(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "client": os.getpid()},
             fds=(0, 1, 2))
    started = recv_msg(sock)
    if started is None:
        sys.exit("warm_python: the server went away")
    pid = started["pid"]

    def relay(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, relay)
    reply = recv_msg(sock)
    if reply is None:
        sys.exit("warm_python: the server went away")
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
