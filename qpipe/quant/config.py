"""Recipe sections for the calibrate and quantize stages."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from qpipe.config_base import Section

QuantMethod = Literal["none", "awq", "gptq", "int8-sq", "fp8", "int8-wo", "int4-wo"]


class CalibrationConfig(Section):
    """Where the calibration samples come from and how they become token windows."""

    dataset: str = Field(description="File or directory (JSONL, text, CSV, Parquet, datasets dir).")
    format: Literal["auto", "jsonl", "text", "csv", "parquet", "hf-dir"] = "auto"
    field: str | None = Field(
        default=None, description="Column/field holding the text; auto-detected when omitted."
    )
    num_samples: int = Field(default=512, gt=0)
    seq_len: int = Field(
        default=512,
        ge=2,
        description="Tokens per window; at least 2, so quantize's probe can score a next token.",
    )
    seed: int = 0
    packing: bool = Field(default=False, description="Pack samples and cut into seq_len chunks.")
    min_tokens: int = Field(default=8, ge=1, description="Drop samples shorter than this.")
    max_tokens: int | None = Field(
        default=None, gt=0, description="Drop samples longer than this (default: truncate)."
    )
    split: str | None = Field(
        default=None, description="Split of a saved DatasetDict (hf-dir); needed if several."
    )
    deduplicate: bool = True
    apply_chat_template: bool = True

    @model_validator(mode="after")
    def _check_lengths(self) -> CalibrationConfig:
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) is below min_tokens ({self.min_tokens}); "
                "raise max_tokens or lower min_tokens"
            )
        return self


class AutoKeep16Bit(Section):
    """Find the blocks to keep in 16-bit: the fewest, most sensitive first, that meet a budget."""

    max_kld: float = Field(
        gt=0,
        description="Budget: mean KL divergence (nats/token) of the whole quantized model vs the "
        "16-bit one on held-out text.",
    )
    heldout: str | None = Field(
        default=None,
        description="Held-out domain text (.txt, or .jsonl with text/question/answer fields) to "
        "measure on; default: the calibration windows (in-domain, but not held out).",
    )
    num_windows: int = Field(default=8, gt=0, description="Held-out windows to measure on.")
    seq_len: int = Field(
        default=256,
        ge=2,
        description="Tokens per held-out window; at least 2, to score a next token.",
    )


# Which methods each parameter shapes; setting one for another method is an error, not a no-op.
_PARAMETER_METHODS: dict[str, tuple[str, ...]] = {
    "bits": ("gptq",),
    "group_size": ("awq", "gptq", "int4-wo", "int8-wo"),
    "symmetric": ("awq", "gptq", "int4-wo", "int8-wo"),
    "act_order": ("gptq",),
    "dampening": ("gptq",),
    "smoothquant_alpha": ("int8-sq",),
    "weights": ("fp8",),
    "activations": ("int8-sq", "fp8"),
    "auto_keep_16bit": ("awq", "gptq", "int8-sq", "fp8", "int8-wo", "int4-wo"),
}


class QuantizationConfig(Section):
    """One quantization method and its parameters (validated against the method).

    Unset parameters take the method's usual default (see the properties below): AWQ is asymmetric
    like AutoAWQ, the others symmetric; 4-bit weights use groups of 128, 8-bit weights one scale per
    output channel.
    """

    method: QuantMethod = "none"
    bits: Literal[4, 8] | None = Field(default=None, description="gptq weight bits (default 4).")
    group_size: int | None = Field(
        default=None, gt=0, description="Input columns per weight scale (4-bit default 128)."
    )
    symmetric: bool | None = Field(default=None, description="Symmetric weights (no zero point).")
    act_order: bool = Field(default=False, description="gptq: columns by activation order.")
    dampening: float = Field(default=0.01, gt=0, lt=1, description="gptq: Hessian dampening.")
    smoothquant_alpha: float = Field(
        default=0.5, ge=0, le=1, description="int8-sq: how much activation range moves to weights."
    )
    weights: Literal["per-channel", "per-tensor"] | None = Field(
        default=None, description="fp8 weight scales (default per-channel)."
    )
    activations: Literal["dynamic", "static"] = Field(
        default="dynamic",
        description="int8-sq/fp8 activation scales: dynamic per-token, or static per-tensor "
        "(measured on the calibration set).",
    )
    kv_cache: Literal["none", "fp8", "fp8-head"] = Field(
        default="none",
        description="fp8: K and V stored in fp8 e4m3 with one scale per layer each, measured on "
        "the calibration set (k_scale/v_scale, as vLLM and TensorRT-LLM read them); fp8-head: "
        "one scale per KV head (llm-compressor's attn_head strategy), for heads whose ranges "
        "differ widely (TensorRT-LLM keeps one factor per layer: the largest).",
    )
    keep_16bit: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Modules left in 16-bit: exact module names or 're:<regex>' (llm-compressor "
        "ignore syntax), e.g. 're:model\\.layers\\.0\\..*'.",
    )
    auto_keep_16bit: AutoKeep16Bit | None = None

    @model_validator(mode="after")
    def _check_method_params(self) -> QuantizationConfig:
        for name in sorted(self.model_fields_set):
            methods = _PARAMETER_METHODS.get(name)
            if methods is not None and self.method not in methods:
                raise ValueError(
                    f"{name} is a parameter of {', '.join(methods)}, not of method "
                    f"{self.method!r}; remove it"
                )
        if self.group_size is not None and self.group_size % 8 != 0:
            raise ValueError(
                f"group_size must be a multiple of 8 (usual: 32, 64, 128), got {self.group_size}"
            )
        for pattern in self.keep_16bit:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise ValueError(
                        f"keep_16bit pattern {pattern!r} is not a valid regex: {exc}"
                    ) from exc
        return self

    @property
    def weight_bits(self) -> int | None:
        """Bits per weight, or None for method none."""
        return {"none": None, "awq": 4, "int4-wo": 4, "gptq": self.bits or 4}.get(self.method, 8)

    @property
    def effective_group_size(self) -> int | None:
        """Columns per weight scale; None means one scale per output channel (or per tensor)."""
        if self.group_size is not None:
            return self.group_size
        return 128 if self.weight_bits == 4 else None

    @property
    def is_symmetric(self) -> bool:
        return self.symmetric if self.symmetric is not None else self.method != "awq"

    @property
    def parameters(self) -> dict[str, object]:
        """The method's parameters with defaults resolved (what qpipe_quant.json records)."""
        resolved: dict[str, object] = {
            "bits": self.weight_bits,
            "group_size": self.effective_group_size,
            "symmetric": self.is_symmetric,
            "weights": self.weights or "per-channel",
        }
        return {
            name: resolved.get(name, getattr(self, name))
            for name, methods in _PARAMETER_METHODS.items()
            if self.method in methods and name != "auto_keep_16bit"
        }

    @property
    def label(self) -> str:
        """The method, and the KV cache when it is quantized, as messages name them."""
        kv = f" with kv_cache {self.kv_cache!r}" if self.kv_cache != "none" else ""
        return f"method {self.method!r}{kv}"

    @property
    def quantizes(self) -> bool:
        """Whether anything is quantized: the weights, the KV cache, or both."""
        return self.method != "none" or self.kv_cache != "none"

    @property
    def method_calibrates(self) -> bool:
        """Whether quantizing reads activations (AWQ, GPTQ, SmoothQuant, static activation
        scales, KV-cache scales)."""
        if self.kv_cache != "none":
            return True
        if self.method in ("none", "int8-wo", "int4-wo"):
            return False
        return not (self.method == "fp8" and self.activations == "dynamic")

    @property
    def needs_calibration(self) -> bool:
        """Whether the recipe needs a calibration set (the method, or auto_keep_16bit's text)."""
        if self.auto_keep_16bit is not None and self.auto_keep_16bit.heldout is None:
            return True
        return self.method_calibrates
