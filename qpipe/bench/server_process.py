"""A server as a child process for the length of a benchmark: qpipe's own, or any other.

A separate process, not an in-process app: the benchmark's client and the engine must not share one
event loop or one GIL, or the client's timing would measure itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from qpipe.serve.parent_watch import PARENT_ENV

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 30.0


class ServerStartError(Exception):
    """The server exited or never became healthy; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_flags(args: dict[str, str | int | float | bool]) -> list[str]:
    """`{"max_num_seqs": 8, "enable_prefix_caching": False}` → `--max-num-seqs 8
    --no-enable-prefix-caching` (the `qpipe serve` options)."""
    flags = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


class ServerProcess:
    """`with ServerProcess(...) as server:` serves on `server.base_url` until the block ends.

    With `own_session` the server runs in its own process group, for servers that spawn workers
    (vLLM's engine core, compile workers): stopping only the leader would leave them holding the
    CPU. Without it the server stays in the caller's group, so a signal to the caller's group (a CI
    timeout, Ctrl-C) reaches it too. Stopping is in `__exit__` either way. `command` must bind
    127.0.0.1:`port` and answer GET /health with 200 once it can serve."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        own_session: bool = True,
    ):
        self.name = name
        self.own_session = own_session
        self.command = tuple(command)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.env = dict(env or {})  # on top of this process's environment
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=self.own_session,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.process.returncode} before it was "
                    f"healthy (log: {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise ServerStartError(
            f"{self.name} was not healthy within {self.startup_timeout_s:g}s "
            f"(log: {self.log_path}):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM (qpipe's server drains), SIGKILL to whatever is left after the grace period;
        to the whole group when the server has its own session."""
        if self.process is None:
            return
        if not self.own_session:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            return
        group = self.process.pid  # the leader of a new session is its group's id
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _group_alive(group) and time.monotonic() < deadline:
            self.process.poll()  # reap the leader so it does not count as alive
            time.sleep(0.2)
        _signal_group(group, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"


class BuiltinServer(ServerProcess):
    """`qpipe serve MODEL_DIR` on a free port; the log file keeps the server's output for the
    stage's report."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        args: dict[str, str | int | float | bool] | None = None,
        startup_timeout_s: float = 600.0,
    ):
        port = free_port()
        command = [
            sys.executable, "-m", "qpipe", "serve", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), *server_flags(dict(args or {})),
        ]  # fmt: skip
        # it also ends if this process is killed outright (a CI job's SIGKILL): parent_watch.py
        env = {PARENT_ENV: str(os.getpid())}
        super().__init__(
            "the server", command, port, log_path, env, startup_timeout_s, own_session=False
        )


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
