"""Runs a test file's Triton kernels on CPU, in Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """`script`'s stdout, run with `args` as a child Python with TRITON_INTERPRET=1 (and `env`),
    asserting it succeeded.
    A child, because Triton picks its interpreter when a kernel is defined: it cannot be switched
    on inside a process that has already imported the kernels."""
    done = subprocess.run(
        [sys.executable, script, *args],
        env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
