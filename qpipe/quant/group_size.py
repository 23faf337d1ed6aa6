"""Group-size divisibility, checked from config.json before any weight is loaded.

Grouped weight scales need every quantized layer's input features to be a multiple of the group
size; llm-compressor finds out only after loading the model (and a GPTQ run may already be minutes
in). Reading the dimensions from config.json makes this a recipe-time error. No torch import here:
the lead calls it from recipe validation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qpipe.quant.config import QuantizationConfig

# Input features of a Llama-family decoder layer's linears, by config.json field.
_ATTENTION_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")


class GroupSizeError(ValueError):
    """A group size that does not divide some quantized layer's input features."""


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """llm-compressor's ignore semantics for module names: 're:<regex>' (re.match) or exact."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern:
            return True
    return False


def linear_in_features(config: Mapping[str, Any]) -> dict[str, int]:
    """Every decoder linear's input features, by module name, from a Llama-family config.json."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    per_layer = {name: hidden for name in _ATTENTION_IN + _MLP_IN}
    per_layer["self_attn.o_proj"] = heads * head_dim
    per_layer["mlp.down_proj"] = int(config["intermediate_size"])
    return {
        f"model.layers.{layer}.{name}": features
        for layer in range(int(config["num_hidden_layers"]))
        for name, features in per_layer.items()
    }


def _field_of(suffix: str) -> str:
    if suffix == "mlp.down_proj":
        return "intermediate_size"
    if suffix == "self_attn.o_proj":
        return "num_attention_heads*head_dim"
    return "hidden_size"


def suggest_group_sizes(features: Iterable[int]) -> list[int]:
    """Usual group sizes (largest first) that divide all of `features`."""
    features = list(features)
    return [g for g in (256, 128, 64, 32, 16) if all(f % g == 0 for f in features)]


def weight_group(quant: QuantizationConfig) -> int | None:
    """The group size when weights are quantized in groups: the only case that depends on widths."""
    return quant.effective_group_size if quant.weight_bits is not None else None


def check_group_size(
    config: Mapping[str, Any] | Path, quant: QuantizationConfig, extra_keep: Iterable[str] = ()
) -> None:
    """Raise GroupSizeError naming the first layer whose input features the group size splits.

    `config` is a parsed config.json or its path (or the checkpoint directory holding it).
    """
    group = weight_group(quant)
    if group is None:
        return
    if isinstance(config, Path):
        path = config / "config.json" if config.is_dir() else config
        config = json.loads(path.read_text())
    if not all(k in config for k in REQUIRED_FIELDS):
        return  # not Llama-shaped: the check on the loaded modules covers it
    keep = [*quant.keep_16bit, *extra_keep]
    quantized = {n: f for n, f in linear_in_features(config).items() if not matches_any(n, keep)}
    bad = {n: f for n, f in quantized.items() if f % group != 0}
    if not bad:
        return
    name, features = next(iter(bad.items()))
    suffix = name.split(".", 3)[3]
    others = sorted({n.split(".", 3)[3] for n in bad} - {suffix})
    also = f" (also {', '.join(others)})" if others else ""
    options = suggest_group_sizes(quantized.values())
    fix = (
        f"use {' or '.join(str(g) for g in options[:2])}"
        if options
        else "keep those layers in 16-bit (keep_16bit) or drop group_size"
    )
    raise GroupSizeError(
        f"quantization.group_size: {group} does not divide {_field_of(suffix)} {features} "
        f"of model.layers.*.{suffix}{also}; {fix}"
    )
