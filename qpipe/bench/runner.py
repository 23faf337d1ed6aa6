"""Runs load profiles one after another against one endpoint and collects their figures.

Shared by `qpipe bench` and the pipeline's bench stage. Each level and repeat gets its own prompts,
and the warm-up one no level sends, so a server's prefix cache cannot carry one level's prompts into
the next.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qpipe.bench.client import RequestResult, Target, run_load, send_request
from qpipe.bench.config import LoadProfile
from qpipe.bench.dataset import BenchPrompt, Tokenizer, prompt_sets
from qpipe.bench.metrics import BenchMetrics, compute_metrics

WARMUP_OUTPUT_LEN = 8


class BenchError(Exception):
    """The benchmark cannot run (endpoint down, wrong model, bad dataset): what and how to fix."""


@dataclass(frozen=True)
class BenchOptions:
    """What stays the same across the levels of one benchmark."""

    dataset: str = "random"
    burstiness: float = 1.0
    goodput: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


@dataclass(frozen=True)
class LevelResult:
    profile: LoadProfile
    metrics: BenchMetrics
    date: str

    def profile_label(self, dataset: str) -> str:
        """The history key for this load shape: runs compare only within one label."""
        p = self.profile
        rate = "inf" if p.request_rate is None else f"{p.request_rate:g}"
        shape = f"out{p.output_len}:c{p.concurrency}:rate{rate}:n{p.num_prompts}"
        if dataset == "random":
            return f"random:in{p.input_len}:{shape}"
        return f"{Path(dataset).name}:{shape}"

    def to_json(self, target: Target, options: BenchOptions, tokenizer_id: str | None) -> dict:
        """One result object with `vllm bench serve`'s top-level keys plus the figures."""
        return {
            "date": self.date,
            "backend": "openai-chat" if target.chat else "openai",
            "endpoint": target.url,
            "model_id": target.model,
            "tokenizer_id": tokenizer_id,
            "dataset": options.dataset,
            "num_prompts": self.profile.num_prompts,
            "input_len": self.profile.input_len,
            "output_len": self.profile.output_len,
            "request_rate": "inf"
            if self.profile.request_rate is None
            else self.profile.request_rate,
            "burstiness": options.burstiness,
            "max_concurrency": self.profile.concurrency,
            "goodput_slos_ms": options.goodput or None,
            **self.metrics.to_json(),
        }


def run_benchmark(
    target: Target,
    profiles: list[LoadProfile],
    options: BenchOptions,
    tokenizer: Tokenizer | None,
    show_progress: bool = True,
) -> list[LevelResult]:
    """Warm up, then every profile in order, with a progress bar per level."""
    return asyncio.run(_run_all(target, profiles, options, tokenizer, show_progress))


async def _run_all(
    target: Target,
    profiles: list[LoadProfile],
    options: BenchOptions,
    tokenizer: Tokenizer | None,
    show_progress: bool,
) -> list[LevelResult]:
    warm_up = LoadProfile(input_len=16, output_len=WARMUP_OUTPUT_LEN, concurrency=1, num_prompts=1)
    if options.warmup:
        # NOTE: the warm-up set comes first, with seed - 1: level i's random prompts keep seed + i.
        (warm_up_prompts, *level_prompts) = _prompt_sets(
            options, tokenizer, [warm_up, *profiles], options.seed - 1
        )
        await _warm_up(target, options, replace(warm_up_prompts[0], output_len=WARMUP_OUTPUT_LEN))
    else:
        level_prompts = _prompt_sets(options, tokenizer, profiles, options.seed)
    levels = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        disable=not show_progress,
    ) as progress:
        for index, (profile, prompts) in enumerate(zip(profiles, level_prompts, strict=True)):
            task = progress.add_task(
                f"concurrency {profile.concurrency}", total=len(prompts), failed=0
            )

            def advance(result: RequestResult, task: int = task) -> None:
                progress.update(task, advance=1)
                if not result.success:
                    failed = progress.tasks[task].fields["failed"] + 1
                    progress.update(task, failed=failed)

            load = await run_load(
                target,
                prompts,
                profile.concurrency,
                profile.request_rate,
                options.burstiness,
                options.seed + index,
                tokenizer,
                on_done=advance,
            )
            try:
                metrics = compute_metrics(load, options.goodput)
            except ValueError as exc:
                raise BenchError(str(exc)) from exc
            date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            levels.append(LevelResult(profile, metrics, date))
    return levels


def _prompt_sets(
    options: BenchOptions, tokenizer: Tokenizer | None, profiles: list[LoadProfile], seed: int
) -> list[list[BenchPrompt]]:
    try:
        return prompt_sets(options.dataset, tokenizer, profiles, seed)
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from exc


async def _warm_up(target: Target, options: BenchOptions, prompt: BenchPrompt) -> None:
    """A few short requests outside the timing: they load lazy kernels and, when they fail, stop the
    run with the server's own answer instead of a table of identical failures."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.read_timeout_s, connect=10.0)) as c:
        for _ in range(options.warmup):
            result = await send_request(c, target, prompt)
            if not result.success:
                raise BenchError(
                    f"warm-up request to {target.url} (model {target.model!r}) failed: "
                    f"{result.error}. Check the endpoint, --model and that the server is up."
                )
