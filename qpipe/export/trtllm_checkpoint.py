"""Write a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors) for a Llama-family model.

The source is qpipe's quantized checkpoint (compressed-tensors, or plain 16-bit for method none),
so the engine gets the integers and scales that qpipe evaluated, except where TensorRT-LLM's
layout has no place for them: FP8 keeps one weight scale per fused linear, and W8A16/W4A16 are
rounded again by trtllm-build (qpipe/export/trtllm_quant.py says how). Names, fusion and
sharding follow TensorRT-LLM's documented format (docs/source/architecture/checkpoint.md) and its
Llama converter (tensorrt_llm/models/llama/convert.py, tensorrt_llm/models/convert_utils.py):

    transformer.vocab_embedding.weight     split over vocab (dim 0) when tp > 1
    transformer.layers.{i}.input_layernorm.weight, .post_layernorm.weight
    transformer.layers.{i}.attention.qkv   q, k, v each split by heads per rank, then concatenated
                                           (k/v heads repeated when kv_heads < tp)
    transformer.layers.{i}.attention.dense o_proj, split on input features (row parallel)
    transformer.layers.{i}.mlp.fc          gate_proj (!), split on output features
    transformer.layers.{i}.mlp.gate        up_proj (!), split on output features
    transformer.layers.{i}.mlp.proj        down_proj, split on input features (row parallel)
    transformer.ln_f.weight, lm_head.weight (split over vocab, padded to a multiple of tp)

Layers are numbered per pipeline stage (rank = pp_rank * tp + tp_rank); the embedding lives on the
first stage, ln_f and lm_head on the last. Per-algorithm tensors: see qpipe/export/trtllm_quant.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qpipe.export.quantized_checkpoint import (
    CheckpointFormatError,
    QuantizedCheckpoint,
    QuantizedLinear,
    concat_rows,
)
from qpipe.export.trtllm_quant import (
    SQ_PER_TOKEN,
    QuantLayout,
    check_groupwise_shape,
    checkpoint_dtype,
    choose_layout,
    fp8_requantize_error,
    linear_tensors,
)
from qpipe.fit import FitError, ModelShape
from qpipe.quant.group_size import matches_any

ARCHITECTURES = ("LlamaForCausalLM",)
# TensorRT-LLM linear -> the HF linears it holds (fused in order).
LINEARS: dict[str, tuple[str, ...]] = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj",),
    "mlp.gate": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}
ROW_PARALLEL = ("attention.dense", "mlp.proj")


class ParallelismError(CheckpointFormatError):
    """tp/pp sizes the model's shape cannot be split into."""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class LlamaShape(ModelShape):
    """A Llama-family shape (read as `qpipe fit` reads it) and the tp/pp splits it allows."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaShape:
        archs = config.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise CheckpointFormatError(
                f"architectures {archs} is not Llama-family; the TensorRT-LLM checkpoint writer "
                f"supports {', '.join(ARCHITECTURES)}"
            )
        try:
            shape = super().from_config(config)
        except FitError as exc:
            raise CheckpointFormatError(str(exc)) from exc
        assert isinstance(shape, LlamaShape)
        return shape

    def check_parallel(self, tp: int, pp: int) -> None:
        if self.num_heads % tp:
            raise ParallelismError(
                f"tp={tp} does not divide the model's {self.num_heads} attention heads; "
                f"use build.tp in {{{_divisors(self.num_heads)}}}"
            )
        kv = self.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ParallelismError(
                f"tp={tp} cannot share the model's {kv} key/value heads (each rank needs whole "
                f"heads); use a tp that divides {kv} or is a multiple of it"
            )
        if self.intermediate_size % tp:
            raise ParallelismError(
                f"tp={tp} does not divide intermediate_size {self.intermediate_size}"
            )
        if self.num_layers % pp:
            raise ParallelismError(
                f"pp={pp} does not divide the model's {self.num_layers} layers; "
                f"use build.pp in {{{_divisors(self.num_layers)}}}"
            )

    def qkv_rows(self, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices of this rank's q and of its k (= v) heads."""
        q_per_rank = self.num_heads // tp
        if self.num_kv_heads >= tp:
            per_rank = self.num_kv_heads // tp
            kv_heads = range(rank * per_rank, (rank + 1) * per_rank)
        else:  # replicated: tp / kv ranks share each kv head
            shared = rank // (tp // self.num_kv_heads)
            kv_heads = range(shared, shared + 1)
        q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
        return self._head_rows(q_heads), self._head_rows(kv_heads)

    def _head_rows(self, heads: range) -> torch.Tensor:
        return torch.cat([torch.arange(h * self.head_dim, (h + 1) * self.head_dim) for h in heads])


