"""The human name of a build: `{model}-{arch}-{quant}-tp{N}` (e.g. `llama3-70b-sm80-int8-tp4`).

Teams already call engines this way; the alias points at the content key, so two builds that share
a name but not their inputs never get confused (the newer one moves the alias).
"""

from __future__ import annotations

import re

from qpipe.gpu import arch_name
from qpipe.quant.config import QuantizationConfig
from qpipe.recipe import Recipe

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def quant_name(quant: QuantizationConfig, dtype: str) -> str:
    """The short quantization name used in aliases (bf16/fp16/fp32 for unquantized weights),
    with `-fp8kv` when the KV cache is fp8 (`int8-fp8kv`), its scales per layer or per head: it
    changes what the engine reads."""
    kv = "" if quant.kv_cache == "none" else "-fp8kv"
    return _weights_name(quant, dtype) + kv


def _weights_name(quant: QuantizationConfig, dtype: str) -> str:
    if quant.method == "none":
        return _DTYPE_NAMES[dtype]
    if quant.method == "int8-sq":
        return "int8"
    if quant.method == "gptq":
        return f"gptq-w{quant.bits or 4}"
    return quant.method  # fp8, awq, int8-wo, int4-wo


def engine_alias(recipe: Recipe, arch: str) -> str:
    """`{model}-{arch}-{quant}-tp{N}`, with `-pp{M}` appended when pipeline parallel."""
    build = recipe.build
    parts = [
        recipe.model_name,
        arch_name(arch),  # "cpu" when built without a GPU, as the registry records it
        quant_name(recipe.quantization, recipe.model.dtype),
        f"tp{build.tp}",
    ]
    if build.pp > 1:
        parts.append(f"pp{build.pp}")
    return _UNSAFE.sub("-", "-".join(parts).lower()).strip("-")
