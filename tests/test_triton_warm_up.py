"""Serving on a GPU compiles no Triton kernel after the engine has started. Triton compiles a
kernel at its first call for each new specialization of its arguments, and a compile stalls every
running request for ~0.4-0.9 s. Two things keep that out of serving: arguments that change from
step to step (the block tables' width, the weight-only kernel's row count) are excluded from the
specialization, and the engine's start runs one mixed step (`ModelRunner.warm_up`) that calls
the attention kernels the profiling pass and graph capture do not reach.

The interpreter is chosen when a kernel is defined, so the warm-up's check runs in a child
process with TRITON_INTERPRET=1 (this file is also that child's script)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from qpipe.serve.layers import triton_attention  # noqa: E402
from tests.test_triton_compile import KERNELS  # noqa: E402


def _specialization(name: str, **changed: int) -> list[object]:
    """What Triton keys the compiled variant of kernel KERNELS[name] on (its own launcher's
    binder, for sm_90) when every integer argument is 960 but those in `changed`; CPU tensors
    stand in for the pointers, floats are 0.125."""
    kernel, types, constants = KERNELS[name]
    args: dict[str, object] = {}
    for arg, kind in types.items():
        if kind.startswith("*"):
            args[arg] = torch.zeros(16)
        else:
            args[arg] = 0.125 if kind == "fp32" else 960
    binder = create_function_from_signature(
        kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32))
    )
    _, specialization, _ = binder(**(args | changed), **constants)
    return specialization


@pytest.mark.parametrize(
    ("name", "argument"),
    [
        ("decode_attention bf16", "stride_tb"),
        ("context_attention bf16", "stride_tb"),
        ("weight_only bf16", "M"),
    ],
)
def test_arguments_that_change_every_step_share_one_compiled_kernel(
    name: str, argument: str
) -> None:
    """A block table's width (its longest context in blocks) or a step's row count of 1, of a
    multiple of 16, or of anything else would each be a compile of its own."""
    variants = {str(_specialization(name, **{argument: value})) for value in (1, 9, 16, 512)}
    assert len(variants) == 1, variants
    # the same binder does tell a multiple of 16 from other values where the argument stays
    # fixed for a model's life (a stride of q): the check above could fail
    fixed = {str(_specialization(name, **{"stride_xm" if "weight" in name else "stride_qt": v}))
             for v in (960, 961)}  # fmt: skip
    assert len(fixed) == 2


def _warm_up_in_interpreter(checkpoint: str) -> None:
    from tests.triton_interpreter import count_calls, gpu_kernel_engine

    calls: Counter[str] = Counter()
    count_calls(triton_attention, ("decode_attention", "context_attention"), calls)
    engine = gpu_kernel_engine(checkpoint, num_kv_blocks=8)
    runner = engine.model_runner
    before = runner.kv_cache.clone()
    runner.warm_up()
    layers = runner.num_layers
    assert calls == {"decode_attention": layers, "context_attention": layers}, calls
    # [layers, K/V, blocks]: which blocks the step wrote into
    written = (runner.kv_cache != before).flatten(3).any(-1)
    assert written[:, :, runner.scratch_block].all(), written
    assert not written[:, :, : runner.scratch_block].any(), written  # the blocks requests get
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    print("ok warm-up")


def test_warm_up_calls_both_attention_kernels_in_the_scratch_block_in_the_interpreter(
    tiny_llama_checkpoint: Path,
) -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__, str(tiny_llama_checkpoint), env={"QPIPE_CPU_KERNELS": "0"})
    assert "ok warm-up" in stdout, stdout


def _compiled(kernel: object) -> int:
    """How many variants of a Triton kernel this process has compiled for the current GPU."""
    caches = kernel.device_caches  # type: ignore[attr-defined]
    device = torch.cuda.current_device()
    return len(caches[device][0]) if device in caches else 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_serving_on_the_gpu_compiles_nothing_after_start(tiny_llama_checkpoint: Path) -> None:
    """Mixed steps of every shape after start: decodes beside new prompts, contexts of one block
    (width 1) and of several, a prefix-cache hit and a prompt split into chunks."""
    from qpipe.serve.config import EngineConfig
    from qpipe.serve.engine import LLMEngine
    from qpipe.serve.layers import triton_elementwise
    from qpipe.serve.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_checkpoint),
            device="cuda",
            dtype="bfloat16",
            gpu_memory_utilization=0.05,
            max_num_batched_tokens=64,
        )
    )
    kernels = [
        triton_attention._decode_kernel,
        triton_attention._context_kernel,
        triton_elementwise._rms_norm_kernel,
        triton_elementwise._rotary_kernel,
        triton_elementwise._silu_and_mul_kernel,
        triton_elementwise._write_kv_kernel,
    ]
    at_start = [_compiled(kernel) for kernel in kernels]
    assert at_start[0] and at_start[1], at_start  # both attention kernels, before any request
    shared = list(range(100, 140))
    prompts = [shared + [7, 8], list(range(200, 205)), list(range(300, 500)), shared + [9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)
    assert engine.stats().prefix_cache_hits > 0
    assert [_compiled(kernel) for kernel in kernels] == at_start


if __name__ == "__main__":
    _warm_up_in_interpreter(sys.argv[1])
