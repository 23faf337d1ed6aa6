"""Seeded random workloads against the engine. Whatever the batching, chunked prefill, prefix
cache hits, preemptions and aborts did, each request's tokens are those it gets alone, and the
block manager's books balance after every step.

The hand-written engine tests pin one mechanism each on SmolLM2; these mix them at random on a
2-layer model, where a step takes milliseconds, so many interleavings fit in a few seconds.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams

BLOCK = 16
MAX_MODEL_LEN = 96
# tiny-llama's weights scaled, by the name part they contain
SCALES = {"q_proj": 4.0, "k_proj": 4.0, "v_proj": 5.0, "o_proj": 5.0, "mlp": 2.0, "model.norm": 3.0}


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama with its attention, MLP and final norm weights scaled up. The plain random
    model repeats one token whatever it reads, so stale or misplaced K/V would not change its
    output; this one's greedy tokens depend on the whole context."""
    out = tmp_path_factory.mktemp("sharp-llama")
    for path in tiny_llama_checkpoint.iterdir():
        if path.is_file():
            shutil.copy(path, out)
    weights = load_file(out / "model.safetensors")
    for name, tensor in weights.items():
        weights[name] = tensor * next((s for part, s in SCALES.items() if part in name), 1.0)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def alone(sharp_llama: Path) -> LLMEngine:
    """The oracle: one request at a time, no prefix cache, room for all of it."""
    return LLMEngine(
        EngineConfig(
            model=str(sharp_llama), dtype="float32", block_size=BLOCK, max_num_seqs=1,
            enable_prefix_caching=False, num_kv_blocks=MAX_MODEL_LEN // BLOCK + 2,
            max_model_len=MAX_MODEL_LEN,
        )
    )  # fmt: skip


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0]


def test_the_sharp_model_reads_its_whole_context(alone: LLMEngine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(300, 340))
    outputs = {tuple(run_alone(alone, [first, *prompt[1:]], params)) for first in (300, 301, 302)}
    assert len(outputs) == 3  # the first of 40 tokens changes what follows


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrives: int  # step
    aborted_at: int | None
    mid_step: bool  # aborted between the scheduler forming that step's batch and its run
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


def random_requests(rng: random.Random, count: int) -> list[Request]:
    """Prompts of 1-80 tokens: most start with one of two shared prefixes (one a whole number of
    blocks), some are exact duplicates, some one block repeated; greedy, seeded sampling or
    penalties; a few aborted, half of those between a step's scheduling and its run."""
    prefixes = [[rng.randrange(3, 3000) for _ in range(n)] for n in (2 * BLOCK, rng.randint(5, 40))]
    requests: list[Request] = []
    for i in range(count):
        draw = rng.random()
        if requests and draw < 0.15:
            prompt = list(rng.choice(requests).prompt)
        elif draw < 0.25:  # equal blocks at different positions: their hashes must differ
            prompt = [rng.randrange(3, 3000) for _ in range(BLOCK)] * rng.randint(2, 4)
        elif draw < 0.75:
            suffix = rng.choice([0, rng.randint(1, 5), BLOCK, rng.randint(1, 40)])
            prompt = rng.choice(prefixes) + [rng.randrange(3, 3000) for _ in range(suffix)]
        else:
            prompt = [rng.randrange(3, 3000) for _ in range(rng.randint(1, 80))]
        room = MAX_MODEL_LEN - len(prompt)
        max_tokens = rng.choice([1, room, rng.randint(1, min(room, 30))])
        params = rng.choice(
            [
                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, top_k=20, seed=rng.randrange(1 << 20),
                    ignore_eos=True,
                ),
                SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True,
                    repetition_penalty=1.2, presence_penalty=0.5,
                ),
            ]
        )  # fmt: skip
        arrives = rng.randint(0, 20)
        aborted_at = arrives + rng.randint(0, 25) if rng.random() < 0.15 else None
        mid_step = aborted_at is not None and rng.random() < 0.5
        requests.append(Request(f"r{i}", prompt, params, arrives, aborted_at, mid_step))
    return requests


def abort_now(engine: LLMEngine, requests: list[Request], step: int, mid_step: bool) -> None:
    for r in requests:
        if r.aborted_at == step and r.mid_step == mid_step and not r.finished:
            engine.abort_request(r.request_id)
            r.finished = True


def check_books(engine: LLMEngine) -> None:
    """Each block's reference count is the number of running sequences holding it, the free
    list holds exactly the unreferenced blocks, every cached hash names a block carrying it, and
    waiting sequences hold nothing."""
    scheduler = engine.scheduler
    manager = scheduler.block_manager
    holders = [0] * manager.num_blocks
    for seq in scheduler.running:
        assert len(set(seq.block_table)) == len(seq.block_table), seq.request_id
        for block in seq.block_table:
            holders[block] += 1
    assert [block.ref_count for block in manager.blocks] == holders
    assert set(manager.free) == {b for b, count in enumerate(holders) if count == 0}
    for block_hash, block in manager.hash_to_block.items():
        assert manager.blocks[block].hash == block_hash
    assert all(not seq.block_table for seq in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.max_num_seqs


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_give_each_request_its_tokens_alone(
    seed: int, sharp_llama: Path, alone: LLMEngine
) -> None:
    rng = random.Random(seed)
    max_num_seqs = rng.randint(1, 8)
    config = EngineConfig(
        model=str(sharp_llama), dtype="float32", block_size=BLOCK, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, rng.choice([16, 17, 31, 48, 64])),
        enable_prefix_caching=rng.random() < 0.7,
        num_kv_blocks=MAX_MODEL_LEN // BLOCK + rng.choice([0, 2, 6, 12]),
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    engine = LLMEngine(config)
    requests = random_requests(rng, 16)
    by_id = {r.request_id: r for r in requests}
    step = 0
    while engine.has_unfinished() or any(r.arrives >= step for r in requests):
        for r in requests:
            if r.arrives == step:
                engine.add_request(r.request_id, r.prompt, r.params)
        abort_now(engine, requests, step, mid_step=False)
        batch = engine.scheduler.schedule()
        abort_now(engine, requests, step, mid_step=True)
        for out in engine.execute(batch):
            request = by_id[out.request_id]
            assert not request.finished, f"{out.request_id} got a token after it ended"
            request.tokens.extend(out.new_token_ids)
            request.finished = out.finished
        check_books(engine)
        step += 1
        assert step < 2000, "the engine stopped making progress"

    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    for r in requests:
        expected = run_alone(alone, r.prompt, r.params)
        if r.aborted_at is None:
            assert r.tokens == expected, f"seed {seed}, {r.request_id}"
        else:  # what it got before the abort
            assert r.tokens == expected[: len(r.tokens)], f"seed {seed}, {r.request_id}"
