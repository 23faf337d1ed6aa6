"""The *.safetensors files behind a `WeightSource`: each header read once, then checked against
config.json.

A damaged file or a config.json that belongs to another model fails here, naming the file, the
tensor and the fix, instead of as a bare safetensors header error or as a shape error deep in the
first forward pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig

from qpipe.serve.models.llama import head_dim_of

# `model.layers.{i}.{linear}.weight` (or a pack-quantized `weight_packed`), `lm_head.weight`,
# `model.embed_tokens.weight`: the rows of each are fixed by config.json
_ROWS_OF = re.compile(r"(?:model\.layers\.\d+\.)?(.+)\.weight(?:_packed)?")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class WeightFiles:
    """Tensors by name across safetensors files; `fix` says how to get a sound copy of them."""

    def __init__(self, files: list[Path], fix: str) -> None:
        self.fix = fix
        self.where: dict[str, Path] = {}
        self._handles: dict[Path, safe_open] = {}
        for file in files:
            try:
                handle = safe_open(file, "pt")
            except SafetensorError as exc:  # a truncated copy, or not safetensors at all
                raise ValueError(
                    f"{file} is not a readable safetensors file ({exc}); {fix}"
                ) from exc
            self._handles[file] = handle
            self.where.update(dict.fromkeys(handle.keys(), file))

    def get(self, name: str) -> torch.Tensor | None:
        file = self.where.get(name)
        return None if file is None else self._handles[file].get_tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint; {self.fix}")
        return tensor

    def check_against(self, config: PretrainedConfig) -> None:
        """The layer count and each weight's rows (embeddings, every linear, fused or not) are
        what config.json says: one edited or copied from another model fails here, before a
        reshape of the first forward pass or a missing layer does."""
        expected = _rows(config)
        for name, file in self.where.items():
            match = _ROWS_OF.fullmatch(name)
            if match is None or match[1] not in expected:
                continue
            rows, why = expected[match[1]]
            shape = self._handles[file].get_slice(name).get_shape()
            if shape[0] != rows:
                raise ValueError(
                    f"config.json says {why} but {file} holds {shape} for {name}: "
                    f"config.json belongs to another model; {self.fix}"
                )
        layers = {int(m[1]) for name in self.where if (m := _LAYER.match(name))}
        if layers != set(range(config.num_hidden_layers)):
            missing = sorted(set(range(config.num_hidden_layers)) - layers)
            held = f"layers {min(layers)}-{max(layers)}" if layers else "no layers"
            files = sorted(set(self._handles))
            where = str(files[0]) if len(files) == 1 else f"the *.safetensors in {files[0].parent}"
            gap = f" (model.layers.{missing[0]}.* is missing)" if missing else ""
            raise ValueError(
                f"config.json says num_hidden_layers={config.num_hidden_layers} but {where} "
                f"holds {held}{gap}; {self.fix}"
            )


def _rows(config: PretrainedConfig) -> dict[str, tuple[int, str]]:
    """Rows of each weight by its name past `model.layers.{i}.`, and the config.json fields that
    fix them."""
    head_dim = head_dim_of(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q, kv, qkv = heads * head_dim, kv_heads * head_dim, (heads + 2 * kv_heads) * head_dim
    inter = config.intermediate_size
    kv_rows = (kv, f"num_key_value_heads={kv_heads} x head_dim={head_dim} = {kv} rows")
    inter_rows = (inter, f"intermediate_size={inter} rows")
    hidden_rows = (config.hidden_size, f"hidden_size={config.hidden_size} rows")
    vocab_rows = (config.vocab_size, f"vocab_size={config.vocab_size} rows")
    return {
        "model.embed_tokens": vocab_rows,
        "lm_head": vocab_rows,
        "self_attn.q_proj": (q, f"num_attention_heads={heads} x head_dim={head_dim} = {q} rows"),
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "self_attn.qkv_proj": (
            qkv,
            f"(num_attention_heads={heads} + 2 x num_key_value_heads={kv_heads}) x "
            f"head_dim={head_dim} = {qkv} rows",
        ),
        "self_attn.o_proj": hidden_rows,
        "mlp.gate_proj": inter_rows,
        "mlp.up_proj": inter_rows,
        "mlp.gate_up_proj": (2 * inter, f"2 x intermediate_size={inter} = {2 * inter} rows"),
        "mlp.down_proj": hidden_rows,
    }
