"""LLMEngine on the real SmolLM2: greedy parity with transformers under continuous batching, prefix
caching, chunked prefill, preemption, abort, seeded sampling — and no leaked KV blocks."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qpipe.serve import model_runner
from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.layers import cpu_kernels, linear
from qpipe.serve.model_runner import StepResult, prompt_logprob_rows, resolve_kv_cache_dtype
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.scheduler import ScheduledBatch, ScheduledSeq
from qpipe.serve.sequence import Sequence
from tests.agreement import teacher_forced_logits, top1_agreement, worst_rank
from tests.conftest import TEST_CACHE
from tests.model_cache import built_once

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and precisely, and never make up facts. "
    "If you do not know, say so. The user asks: "
)


@pytest.fixture(scope="module")
def engine(smollm2_engine: LLMEngine) -> LLMEngine:
    return smollm2_engine


@pytest.fixture(autouse=True)
def no_leaked_blocks(engine: LLMEngine) -> Iterator[None]:
    yield
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert stats.num_free_blocks == stats.num_total_blocks, stats


@pytest.fixture(scope="module")
def hf_model(smollm2_checkpoint: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def encode(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer(text).input_ids


def step_into(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def run_all(engine: LLMEngine, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished():
        step_into(engine, tokens)
    return tokens


def test_greedy_matches_transformers_while_other_requests_share_the_batch(
    engine: LLMEngine, hf_model: torch.nn.Module
) -> None:
    prompts = [encode(engine, p) for p in PROMPTS]
    sampled = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)
    engine.add_request("noise-0", encode(engine, "Write a poem about rain."), sampled)
    engine.add_request("greedy-0", prompts[0], GREEDY)
    tokens: dict[str, list[int]] = {}
    step_into(engine, tokens)
    step_into(engine, tokens)  # greedy-0 and noise-0 decode while the next ones prefill
    engine.add_request("greedy-1", prompts[1], GREEDY)
    engine.add_request("noise-1", encode(engine, "List three colors:"), sampled)
    step_into(engine, tokens)
    engine.add_request("greedy-2", prompts[2], GREEDY)
    run_all(engine, tokens)
    for i, prompt in enumerate(prompts):
        assert tokens[f"greedy-{i}"] == hf_greedy(hf_model, prompt, GREEDY.max_tokens), PROMPTS[i]
    assert len(tokens["noise-0"]) == len(tokens["noise-1"]) == 20


@pytest.mark.parametrize("kernel", [True, False])
def test_fresh_prompts_of_one_length_attend_in_one_call_and_match_transformers(
    engine: LLMEngine, hf_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """On CPU the paged kernel runs every query of a step in one call, through block tables; the
    SDPA path (GPU, no compiler) batches fresh prompts of one length into one call instead."""
    text = encode(
        engine,
        "Rivers carve valleys over millions of years, and the sediment they carry builds wide, "
        "fertile deltas where they finally meet the sea.",
    )
    assert len(text) >= 27
    # three of 20 tokens, one of 13; each run its own, so that neither hits the other's prefixes
    first = 0 if kernel else 1
    prompts = [text[first + i : first + i + 20] for i in (0, 3, 6)] + [text[first : first + 13]]
    runner = engine.model_runner
    if not kernel:
        monkeypatch.setattr(runner, "attention_kernel", False)
    elif not runner.attention_kernel:
        pytest.skip("the paged attention kernel did not build here")
    prepare = runner._prepare
    spans: list[tuple[int, int, int]] = []
    kernel_rows: list[list[int]] = []

    def recording(*args: object) -> object:
        prepared = prepare(*args)
        meta = prepared[2]
        spans.extend((s.num_seqs, s.num_tokens, s.context_start) for s in meta.prefills)
        if meta.query_starts is not None:
            kernel_rows.append(meta.query_starts.tolist())
        return prepared

    monkeypatch.setattr(runner, "_prepare", recording)
    outputs = engine.generate(prompts, GREEDY)
    if kernel:
        assert spans == []
        assert kernel_rows[0] == [0, 13, 33, 53, 73]  # the step's prompts, shortest first
    else:
        assert sorted(spans) == [(1, 13, 0), (3, 20, 0)]
        assert kernel_rows == []
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


class OpenAIPenalties:
    """OpenAI's documented presence/frequency rule over the generated tokens, as a logits processor
    for transformers' generate (which has the repetition penalty and the bias built in)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(len(scores)):
            for token, count in Counter(input_ids[row, self.prompt_len :].tolist()).items():
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def test_penalties_and_logit_bias_match_transformers_in_a_shared_batch(
    engine: LLMEngine, hf_model: torch.nn.Module
) -> None:
    prompt = encode(engine, PROMPTS[2])
    (the,) = encode(engine, " the")
    plain = replace(GREEDY, max_tokens=24)
    cases = {
        "repetition": (replace(plain, repetition_penalty=1.4), {"repetition_penalty": 1.4}),
        "bias": (replace(plain, logit_bias=((the, 4.0),)), {"sequence_bias": {(the,): 4.0}}),
        "openai": (
            replace(plain, presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.1),
            {
                "repetition_penalty": 1.1,
                "logits_processor": [OpenAIPenalties(len(prompt), 0.8, 1.2)],
            },
        ),
    }
    for name, (params, _) in cases.items():
        engine.add_request(name, prompt, params)
    engine.add_request("plain", prompt, plain)
    tokens = run_all(engine)
    for name, (_, hf_kwargs) in cases.items():
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, **hf_kwargs
            )
        assert tokens[name] == out[0, len(prompt) :].tolist(), name
        assert tokens[name] != tokens["plain"], f"{name} changed nothing"
    assert tokens["plain"] == hf_greedy(hf_model, prompt, 24)
    assert tokens["bias"].count(the) > tokens["plain"].count(the)
    assert max(Counter(tokens["openai"]).values()) < max(Counter(tokens["plain"]).values())


