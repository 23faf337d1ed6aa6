"""build: the quantized checkpoint -> what each serving engine loads (the recipe's build.targets).

    trtllm-checkpoint/   TensorRT-LLM checkpoint (config.json, rank{N}.safetensors)
    trtllm-engine/       rank{N}.engine + config.json from trtllm-build (TensorRT-LLM 1.2.x, GPU)
    compressed-tensors/  the checkpoint vLLM, SGLang, TGI and transformers load
    qpipe/               the built-in server's artifact
    build.json           targets and their status, arch, tp/pp, quant, alias, toolchain

Engines bind to GPU arch and toolchain, so both are in the key. A machine without the engine
toolchain still produces and caches every other target; the engine target then records why it
could not be built and fails the stage's gate with that reason (never a fake engine). A re-run on
a machine that has the toolchain has a different key (arch, versions, trtllm-build path) and
builds it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from qpipe.console import console
from qpipe.export.alias import engine_alias, quant_name
from qpipe.export.toolchain import ABSENT, toolchain_versions
from qpipe.gpu import resolve_arch
from qpipe.recipe import Recipe
from qpipe.stages.base import (
    GateVerdict,
    NotAvailable,
    Stage,
    StageContext,
    StageError,
    StageResult,
)

BUILD_JSON = "build.json"
# Checkpoint before engine: the engine is built from it.
TARGET_ORDER = ("trtllm-checkpoint", "trtllm-engine", "compressed-tensors", "qpipe")


class _BuildSection(BaseModel):
    """The build settings (trtllm-build's only with an engine target, so tuning them never
    rebuilds the other artifacts) plus what build.json and the checkpoint are named/typed by."""

    build: dict[str, Any]
    model_name: str
    dtype: str


def _size_mib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 2)


class BuildStage(Stage):
    name = "build"
    version = 2  # 2: trtllm-checkpoint's exclude_modules patterns, 16-bit weight-only dtype
    needs = ("quantize",)

    def section(self, recipe: Recipe) -> BaseModel:
        engine = "trtllm-engine" in recipe.build.targets
        build = recipe.build.model_dump(mode="json", exclude=None if engine else {"trtllm"})
        return _BuildSection(build=build, model_name=recipe.model_name, dtype=recipe.model.dtype)

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        return ("torch", "transformers", "safetensors", "compressed-tensors")

    def check_available(self, recipe: Recipe) -> None:
        """Quantization formats TensorRT-LLM's checkpoint cannot hold, refused before any work."""
        if not {"trtllm-checkpoint", "trtllm-engine"} & set(recipe.build.targets):
            return
        quant = recipe.quantization
        hint = "or drop trtllm-checkpoint/trtllm-engine from build.targets"
        if quant.method == "fp8" and quant.activations == "dynamic":
            raise NotAvailable(
                "build/trtllm-checkpoint for fp8 with dynamic activations",
                "TensorRT-LLM's FP8 checkpoint needs static activation scales: set "
                f"quantization.activations: static (and a calibration section), {hint}",
            )
        if quant.method == "gptq" and quant.act_order:
            raise NotAvailable(
                "build/trtllm-checkpoint for gptq act_order",
                f"TensorRT-LLM has no activation-ordered groups: set act_order: false, {hint}",
            )
        decoder_kept = [p for p in quant.keep_16bit if p != "lm_head"]
        if quant.method == "int8-sq" and quant.activations == "dynamic" and decoder_kept:
            raise NotAvailable(
                "build/trtllm-checkpoint for int8-sq with decoder layers kept 16-bit "
                f"({', '.join(decoder_kept)})",
                "TensorRT-LLM's SmoothQuant plugin quantizes every decoder layer: set "
                f"quantization.activations: static, or keep only lm_head 16-bit, {hint}",
            )
        if quant.method in ("gptq", "int8-wo") and quant.weight_bits == 8 and quant.group_size:
            raise NotAvailable(
                "build/trtllm-checkpoint for grouped int8 weights",
                "its W8A16_GPTQ layout is interleaved for one GPU at conversion: quantize int8 "
                f"weights per channel (no group_size), {hint}",
            )

    def key_extras(self, recipe: Recipe) -> Mapping[str, str]:
        build = recipe.build
        extras = {
            "arch": resolve_arch(build.arch),
            "tp": str(build.tp),
            "pp": str(build.pp),
            "quant": quant_name(recipe.quantization, recipe.model.dtype),
            **toolchain_versions(),
        }
        if "trtllm-engine" in build.targets:
            extras["trtllm_build"] = shutil.which("trtllm-build") or ABSENT
        if "qpipe" in build.targets:
            from qpipe.serve import ARTIFACT_FORMAT_VERSION

            extras["qpipe_artifact_format"] = str(ARTIFACT_FORMAT_VERSION)
        return extras

    def run(self, ctx: StageContext) -> StageResult:
        recipe, build = ctx.recipe, ctx.recipe.build
        quantized = ctx.inputs["quantize"]
        arch = resolve_arch(build.arch)
        wanted = [t for t in TARGET_ORDER if t in build.targets]
        if "trtllm-engine" in wanted and "trtllm-checkpoint" not in wanted:
            wanted.insert(0, "trtllm-checkpoint")  # the engine's input, kept with it
        record: dict[str, dict[str, Any]] = {}
        metrics: dict[str, Any] = {}
        failures: list[str] = []
        for target in wanted:
            started = time.perf_counter()
            out = ctx.out_dir / target
            entry = self._build_target(target, quantized, out, recipe, arch)
            if entry["status"] == "failed":
                failures.append(f"{target}: {entry['reason']}")
            else:
                metrics[f"{target}_mib"] = _size_mib(out)
            metrics[f"{target}_seconds"] = round(time.perf_counter() - started, 2)
            record[target] = entry
        alias = engine_alias(recipe, arch)
        info = {
            "targets": record,
            "arch": arch,
            "tp": build.tp,
            "pp": build.pp,
            "quant": quant_name(recipe.quantization, recipe.model.dtype),
            "alias": alias,
            "toolchain": toolchain_versions(),
        }
        (ctx.out_dir / BUILD_JSON).write_text(json.dumps(info, indent=2))
        metrics["alias"] = alias
        gate = GateVerdict(passed=False, failures=tuple(failures)) if failures else None
        built = [target for target, entry in record.items() if entry["status"] == "built"]
        alias_info = {key: info[key] for key in ("arch", "tp", "pp", "quant")}
        return StageResult(
            metrics=metrics, gate=gate, aliases={alias: {**alias_info, "targets": built}}
        )

    def _build_target(
        self, target: str, quantized: Path, out: Path, recipe: Recipe, arch: str
    ) -> dict[str, Any]:
        build = recipe.build
        if target == "trtllm-checkpoint":
            from qpipe.export.quantized_checkpoint import CheckpointFormatError
            from qpipe.export.trtllm_checkpoint import write_trtllm_checkpoint

            try:
                written = write_trtllm_checkpoint(
                    quantized, out, build.tp, build.pp, recipe.model.dtype, arch
                )
            except CheckpointFormatError as exc:
                raise StageError(f"build target trtllm-checkpoint: {exc}") from exc
            entry = {"status": "built", "path": target, "quant_algo": written.quant_algo}
            entry["dtype"] = written.config["dtype"]
            if written.requantize_error:
                entry["fp8_requantize_error"] = round(written.requantize_error, 6)
                console.print(
                    "[yellow]trtllm-checkpoint: FP8 keeps one weight scale per fused linear, so "
                    "the engine's weights differ from the evaluated ones by up to "
                    f"{written.requantize_error:.2%} (relative); quantization.weights: "
                    "per-tensor avoids all but q/k/v's[/]"
                )
            return entry
        if target == "trtllm-engine":
            return self._engine(out, recipe, arch)
        if target == "compressed-tensors":
            from qpipe.export.hf_package import PackageError, package_checkpoint

            try:
                files = package_checkpoint(quantized, out)
            except PackageError as exc:
                raise StageError(f"build target compressed-tensors: {exc}") from exc
            return {"status": "built", "path": target, "files": files}
        from qpipe.serve.artifact import write_artifact

        try:
            write_artifact(quantized, out, dtype=recipe.model.dtype)
        except (ValueError, NotImplementedError) as exc:
            raise StageError(f"build target qpipe: {exc}") from exc
        return {"status": "built", "path": target}

    def _engine(self, out: Path, recipe: Recipe, arch: str) -> dict[str, Any]:
        from qpipe.export.trtllm_engine import EngineBuildError, build_engine, engine_blockers

        blockers, toolchain = engine_blockers(arch)
        if toolchain is None:
            return {"status": "failed", "reason": "; ".join(blockers)}
        checkpoint = out.parent / "trtllm-checkpoint"
        try:
            engines = build_engine(
                toolchain, checkpoint, out, recipe.build.trtllm, recipe.build.world_size
            )
        except EngineBuildError as exc:
            raise StageError(f"build target trtllm-engine: {exc}") from exc
        return {
            "status": "built",
            "path": "trtllm-engine",
            "engines": [e.name for e in engines],
            "tensorrt_llm": toolchain.version,
        }
