"""Ctrl-C during a script's first seconds, before the script's own handling is in place.

Importing torch, lancedb and pyarrow takes seconds, and a Ctrl-C then ends in a
KeyboardInterrupt traceback: from the script itself, and from each of its worker processes,
which import the script again as `__mp_main__` (spawn, forkserver) and get the terminal's
Ctrl-C too (it goes to the whole process group). `quiet_ctrl_c(__name__)`, called before those
imports, makes the script leave with one line and exit 130, and its workers ignore Ctrl-C
(the script handles it); `script_handles_ctrl_c()` ends that once the script takes over.
"""

import os
import signal
import sys

INTERRUPTED = "interrupted while starting: nothing was written"


def quiet_ctrl_c(name: str) -> None:
    """Call first thing in a script, with its `__name__`."""
    if name == "__mp_main__":  # a worker process importing the script: Ctrl-C is the parent's
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    elif name == "__main__":
        signal.signal(signal.SIGINT, _leave)


def script_handles_ctrl_c() -> None:
    """Back to Python's KeyboardInterrupt, where quiet_ctrl_c put its own handler."""
    if signal.getsignal(signal.SIGINT) is _leave:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _leave(signum, frame) -> None:
    sys.stderr.write(INTERRUPTED + "\n")
    sys.stderr.flush()
    os._exit(130)
