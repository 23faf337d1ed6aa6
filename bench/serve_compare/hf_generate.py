"""The in-process baseline: Hugging Face `generate` on static batches of exactly the prompts the
HTTP peers get, timed per token by a streamer and summarised by qpipe's own metrics code.

Static batches are how `generate` serves several requests at once: a batch of C prompts starts
together and ends together, so all its requests share one TTFT (batch start to the moment the
first new tokens exist) and one end. All prompts are exactly `input_len` tokens, so no padding.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress
from transformers.generation.streamers import BaseStreamer

from qpipe.bench.client import LoadResult, RequestResult
from qpipe.bench.config import LoadProfile
from qpipe.bench.dataset import BenchPrompt, Tokenizer, random_prompts
from qpipe.bench.metrics import compute_metrics
from qpipe.bench.runner import LevelResult

WARMUP_OUTPUT_LEN = 8


class TokenClock(BaseStreamer):
    """Records when each step's new tokens exist. `generate` calls `put` once with the prompt,
    then once per step with that step's tokens for the whole batch."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value: Any) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def token_times(self) -> list[float]:
        return self.puts[1:]


def level_prompts(
    tokenizer: Tokenizer, profile: LoadProfile, seed: int, index: int
) -> list[BenchPrompt]:
    """The prompts `qpipe.bench.runner.run_benchmark` sends at level `index` (its seed rule:
    options.seed + index), so HF answers the same texts as the HTTP peers."""
    return random_prompts(
        tokenizer, profile.num_prompts, profile.input_len, profile.output_len, seed + index
    )


def run_hf_generate(
    checkpoint: Path,
    tokenizer: Tokenizer,
    profiles: list[LoadProfile],
    seed: int,
    progress: Progress,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[LevelResult]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    warmup = random_prompts(tokenizer, 1, profiles[0].input_len, WARMUP_OUTPUT_LEN, seed - 1)
    _generate(model, tokenizer, warmup, WARMUP_OUTPUT_LEN)
    levels = []
    for index, profile in enumerate(profiles):
        prompts = level_prompts(tokenizer, profile, seed, index)
        task = progress.add_task(f"hf concurrency {profile.concurrency}", total=len(prompts))
        results: list[RequestResult] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), profile.concurrency):
            batch = prompts[first : first + profile.concurrency]
            results += _generate(model, tokenizer, batch, profile.output_len)
            progress.update(task, advance=len(batch))
        load = LoadResult(results, time.perf_counter() - start)
        date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        levels.append(LevelResult(profile, compute_metrics(load), date))
    return levels


def _generate(
    model: Any, tokenizer: Tokenizer, batch: list[BenchPrompt], output_len: int
) -> list[RequestResult]:
    """One static batch; every request in it gets the batch's timings."""
    import torch
    from transformers import GenerationConfig

    ids = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in batch]
    lengths = {len(i) for i in ids}
    if lengths != {batch[0].prompt_len}:
        raise ValueError(
            f"prompts re-tokenize to {sorted(lengths)} tokens, not {batch[0].prompt_len}: "
            "a static batch without padding needs equal lengths"
        )
    input_ids = torch.tensor(ids, device=model.device)
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
        eos_token_id=model.config.eos_token_id,
    )
    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            streamer=clock,
        )
    new_tokens = out.shape[1] - input_ids.shape[1]
    times = clock.token_times
    if new_tokens != output_len or len(times) != output_len:
        raise RuntimeError(
            f"generate made {new_tokens} tokens ({len(times)} steps), not {output_len}"
        )
    itl = [later - earlier for earlier, later in itertools.pairwise(times)]
    return [
        RequestResult(
            prompt_len=len(i),
            success=True,
            output_len=output_len,
            ttft=times[0] - start,
            itl=list(itl),  # a copy per request: RequestResult owns its list
            latency=times[-1] - start,
        )
        for i in ids
    ]
