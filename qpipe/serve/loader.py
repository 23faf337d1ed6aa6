"""Reads HF safetensors checkpoints, 16/32-bit or compressed-tensors (llm-compressor's output), into
the engine's linear layers.

compressed-tensors formats handled: "int-quantized" (int8 W8A8, or int8 weight-only when there is
no activation scheme), "float-quantized" (fp8 weights, with fp8 activations dynamic per token or
statically scaled, or weight-only), "pack-quantized" (int4/int8 weight-only with groups),
"naive-quantized" like int.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qpipe.serve.huge_pages import HugePageArena
from qpipe.serve.layers.attention import KVScales
from qpipe.serve.layers.linear import (
    DenseLinear,
    Fp8Linear,
    Int8Linear,
    LinearBase,
    WeightOnlyLinear,
    has_bf16_dot_product,
    pack_linear_weights,
)
from qpipe.serve.weight_files import WeightFiles

if TYPE_CHECKING:
    from qpipe.serve.models.llama import WeightSource

log = logging.getLogger(__name__)

CHECKPOINT_FIX = "copy the checkpoint again from its source (or re-run `qpipe convert`)"


@dataclass(frozen=True)
class LayerScheme:
    """How one checkpoint linear is stored, from its compressed-tensors config group."""

    format: str  # "dense" or a compressed-tensors format name
    num_bits: int = 16
    activations_dynamic_int8: bool = False
    activations_fp8: bool = False


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


class QuantizationConfig:
    def __init__(self, raw: dict | None) -> None:
        self.raw = raw or {}
        method = self.raw.get("quant_method")
        if raw and method != "compressed-tensors":
            raise ValueError(
                f"quantization_config.quant_method {method!r} is not served; qpipe serves "
                "compressed-tensors checkpoints (llm-compressor's output) and 16/32-bit ones"
            )
        if raw and self.raw.get("quantization_status", "compressed") != "compressed":
            raise ValueError(
                "quantization_config.quantization_status is not 'compressed'; save the model "
                "with save_pretrained(..., save_compressed=True)"
            )
        self.kv_cache_fp8 = _kv_cache_fp8(self.raw.get("kv_cache_scheme"))

    def scheme_for(self, name: str) -> LayerScheme:
        if not self.raw or any(_matches(name, t) for t in self.raw.get("ignore", [])):
            return LayerScheme("dense")
        for group in self.raw.get("config_groups", {}).values():
            if not any(_matches(name, t) for t in group.get("targets", [])):
                continue
            weights = group.get("weights") or {}
            acts = group.get("input_activations") or {}
            fmt = group.get("format") or self.raw.get("format")
            return LayerScheme(
                fmt,
                int(weights.get("num_bits", 16)),
                activations_dynamic_int8=acts.get("type") == "int" and acts.get("num_bits") == 8,
                activations_fp8=acts.get("type") == "float" and acts.get("num_bits") == 8,
            )
        return LayerScheme("dense")


def _kv_cache_fp8(scheme: dict | None) -> bool:
    """Whether the checkpoint calibrated an fp8 KV cache: e4m3 with static scales for K and
    for V (`k_scale`, `v_scale`), one per layer or one per KV head (llm-compressor's `tensor`
    and `attn_head` strategies for `kv_cache_scheme`). Other schemes are refused, not served
    unscaled."""
    if not scheme:
        return False
    served = (
        scheme.get("type") == "float"
        and scheme.get("num_bits") == 8
        and scheme.get("strategy") in ("tensor", "attn_head")
        and not scheme.get("dynamic")
    )
    if not served:
        described = {k: scheme.get(k) for k in ("type", "num_bits", "strategy", "dynamic")}
        raise ValueError(
            f"quantization_config.kv_cache_scheme {described} is not served; qpipe serves fp8 "
            "(type float, 8 bits) with static scales per tensor or per attention head. Quantize "
            "the KV cache with qpipe's quantization.kv_cache: fp8 or fp8-head, or drop "
            "kv_cache_scheme"
        )
    return True


def read_kv_scales(
    source: Callable[[str], torch.Tensor | None], attn: str, num_kv_heads: int
) -> KVScales:
    """The k_scale and v_scale of one attention module, from a lookup that returns None when a
    tensor is missing: floats for one scale each, fp32 [num_kv_heads] tensors for one per head."""
    scales: list[float | torch.Tensor] = []
    for name in (f"{attn}.k_scale", f"{attn}.v_scale"):
        tensor = source(name)
        if tensor is None:
            raise KeyError(
                f"tensor {name!r} is missing: the checkpoint declares an fp8 KV cache "
                "(kv_cache_scheme) but has no scale for this layer; re-run its quantization"
            )
        flat = tensor.float().reshape(-1)
        if flat.numel() not in (1, num_kv_heads):
            raise ValueError(
                f"tensor {name!r} holds {flat.numel()} scales; an fp8 KV cache takes one per "
                f"layer or one per KV head ({num_kv_heads} here); re-run its quantization"
            )
        scales.append(float(flat) if flat.numel() == 1 else flat)
    k, v = scales
    if isinstance(k, float) != isinstance(v, float):
        raise ValueError(f"{attn}: k_scale and v_scale hold different numbers of scales")
    return KVScales(k, v)


class CheckpointWeights:
    """A `WeightSource` over an HF checkpoint directory (one or more *.safetensors files)."""

    def __init__(
        self,
        path: Path,
        quantization: QuantizationConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{path}: no *.safetensors files; convert the model first (qpipe convert)"
            )
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.files = WeightFiles(files, CHECKPOINT_FIX)

    def has(self, name: str) -> bool:
        return any(key.startswith(name + ".") for key in self.files.where)

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.tensor(name).to(self.device, self.dtype)

    def kv_scales(self, attn: str, num_kv_heads: int) -> KVScales | None:
        if not self.quantization.kv_cache_fp8:
            return None
        return read_kv_scales(self.files.get, attn, num_kv_heads).to(self.device, self.dtype)

    def linear(self, name: str, parts: list[str]) -> LinearBase:
        schemes = {self.quantization.scheme_for(part) for part in parts}
        if len(schemes) != 1:
            raise ValueError(f"{parts} are quantized differently; cannot fuse them into {name}")
        scheme = schemes.pop()
        loaded = [self._part(part, scheme) for part in parts]
        bias = None
        if any(p.get("bias") is not None for p in loaded):
            bias = torch.cat([p["bias"] for p in loaded]).to(self.dtype)
        weight = torch.cat([p["weight"] for p in loaded])
        if scheme.format == "dense":
            return DenseLinear(weight, bias)
        scale = torch.cat([p["weight_scale"] for p in loaded])
        if scheme.format == "float-quantized":
            if scale.shape[1] != 1:
                raise ValueError(f"{name}: fp8 with grouped scales is not served; use per-channel")
            if not scheme.activations_fp8:  # weight-only fp8: expanded once, a dense layer
                return DenseLinear((weight.float() * scale).to(self.dtype), bias)
            # one input feeds every fused part: their calibrated scales agree, the largest is kept
            input_scales = [p["input_scale"] for p in loaded if p.get("input_scale") is not None]
            input_scale = torch.stack(input_scales).max().reshape(1) if input_scales else None
            return Fp8Linear(weight, scale, input_scale, bias).prepare_for(self.dtype, self.device)
        zero = None
        if any(p.get("weight_zero_point") is not None for p in loaded):
            zero = torch.cat(
                [
                    p["weight_zero_point"]
                    if p.get("weight_zero_point") is not None
                    else torch.zeros_like(p["weight_scale"])
                    for p in loaded
                ]
            )
        if scheme.num_bits == 8 and scheme.activations_dynamic_int8 and zero is None:
            if scale.shape[1] != 1:
                raise ValueError(f"{name}: int8 W8A8 with grouped weight scales is not served")
            return Int8Linear(weight, scale, bias)
        return WeightOnlyLinear(weight, scale, zero, bias)

    def _part(self, part: str, scheme: LayerScheme) -> dict[str, torch.Tensor | None]:
        """One checkpoint linear as weight, weight_scale [out, groups], weight_zero_point?, bias."""
        bias = self.files.get(f"{part}.bias")
        if scheme.format == "dense":
            return {"weight": self.tensor(f"{part}.weight"), "bias": bias}
        if scheme.format == "pack-quantized":
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            shape = torch.Size(self.files.get(f"{part}.weight_shape").tolist())
            weight = unpack_from_int32(
                self.files.get(f"{part}.weight_packed"), scheme.num_bits, shape
            )
        else:
            weight = self.files.get(f"{part}.weight")
        if weight is None:
            raise KeyError(f"{part}: no quantized weight in the checkpoint ({scheme.format})")
        scale = self.files.get(f"{part}.weight_scale").float()
        scale = scale.reshape(-1, 1).expand(weight.shape[0], 1) if scale.numel() == 1 else scale
        scale = scale.reshape(weight.shape[0], -1)
        zero = self.files.get(f"{part}.weight_zero_point")
        if zero is not None and scheme.format == "pack-quantized" and zero.dtype == torch.int32:
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            zero = unpack_from_int32(zero, scheme.num_bits, scale.shape, packed_dim=0)
        if zero is not None and not zero.any():
            zero = None
        if scheme.format == "float-quantized":
            input_scale = self.files.get(f"{part}.input_scale")
            return {
                "weight": weight,
                "weight_scale": scale,
                "input_scale": None if input_scale is None else input_scale.float().reshape(()),
                "bias": bias,
            }
        part_tensors: dict[str, torch.Tensor | None] = {
            "weight": weight.to(torch.int8),
            "weight_scale": scale,
            "bias": bias,
        }
        if zero is not None:
            part_tensors["weight_zero_point"] = zero.float().reshape(scale.shape)
        return part_tensors


def read_config_json(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a checkpoint directory?")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON ({exc}); {CHECKPOINT_FIX}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a {type(config).__name__}, not an object; {CHECKPOINT_FIX}")
    return config


def resolve_dtype(requested: str, device: str, checkpoint: dict) -> torch.dtype:
    """ "auto" computes in 16 bits wherever the hardware multiplies 16-bit values: the checkpoint's
    16-bit dtype on GPU (bf16 when it is stored in fp32), bf16 on CPUs with a bf16 dot product
    (AMX: bf16 GEMMs 3-7x faster than fp32, serving ~1.9x on a Sapphire Rapids VM; AVX512-BF16
    without AMX: SmolLM2 served 1.4x / 1.6x fp32 at concurrency 8 / 32 on a Zen 4, level at 1),
    fp32 on other CPUs, where bf16 is summed on the same fp32 FMAs and is no faster (a 16-bit
    checkpoint's weights stay bf16 in memory there: `linear._packed_dense`). vLLM's "auto"
    downcasts fp32 checkpoints. float16 on CPU is served but warned about: the CPU kernels take
    fp32 and bf16 only, and torch's eager fp16 ops are slow there (SmolLM2 on a Zen 3: TTFT 3.9 s
    for 128 tokens, against 0.5 s in bf16)."""
    if requested == "float16" and device == "cpu":
        log.warning(
            "--dtype float16 on CPU runs on torch's eager fp16 ops, several times slower than "
            "bfloat16 or float32 here; pass --dtype bfloat16 (the same 2 bytes per weight) or auto"
        )
    if requested != "auto":
        return getattr(torch, requested)
    if device == "cpu":
        return torch.bfloat16 if has_bf16_dot_product() else torch.float32
    stored = checkpoint.get("dtype") or checkpoint.get("torch_dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


class PackingWeights:
    """Wraps a CPU model's `WeightSource` and packs each linear layer as it is read
    (`LinearBase.pack`), so that only one layer at a time is held in its loaded form:
    a 16-bit checkpoint served in fp32 is read as fp32 and kept in bf16 tiles, an int4 one is
    read one value per byte and kept two per byte. Packing after the whole model was read held
    every layer in both forms at the peak."""

    def __init__(self, inner: WeightSource, batch_hint: int, arena: HugePageArena) -> None:
        self.inner = inner
        self.batch_hint = batch_hint
        self.arena = arena

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.inner.tensor(name)

    def kv_scales(self, attn: str, num_kv_heads: int) -> KVScales | None:
        return self.inner.kv_scales(attn, num_kv_heads)

    def linear(self, name: str, parts: list[str]) -> LinearBase:
        layer = self.inner.linear(name, parts)
        layer.pack(self.batch_hint, self.arena)
        return layer


def load_model(
    path: Path, dtype: torch.dtype, device: str, max_positions: int, batch_hint: int
) -> torch.nn.Module:
    """The served model from a checkpoint or a qpipe artifact directory, on `device`; on CPU
    its linear layers packed for `batch_hint` rows (`pack_linear_weights`) as they are read."""
    from transformers import AutoConfig

    from qpipe.serve.artifact import ARTIFACT_MARKER, ArtifactWeights
    from qpipe.serve.models.llama import LlamaForCausalLM

    hf_config = AutoConfig.from_pretrained(path)
    target = torch.device(device)
    weights: WeightSource
    if (path / ARTIFACT_MARKER).is_file():
        weights = ArtifactWeights(path, dtype, target)
    else:
        quantization = QuantizationConfig(read_config_json(path).get("quantization_config"))
        weights = CheckpointWeights(path, quantization, dtype, target)
    weights.files.check_against(hf_config)
    arena = HugePageArena()
    if target.type == "cpu":
        weights = PackingWeights(weights, batch_hint, arena)
    with torch.device("cpu"):
        model = LlamaForCausalLM(hf_config, weights, max_positions)
    if target.type == "cpu":
        # what no source handed over: a tied lm_head
        pack_linear_weights(model, batch_hint, arena)
        packed = sum(m.packed is not None for m in model.modules() if isinstance(m, LinearBase))
        log.info("%d linear layers packed for this CPU", packed)
    return model.to(device).eval()
