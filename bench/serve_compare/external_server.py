"""A benchmark peer's server as a child process in its own session, for the length of one block.

Its own session (process group) because servers spawn workers (vLLM's engine core, compile
workers): stopping only the leader would leave them holding the CPU for the next peer. Stopping is
in `__exit__`, so an exception or Ctrl-C in the block still takes the whole group down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

HEALTH_POLL_S = 1.0
STOP_GRACE_S = 30.0


class ServerStartError(Exception):
    """The server exited or never became healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: `command` must bind 127.0.0.1:`port` and answer GET /health with
    200 once it can serve (llama-server answers 503 while it loads the model)."""

    name: str
    command: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)  # on top of this process's environment
    startup_timeout_s: float = 600.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ExternalServer:
    """`with ExternalServer(spec, log_path) as server:` serves on `server.spec.base_url`."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ExternalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.spec.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env},
                start_new_session=True,
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
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.spec.name} exited with code {self.process.returncode} before it was "
                    f"healthy (log: {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.spec.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise ServerStartError(
            f"{self.spec.name} was not healthy within {self.spec.startup_timeout_s:g}s "
            f"(raise --startup-timeout; log: {self.log_path}):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to whatever is left after the grace period."""
        if self.process is None:
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


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
