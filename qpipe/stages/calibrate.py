"""calibrate: the user's domain data + the model's tokenizer -> a tokenized, hashed calibration set.

Its key covers the dataset's bytes (a dataset directory is declared whole: the pipeline hashes every
file below it) and, through convert's key, the tokenizer: editing one sample re-runs calibrate and
what follows, nothing upstream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from qpipe.calibration.seq_len import SeqLenError, check_seq_len
from qpipe.quant.config import CalibrationConfig
from qpipe.recipe import Recipe
from qpipe.stages.base import Stage, StageContext, StageError, StageResult, input_path


class _CalibrateSection(BaseModel):
    """The settings without the dataset path: the data is keyed by content, so a moved file hits."""

    settings: dict[str, Any]


def _config(recipe: Recipe) -> CalibrationConfig:
    if recipe.calibration is None:
        raise StageError("the recipe has no calibration section; add calibration.dataset")
    return recipe.calibration


class CalibrateStage(Stage):
    name = "calibrate"
    version = 1
    needs = ("convert",)

    def section(self, recipe: Recipe) -> BaseModel | None:
        return _CalibrateSection(settings=_config(recipe).model_dump(exclude={"dataset"}))

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        path = input_path("calibration.dataset", _config(recipe).dataset, recipe_dir)
        return {"calibration.dataset": path}

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        return ("transformers", "tokenizers")

    def run(self, ctx: StageContext) -> StageResult:
        from transformers import AutoTokenizer

        from qpipe.calibration.builder import build_calibration_set

        config = _config(ctx.recipe)
        # NOTE: before any window is allocated: validation cannot read every model's context (a
        # model not downloaded there, a GGUF header without it)
        model_config = json.loads((ctx.inputs["convert"] / "config.json").read_text())
        try:
            check_seq_len(config.seq_len, model_config)
        except SeqLenError as exc:
            raise StageError(f"calibration.seq_len: {exc}") from exc
        tokenizer = AutoTokenizer.from_pretrained(ctx.inputs["convert"])
        calibration_set = build_calibration_set(config, ctx.resolve(config.dataset), tokenizer)
        calibration_set.save(ctx.out_dir)
        stats = calibration_set.stats
        return StageResult(
            metrics={
                "rows": stats.rows,
                "samples_kept": stats.kept,
                "samples_read": stats.samples_read,
                "tokens": stats.tokens.in_rows,
                "truncated": stats.truncated,
                "content_hash": stats.content_hash,
            }
        )
