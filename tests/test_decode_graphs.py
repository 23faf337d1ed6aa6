"""Decode steps through static, padded buffers (what a CUDA graph records) give the eager engine's
tokens and KV cache, on the real SmolLM2; on a GPU, replayed graphs give the eager tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qpipe.serve.config import EngineConfig
from qpipe.serve.decode_graphs import batch_buckets
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "Water boils at",
    "The quick brown fox",
    "In 1969, astronauts",
]


def run_workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Seven requests of different lengths, so decode-only steps shrink through 7..1 rows; one of
    them sampled with a seed."""
    for i, text in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True)
        if i == 2:
            params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
        engine.add_request(f"r{i}", engine.tokenizer(text).input_ids, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return tokens


def test_buckets_cover_every_batch_with_little_padding() -> None:
    for max_batch in (1, 6, 64, 100):
        buckets = batch_buckets(max_batch)
        assert buckets[-1] == max_batch and buckets == sorted(set(buckets))
        for batch in range(1, max_batch + 1):
            bucket = next(b for b in buckets if b >= batch)
            assert bucket - batch <= max(7, batch // 2)


def test_static_decode_equals_the_eager_step(smollm2_checkpoint: Path) -> None:
    config = EngineConfig(
        model=str(smollm2_checkpoint), dtype="float32", num_kv_blocks=64, max_model_len=256
    )
    eager = LLMEngine(config)
    padded = LLMEngine(config)
    runner = padded.model_runner
    if not runner.attention_kernel:
        pytest.skip("the paged attention kernel did not build here")
    graphs = runner.static_decode(max_batch=6)  # buckets 1, 2, 4, 6
    runner.decode_graphs = graphs
    batches: list[int] = []
    run = graphs.run

    def counted(*inputs: torch.Tensor) -> torch.Tensor:
        batches.append(inputs[0].shape[0])
        return run(*inputs)

    graphs.run = counted  # type: ignore[method-assign]

    assert run_workload(padded) == run_workload(eager)
    # 7 rows exceed the largest bucket and ran eagerly; 3 and 5 were padded to 4 and 6
    assert 7 not in batches and {1, 2, 3, 4, 5, 6} <= set(batches)
    # padding rows wrote only into the scratch block: every other block holds the eager cache's
    # values (to fp32 rounding: a GEMM's per-row result depends on its row count; a stray padding
    # write would differ by O(1), or land in a slot the eager cache left zero)
    scratch = runner.scratch_block
    torch.testing.assert_close(
        runner.kv_cache[:, :, :scratch], eager.model_runner.kv_cache[:, :, :scratch],
        rtol=1e-5, atol=1e-4,
    )  # fmt: skip
    assert runner.kv_cache[:, :, scratch].abs().sum() > 0
    assert eager.model_runner.kv_cache[:, :, scratch].abs().sum() == 0


def test_one_token_prompt_chunks_in_a_static_step_score_their_prompt_logprobs(
    smollm2_checkpoint: Path,
) -> None:
    """With a 3-token budget and two requests decoding, a third request's prompt advances one
    token per step: each step is all single-token rows, which the static (graph) path runs, and
    the prompt rows among them must still hand back their logits."""

    def scored(static: bool) -> list[dict[int, float] | None]:
        engine = LLMEngine(
            EngineConfig(
                model=str(smollm2_checkpoint), dtype="float32", num_kv_blocks=64,
                max_model_len=256, max_num_batched_tokens=3, max_num_seqs=3,
            )
        )  # fmt: skip
        runner = engine.model_runner
        if static:
            if not runner.attention_kernel:
                pytest.skip("the paged attention kernel did not build here")
            runner.decode_graphs = runner.static_decode(max_batch=4)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i, text in enumerate(PROMPTS[:2]):
            engine.add_request(f"busy{i}", engine.tokenizer(text).input_ids[:1], params)
        engine.step()  # both decode from now on
        prompt = engine.tokenizer(PROMPTS[2]).input_ids[:8]
        engine.add_request("scored", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
        result = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    result = out.prompt_logprobs
        assert result is not None and len(result) == len(prompt)
        return result

    static, eager = scored(static=True), scored(static=False)
    assert static[0] is None and eager[0] is None
    for a, b in zip(static[1:], eager[1:], strict=True):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_gives_the_eager_tokens(smollm2_checkpoint: Path) -> None:
    def engine(enforce_eager: bool) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(smollm2_checkpoint), device="cuda", dtype="float32",
                num_kv_blocks=64, max_model_len=256, max_num_seqs=6, enforce_eager=enforce_eager,
            )
        )  # fmt: skip

    graphed = engine(enforce_eager=False)
    assert graphed.model_runner.decode_graphs is not None
    assert run_workload(graphed) == run_workload(engine(enforce_eager=True))
