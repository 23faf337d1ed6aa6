"""quantize: 16-bit checkpoint + calibration set + method -> compressed-tensors checkpoint.

Writes the quantized HF checkpoint at the root of its directory (vLLM, SGLang, TGI and transformers
load it; build converts it for the other engines) and `qpipe_quant.json`: method, parameters,
calibration set hash, the layers left in 16-bit (and, with auto_keep_16bit, why), tool versions,
wall time, peak RSS, and the in-memory KLD/perplexity probe against the 16-bit model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from qpipe.quant.config import QuantizationConfig
from qpipe.recipe import Recipe
from qpipe.stages.base import (
    GateVerdict,
    MetricValue,
    Stage,
    StageContext,
    StageError,
    StageResult,
    input_path,
)
from qpipe.store.entry import MARKER

QUANT_JSON = "qpipe_quant.json"
CALIBRATION_FILE = "calibration.safetensors"
# Windows for the in-memory probe when the recipe names no held-out text: cheap, and enough to catch
# a broken quantization (the evaluate stage measures properly).
PROBE_WINDOWS = 8


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _link_or_copy(source: Path, target: Path) -> None:
    """Method none: the 16-bit checkpoint as is; hardlinks cost no space (the store never edits).
    The convert entry's marker stays behind: this entry gets its own."""
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if dest == target / MARKER:
            continue
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)


class QuantizeStage(Stage):
    name = "quantize"
    version = 1
    needs = ("convert", "calibrate")

    def section(self, recipe: Recipe) -> BaseModel:
        return recipe.quantization

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        auto = recipe.quantization.auto_keep_16bit
        if auto is None or auto.heldout is None:
            return {}
        field = "quantization.auto_keep_16bit.heldout"
        return {field: input_path(field, auto.heldout, recipe_dir, file_only=True)}

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        if not recipe.quantization.quantizes:
            return ()
        return ("torch", "transformers", "llmcompressor", "compressed-tensors")

    def run(self, ctx: StageContext) -> StageResult:
        quant = ctx.recipe.quantization
        checkpoint = ctx.inputs["convert"]
        if not quant.quantizes:
            _link_or_copy(checkpoint, ctx.out_dir)
            record = {"method": "none", "layers_16bit": "all"}
            (ctx.out_dir / QUANT_JSON).write_text(json.dumps(record, indent=2) + "\n")
            return StageResult(metrics={"method": "none"})
        return self._quantize(ctx, quant, checkpoint)

    def _quantize(
        self, ctx: StageContext, quant: QuantizationConfig, checkpoint: Path
    ) -> StageResult:
        from qpipe.quant.group_size import GroupSizeError, check_group_size
        from qpipe.quant.keep_16bit import Keep16BitError, check_keep_16bit
        from qpipe.quant.progress import stage_progress
        from qpipe.quant.quantize import quantize_checkpoint

        config = json.loads((checkpoint / "config.json").read_text())
        try:
            check_group_size(config, quant)
            check_keep_16bit(config, quant.keep_16bit)
        except GroupSizeError as exc:
            raise StageError(str(exc)) from exc
        except Keep16BitError as exc:
            raise StageError(f"quantization.keep_16bit: {exc}") from exc
        calibration = None
        if "calibrate" in ctx.inputs:
            calibration = ctx.inputs["calibrate"] / CALIBRATION_FILE
        if quant.needs_calibration and (calibration is None or not calibration.is_file()):
            raise StageError(
                f"quantization {quant.label} needs the calibration set "
                f"({CALIBRATION_FILE} from the calibrate stage); add a calibration section"
            )
        windows, source = self._probe_windows(ctx, quant, checkpoint, calibration)
        with stage_progress() as progress:
            try:
                outcome = quantize_checkpoint(
                    checkpoint, quant, ctx.out_dir, calibration, windows, progress
                )
            except ValueError as exc:
                raise StageError(f"quantize ({quant.method}): {exc}") from exc
        record = _record(outcome, calibration, source)
        (ctx.out_dir / QUANT_JSON).write_text(json.dumps(record, indent=2) + "\n")
        return StageResult(metrics=_metrics(outcome), gate=_gate(outcome))

    def _probe_windows(
        self,
        ctx: StageContext,
        quant: QuantizationConfig,
        checkpoint: Path,
        calibration: Path | None,
    ) -> tuple[Any, str | None]:
        from qpipe.quant.divergence import heldout_windows, read_texts, windows_from_calibration

        auto = quant.auto_keep_16bit
        if auto is not None and auto.heldout is not None:
            from transformers import AutoTokenizer

            path = ctx.resolve(auto.heldout)
            try:
                texts = read_texts(path)
                tokenizer = AutoTokenizer.from_pretrained(checkpoint)
                windows = heldout_windows(tokenizer, texts, auto.num_windows, auto.seq_len)
            except ValueError as exc:
                raise StageError(f"quantization.auto_keep_16bit.heldout: {exc}") from exc
            return windows, f"held-out text {path.name}"
        if calibration is None:
            return None, None
        count = auto.num_windows if auto is not None else PROBE_WINDOWS
        try:
            windows = windows_from_calibration(calibration, count)
        except ValueError as exc:
            raise StageError(
                "calibration: no sample has two or more tokens, so the quantized model has no "
                "window to be measured on; use longer samples (calibration.min_tokens: 2 or more "
                "drops one-token ones) and calibration.seq_len: 2 or more"
            ) from exc
        return windows, "calibration set (not held out)"


