"""One evaluation of a candidate against its baseline: distribution checks, lm-eval tasks, gates.

Shared by the `evaluate` stage and `qpipe eval`; it writes nothing but lm-eval's task YAMLs and
logged samples into `work_dir` (report.py writes the report).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qpipe.data import WIKITEXT2_TEST
from qpipe.evaluate.config import EvaluateConfig
from qpipe.evaluate.distribution import (
    DistributionStats,
    compare_distributions,
    distribution_comparisons,
    token_windows,
)
from qpipe.evaluate.gates import check_gates
from qpipe.evaluate.models import ModelRef, load_causal_lm
from qpipe.evaluate.significance import Comparison, compare_items
from qpipe.evaluate.tasks import TaskScores, lm_eval_model, run_task, task_yaml
from qpipe.stages.base import GateVerdict


@dataclass(frozen=True)
class EvalReport:
    baseline: str
    candidate: str
    comparisons: list[Comparison]
    gate: GateVerdict
    distribution: DistributionStats | None = None
    text_file: str | None = None
    tasks: dict[str, tuple[TaskScores, TaskScores]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def evaluate(
    baseline: ModelRef,
    candidate: ModelRef,
    config: EvaluateConfig,
    work_dir: Path,
    resolve: Callable[[str], Path] = lambda p: Path(p).expanduser().resolve(),
) -> EvalReport:
    """Compare candidate with baseline as `config` asks; gates are checked, not raised."""
    for ref in (baseline, candidate):
        ref.check()
    comparisons: list[Comparison] = []
    notes: list[str] = []
    stats = None
    text_file = resolve(config.text) if config.text else WIKITEXT2_TEST
    if baseline.is_endpoint or candidate.is_endpoint:
        notes.append(
            "distribution checks (perplexity, KLD, top-1 agreement) skipped: they need both "
            "models' logits, so both must be checkpoint directories; only lm-eval tasks ran"
        )
    elif config.max_tokens == 0:
        notes.append("distribution checks off (max_tokens: 0)")
    else:
        if not text_file.is_file():
            raise FileNotFoundError(f"evaluate.text: {text_file} does not exist")
        stats = distribution_pass(baseline, candidate, config, text_file)
        comparisons += distribution_comparisons(
            stats,
            iterations=config.bootstrap_iterations,
            confidence=config.confidence,
            seed=config.seed,
        )
    base_scores = run_tasks(baseline, config, work_dir, resolve, "baseline")
    cand_scores = run_tasks(candidate, config, work_dir, resolve, "candidate")
    tasks = {task.name: (base_scores[task.name], cand_scores[task.name]) for task in config.tasks}
    for name, (base, cand) in tasks.items():
        if base.doc_ids != cand.doc_ids:
            raise RuntimeError(
                f"task {name!r}: baseline and candidate were scored on different items"
            )
        for metric in base.metrics:
            comparisons.append(
                compare_items(
                    f"{name}/{metric}",
                    base.items[metric],
                    cand.items[metric],
                    iterations=config.bootstrap_iterations,
                    confidence=config.confidence,
                    seed=config.seed,
                )
            )
    return EvalReport(
        baseline=baseline.spec,
        candidate=candidate.spec,
        comparisons=comparisons,
        gate=check_gates(config.max_drop, comparisons),
        distribution=stats,
        text_file=str(text_file) if stats is not None else None,
        tasks=tasks,
        notes=notes,
    )


def distribution_pass(
    baseline: ModelRef, candidate: ModelRef, config: EvaluateConfig, text_file: Path
) -> DistributionStats:
    import torch
    from rich.progress import track
    from transformers import AutoTokenizer

    from qpipe.console import console

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(baseline.path)
    windows = token_windows(text_file, tokenizer, config.max_tokens, config.window).to(device)
    start = time.perf_counter()
    models = [load_causal_lm(ref, config.dtype).to(device) for ref in (baseline, candidate)]
    with torch.inference_mode():
        for model in models:
            # NOTE: compressed-tensors checkpoints decompress on their first forward: do it here,
            # so the timed pass measures scoring, not loading.
            model(input_ids=windows[:1, :8])
    load_seconds = time.perf_counter() - start
    batches = windows.split(config.batch_size)
    stats = compare_distributions(
        *models,
        # NOTE: progress on stderr keeps stdout clean for `qpipe eval --json`.
        track(
            batches,
            description=f"KLD over {windows.numel()} tokens",
            transient=True,
            console=console,
        ),
    )
    del models
    gc.collect()
    return dataclasses.replace(stats, load_seconds=load_seconds)


def run_tasks(
    ref: ModelRef,
    config: EvaluateConfig,
    work_dir: Path,
    resolve: Callable[[str], Path],
    label: str,
) -> dict[str, TaskScores]:
    """All recipe tasks on one model, loaded once."""
    if not config.tasks:
        return {}
    specs = {task.name: task_yaml(task, resolve, work_dir) for task in config.tasks}
    model = lm_eval_model(ref, config.dtype, config.batch_size)
    scores = {
        task.name: run_task(
            model,
            task,
            specs[task.name],
            work_dir / "samples" / f"{label}-{task.name}.jsonl",
            config.seed,
        )
        for task in config.tasks
    }
    del model
    gc.collect()
    return scores