def test_prefix_cache_hits_give_the_same_tokens_and_are_counted(engine: LLMEngine) -> None:
    prompt = encode(engine, SHARED_PREFIX + "What is the boiling point of water?")
    before = engine.stats()
    (miss,) = engine.generate([prompt], GREEDY)
    engine.add_request("again", prompt, GREEDY)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    hit = [t for out in outputs for t in out.new_token_ids]
    after = engine.stats()
    cached = outputs[0].num_cached_tokens
    assert hit == miss
    assert cached == (len(prompt) - 1) // 16 * 16 and cached >= 32
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * len(prompt)


def test_min_tokens_holds_off_eos_as_transformers_min_new_tokens(
    engine: LLMEngine, hf_model: torch.nn.Module
) -> None:
    prompt = encode(engine, "Describe the ocean at night in three sentences.")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (plain,) = engine.generate([prompt], params)
    assert plain[-1] in engine.eos_token_ids and len(plain) < 5, "greedy ends at once here"
    (held,) = engine.generate([prompt], replace(params, min_tokens=5))
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=5, do_sample=False
        )
    assert held == out[0, len(prompt) :].tolist()
    assert len(held) >= 5 and not set(held[:5]) & engine.eos_token_ids


def test_identical_prompts_admitted_together_compute_their_full_blocks_once(
    engine: LLMEngine, hf_model: torch.nn.Module, smollm2_checkpoint: Path
) -> None:
    """The n choices of one prompt: the first computes the prompt, the others hit its blocks in
    the same step (as vLLM's V1 engine does), also when the prompt is prefilled in chunks."""
    prompt = encode(
        engine,
        "The old lighthouse keeper climbed the spiral stairs every evening to light the great "
        "lamp, and on the night of the worst storm in forty years he looked out to sea and saw",
    )
    full = (len(prompt) - 1) // 16 * 16
    assert full >= 32
    steps: list[int] = []
    run = engine.model_runner.run

    def recording(batch: ScheduledBatch) -> StepResult:
        steps.append(batch.num_tokens)
        return run(batch)

    before = engine.stats()
    engine.model_runner.run = recording  # type: ignore[method-assign]
    try:
        for i in range(4):
            engine.add_request(f"twin-{i}", prompt, GREEDY)
        tokens = run_all(engine)
    finally:
        del engine.model_runner.run
    assert steps[0] == len(prompt) + 3 * (len(prompt) - full)
    assert engine.stats().prefix_cache_hits - before.prefix_cache_hits == 3 * full
    expected = hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    assert all(tokens[f"twin-{i}"] == expected for i in range(4))

    # a 24-token budget: the second copy joins mid-prefill and hits only the blocks computed so far
    chunked = LLMEngine(
        EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", kv_cache_memory_gib=0.05,
            max_model_len=256, max_num_batched_tokens=24, max_num_seqs=8,
        )
    )  # fmt: skip
    assert chunked.generate([prompt, prompt], GREEDY) == [expected, expected]
    assert chunked.stats().prefix_cache_hits > 0


