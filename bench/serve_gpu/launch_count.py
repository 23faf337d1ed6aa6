"""Kernel launches of one decode step on the GPU path, counted on CPU: every torch op the static
decode forward (what CUDA graphs record) dispatches, plus every Triton kernel it calls, with the
layers' elementwise steps as eager torch ops and as qpipe's Triton kernels; then those of one
eager mixed step (the engine's warm-up: a decode, a fresh prompt and a chunk after cached
context, its inputs built as any step's), which no graph records. Not a test.

    .venv/bin/python bench/serve_gpu/launch_count.py CHECKPOINT [--dtype bfloat16]

Why: on the H200 a SmolLM2 decode step took 2.7 ms at one sequence, ~40x the time to read its
weights: a small model's step is bound by how many kernels it launches. Triton runs here in its
interpreter (set below, before Triton is imported), whose own bookkeeping ops (`set_`, `copy_`)
are left out; views and allocations launch nothing and are left out too. (The GPU path's mixed
step calls no SDPA since the thirty-second session: every prefill chunk goes to the context
kernel.)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton defines a kernel
os.environ["QPIPE_CPU_KERNELS"] = "0"  # the GPU path's ops, not the C++ kernels

import argparse  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from qpipe.serve.config import EngineConfig  # noqa: E402
from qpipe.serve.engine import LLMEngine  # noqa: E402
from qpipe.serve.layers import triton_attention, triton_elementwise  # noqa: E402

NO_LAUNCH = {  # views, allocations, and no-op casts (`to` the same dtype) launch no kernel
    "view", "_unsafe_view", "split", "split_with_sizes", "slice", "t", "transpose", "expand",
    "unsqueeze", "squeeze", "permute", "select", "alias", "detach", "as_strided", "empty",
    "empty_like", "new_empty", "empty_strided", "reshape", "unbind", "flatten",
}  # fmt: skip
INTERPRETER = {"set_", "copy_"}  # the interpreter moving tensors to and from NumPy


class Launches(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # `to` that returns its input (the same dtype and device) launches nothing
        if name not in NO_LAUNCH | INTERPRETER and not (name == "to" and out is args[0]):
            self.counts[name] += 1
        return out


def counted(module: object, name: str, counts: Counter[str]) -> None:
    inner: Callable[..., None] = getattr(module, name)

    def call(*args: object) -> None:
        counts[f"triton {name}"] += 1
        inner(*args)

    setattr(module, name, call)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    counts: Counter[str] = Counter()
    names = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "write_kv")
    for name in names:
        counted(triton_elementwise, name, counts)
    counted(triton_attention, "decode_attention", counts)
    counted(triton_attention, "context_attention", counts)
    triton_attention.usable = lambda q: True  # the attention kernels, as on a GPU
    config = EngineConfig(
        model=args.checkpoint, device="cpu", dtype=args.dtype, num_kv_blocks=16, max_num_seqs=1
    )
    runner = LLMEngine(config).model_runner
    static = runner.static_decode(1)
    takes = triton_elementwise.usable
    for label, usable in (("eager torch ops", takes), ("Triton kernels", lambda x: True)):
        triton_elementwise.usable = usable  # the real one refuses CPU tensors: eager ops
        counts.clear()
        with torch.inference_mode(), Launches(counts):
            static.forward(1)
        total = sum(counts.values())
        top = ", ".join(f"{name} {n}" for name, n in counts.most_common(12))
        print(
            f"elementwise steps as {label}: {total} launches per decode step, "
            f"{total / runner.num_layers:.1f} per layer ({top})"
        )
    runner.attention_kernel, runner.kernel_family = True, "triton"  # the metadata a GPU gets
    counts.clear()
    with torch.inference_mode(), Launches(counts):
        runner.warm_up()
    top = ", ".join(f"{name} {n}" for name, n in counts.most_common(12))
    print(f"one eager mixed step: {sum(counts.values())} launches ({top})")


if __name__ == "__main__":
    main()
