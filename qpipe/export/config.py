"""Recipe section for the build stage: which artifacts to produce, for which GPU and parallelism."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from qpipe.config_base import Section

BuildTarget = Literal["trtllm-checkpoint", "trtllm-engine", "compressed-tensors", "qpipe"]


class TrtllmBuildConfig(Section):
    """Parameters passed to `trtllm-build` (TensorRT-LLM <= 1.2.x)."""

    max_batch_size: int = Field(default=64, gt=0)
    max_input_len: int = Field(default=2048, gt=0)
    max_seq_len: int = Field(default=4096, gt=0)
    max_num_tokens: int = Field(default=8192, gt=0)
    gemm_plugin: str = Field(
        default="auto", description="auto, disable, or a dtype (float16, bfloat16, fp8, ...)."
    )
    paged_kv_cache: bool = True
    use_paged_context_fmha: bool = True
    use_timing_cache: bool = Field(
        default=True, description="Write TensorRT's timing cache next to the engine (reusable)."
    )

    @model_validator(mode="after")
    def _lengths(self) -> TrtllmBuildConfig:
        if self.max_input_len > self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) exceeds max_seq_len ({self.max_seq_len}); "
                "raise max_seq_len or lower max_input_len"
            )
        return self


class BuildConfig(Section):
    targets: list[BuildTarget] = Field(default_factory=lambda: ["compressed-tensors", "qpipe"])
    arch: str = Field(
        default="auto",
        description="GPU arch to build for: auto (detect), sm80, sm86, sm89, sm90, sm100, sm120.",
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks (TensorRT-LLM targets).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel stages (TensorRT-LLM targets).")
    trtllm: TrtllmBuildConfig = Field(default_factory=TrtllmBuildConfig)

    @field_validator("targets")
    @classmethod
    def _targets(cls, value: list[BuildTarget]) -> list[BuildTarget]:
        if not value:
            raise ValueError("list at least one target (compressed-tensors, qpipe, ...)")
        if len(set(value)) != len(value):
            raise ValueError("a target is listed twice; list each once")
        return value

    @field_validator("arch")
    @classmethod
    def _arch(cls, value: str) -> str:
        from qpipe.gpu import ARCH_PATTERN

        if value != "auto" and not ARCH_PATTERN.match(value):
            raise ValueError(
                f"arch {value!r} is not 'auto' or an sm name like sm80, sm86, sm89, sm90"
            )
        return value

    @property
    def world_size(self) -> int:
        return self.tp * self.pp
