"""Rotary position embedding with a precomputed cos/sin table indexed by absolute position.

The inverse frequencies come from transformers' own rope functions for scaled variants (llama3,
linear, yarn, ...), so every rope type a checkpoint declares is computed the way its authors did.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} in the checkpoint's config is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class RotaryEmbedding(nn.Module):
    """cos and sin tables by position; `sin` carries rotate_half's sign in its first half, so a
    rotation is `x * cos + x.roll(half) * sin`, the same products as HF's cat/neg form."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.ones(head_dim)
        sign[: head_dim // 2] = -1.0
        self.register_buffer("cos", emb.cos() * scaling)
        self.register_buffer("sin", emb.sin() * scaling * sign)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """Looked up once per forward: every layer rotates at the same positions."""
        return RotaryTables(
            self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        )


class RotaryTables(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim], first half negated

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (query and key heads together)."""
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin
