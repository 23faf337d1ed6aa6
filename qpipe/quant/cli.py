"""`qpipe sensitivity RECIPE`: rank decoder blocks by the KL divergence their quantization adds.

Without --checkpoint, the recipe's own pipeline provides the 16-bit checkpoint and the calibration
set (running convert/calibrate if they are not cached).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _upstream(recipe_path: Path, store: str | None) -> tuple[Path, Path | None]:
    """The convert and calibrate outputs for the recipe, from the store (run if missing)."""
    from qpipe.cli import _pipeline

    pipeline = _pipeline(recipe_path, store)
    until = "calibrate" if pipeline.recipe.calibration is not None else "convert"
    planned = {p.name: p for p in pipeline.run(until=until)}
    failed = [p for p in planned.values() if p.status == "failed"]
    if failed:
        raise typer.BadParameter(
            f"{failed[0].name} failed: {failed[0].reason}", param_hint="RECIPE"
        )
    calibrate = planned.get("calibrate")
    calibration = None
    if calibrate is not None and calibrate.path:
        calibration = Path(calibrate.path) / "calibration.safetensors"
    return Path(planned["convert"].path), calibration


def sensitivity(
    recipe: Annotated[Path, typer.Argument(help="Recipe whose quantization method to rank.")],
    text: Annotated[
        Path | None,
        typer.Option(help="Held-out domain text (.txt or .jsonl); default: the calibration set."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where the table, JSON and PNG go.")] = Path(
        "sensitivity"
    ),
    num_windows: Annotated[int, typer.Option(min=1)] = 8,
    seq_len: Annotated[int, typer.Option(min=8)] = 256,
    checkpoint: Annotated[
        Path | None, typer.Option(help="16-bit HF checkpoint (skips the pipeline).")
    ] = None,
    calibration: Annotated[
        Path | None, typer.Option(help="calibration.safetensors (with --checkpoint).")
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="Store location (default: the recipe's).")
    ] = None,
) -> None:
    """Quantize one decoder block at a time (RTN proxy of the recipe's scheme) and rank them."""
    from qpipe.console import out as results
    from qpipe.quant.progress import stage_progress
    from qpipe.quant.sensitivity import run_sensitivity
    from qpipe.recipe import RecipeError, load_recipe

    try:
        quant = load_recipe(recipe).quantization
    except RecipeError as exc:
        raise typer.BadParameter(str(exc), param_hint="RECIPE") from exc
    if checkpoint is None:
        checkpoint, calibration = _upstream(recipe, store)
    with stage_progress() as progress:
        try:
            report = run_sensitivity(
                checkpoint, calibration, quant, text, out, num_windows, seq_len, progress
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    results.print(report.table())
    results.print(f"wrote {out / 'sensitivity.md'}, {out / 'sensitivity.json'}, "
                  f"{out / 'sensitivity.png'}")  # fmt: skip