def check_model_config(
    config: dict[str, Any], tp: int, pp: int, int4_group: int | None, keep_16bit: list[str]
) -> None:
    """What writing the checkpoint would refuse about the model, read from its config.json, so
    that a recipe fails before convert, calibrate and quantize spend their time: the
    architecture, the tp/pp split, linear biases and (int4 groups) TensorRT-LLM's padding rule."""
    shape = LlamaShape.from_config(config)
    shape.check_parallel(tp, pp)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointFormatError(
            "the model's linears have biases (attention_bias/mlp_bias), which qpipe's TensorRT-LLM "
            "checkpoint writer does not support; drop trtllm-checkpoint/trtllm-engine from "
            "build.targets"
        )
    if int4_group is None:
        return
    h, attn = shape.hidden_size, shape.num_heads * shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    inter = shape.intermediate_size
    features = {  # TensorRT-LLM linear: (in, out), unsharded
        "attention.qkv": (h, qkv), "attention.dense": (attn, h),
        "mlp.fc": (h, inter), "mlp.gate": (h, inter), "mlp.proj": (inter, h),
    }  # fmt: skip
    for layer in range(shape.num_layers):
        for tllm, hf_names in LINEARS.items():
            if not matches_any(f"model.layers.{layer}.{hf_names[0]}", keep_16bit):
                in_f, out_f = features[tllm]
                check_groupwise_shape(f"transformer.layers.{layer}.{tllm}", in_f, out_f,
                                      int4_group, tp)  # fmt: skip


