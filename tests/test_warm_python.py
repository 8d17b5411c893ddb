"""tests/warm_python.py, which most of the suite's runs go through, must be indistinguishable
from `python SCRIPT` and `python -m MODULE`: the same stdout, stderr (tracebacks included), exit code or death by
signal, argv, `__name__`, atexit handlers and threads; and a killed client takes its run with it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import is_alive, kill_tree, process_tree, session_pids, wait_gone, warm_python
from warm_python import HANDLED_BY_THE_CHILD, IMPORT_TIME

SCRIPTS = {
    "exit code": "raise SystemExit(3)",
    "traceback": "def f():\n    raise ValueError('x')\nf()",
    "exit message": "import sys; sys.exit('msg')",
    "ctrl-c": "raise KeyboardInterrupt",
    "signal": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "argv and name": "import os, sys; print(sys.argv, __name__, __file__, os.getcwd(), os.environ['WARM_PROBE'])",
    "atexit and threads": """
        import atexit, threading, time
        atexit.register(lambda: print('atexit'))
        threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()
        print('main')""",
    "unbuffered stdout": "import sys; print('out'); print('err', file=sys.stderr); print('out again')",
    "torch threads": "import torch; print(torch.get_num_threads())",
}


def server_import_env():
    """This process's variables read at import time: the server's, so a run with them is warm."""
    return {name: value for name, value in os.environ.items()
            if name.startswith(IMPORT_TIME) and name not in HANDLED_BY_THE_CHILD}


@pytest.fixture(scope="module")
def warm():
    command = warm_python()
    if command is None:
        pytest.skip("TESTS_COLD_START=1: no warm interpreter to check")
    return command


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "-m"])
@pytest.mark.parametrize("source", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_a_warm_run_is_a_cold_run(warm, tmp_path, source, as_module):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(source).strip() + "\n")
    env = {**server_import_env(), "PYTHONUNBUFFERED": "1", "WARM_PROBE": "42", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    target = ["-m", "s"] if as_module else [str(script)]  # -m: found in the working directory
    runs = [subprocess.run([*prefix, *target, "an arg"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60) for prefix in ([sys.executable], warm)]
    cold, hot = ((r.returncode, r.stdout, r.stderr) for r in runs)
    assert hot == cold


def test_a_killed_client_takes_its_run_with_it_and_the_server_serves_on(warm, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
    client = subprocess.Popen([*warm, str(script)], stdout=subprocess.PIPE, text=True)
    run = int(client.stdout.readline())
    assert run != client.pid and is_alive(run)
    client.send_signal(signal.SIGTERM)  # relayed: the run dies of it, and the client as it did
    assert client.wait(timeout=30) == -signal.SIGTERM

    client = subprocess.Popen([*warm, str(script)], stdout=subprocess.PIPE, text=True)
    run = int(client.stdout.readline())
    client.kill()  # nothing to relay: the server sees the client gone
    client.wait()
    deadline = time.monotonic() + 30
    while is_alive(run) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(run)

    # and the server serves on, many runs at once, some of whose clients die as they start
    clients = [subprocess.Popen([*warm, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    for client in clients[::2]:
        client.kill()
    runs = [int(client.stdout.readline()) for client in clients[1::2]]
    for client in clients[1::2]:
        client.terminate()
    assert [client.wait(timeout=30) for client in clients] == [-signal.SIGKILL, -signal.SIGTERM] * 3
    deadline = time.monotonic() + 30
    while any(map(is_alive, runs)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(is_alive, runs))
    missing = str(tmp_path / "missing.py")
    hot, cold = (subprocess.run([*prefix, missing], capture_output=True, text=True, timeout=60)
                 for prefix in (warm, [sys.executable]))
    assert (hot.returncode, hot.stderr) == (cold.returncode, cold.stderr) == (2, hot.stderr)  # served
    hot, cold = (subprocess.run([*prefix, "-m", "no_such_module"], capture_output=True, text=True, timeout=60)
                 for prefix in (warm, [sys.executable]))
    assert (hot.returncode, hot.stderr) == (cold.returncode, cold.stderr) == (1, hot.stderr)


def test_process_tree_and_session_pids_follow_a_client_to_its_run(warm, tmp_path):
    """What the fault tests rely on to find everything a warm run started, and kill it."""
    script = tmp_path / "s.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                      "print(os.getpid(), child.pid, flush=True)\ntime.sleep(120)\n")
    client = subprocess.Popen([*warm, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    run, child = map(int, client.stdout.readline().split())
    assert process_tree(client.pid) == [client.pid, run, child]
    assert sorted(session_pids(client.pid)) == sorted([client.pid, run, child])
    killed = kill_tree(client.pid)
    assert sorted(killed) == sorted([client.pid, run, child]) and wait_gone(killed) == []
    client.wait()


IMPORT_TIME_PROBE = """
import os, sys
import torch._logging._internal as logs
seeded = "PYTHONHASHSEED" in os.environ
print(hash("warm") if seeded else "-", sorted(logs.log_state.artifact_names), sys.flags.dont_write_bytecode)
print("parent", os.getppid())
"""
CHANGES = {
    "TORCH_LOGS": lambda env: {**env, "TORCH_LOGS": "recompiles"},
    "PYTHONHASHSEED": lambda env: {**env, "PYTHONHASHSEED": "7"},
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_run_whose_import_time_environment_is_not_the_servers_starts_cold(warm, tmp_path, change):
    """TORCH_LOGS, PYTHONHASHSEED: read when torch is imported or the interpreter starts, so in a fork the server's values would hold. Such a run starts cold (its parent
    is then this process: the client exec'ed the interpreter) and sees its own; a run with
    the server's values is forked (its parent is the server)."""
    script = tmp_path / "probe.py"
    script.write_text(IMPORT_TIME_PROBE)
    base = {**server_import_env(), "PATH": "/usr/bin:/bin"}
    changed = change(base)
    cold = subprocess.run([sys.executable, script], env=changed, capture_output=True, text=True, timeout=60)
    hot = subprocess.run([*warm, script], env=changed, capture_output=True, text=True, timeout=60)
    assert hot.returncode == cold.returncode == 0, hot.stderr + cold.stderr
    assert hot.stdout.splitlines()[0] == cold.stdout.splitlines()[0]
    assert hot.stdout.splitlines()[1] == f"parent {os.getpid()}"
    same = subprocess.run([*warm, script], env=base, capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and same.stdout.splitlines()[1] != f"parent {os.getpid()}", same.stdout
