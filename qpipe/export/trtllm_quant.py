"""TensorRT-LLM's quantization algorithms and the tensors each one stores per linear layer.

What each algorithm stores follows TensorRT-LLM (<= 1.2.x) as it loads a checkpoint:
`tensorrt_llm/models/modeling_utils.py` (`from_checkpoint` -> `preprocess_weights` ->
`preprocess_perlayer_weights`), the layer parameters in `tensorrt_llm/quantization/layers.py`, and
the SmoothQuant writer in `tensorrt_llm/models/llama/convert.py` (`get_tllm_linear_sq_weight`).

    (none), W8A16, W4A16   weight [out, in] in the model dtype. For W8A16/W4A16 trtllm-build
                           quantizes per channel itself (`weight_only_quantize_dict`): their int
                           layout is interleaved for the build GPU, so a portable checkpoint holds
                           the (dequantized) 16-bit weights. trtllm-build rounds them to its own
                           grid (max/127), so the engine's integers are not exactly the evaluated
                           ones (GPTQ's rounding choices are redone). The weight-only GEMM plugins
                           take fp16/bf16 activations only: see `checkpoint_dtype`.
    W8A8_SQ_PER_CHANNEL    (static activations; ModelOpt's int8_sq layout, Int8SmoothQuantLinear)
                           weight int8 [out, in]; weights_scaling_factor f32 [out];
                           activation_scaling_factor f32 [1] (input scale); prequant_scaling_factor
                           [in] (ones: llm-compressor folds smoothing into the weights).
    W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN  (dynamic per-token activations; the SmoothQuant plugin,
                           `get_tllm_linear_sq_weight` in llama/convert.py) weight int8 [out, in];
                           per_channel_scale f32 [1, out]; row-parallel layers add smoother f32
                           [1, in] (ones); the layer norms carry scale_to_int f32 [1] = 1.0.
    FP8                    weight float8_e4m3fn [out, in]; weights_scaling_factor f32 [1];
                           activation_scaling_factor f32 [1] (static only). Per-channel scales,
                           and q/k/v's three per-tensor scales in the fused qkv, are requantized
                           to the layer's max scale (as ModelOpt does for qkv); the writer
                           reports the weight error that adds (`fp8_requantize_error`).
    W4A16_AWQ              weight int8 [out/2, in]: two signed int4 of neighbouring output
                           channels per byte, even channel in the low nibble (ModelOpt's packing,
                           `modelopt/torch/export/quant_utils.py`); trtllm-build transposes and
                           interleaves it for the build GPU (`preprocess_weights_for_mixed_gemm`).
                           weights_scaling_factor f32 [out, in/group] (cast and transposed at
                           build); prequant_scaling_factor [in] (ones: AWQ scales are folded);
                           zero [in/group, out] (= -zero_point * scale, not transposed at build)
                           when asymmetric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qpipe.export.quantized_checkpoint import CheckpointFormatError, QuantizedLinear

FP8_MAX = 448.0
SQ_PER_TOKEN = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
SQ_STATIC = "W8A8_SQ_PER_CHANNEL"
FLOAT_WEIGHTS = (None, "W8A16", "W4A16")
WEIGHT_ONLY = ("W8A16", "W4A16", "W4A16_AWQ")


@dataclass(frozen=True)
class QuantLayout:
    """The `quantization` block of a TensorRT-LLM checkpoint config."""

    quant_algo: str | None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    has_zero_point: bool = False
    pre_quant_scale: bool = False

    def to_config(self, exclude_modules: list[str]) -> dict[str, object]:
        return {
            "quant_algo": self.quant_algo,
            "kv_cache_quant_algo": self.kv_cache_quant_algo,
            "group_size": self.group_size,
            "has_zero_point": self.has_zero_point,
            "pre_quant_scale": self.pre_quant_scale,
            "exclude_modules": exclude_modules or None,
        }


def checkpoint_dtype(quant_algo: str | None, dtype: str, arch: str) -> str:
    """The checkpoint's dtype (its activations'). TensorRT-LLM's weight-only GEMM plugins
    (WeightOnlyQuantMatmulPlugin, WeightOnlyGroupwiseQuantMatmulPlugin) take fp16 or bf16 only, so
    a float32 model (qpipe's CPU recipes) goes to bf16 for them, or to fp16 before sm80, which has
    no bf16 tensor cores."""
    if quant_algo not in WEIGHT_ONLY or dtype in ("float16", "bfloat16"):
        return dtype
    version = arch.lower().removeprefix("sm")
    return "float16" if version.isdigit() and int(version) < 80 else "bfloat16"


def fp8_requantize_error(
    linear: QuantizedLinear, written: dict[str, torch.Tensor], name: str
) -> float:
    """Relative weight error (Frobenius) of the FP8 tensors written for `name` against `linear`
    as evaluated: nonzero when its scales (per channel, or q/k/v's three) became one."""
    if linear.scale is None or bool((linear.scale == linear.scale.flatten()[0]).all()):
        return 0.0
    reference = linear.dequantize().float()
    engine = written[f"{name}.weight"].float() * written[f"{name}.weights_scaling_factor"]
    return float((engine - reference).norm() / reference.norm().clamp_min(1e-30))


def choose_layout(linears: list[QuantizedLinear], kv_cache: str | None) -> QuantLayout:
    """The one TensorRT-LLM algorithm that represents every quantized decoder linear."""
    kv_algo = {"fp8": "FP8", "int8": "INT8", None: None}[kv_cache]
    quantized = [lin for lin in linears if lin.kind != "dense"]
    if not quantized:
        return QuantLayout(None, kv_algo)
    schemes = {
        (
            lin.kind,
            lin.num_bits,
            lin.group_size,
            lin.zero_point is not None,
            lin.input_scale is not None,
            lin.dynamic_activations,
        )
        for lin in quantized
    }
    if len({s[:3] + s[4:] for s in schemes}) != 1:
        raise CheckpointFormatError(
            "decoder linears use different quantization schemes; a TensorRT-LLM checkpoint "
            f"holds one algorithm ({sorted(map(str, schemes))})"
        )
    kind, bits, group, has_zero, static, dynamic = schemes.pop()
    if has_zero and kind != "int":
        raise CheckpointFormatError("fp8 weights with zero points are not supported")
    if kind == "fp8":
        if not static:
            raise CheckpointFormatError(
                "TensorRT-LLM's FP8 checkpoint needs static activation scales; quantize with "
                "quantization.activations: static (dynamic fp8 serves from compressed-tensors)"
            )
        return QuantLayout("FP8", kv_algo)
    if static or dynamic:
        if bits != 8 or group is not None:
            raise CheckpointFormatError("int8 activations need per-channel int8 weights")
        if any(lin.zero_point is not None for lin in quantized):
            raise CheckpointFormatError("SmoothQuant weights must be symmetric")
        return QuantLayout(SQ_STATIC if static else SQ_PER_TOKEN, kv_algo)
    if group is not None:
        if bits != 4:
            raise CheckpointFormatError(
                "int8 weights with groups (gptq bits: 8 + group_size) have no portable "
                "TensorRT-LLM layout (W8A16_GPTQ is interleaved for the GPU at conversion); "
                "quantize int8 weights per channel (no group_size)"
            )
        return QuantLayout(
            "W4A16_AWQ", kv_algo, group_size=group, has_zero_point=any(
                lin.zero_point is not None for lin in quantized
            ), pre_quant_scale=True,
        )  # fmt: skip
    return QuantLayout("W8A16" if bits == 8 else "W4A16", kv_algo)


def check_groupwise_shape(
    name: str, in_features: int, out_features: int, group: int, tp: int
) -> None:
    """TensorRT-LLM pads groupwise layers to multiples of max(64, group) * tp, moving channels
    between ranks (WeightOnlyGroupwiseQuantLinear); a checkpoint must not need that padding."""

    def fits(group: int, tp: int) -> bool:
        multiple = max(64, group) * tp
        return in_features % multiple == 0 and out_features % multiple == 0

    if fits(group, tp):
        return
    if group > 64 and fits(64, tp):
        fix = "use group_size: 64"
    elif tps := [t for t in range(1, tp) if fits(group, t)]:
        fix = f"use build.tp in {{{', '.join(map(str, tps))}}}"
    else:
        fix = "keep the layer 16-bit (quantization.keep_16bit) or drop the TensorRT-LLM targets"
    raise CheckpointFormatError(
        f"{name} [{out_features}x{in_features}] is not a multiple of {max(64, group) * tp} "
        f"(max(64, group_size={group}) * tp={tp}), which TensorRT-LLM's int4 groupwise "
        f"layers need; {fix}"
    )


def pack_int4_pairs(values: torch.Tensor) -> torch.Tensor:
    """Signed int4 [out, in] -> int8 [out/2, in], channel 2k low nibble, 2k+1 high nibble."""
    if values.shape[0] % 2:
        raise CheckpointFormatError(f"int4 packing needs an even output size, got {values.shape}")
    low, high = values[0::2].to(torch.int16), values[1::2].to(torch.int16)
    packed = (low & 0x0F) | ((high & 0x0F) << 4)
    return packed.to(torch.uint8).view(torch.int8)


def linear_tensors(
    name: str, linear: QuantizedLinear, layout: QuantLayout, dtype: torch.dtype, row: bool
) -> dict[str, torch.Tensor]:
    """The tensors of one sharded linear `name` (e.g. transformer.layers.0.mlp.fc)."""
    algo = layout.quant_algo
    if algo in FLOAT_WEIGHTS or linear.kind == "dense":
        return {f"{name}.weight": linear.dequantize().to(dtype).contiguous()}
    if algo == SQ_PER_TOKEN:
        out = {
            f"{name}.weight": linear.channelwise().weight.contiguous(),
            f"{name}.per_channel_scale": linear.channelwise().scale.reshape(1, -1).float(),
        }
        if row:
            out[f"{name}.smoother"] = torch.ones(1, linear.in_features, dtype=torch.float32)
        return out
    if algo == SQ_STATIC:
        return {
            f"{name}.weight": linear.weight.contiguous(),
            f"{name}.weights_scaling_factor": linear.channelwise().scale.reshape(-1).float(),
            f"{name}.activation_scaling_factor": linear.input_scale.reshape(1).float(),
            f"{name}.prequant_scaling_factor": torch.ones(linear.in_features, dtype=dtype),
        }
    if algo == "FP8":
        scale = linear.scale.max().reshape(1)
        values = (linear.dequantize() / scale).clamp(-FP8_MAX, FP8_MAX)
        return {
            f"{name}.weight": values.to(torch.float8_e4m3fn).contiguous(),
            f"{name}.weights_scaling_factor": scale.float(),
            f"{name}.activation_scaling_factor": linear.input_scale.reshape(1).float(),
        }
    if algo == "W4A16_AWQ":
        out = {
            f"{name}.weight": pack_int4_pairs(linear.weight).contiguous(),
            f"{name}.weights_scaling_factor": linear.scale.float().contiguous(),
            f"{name}.prequant_scaling_factor": torch.ones(linear.in_features, dtype=dtype),
        }
        if layout.has_zero_point:
            zero = linear.zero_point
            zero_x_scale = (
                torch.zeros_like(linear.scale) if zero is None else -zero.float() * linear.scale
            )
            out[f"{name}.zero"] = zero_x_scale.t().to(dtype).contiguous()
        return out
    raise CheckpointFormatError(f"no tensor layout for quant_algo {algo!r}")
