"""A server started for a benchmark ends with the process that started it.

The pipeline's bench stage runs `qpipe serve` as a child. Stopping it in `__exit__` covers every
way the stage can end except its own process being killed outright: a `kill -9` of `qpipe run`
(a CI job's hard timeout) left the server running under PID 1, holding the model and its KV cache
(3.4 GB resident for SmolLM2's bench) and its port.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "QPIPE_EXIT_WITH_PARENT"  # the starter's pid
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent() -> bool:
    """Where the starter set `QPIPE_EXIT_WITH_PARENT` to its pid, asks Linux to send this process
    SIGTERM (the server's graceful drain) when the starting thread dies, however it dies; returns
    False if the starter is already gone, which the request cannot cover. Elsewhere, or without
    the variable, does nothing and returns True."""
    value = os.environ.get(PARENT_ENV)
    if not value:
        return True
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == int(value)
