"""convert: model source → safetensors checkpoint in the recipe's dtype, verified against it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from qpipe.convert import SourceError, convert_to_dir, resolve_source
from qpipe.recipe import ModelConfig, Recipe
from qpipe.stages.base import Stage, StageContext, StageError, StageResult


class _ConvertSection(BaseModel):
    """What shapes the checkpoint: the source bytes are keyed as files, so the spec text is not."""

    dtype: str
    allow_pickle: bool
    verify_prompts: list[str]


class ConvertStage(Stage):
    name = "convert"
    version = 1

    def section(self, recipe: Recipe) -> BaseModel:
        model: ModelConfig = recipe.model
        return _ConvertSection(
            dtype=model.dtype, allow_pickle=model.allow_pickle, verify_prompts=model.verify_prompts
        )

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        """A GGUF file is the model whatever its name; in a model directory the names are what
        loaders look for (config.json, tokenizer.json), so they are the roles."""
        try:
            source = resolve_source(recipe.model.source, recipe.model.allow_pickle, recipe_dir)
        except SourceError as exc:
            raise StageError(f"model.source: {exc}") from exc
        if source.kind == "gguf":
            return {"model": source.path}
        return {f"model/{file.relative_to(source.path).as_posix()}": file for file in source.files}

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        tools = ("torch", "transformers", "safetensors")
        return tools + ("gguf",) if recipe.model.source.endswith(".gguf") else tools

    def run(self, ctx: StageContext) -> StageResult:
        model = ctx.recipe.model
        try:
            source = resolve_source(model.source, model.allow_pickle, ctx.recipe_dir)
        except SourceError as exc:
            raise StageError(f"model.source: {exc}") from exc
        try:
            report = convert_to_dir(source, ctx.out_dir, model.dtype, tuple(model.verify_prompts))
        except SourceError as exc:
            raise StageError(f"model.source: {exc}") from exc
        except ValueError as exc:
            raise StageError(f"convert: {exc}") from exc
        (ctx.out_dir / "convert.json").write_text(report.to_json())
        return StageResult(
            metrics={
                "max_abs_logit_diff": report.max_abs_logit_diff,
                "top1_agreement": report.top1_agreement,
                "logit_tolerance": report.tolerance,
                "num_parameters": report.num_parameters,
            }
        )