def _record(outcome: Any, calibration: Path | None, source: str | None) -> dict[str, Any]:
    from dataclasses import asdict

    record: dict[str, Any] = {
        "method": outcome.method,
        "parameters": outcome.parameters,
        "kv_cache": outcome.kv_cache,
        "calibration": {"file": CALIBRATION_FILE, "sha256": _sha256(calibration)}
        if calibration is not None
        else None,
        "keep_16bit": outcome.keep_16bit,
        "layers_16bit": sorted(outcome.layers_16bit),
        "quantized_layers": outcome.quantized_layers,
        "tool_versions": outcome.tool_versions,
        "wall_s": outcome.wall_s,
        "peak_rss_mib": outcome.peak_rss_mib,
        "notes": outcome.notes,
    }
    if outcome.probe is not None:
        record["probe"] = {"source": source, **asdict(outcome.probe)}
    if outcome.auto_keep is not None:
        decision = outcome.auto_keep
        record["auto_keep_16bit"] = {
            **asdict(decision),
            "reason": decision.reason(),
            "measured_kld": outcome.probe.divergence.kld,
        }
    return record


def _metrics(outcome: Any) -> dict[str, MetricValue]:
    metrics: dict[str, MetricValue] = {
        "method": outcome.method,
        "kv_cache": outcome.kv_cache,
        "quantized_layers": outcome.quantized_layers,
        "layers_16bit": len(outcome.layers_16bit),
        "wall_s": outcome.wall_s,
        "peak_rss_mib": outcome.peak_rss_mib,
    }
    if outcome.probe is not None:
        metrics["probe_kld"] = round(outcome.probe.divergence.kld, 6)
        metrics["probe_perplexity"] = round(outcome.probe.divergence.perplexity, 4)
        metrics["probe_baseline_perplexity"] = round(outcome.probe.baseline_perplexity, 4)
    return metrics


def _gate(outcome: Any) -> GateVerdict | None:
    """auto_keep_16bit's budget, checked on the real quantized model (it chose with a proxy)."""
    if outcome.auto_keep is None:
        return None
    budget = outcome.auto_keep.max_kld
    measured = outcome.probe.divergence.kld
    failures = ()
    if measured > budget:
        failures = (
            f"quantization.auto_keep_16bit: the quantized model's KLD {measured:.4f} exceeds "
            f"max_kld {budget} ({outcome.auto_keep.reason()}; the choice was made with an RTN "
            "proxy); raise max_kld or list more blocks in keep_16bit",
        )
    return GateVerdict(
        passed=not failures, failures=failures, checked={"kld": measured, "max_kld": budget}
    )
