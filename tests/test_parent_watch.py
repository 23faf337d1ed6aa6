"""A bench stage's server ends with the `qpipe run` that started it, even one killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qpipe.bench.server_process import BuiltinServer
from qpipe.serve.parent_watch import PARENT_ENV

CHILD = (
    "import time\n"
    "from qpipe.serve.parent_watch import exit_with_parent\n"
    "assert exit_with_parent()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
STARTER = (  # argv: "watch" or "plain", the variable's name, the child's code
    "import os, subprocess, sys, time\n"
    "mode, name, code = sys.argv[1:]\n"
    "env = {**os.environ, **({name: str(os.getpid())} if mode == 'watch' else {})}\n"
    "child = subprocess.Popen([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE,\n"
    "                         text=True)\n"
    "assert child.stdout.readline().strip() == 'ready'\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _orphan_after_sigkill(mode: str) -> int:
    """Starts a starter that starts a child, SIGKILLs the starter, returns the child's pid."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, mode, PARENT_ENV, CHILD], stdout=subprocess.PIPE, text=True
    )
    assert starter.stdout is not None
    child = int(starter.stdout.readline())
    starter.kill()
    starter.wait()
    return child


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_ends_when_its_starter_is_killed_outright() -> None:
    watched = _orphan_after_sigkill("watch")
    deadline = time.monotonic() + 10
    while _running(watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(watched), "the child outlived the starter it was told to watch"
    unwatched = _orphan_after_sigkill("plain")  # the control: without the variable it stays
    try:
        time.sleep(0.5)
        assert _running(unwatched)
    finally:
        os.kill(unwatched, signal.SIGKILL)


def test_the_bench_stages_server_is_told_to_watch_this_process(tmp_path: Path) -> None:
    server = BuiltinServer(tmp_path / "model", tmp_path / "server.log")
    assert server.env[PARENT_ENV] == str(os.getpid())
    assert server.command[1:4] == ("-m", "qpipe", "serve")
