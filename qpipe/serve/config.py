"""The engine's one configuration object: what to load, where, and how much room the KV cache
gets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs. Values the checkpoint decides (the real `max_model_len`, the
    dtype behind "auto") are resolved by the engine and exposed on it, never written back here."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_model_len_cap: int = 8192
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
        if self.device not in DEVICES:
            raise ValueError(f"EngineConfig.device must be one of {DEVICES}, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"EngineConfig.block_size must be a power of two, got {self.block_size}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "EngineConfig.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
