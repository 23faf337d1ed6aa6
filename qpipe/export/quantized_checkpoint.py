"""Read a compressed-tensors checkpoint (the quantize stage's output) one linear layer at a time.

Exporters need the quantized integers and their scales, not dequantized floats: each linear comes
back as a `QuantizedLinear` (int8 values unpacked from int32 words by compressed-tensors' own
helper, fp8 values as stored, or a plain 16/32-bit weight), with sharding helpers that keep values,
scales and zero points aligned. A 16-bit checkpoint (method none) reads as all-dense.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

LinearKind = Literal["dense", "int", "fp8"]


class CheckpointFormatError(ValueError):
    """The checkpoint is not a (supported) compressed-tensors or HF safetensors checkpoint."""


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear layer: `weight` [out, in] plus per-channel/group/tensor scales.

    Scales are float32 and 2-D: [1, 1] per tensor, [out, 1] per channel, [out, groups] per group.
    Zero points are signed int8 with the scale's shape; dequantized = (weight - zero) * scale.
    """

    weight: torch.Tensor
    kind: LinearKind
    num_bits: int | None = None
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    group_size: int | None = None
    input_scale: torch.Tensor | None = None
    dynamic_activations: bool = False

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def is_per_tensor(self) -> bool:
        return self.scale is not None and self.scale.numel() == 1

    def expanded(self, tensor: torch.Tensor) -> torch.Tensor:
        """A scale-shaped tensor broadcast to the weight's [out, in]."""
        if self.group_size is not None:
            tensor = tensor.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return tensor.expand(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        if self.kind == "dense":
            return self.weight.float()
        values = self.weight.float()
        if self.zero_point is not None:
            values = values - self.expanded(self.zero_point.float())
        return values * self.expanded(self.scale)

    def channelwise(self) -> QuantizedLinear:
        """Per-tensor scales repeated per output channel (fused layers concatenate row-wise)."""
        if not self.is_per_tensor:
            return self
        rows = self.out_features
        zero = None if self.zero_point is None else self.zero_point.reshape(1, 1).expand(rows, 1)
        return replace(self, scale=self.scale.reshape(1, 1).expand(rows, 1), zero_point=zero)

    def rows(self, index: torch.Tensor) -> QuantizedLinear:
        """The output channels at `index` (column-parallel sharding, head selection)."""
        per_row = not self.is_per_tensor
        return replace(
            self,
            weight=self.weight[index],
            scale=self.scale[index] if self.scale is not None and per_row else self.scale,
            zero_point=(
                self.zero_point[index]
                if self.zero_point is not None and per_row
                else self.zero_point
            ),
        )

    def columns(self, start: int, stop: int) -> QuantizedLinear:
        """Input features [start, stop) (row-parallel sharding); groups must not be cut."""
        scale, zero = self.scale, self.zero_point
        if self.group_size is not None:
            if start % self.group_size or (stop - start) % self.group_size:
                raise CheckpointFormatError(
                    f"input features {start}:{stop} cut a quantization group of "
                    f"{self.group_size}; use a tp size that keeps whole groups per rank"
                )
            groups = slice(start // self.group_size, stop // self.group_size)
            scale = scale[:, groups]
            zero = None if zero is None else zero[:, groups]
        return replace(self, weight=self.weight[:, start:stop], scale=scale, zero_point=zero)


def concat_rows(parts: list[QuantizedLinear]) -> QuantizedLinear:
    """Fuse linears that share an input (q/k/v) into one, stacking output channels."""
    first = parts[0]
    kinds = {(p.kind, p.num_bits, p.group_size, p.zero_point is None) for p in parts}
    if len(kinds) != 1:
        raise CheckpointFormatError(
            "linears fused by TensorRT-LLM (q/k/v) are quantized differently; quantize them "
            "alike (keep all three in 16-bit or none)"
        )
    if first.kind == "dense":
        return replace(first, weight=torch.cat([p.weight for p in parts]))
    parts = [p.channelwise() for p in parts]
    zero = None if first.zero_point is None else torch.cat([p.zero_point for p in parts])
    input_scales = [p.input_scale for p in parts if p.input_scale is not None]
    return replace(
        parts[0],
        weight=torch.cat([p.weight for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        zero_point=zero,
        # NOTE: q, k and v see the same input; their observed scales agree, the max is safe.
        input_scale=torch.stack(input_scales).max().reshape(1) if input_scales else None,
    )


class QuantizedCheckpoint:
    """A safetensors checkpoint directory, its config and (optional) quantization_config."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointFormatError(f"{self.path}: no config.json (not an HF checkpoint)")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointFormatError(f"{self.path}: no *.safetensors weight files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}  # noqa: SIM118
        self.quantization: dict[str, Any] = self.config.get("quantization_config") or {}
        if self.quantization and self.quantization.get("quant_method") != "compressed-tensors":
            raise CheckpointFormatError(
                f"{self.path}: quantization_config.quant_method is "
                f"{self.quantization.get('quant_method')!r}; only compressed-tensors checkpoints "
                "(qpipe's quantize stage) can be exported"
            )
        if self.quantization.get("quantization_status", "compressed") != "compressed":
            raise CheckpointFormatError(f"{self.path}: weights are not saved compressed")

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is missing") from None

    @property
    def dtype(self) -> str:
        return str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32")

    def _activation_args(self, weight_type: str, num_bits: int) -> dict[str, Any] | None:
        """input_activations of the config group whose weights match (type, bits)."""
        for group in (self.quantization.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("type") == weight_type and weights.get("num_bits") == num_bits:
                return group.get("input_activations")
        return None

    def _group_size(self, scale: torch.Tensor, in_features: int) -> int | None:
        groups = scale.shape[-1] if scale.dim() == 2 else 1
        if groups <= 1:
            return None
        for group in (self.quantization.get("config_groups") or {}).values():
            size = (group.get("weights") or {}).get("group_size")
            if size and -(-in_features // size) == groups:
                return int(size)
        raise CheckpointFormatError(
            f"{self.path}: {groups} weight groups match no group_size in quantization_config"
        )

    def linear(self, prefix: str) -> QuantizedLinear:
        """The linear layer `prefix` (e.g. model.layers.0.self_attn.q_proj)."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        if self.has(f"{prefix}.weight_g_idx"):
            raise CheckpointFormatError(
                f"{prefix}: activation-ordered groups (g_idx) have no TensorRT-LLM layout; "
                "quantize with act_order: false"
            )
        if self.has(f"{prefix}.bias"):
            raise CheckpointFormatError(f"{prefix}: linear biases are not supported")
        if not self.has(f"{prefix}.weight_scale"):
            return QuantizedLinear(weight=self.tensor(f"{prefix}.weight"), kind="dense")
        scale = self.tensor(f"{prefix}.weight_scale").float()
        if self.has(f"{prefix}.weight_packed"):
            packed = self.tensor(f"{prefix}.weight_packed")
            out_f, in_f = (int(v) for v in self.tensor(f"{prefix}.weight_shape"))
            bits = round(packed.shape[1] * 32 / in_f)
            weight = unpack_from_int32(packed, bits, torch.Size((out_f, in_f)), packed_dim=1)
            zero = None
            if self.has(f"{prefix}.weight_zero_point"):
                zero = unpack_from_int32(
                    self.tensor(f"{prefix}.weight_zero_point"), bits, scale.shape, packed_dim=0
                )
            kind: LinearKind = "int"
        else:
            weight = self.tensor(f"{prefix}.weight")
            kind = "fp8" if weight.dtype == torch.float8_e4m3fn else "int"
            if kind == "int" and weight.dtype != torch.int8:
                raise CheckpointFormatError(f"{prefix}: unexpected weight dtype {weight.dtype}")
            bits = 8
            zero = (
                self.tensor(f"{prefix}.weight_zero_point").to(torch.int8)
                if self.has(f"{prefix}.weight_zero_point")
                else None
            )
        if scale.dim() < 2:
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)
        if zero is not None:
            zero = zero.reshape(scale.shape).to(torch.int8)
            if not bool(zero.any()):
                zero = None  # a symmetric scheme saved with explicit zeros
        input_scale = (
            self.tensor(f"{prefix}.input_scale").float().reshape(1)
            if self.has(f"{prefix}.input_scale")
            else None
        )
        act = self._activation_args("float" if kind == "fp8" else "int", bits)
        return QuantizedLinear(
            weight=weight,
            kind=kind,
            num_bits=bits,
            scale=scale,
            zero_point=zero,
            group_size=self._group_size(scale, weight.shape[1]),
            input_scale=input_scale,
            dynamic_activations=bool(act and act.get("dynamic")) and input_scale is None,
        )

    @property
    def kv_cache_type(self) -> str | None:
        """ "fp8" or "int8" when the KV cache is quantized, else None."""
        scheme = self.quantization.get("kv_cache_scheme")
        if not scheme:
            return None
        return "fp8" if scheme.get("type") == "float" else "int8"

    def kv_cache_scale(self, layer: int) -> torch.Tensor:
        """One scale for K and V of a decoder layer (TensorRT-LLM keeps a single factor)."""
        prefix = f"model.layers.{layer}.self_attn"
        scales = [self.tensor(f"{prefix}.{n}").float().reshape(-1) for n in ("k_scale", "v_scale")]
        return torch.cat(scales).max().reshape(1)