def test_chunked_prefill_and_preemption_give_the_same_tokens(
    engine: LLMEngine, smollm2_checkpoint: Path
) -> None:
    prompts = [encode(engine, SHARED_PREFIX + q) for q in ("Who are you?", "Name a fruit.")]
    prompts.append(encode(engine, PROMPTS[2]))  # 34 + 34 + 19 prompt tokens
    # the penalty reads the generated tokens, which a recomputed request must count again
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    reference = engine.generate(prompts, params)
    # 4 + 4 + 3 blocks at the end: 8 blocks force preemption; a 40-token budget splits the 87
    # prompt tokens into chunks.
    tight = LLMEngine(
        EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", num_kv_blocks=8,
            max_num_batched_tokens=40, max_num_seqs=40, enable_prefix_caching=False,
        )
    )  # fmt: skip
    assert tight.generate(prompts, params) == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks == 8


def collect_prompt_logprobs(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[dict[int, float] | None]], list[list[int]]]:
    """Each request's prompt logprobs (they must come exactly once) and completion tokens."""
    ids = [f"plp-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    scored: dict[str, list[dict[int, float] | None]] = {}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.prompt_logprobs is not None:
                assert out.request_id not in scored, "prompt logprobs come once"
                scored[out.request_id] = out.prompt_logprobs
    return [scored[i] for i in ids], [tokens[i] for i in ids]


def test_prompt_logprobs_equal_transformers_past_the_cache_chunks_and_preemption(
    engine: LLMEngine,
    hf_model: torch.nn.Module,
    smollm2_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What lm-eval's loglikelihood requests read (echo + logprobs): each prompt token's logprob
    and the top 2, from the model run over the whole prompt, even where the prefix cache holds
    the prompt's blocks, the prefill is chunked, or the request is preempted and replayed; the
    prompt rows are projected to the vocabulary 8 at a time here, so slices end mid-prompt."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_SLICE", 8)
    prompts = [encode(engine, SHARED_PREFIX + q) for q in ("Who are you?", "Name a fruit.")]
    prompts.append(encode(engine, PROMPTS[2]))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    greedy = engine.generate(prompts, params)  # also leaves the shared prefix in the cache
    hits = engine.stats().prefix_cache_hits
    scored, tokens = collect_prompt_logprobs(engine, prompts, params)
    assert engine.stats().prefix_cache_hits == hits, "cached blocks would skip their logprobs"
    assert tokens == greedy
    for prompt, got in zip(prompts, scored, strict=True):
        with torch.inference_mode():
            reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        assert len(got) == len(prompt) and got[0] is None
        for position, entry in enumerate(got[1:], start=1):
            expected = reference[position - 1]
            assert entry is not None
            assert entry[prompt[position]] == pytest.approx(
                expected[prompt[position]].item(), abs=2e-4
            )
            top2 = expected.topk(2).indices.tolist()
            assert set(top2) <= set(entry) and len(entry) <= 3
    tight = LLMEngine(
        EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", num_kv_blocks=8,
            max_num_batched_tokens=40, max_num_seqs=40,
        )
    )  # fmt: skip
    tight_scored, tight_tokens = collect_prompt_logprobs(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert tight_tokens == greedy
    for got, again in zip(scored, tight_scored, strict=True):
        assert len(again) == len(got)
        for a, b in zip(got[1:], again[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert list(b.values()) == pytest.approx(list(a.values()), abs=2e-4)


def test_a_replayed_chunk_scores_only_the_prompt_tokens_not_yet_scored() -> None:
    """A request preempted halfway through its prefill restarts at position 0: the positions it
    scored before are not scored again, and the last prompt position is the sampling row."""
    seq = Sequence("r", list(range(100, 120)), SamplingParams(prompt_logprobs=1))
    assert seq.prompt_logprobs is not None
    seq.prompt_logprobs += [{101 + i: -1.0} for i in range(10)]  # tokens 1..10 scored
    rows = prompt_logprob_rows([ScheduledSeq(seq, 0, 20, samples=True)])
    assert rows.flat == list(range(10, 19))  # positions 10..18 predict tokens 11..19
    assert rows.targets == list(range(111, 120))
    assert rows.request_ids == ["r"] * 9 and rows.top == [1] * 9


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    total = engine.stats().num_total_blocks
    engine.add_request("keep", encode(engine, PROMPTS[2]), GREEDY)
    engine.add_request("drop", encode(engine, PROMPTS[2] + " and his dog"), GREEDY)
    tokens: dict[str, list[int]] = {}
    step_into(engine, tokens)
    held = total - engine.stats().num_free_blocks
    engine.abort_request("drop")
    engine.abort_request("drop")  # twice, or after finishing: harmless
    assert total - engine.stats().num_free_blocks < held
    engine.add_request("never-run", encode(engine, "hello"), GREEDY)
    engine.abort_request("never-run")
    run_all(engine, tokens)
    assert set(tokens) == {"keep", "drop"}
    assert len(tokens["keep"]) == GREEDY.max_tokens and len(tokens["drop"]) == 1


def test_an_abort_between_schedule_and_execute_waits_for_its_step(
    engine: LLMEngine, hf_model: torch.nn.Module
) -> None:
    """A request aborted after `schedule` formed its batch still has its step run: the twin
    admitted with it hits the blocks that step writes, so dropping it then would leave the twin
    reading K/V that nobody wrote. Its blocks are freed once the step is done."""
    prompt = encode(engine, SHARED_PREFIX + PROMPTS[2])
    assert len(prompt) > 32  # the twin shares full blocks
    engine.add_request("first", prompt, GREEDY)
    engine.add_request("twin", prompt, GREEDY)
    batch = engine.scheduler.schedule()
    engine.abort_request("first")
    outputs = engine.execute(batch)
    assert [out.request_id for out in outputs] == ["twin"]
    stats = engine.stats()  # only the twin's blocks are held now
    held = stats.num_total_blocks - stats.num_free_blocks
    assert held == len(engine.scheduler.running[0].block_table)
    tokens = run_all(engine, {"twin": outputs[0].new_token_ids})
    assert tokens == {"twin": hf_greedy(hf_model, prompt, GREEDY.max_tokens)}


def test_seeded_sampling_and_logprobs(engine: LLMEngine) -> None:
    prompt = encode(engine, "My favourite animal is the")
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, seed=1234, logprobs=3)
    (alone,) = engine.generate([prompt], params)
    engine.add_request("seeded", prompt, params)
    engine.add_request("other", encode(engine, PROMPTS[1]), SamplingParams(max_tokens=8, seed=9))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.request_id == "seeded")
    assert [t for o in outputs for t in o.new_token_ids] == alone
    for out in outputs:
        (token,) = out.new_token_ids
        (logprobs,) = out.new_logprobs
        assert token in logprobs and 3 <= len(logprobs) <= 4
        assert all(v <= 0.0 for v in logprobs.values())
        assert max(logprobs.values()) == pytest.approx(sorted(logprobs.values())[-1])
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"


def test_bad_requests_are_rejected_with_the_reason(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * engine.max_model_len, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    outside = replace(GREEDY, logit_bias=((engine.vocab_size, 1.0),))
    with pytest.raises(ValueError, match="outside this model's vocabulary of 49152"):
        engine.add_request("bias", [1, 2, 3], outside)
    # ids past the vocabulary would index out of the embedding or the logits mid-step
    with pytest.raises(ValueError, match=r"the prompt holds token ids \[49152\]"):
        engine.add_request("prompt", [5, engine.vocab_size, 7], GREEDY)
    with pytest.raises(ValueError, match=r"the prompt holds token ids \[-3\]"):
        engine.add_request("prompt", [5, -3], GREEDY)
    with pytest.raises(ValueError, match=r"stop_token_ids holds token ids \[60000\]"):
        engine.add_request("stop", [5], replace(GREEDY, stop_token_ids=(60000,)))
    with pytest.raises(ValueError, match="stop_token_ids must be token ids >= 0"):
        replace(GREEDY, stop_token_ids=(-100000,))
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], GREEDY)
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "length" and out.num_prompt_tokens == 3
    # generate() with a bad prompt leaves none of the prompts before it queued
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1, 2], [3, 4], [1] * engine.max_model_len], GREEDY)
    assert not engine.has_unfinished() and engine.stats().num_waiting == 0


