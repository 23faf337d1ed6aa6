"""A QuantizationConfig as compressed-tensors schemes and llm-compressor modifiers.

Each method is one explicit QuantizationScheme (not a preset name) so that group size, symmetry and
scale granularity come from the recipe, and the same scheme drives both the real quantization and
the cheap round-to-nearest proxy used for sensitivity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qpipe.quant.config import QuantizationConfig

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers import Modifier

LINEAR_TARGETS = ["Linear"]


def weight_args(quant: QuantizationConfig) -> QuantizationArgs:
    from compressed_tensors.quantization import QuantizationArgs

    if quant.method == "fp8":
        strategy = "tensor" if quant.weights == "per-tensor" else "channel"
        return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
    group = quant.effective_group_size
    return QuantizationArgs(
        num_bits=quant.weight_bits,
        type="int",
        strategy="group" if group else "channel",
        group_size=group,
        symmetric=quant.is_symmetric,
    )


def activation_args(quant: QuantizationConfig) -> QuantizationArgs | None:
    """Input-activation quantization of the W8A8 methods; None for weight-only ones."""
    from compressed_tensors.quantization import QuantizationArgs

    if quant.method not in ("int8-sq", "fp8"):
        return None
    dynamic = quant.activations == "dynamic"
    return QuantizationArgs(
        num_bits=8,
        type="float" if quant.method == "fp8" else "int",
        strategy="token" if dynamic else "tensor",
        symmetric=True,
        dynamic=dynamic,
    )


def kv_cache_args(quant: QuantizationConfig) -> QuantizationArgs | None:
    """fp8 e4m3 K and V with static scales, one per layer each (`fp8`) or one per KV head
    (`fp8-head`): llm-compressor's running estimate of the largest |K| (after RoPE) and |V|
    over the calibration set, over 448. These are the `k_scale`/`v_scale` that vLLM,
    TensorRT-LLM and qpipe's server read. Without them fp8 saturates at 448 and keeps fewer bits
    below 2^-6, where most of SmolLM2's first-layer V lies (it peaks near 0.6)."""
    from compressed_tensors.quantization import QuantizationArgs

    if quant.kv_cache == "none":
        return None
    strategy = "attn_head" if quant.kv_cache == "fp8-head" else "tensor"
    return QuantizationArgs(
        num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False
    )


def quantization_scheme(quant: QuantizationConfig) -> QuantizationScheme:
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(
        targets=LINEAR_TARGETS,
        weights=weight_args(quant),
        input_activations=activation_args(quant),
    )


def modifiers(quant: QuantizationConfig, keep_16bit: list[str]) -> list[Modifier]:
    """The llm-compressor recipe for one method; `keep_16bit` becomes its `ignore` list. A
    quantized KV cache rides on the modifier that sets the scales (on its own for method none)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    kv = kv_cache_args(quant)
    if quant.method == "none":
        return [QuantizationModifier(kv_cache_scheme=kv)]
    groups = {"group_0": quantization_scheme(quant)}
    if quant.method == "gptq":
        return [
            GPTQModifier(
                config_groups=groups,
                ignore=keep_16bit,
                dampening_frac=quant.dampening,
                actorder="static" if quant.act_order else None,
                kv_cache_scheme=kv,
            )
        ]
    quantize = QuantizationModifier(config_groups=groups, ignore=keep_16bit, kv_cache_scheme=kv)
    if quant.method == "awq":
        # AWQ only rescales channels; the QuantizationModifier after it sets the scales.
        return [AWQModifier(), quantize]
    if quant.method == "int8-sq":
        # NOTE: llm-compressor's W8A8 example runs GPTQ after smoothing; with 8-bit per-channel
        # weights the activation error dominates, so qpipe rounds the weights (several times
        # faster). bench/quantize/RESULTS.md has the resulting KLD.
        return [SmoothQuantModifier(smoothing_strength=quant.smoothquant_alpha), quantize]
    return [quantize]
