"""Imported first by the loader workers' forkserver (train.FORKSERVER_PRELOAD): from here on
it ignores Ctrl-C, and so do the workers it forks.

Why: a terminal's Ctrl-C reaches the whole process group, and Python's forkserver starts to
ignore it only after its preload, which imports torch (seconds). A Ctrl-C in between printed
a KeyboardInterrupt traceback from it; its workers restore the handlers it had before that,
so they would take Ctrl-C too. The rank handles Ctrl-C: it checkpoints, and needs its
workers to feed the last step. Delete once CPython's forkserver.main ignores SIGINT before
it preloads.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
