"""The built-in server as a child process for the length of a benchmark.

A separate process, not an in-process app: the benchmark's client and the engine must not share one
event loop or one GIL, or the client's timing would measure itself.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


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


class BuiltinServer:
    """`with BuiltinServer(model_dir, log) as server:` serves on `server.base_url` until the block
    ends; the log file keeps the server's output for the stage's report."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        args: dict[str, str | int | float | bool] | None = None,
        startup_timeout_s: float = 600.0,
    ):
        self.model_dir = model_dir
        self.log_path = log_path
        self.args = dict(args or {})
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BuiltinServer:
        command = [
            sys.executable, "-m", "qpipe", "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), *server_flags(self.args),
        ]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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
                    f"the server exited with code {self.process.returncode} before it was healthy:"
                    f"\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"the server was not healthy within {self.startup_timeout_s:g}s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM (the server drains), then SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"
