"""Will a model fit on a GPU? Weights + KV cache + activations + framework overhead, with a margin.

The rule of thumb users apply by hand, made exact where it can be (weights and KV cache from the
model's config, GQA-aware) and explicit where it cannot (activations ≈ 0.2 × weights, a fixed
framework overhead, × 1.2 safety).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3

# Total memory as nvidia-smi reports it (MiB), which is what an allocator can see.
GPUS_MIB = {
    "A100-40G": 40960,
    "A100-80G": 81920,
    "H100": 81559,
    "H200": 143771,
    "L40S": 46068,
    "A10": 23028,
    "L4": 23034,
    "RTX4090": 24564,
}

# Bytes per parameter of the decoder's linear weights, by quantization (scales added separately).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

ACTIVATION_FRACTION = 0.2
SAFETY = 1.2


class FitError(ValueError):
    pass


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        try:
            heads = config["num_attention_heads"]
            return cls(
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise FitError(f"config.json lacks {exc.args[0]!r}: not a Llama-family config") from exc

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder's linear layers (what quantization shrinks)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return self.num_layers * (attention + 3 * h * self.intermediate_size)

    @property
    def embedding_params(self) -> int:
        copies = 1 if self.tied_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size


@dataclass(frozen=True)
class FitRequest:
    shape: ModelShape
    gpu_gib: float
    gpu_name: str
    quant: str = "bf16"
    kv_dtype: str = "bf16"
    group_size: int = 128
    tp: int = 1
    max_model_len: int = 8192
    concurrency: int = 1
    overhead_gib: float = 3.0

    def __post_init__(self) -> None:
        """Zero, negative or infinite sizes would divide by zero or give a verdict that means
        nothing, so they are refused here, naming the value, for every caller."""
        if not (math.isfinite(self.gpu_gib) and self.gpu_gib > 0):
            raise FitError(f"GPU memory must be a positive number of GiB, got {self.gpu_gib}")
        for name in ("tp", "group_size", "max_model_len", "concurrency"):
            if getattr(self, name) < 1:
                raise FitError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not (math.isfinite(self.overhead_gib) and self.overhead_gib >= 0):
            raise FitError(f"overhead_gib must be a finite number >= 0, got {self.overhead_gib}")


@dataclass(frozen=True)
class FitReport:
    gpu: str
    gpu_gib: float
    tp: int
    weights_gib: float
    kv_cache_gib: float
    activations_gib: float
    overhead_gib: float
    required_gib: float
    fits: bool
    kv_bytes_per_token: int
    max_concurrency_at_len: int
    max_model_len_at_concurrency: int
    max_model_len: int
    concurrency: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def weight_bytes(shape: ModelShape, quant: str, group_size: int) -> float:
    if quant not in WEIGHT_BYTES:
        raise FitError(f"unknown quant {quant!r}; use one of {', '.join(WEIGHT_BYTES)}")
    linear = shape.linear_params * WEIGHT_BYTES[quant]
    if quant == "int4":
        linear += shape.linear_params / group_size * 2  # one 16-bit scale per group
    sixteen_bit = 2.0 if quant != "fp32" else 4.0
    return linear + (shape.embedding_params + shape.norm_params) * sixteen_bit


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """K and V for every layer; with tp, each GPU holds its share of the KV heads (at least one)."""
    if kv_dtype not in KV_BYTES:
        raise FitError(f"unknown KV dtype {kv_dtype!r}; use one of {', '.join(KV_BYTES)}")
    heads = math.ceil(shape.num_kv_heads / tp)
    return 2 * shape.num_layers * heads * shape.head_dim * KV_BYTES[kv_dtype]


def fit(request: FitRequest) -> FitReport:
    shape = request.shape
    if shape.num_heads % request.tp:
        raise FitError(f"tp={request.tp} must divide the {shape.num_heads} attention heads")
    weights = weight_bytes(shape, request.quant, request.group_size) / request.tp
    per_token = kv_bytes_per_token(shape, request.kv_dtype, request.tp)
    kv = per_token * request.max_model_len * request.concurrency
    activations = ACTIVATION_FRACTION * weights
    overhead = request.overhead_gib * GIB
    required = SAFETY * (weights + kv + activations + overhead)
    capacity = request.gpu_gib * GIB
    kv_budget = max(0.0, capacity / SAFETY - weights - activations - overhead)
    return FitReport(
        gpu=request.gpu_name,
        gpu_gib=request.gpu_gib,
        tp=request.tp,
        weights_gib=weights / GIB,
        kv_cache_gib=kv / GIB,
        activations_gib=activations / GIB,
        overhead_gib=request.overhead_gib,
        required_gib=required / GIB,
        fits=required <= capacity,
        kv_bytes_per_token=per_token,
        max_concurrency_at_len=int(kv_budget // (per_token * request.max_model_len)),
        max_model_len_at_concurrency=int(kv_budget // (per_token * request.concurrency)),
        max_model_len=request.max_model_len,
        concurrency=request.concurrency,
    )


def gpu_memory(gpu: str) -> tuple[str, float]:
    """A GPU by name (A100-80G, H100, ...) or a size in GiB ("24", "24GiB")."""
    normalized = gpu.upper().replace(" ", "").replace("_", "-")
    for name, mib in GPUS_MIB.items():
        if normalized in (name, name.replace("-", "")):
            return name, mib / 1024
    number = normalized.removesuffix("GIB").removesuffix("G")
    try:
        return f"{float(number):g} GiB", float(number)
    except ValueError:
        raise FitError(
            f"unknown GPU {gpu!r}; use one of {', '.join(GPUS_MIB)} or a size in GiB"
        ) from None


def load_shape(path: Path) -> ModelShape:
    """From a config.json or a checkpoint directory holding one."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FitError(f"{path} does not exist; give a config.json, a checkpoint dir or a recipe")
    try:
        return ModelShape.from_config(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise FitError(f"{path} is not JSON: {exc}") from exc