def test_a_step_that_raised_leaves_an_engine_that_says_so(tiny_llama_checkpoint: Path) -> None:
    """A failed step published its blocks to the prefix cache and left its requests waiting for
    a postprocess: later steps refuse, instead of rescheduling the same batch forever."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32",
                                    kv_cache_memory_gib=0.02, max_model_len=128))  # fmt: skip
    engine.add_request("a", [1, 2, 3], GREEDY)

    def broken(batch: object) -> None:
        raise IndexError("a kernel's bug")

    engine.model_runner.run = broken  # type: ignore[method-assign]
    with pytest.raises(IndexError):
        engine.step()
    for call in (engine.step, lambda: engine.add_request("b", [1], GREEDY)):
        with pytest.raises(RuntimeError, match="create a new LLMEngine"):
            call()


def test_an_explicit_max_model_len_is_not_capped_to_the_default(
    tiny_llama_checkpoint: Path,
) -> None:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32",
                          kv_cache_memory_gib=0.02, max_model_len_cap=256)  # fmt: skip
    assert LLMEngine(config).max_model_len == 256  # the default: the checkpoint's 2048, capped
    assert LLMEngine(replace(config, max_model_len=1024)).max_model_len == 1024


def test_auto_dtype_is_16_bit_only_where_the_hardware_multiplies_16_bit_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qpipe.serve.loader import resolve_dtype

    for flags, dtype in [
        ("fpu avx512f amx_bf16 amx_tile", torch.bfloat16),  # Sapphire Rapids
        ("fpu avx512f avx512_bf16 avx512_vnni", torch.bfloat16),  # Zen 4
        ("fpu avx512f avx512_vnni", torch.float32),  # Cascade Lake
        ("fpu avx2 fma", torch.float32),  # Zen 3
    ]:
        monkeypatch.setattr(cpu_kernels, "cpuinfo", lambda key, f=flags: f)
        assert resolve_dtype("auto", "cpu", {"dtype": "float32"}) is dtype, flags
        assert resolve_dtype("auto", "cpu", {"dtype": "bfloat16"}) is dtype, flags
    assert resolve_dtype("auto", "cuda", {"dtype": "float16"}) is torch.float16
    assert resolve_dtype("auto", "cuda", {"dtype": "float32"}) is torch.bfloat16
    assert resolve_dtype("float32", "cuda", {}) is torch.float32


def test_kv_cache_dtype_is_checked_and_fp8_on_a_gpu_needs_ada_or_hopper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'bfloat16'"):
        EngineConfig(model=str(tmp_path), kv_cache_dtype="int8")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) is torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu) is torch.float8_e4m3fn
    # a checkpoint with calibrated fp8 KV scales: auto follows it, an explicit dtype overrides it
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, True) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu, True) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9 .* this GPU is 8.0"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda, True) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cuda) is torch.float8_e4m3fn


def test_float16_on_cpu_is_served_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from qpipe.serve.loader import resolve_dtype

    with caplog.at_level(logging.WARNING, logger="qpipe.serve.loader"):
        assert resolve_dtype("float16", "cuda", {}) is torch.float16
        assert not caplog.records
        assert resolve_dtype("float16", "cpu", {}) is torch.float16
    assert "pass --dtype bfloat16" in caplog.text


@pytest.mark.parametrize(
    ("kv_cache_dtype", "stored", "narrower", "agreement", "kernels"),
    [
        ("bfloat16", torch.bfloat16, 2, 0.98, True),
        ("fp8", torch.float8_e4m3fn, 4, 0.95, True),
        ("fp8", torch.float8_e4m3fn, 4, 0.95, False),  # torch ops only: the GPU's write path
    ],
)
def test_a_narrower_kv_cache_holds_more_tokens_and_still_tracks_transformers(
    engine: LLMEngine,
    smollm2_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str,
    stored: torch.dtype,
    narrower: int,
    agreement: float,
    kernels: bool,
) -> None:
    """fp32 compute over a bf16 or fp8 KV cache of the same size in bytes: 2x or 4x the blocks.
    Greedy tokens against transformers' fp64 logits, teacher-forced; a prefix-cache hit reads
    the rounded values the miss attended to, so it gives the miss's tokens exactly. Measured here
    on 5 prompts x 48 tokens: the bf16 cache gave the fp32 cache's 240 tokens, fp8 a top-1
    agreement of 0.96 (fp32: 1.0), no token below second place; on these 72, 1.0 and 0.986
    (0.986 through the torch ops as well)."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    narrow = LLMEngine(replace(engine.model_runner.config, kv_cache_dtype=kv_cache_dtype))
    runner = narrow.model_runner
    assert runner.attention_kernel is kernels
    assert runner.kv_cache.dtype is stored and runner.dtype is torch.float32
    assert runner.block_bytes * narrower == engine.model_runner.block_bytes
    assert runner.num_kv_blocks >= narrower * engine.model_runner.num_kv_blocks

    prompts = [encode(narrow, p) for p in PROMPTS]
    outs = narrow.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    exact = teacher_forced_logits(smollm2_checkpoint, prompts, outs, torch.float64)
    tokens = [torch.tensor(out) for out in outs]
    assert top1_agreement(exact, tokens) >= agreement
    assert worst_rank(exact, tokens) <= 1

    prompt = encode(narrow, SHARED_PREFIX + "What is the boiling point of water?")
    (miss,) = narrow.generate([prompt], GREEDY)
    hits = narrow.stats().prefix_cache_hits
    assert narrow.generate([prompt], GREEDY) == [miss]
    assert narrow.stats().prefix_cache_hits - hits >= 32
    stats = narrow.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bf16_serving_keeps_a_bf16_cache_and_tracks_transformers_bf16(
    smollm2_checkpoint: Path,
) -> None:
    """bf16 (the CPU default where AMX exists) on the real model, against transformers' fp64
    load, with its bf16 load as the yardstick. Without a bf16 dot product (AVX512-BF16, AMX) the
    weights sit in bf16 tiles and are summed in fp32 (`dense_linear`); with AVX512-BF16 and no
    AMX they sit in the pair tiles of its dot product; elsewhere on oneDNN. Measured on a Zen 3,
    72 tokens: top-1 agreement 0.986, transformers' bf16 0.986."""
    bf16 = LLMEngine(
        EngineConfig(model=str(smollm2_checkpoint), dtype="bfloat16", kv_cache_memory_gib=0.05)
    )
    assert bf16.model_runner.kv_cache.dtype is torch.bfloat16
    packed = bf16.model_runner.model.layers[0].qkv_proj.packed
    if cpu_kernels.load() and not linear.has_bf16_dot_product():
        assert packed.dtype is torch.bfloat16 and packed.shape[1:] == (576, cpu_kernels.TILE)
    if linear.bf16_pair_tiles_serve(576):
        assert packed.dtype is torch.bfloat16 and packed.shape[1:] == (288, 2 * cpu_kernels.TILE)
    prompts = [bf16.tokenizer(p).input_ids for p in PROMPTS]
    outs = bf16.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    tokens = [torch.tensor(out) for out in outs]
    exact = teacher_forced_logits(smollm2_checkpoint, prompts, outs, torch.float64)
    yardstick = teacher_forced_logits(smollm2_checkpoint, prompts, outs, torch.bfloat16)
    their_agreement = top1_agreement(exact, [rows.argmax(-1) for rows in yardstick])
    assert top1_agreement(exact, tokens) >= their_agreement - 0.03  # two flips in 72 tokens
    assert worst_rank(exact, tokens) <= 2
    stats = bf16.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_bf16_checkpoint_served_in_fp32_keeps_bf16_weights_and_matches_transformers(
    smollm2_checkpoint: Path,
) -> None:
    """SmolLM2 saved in bf16 (as it is published) and served with --dtype float32: where the
    weights go to the tile kernel they stay in bf16 tiles (half fp32's memory), and the greedy
    tokens equal transformers' fp32 load of the same checkpoint, token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(smollm2_checkpoint).save_pretrained(tmp)

    checkpoint = built_once(TEST_CACHE / "smollm2-135m-bf16", build)
    served = LLMEngine(
        EngineConfig(model=str(checkpoint), dtype="float32", kv_cache_memory_gib=0.05)
    )
    packed = served.model_runner.model.layers[0].gate_up_proj.packed
    if cpu_kernels.load() and linear._fp32_tiles_beat_mkl():
        assert packed.dtype is torch.bfloat16 and packed.shape == (192, 576, cpu_kernels.TILE)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [served.tokenizer(p).input_ids for p in PROMPTS]
    outs = served.generate(prompts, GREEDY)
    assert outs == [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in prompts]
    stats = served.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_freed_memory_stays_in_the_process_on_glibc() -> None:
    """glibc takes the raised mmap/trim thresholds (mallopt returns 1 for each)."""
    import platform

    from qpipe.serve.host_memory import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True


def test_the_whole_model_lands_on_the_serving_device(smollm2_checkpoint: Path) -> None:
    """Off the CPU, every tensor of the model must be on the target device: a tensor kept outside
    nn.Module's parameters and buffers is not moved by `.to()` (the first run on a GPU found the
    embedding left on the CPU). No GPU here: the meta device stands in for it. The tied LM head
    stays the embedding's tensor, not a second copy."""
    from qpipe.serve.loader import load_model

    model = load_model(smollm2_checkpoint, torch.float32, "meta", 64, batch_hint=8)
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.device.type for t in tensors} == {"meta"}
    assert model.embed_tokens.device.type == "meta"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens
