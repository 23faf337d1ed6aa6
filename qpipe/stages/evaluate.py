"""evaluate: the quantized checkpoint against the 16-bit one it came from.

Baseline is the convert stage's checkpoint, candidate the quantize stage's. Runs the distribution
checks on held-out text (the recipe's `evaluate.text`, else the shipped wikitext-2 test split) and
the recipe's lm-eval tasks offline, then the `max_drop` gates; writes report.json, report.md, the
PNG plots and lm-eval's task YAMLs and logged samples.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from qpipe.evaluate.config import EvaluateConfig
from qpipe.recipe import Recipe
from qpipe.stages.base import MetricValue, Stage, StageContext, StageError, StageResult, input_path

HEADLINE = ("ppl_ratio", "kld_mean", "kld_p99", "top1_agreement")


def _config(recipe: Recipe) -> EvaluateConfig:
    return recipe.evaluate or EvaluateConfig()


class EvaluateStage(Stage):
    name = "evaluate"
    version = 1
    needs = ("convert", "quantize")

    def enabled(self, recipe: Recipe) -> bool:
        return recipe.evaluate is not None

    def section(self, recipe: Recipe) -> BaseModel | None:
        return _config(recipe)

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        """The held-out text and task data the recipe points at, by their place in the recipe.

        The data qpipe ships (qpipe/data) is covered by `version`: bump it when that data changes.
        """
        config = _config(recipe)
        named = {"evaluate.text": config.text} if config.text else {}
        for i, task in enumerate(config.tasks):
            for split, path in (task.data_files or {}).items():
                named[f"evaluate.tasks[{i}].data_files.{split}"] = path
            if task.config:
                named[f"evaluate.tasks[{i}].config"] = task.config
        return {field: input_path(field, value, recipe_dir) for field, value in named.items()}

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        return ("torch", "transformers", "compressed-tensors", "lm_eval", "datasets")

    def run(self, ctx: StageContext) -> StageResult:
        from qpipe.evaluate.evaluation import evaluate
        from qpipe.evaluate.models import ModelRef
        from qpipe.evaluate.report import write_report

        config = _config(ctx.recipe)
        baseline = ModelRef(str(ctx.inputs["convert"]))
        candidate = ModelRef(str(ctx.inputs["quantize"]))
        try:
            report = evaluate(baseline, candidate, config, ctx.out_dir, ctx.resolve)
        except (FileNotFoundError, ValueError) as exc:
            raise StageError(f"evaluate: {exc}") from exc
        write_report(report, config, ctx.out_dir)
        metrics: dict[str, MetricValue] = {}
        for comparison in report.comparisons:
            if comparison.name in HEADLINE or "/" in comparison.name:
                metrics[comparison.name] = round(comparison.candidate, 6)
                metrics[f"{comparison.name}.drop"] = round(comparison.drop, 6)
        return StageResult(metrics=metrics, gate=report.gate)
