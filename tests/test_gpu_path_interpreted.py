"""The engine on SmolLM2 (fp32) through the GPU path's kernels, in Triton's interpreter on CPU,
against transformers' greedy tokens: the elementwise kernels in every layer, the decode attention
kernel, and the kernel for every prefill chunk (fresh prompts and chunks after cached context in
one call, no SDPA: on the H200 its cuDNN backend spent ~1.2 ms of host time per call), fed by the
metadata the model runner builds for a GPU, under prefix-cache hits and chunked prefill, with
decode-only steps through the static, padded buffers that CUDA graphs record. What it leaves to a
GPU: capturing and replaying the graphs (tests/test_decode_graphs.py) and the GPU's own
arithmetic.

The child takes the C++ kernels away (QPIPE_CPU_KERNELS=0) and lets the Triton ones take CPU
tensors; the interpreter is chosen when a kernel is defined, so it runs as a child process with
TRITON_INTERPRET=1 (this file is also that child's script)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHARED = (
    "You are a helpful assistant. Answer briefly and precisely, and never make up facts. "
    "The user asks: "
)
PROMPTS = [SHARED + "What is the capital of France?", SHARED + "Who wrote Hamlet?", "Once upon"]
NEW_TOKENS = 6


def _engine_in_interpreter(checkpoint: str) -> None:
    from transformers import AutoModelForCausalLM

    from qpipe.serve.layers import triton_attention, triton_elementwise
    from qpipe.serve.sampling_params import SamplingParams
    from tests.triton_interpreter import count_calls, gpu_kernel_engine

    calls: Counter[str] = Counter()
    elementwise = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "write_kv")
    count_calls(triton_elementwise, elementwise, calls)
    count_calls(triton_attention, ("decode_attention", "context_attention"), calls)
    count_calls(F, ("scaled_dot_product_attention",), calls)
    # a fixed block count skips the profiling pass (minutes in the interpreter); a 32-token budget
    # splits prompts across steps, so later chunks continue a cached context, as the second
    # prompt's first chunk does after its prefix-cache hit
    engine = gpu_kernel_engine(
        checkpoint, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32
    )
    runner = engine.model_runner
    chunks: list[tuple[int, ...]] = []  # each step's prefill chunks: tokens of cached context
    prepare = runner._prepare

    def recording(*args: object) -> object:
        prepared = prepare(*args)
        if (meta := prepared[2].chunks) is not None:
            queries = meta.query_starts.diff()
            chunks.append(tuple((meta.seq_lens - queries).tolist()))
        return prepared

    runner._prepare = recording
    # decode-only steps through the static, padded buffers that a GPU's CUDA graphs record (run
    # here without a graph): 3 sequences in the bucket of 4, one padding row in the scratch block
    runner.decode_graphs = runner.static_decode(4)
    forwards: Counter[str] = Counter()
    count_calls(runner.model, ("final_hidden",), forwards)
    count_calls(runner.decode_graphs, ("forward",), forwards)
    prompts = [engine.tokenizer(text).input_ids for text in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got = engine.generate(prompts, params)
    assert "scaled_dot_product_attention" not in calls, calls  # before transformers' own calls
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist(), (prompt, tokens)
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 16, stats  # the second prompt reused the first's block
    assert forwards["forward"] > 0, forwards  # decode-only steps, through the static buffers
    steps, layers = forwards["final_hidden"], runner.num_layers  # the static forward's too
    assert calls["rms_norm"] == steps, calls  # the first layer's input norm
    assert calls["fused_add_rms_norm"] == steps * 2 * layers, calls  # the rest, and the final
    for name in ("rotary", "silu_and_mul", "write_kv"):
        assert calls[name] == steps * layers, calls
    assert calls["decode_attention"] > 0 and calls["context_attention"] > 0, calls
    # a step ran a fresh prompt and a chunk after cached context in one call of the kernel
    assert any(0 in step and max(step) > 0 for step in chunks), chunks
    print("ok engine", dict(calls), steps, "steps")


@pytest.mark.slow
def test_the_gpu_paths_kernels_give_transformers_greedy_tokens(smollm2_checkpoint: Path) -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__, str(smollm2_checkpoint), env={"QPIPE_CPU_KERNELS": "0"})
    assert "ok engine" in stdout, stdout


if __name__ == "__main__":
    _engine_in_interpreter(sys.argv[1])
