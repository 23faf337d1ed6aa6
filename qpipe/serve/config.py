"""The engine's one configuration object: what to load, where, and how much room the KV cache
gets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": the compute dtype. "fp8" is vLLM's name for fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
DEVICES = ("cpu", "cuda")

# Tokens one step may hold when the user does not say (`max_num_batched_tokens`). Every prompt
# admitted to a step waits for the whole step, so the budget trades the first token's latency
# under load against the GEMM efficiency of big steps. A GPU computes 2048 tokens of a small model
# in tens of milliseconds, and vLLM's API server uses 2048 too. A CPU needs seconds for them
# (SmolLM2 on 2 Zen 3 cores: ~4 s), so there the budget is 512: measured offline at concurrency
# 32, 128-token prompts, TTFT p50 4.1 -> 2.1 s at the same output tok/s (c=8: 2.0 -> 1.3 s,
# c=64: 4.6 -> 2.3 s), for 15-25 % more TPOT and ~15 % more time to a lone 2000-token prompt's
# first token.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs. Values the checkpoint decides (the real `max_model_len`, the
    dtype behind "auto") are resolved by the engine and exposed on it, never written back here."""

    model: str
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: DEFAULT_MAX_NUM_BATCHED_TOKENS[device]
    max_model_len: int | None = None
    max_model_len_cap: int = 8192  # the default max_model_len's bound, not an explicit one's
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float = 2.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enforce_eager: bool = False  # GPU: launch decode steps op by op instead of from CUDA graphs
    seed: int = 0

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(
                f"EngineConfig.model: {self.model!r} is not a directory; pass a checkpoint or "
                "qpipe artifact directory (config.json + *.safetensors + tokenizer files)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"EngineConfig.device must be one of {DEVICES}, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"EngineConfig.block_size must be a power of two, got {self.block_size}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len_cap"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {value}")
        if self.token_budget < self.max_num_seqs:
            # every running request's decode row needs a place in each step, or some stall
            default = self.max_num_batched_tokens is None
            given = f", the {self.device} default" if default else ""
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.token_budget}{given}) is below "
                f"max_num_seqs ({self.max_num_seqs}); raise it to at least max_num_seqs"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.kv_cache_memory_gib < math.inf:  # NaN fails both
            raise ValueError(
                "EngineConfig.kv_cache_memory_gib must be a finite number > 0, "
                f"got {self.kv_cache_memory_gib}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "EngineConfig.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    @property
    def token_budget(self) -> int:
        """Most tokens in one step: `max_num_batched_tokens`, or the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device]