def _shard_rows(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Vocab-parallel split (zero rows pad the vocab to a multiple of tp)."""
    pad = -tensor.shape[0] % tp
    if pad:
        tensor = torch.nn.functional.pad(tensor, (0, 0, 0, pad))
    # NOTE: clone, or safetensors refuses views sharing storage (tied embedding and lm_head).
    return tensor.chunk(tp, dim=0)[rank].clone()


def shard_linear(
    tllm: str, parts: list[QuantizedLinear], shape: LlamaShape, tp: int, rank: int
) -> QuantizedLinear:
    if tllm == "attention.qkv":
        q_rows, kv_rows = shape.qkv_rows(tp, rank)
        q, k, v = parts
        return concat_rows([q.rows(q_rows), k.rows(kv_rows), v.rows(kv_rows)])
    (linear,) = parts
    if tllm in ROW_PARALLEL:
        size = linear.in_features // tp
        return linear.columns(rank * size, (rank + 1) * size)
    size = linear.out_features // tp
    return linear.rows(torch.arange(rank * size, (rank + 1) * size))


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta") or params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    kind = params.pop("rope_type", None) or params.pop("type", None)
    if kind in (None, "default"):
        return theta, None
    return theta, {"type": kind, **params}


def checkpoint_config(
    config: dict[str, Any], shape: LlamaShape, dtype: str, tp: int, pp: int,
    quantization: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    rotary_base, rotary_scaling = _rope(config)
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": config.get("max_position_embeddings"),
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_size": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "hidden_act": config.get("hidden_act", "silu"),
        "norm_epsilon": config.get("rms_norm_eps", 1e-5),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "use_parallel_embedding": tp > 1,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "mlp_bias": False,
        "attn_bias": False,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": quantization,
    }


@dataclass(frozen=True)
class TrtllmCheckpoint:
    path: Path
    config: dict[str, Any]
    # FP8: the largest relative weight error that one scale per linear adds to what was evaluated
    # (0.0 when every fused linear had one per-tensor scale already)
    requantize_error: float = 0.0

    @property
    def quant_algo(self) -> str | None:
        return self.config["quantization"]["quant_algo"]

    @property
    def rank_files(self) -> list[Path]:
        world = self.config["mapping"]["world_size"]
        return [self.path / f"rank{r}.safetensors" for r in range(world)]


class _Writer:
    def __init__(self, src: QuantizedCheckpoint, shape: LlamaShape, dtype: str, tp: int, arch: str):
        self.src, self.shape, self.tp = src, shape, tp
        self.layout = self._find_layout()
        self.dtype_name = checkpoint_dtype(self.layout.quant_algo, dtype, arch)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.requantized: list[float] = []

    def _find_layout(self) -> QuantLayout:
        """The algorithm of the first layer with quantized linears (16-bit layers are excluded)."""
        for layer in range(self.shape.num_layers):
            flat = [lin for parts in self.layer_linears(layer).values() for lin in parts]
            layout = choose_layout(flat, self.src.kv_cache_type)
            if layout.quant_algo is not None:
                return layout
        return layout

    def layer_linears(self, layer: int) -> dict[str, list[QuantizedLinear]]:
        prefix = f"model.layers.{layer}"
        return {
            tllm: [self.src.linear(f"{prefix}.{hf}") for hf in hf_names]
            for tllm, hf_names in LINEARS.items()
        }

    def kept_16bit(self, layer: int) -> list[str]:
        """The TensorRT-LLM linears of `layer` that a quantized checkpoint leaves 16-bit."""
        if self.layout.quant_algo is None:
            return []
        return [
            tllm
            for tllm, hf_names in LINEARS.items()
            if not self.src.has(f"model.layers.{layer}.{hf_names[0]}.weight_scale")
        ]

    def exclude_modules(self, pp: int) -> list[str] | None:
        """exclude_modules of the config: TensorRT-LLM replaces its default list (lm_head, the
        vocab embedding, ...) with this one and matches it with fnmatch against both module names
        (`quantize_layers`) and weight names (`weight_only_quantize_dict`), so it restates the
        defaults a Llama needs and ends each 16-bit linear with `*`. Layers are named per pipeline
        stage, and one config serves every stage: each must keep the same local layers 16-bit."""
        if self.layout.quant_algo is None:
            return None
        per_stage = self.shape.num_layers // pp
        stages = [
            [f"transformer.layers.{local}.{tllm}*"
             for local in range(per_stage) for tllm in self.kept_16bit(stage * per_stage + local)]
            for stage in range(pp)
        ]  # fmt: skip
        if stages[0] and self.layout.quant_algo == SQ_PER_TOKEN:
            raise CheckpointFormatError(
                f"{stages[0][0].removesuffix('*')} is kept 16-bit, which TensorRT-LLM's "
                f"SmoothQuant plugin ({SQ_PER_TOKEN}) cannot hold: it quantizes every decoder "
                "layer and ignores exclude_modules. Quantize with activations: static "
                "(W8A8_SQ_PER_CHANNEL honours exclusions), or keep only lm_head 16-bit "
                "(quantization.keep_16bit: [lm_head], no auto_keep_16bit)"
            )
        if any(stage != stages[0] for stage in stages):
            raise CheckpointFormatError(
                f"pp={pp}: the pipeline stages keep different layers 16-bit, and TensorRT-LLM "
                "names layers per stage with one exclude_modules for all; keep the same layers "
                "of each stage 16-bit, or use build.pp: 1"
            )
        return ["*lm_head", "*vocab_embedding", *stages[0]]

    def layer_tensors(self, layer: int, local: int) -> list[dict[str, torch.Tensor]]:
        try:
            linears = self.layer_linears(layer)
            flat = [lin for parts in linears.values() for lin in parts]
            layout = choose_layout(flat, self.src.kv_cache_type)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"model.layers.{layer}: {exc}") from exc
        if layout.quant_algo is not None and (
            layout.quant_algo != self.layout.quant_algo
            or layout.group_size != self.layout.group_size
            or layout.has_zero_point > self.layout.has_zero_point
        ):
            raise CheckpointFormatError(
                f"layer {layer} is quantized as {layout.quant_algo}, earlier layers as "
                f"{self.layout.quant_algo}; a TensorRT-LLM checkpoint holds one algorithm"
            )
        name = f"transformer.layers.{local}"
        norms = {
            f"{name}.input_layernorm.weight": self._dense(f"model.layers.{layer}.input_layernorm"),
            f"{name}.post_layernorm.weight": self._dense(
                f"model.layers.{layer}.post_attention_layernorm"
            ),
        }
        ranks = []
        for rank in range(self.tp):
            tensors = dict(norms)
            for tllm, parts in linears.items():
                if rank == 0 and self.layout.quant_algo == "W4A16_AWQ":
                    out_features = sum(p.out_features for p in parts)
                    check_groupwise_shape(
                        f"{name}.{tllm}", parts[0].in_features, out_features,
                        self.layout.group_size, self.tp,
                    )  # fmt: skip
                try:
                    sharded = shard_linear(tllm, parts, self.shape, self.tp, rank)
                except CheckpointFormatError as exc:
                    raise CheckpointFormatError(f"model.layers.{layer}: {exc}") from exc
                module = f"{name}.{tllm}"
                written = linear_tensors(
                    module, sharded, self.layout, self.dtype, tllm in ROW_PARALLEL
                )
                if self.layout.quant_algo == "FP8":
                    self.requantized.append(fp8_requantize_error(sharded, written, module))
                tensors.update(written)
            tensors.update(self._activation_quantizers(name))
            if self.layout.kv_cache_quant_algo is not None:
                kv_scale = self.src.kv_cache_scale(layer)
                tensors[f"{name}.attention.kv_cache_scaling_factor"] = kv_scale
            ranks.append(tensors)
        return ranks

    def _activation_quantizers(self, name: str) -> dict[str, torch.Tensor]:
        """The SmoothQuant plugin quantizes each token in the layer norms (scale 1.0)."""
        if self.layout.quant_algo != SQ_PER_TOKEN:
            return {}
        return {
            f"{name}.input_layernorm.scale_to_int": torch.ones(1, dtype=torch.float32),
            f"{name}.post_layernorm.scale_to_int": torch.ones(1, dtype=torch.float32),
        }

    def _dense(self, prefix: str) -> torch.Tensor:
        return self.src.tensor(f"{prefix}.weight").to(self.dtype).contiguous()

    def embedding(self, rank: int) -> torch.Tensor:
        table = self._dense("model.embed_tokens")
        return _shard_rows(table, self.tp, rank) if self.tp > 1 else table.clone()

    def lm_head(self, rank: int) -> torch.Tensor:
        if self.src.has("lm_head.weight") or self.src.has("lm_head.weight_packed"):
            weight = self.src.linear("lm_head").dequantize().to(self.dtype)
        else:  # tied embeddings
            weight = self._dense("model.embed_tokens")
        return _shard_rows(weight, self.tp, rank)


def write_trtllm_checkpoint(
    src: Path, out: Path, tp: int = 1, pp: int = 1, dtype: str | None = None, arch: str = ""
) -> TrtllmCheckpoint:
    """Write `out`/config.json and rank{N}.safetensors from the checkpoint at `src`. `arch` (the
    build's sm version) picks fp16 over bf16 where a float32 model must go 16-bit."""
    from rich.progress import Progress
    from safetensors.torch import save_file

    checkpoint = QuantizedCheckpoint(src)
    shape = LlamaShape.from_config(checkpoint.config)
    shape.check_parallel(tp, pp)
    writer = _Writer(checkpoint, shape, dtype or checkpoint.dtype, tp, arch)
    exclude_modules = writer.exclude_modules(pp)
    per_stage = shape.num_layers // pp
    out.mkdir(parents=True, exist_ok=True)
    with Progress(transient=True) as progress:
        task = progress.add_task("TensorRT-LLM checkpoint", total=shape.num_layers)
        for stage in range(pp):
            ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
            for local in range(per_stage):
                layer = stage * per_stage + local
                for rank, tensors in enumerate(writer.layer_tensors(layer, local)):
                    ranks[rank].update(tensors)
                progress.advance(task)
            for rank, tensors in enumerate(ranks):
                if stage == 0:
                    tensors["transformer.vocab_embedding.weight"] = writer.embedding(rank)
                if stage == pp - 1:
                    tensors["transformer.ln_f.weight"] = writer._dense("model.norm")
                    tensors["lm_head.weight"] = writer.lm_head(rank)
                save_file(tensors, out / f"rank{stage * tp + rank}.safetensors")
    config = checkpoint_config(
        checkpoint.config, shape, writer.dtype_name, tp, pp,
        writer.layout.to_config(exclude_modules),
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return TrtllmCheckpoint(out, config, max(writer.requantized, default=0.0))
