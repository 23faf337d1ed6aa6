"""Runs a test file's Triton kernels on CPU, in Triton's interpreter, and counts what they call."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """`script`'s stdout, run with `args` as a child Python with TRITON_INTERPRET=1 (and `env`),
    asserting it succeeded.
    A child, because Triton picks its interpreter when a kernel is defined: it cannot be switched
    on inside a process that has already imported the kernels."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, script, *args],  # the child imports `tests.` modules too
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def count_calls(owner: object, names: tuple[str, ...], calls: Counter[str]) -> None:
    """Replaces each named function of `owner` (a module or an object) with one that counts its
    calls in `calls`."""
    for name in names:
        inner: Callable[..., object] = getattr(owner, name)

        def call(
            *args: object, inner: Callable[..., object] = inner, name: str = name, **kw: object
        ) -> object:
            calls[name] += 1
            return inner(*args, **kw)

        setattr(owner, name, call)


def gpu_kernel_engine(checkpoint: str, **config: Any) -> Any:  # noqa: ANN401 - an LLMEngine
    """An fp32 LLMEngine on CPU whose steps take the GPU's paths: the Triton elementwise and
    attention kernels (run by the interpreter) and the metadata a GPU gets. For a child run with
    `run_interpreted(..., env={"QPIPE_CPU_KERNELS": "0"})`, so no C++ kernel takes a step."""
    from qpipe.serve.config import EngineConfig
    from qpipe.serve.engine import LLMEngine
    from qpipe.serve.layers import triton_attention, triton_elementwise

    triton_elementwise.usable = lambda x: x.dtype in triton_elementwise.DTYPES
    triton_attention.usable = lambda q: True
    # fp32 named, not left to "auto": that is bf16 on CPUs with a bf16 dot product (a Zen 4)
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", **config))
    runner = engine.model_runner
    runner.attention_kernel, runner.kernel_family = True, "triton"
    return engine
