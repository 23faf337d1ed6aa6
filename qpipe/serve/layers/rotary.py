"""Rotary position embedding with a precomputed cos/sin table indexed by absolute position.

The inverse frequencies come from transformers' own rope functions for scaled variants (llama3,
linear, yarn, ...), so every rope type a checkpoint declares is computed the way its authors did.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from qpipe.serve.layers.elementwise_ops import ElementwiseOps, fused_ops


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

    def tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> RotaryTables:
        """Built once per forward: every layer rotates at the same positions. A fused kernel
        for `hidden`'s device and dtype reads the fp32 tables by position itself; the eager path
        gets them looked up in `hidden`'s dtype."""
        ops = fused_ops(hidden)
        if ops is not None:
            return RotaryTables(positions, self.cos, self.sin, None, None, ops)
        cos = self.cos[positions].unsqueeze(1).to(hidden.dtype)
        sin = self.sin[positions].unsqueeze(1).to(hidden.dtype)
        return RotaryTables(positions, self.cos, self.sin, cos, sin)


class RotaryTables(NamedTuple):
    positions: torch.Tensor  # [T] int64
    cos_cache: torch.Tensor  # [max_positions, head_dim] fp32
    sin_cache: torch.Tensor  # [max_positions, head_dim] fp32, first half negated
    cos: torch.Tensor | None  # [T, 1, head_dim] in the model dtype, eager path only
    sin: torch.Tensor | None
    ops: ElementwiseOps | None = None  # the fused kernels that rotate in place, if any

    def apply(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection [T, (heads + 2 kv_heads) * head_dim] into q, k, v heads
        with q and k rotated (in place on the kernel path)."""
        t = qkv.shape[0]
        if self.ops is not None:
            self.ops.rotary(
                qkv, self.positions, self.cos_cache, self.sin_cache, heads + kv_heads, head_dim
            )
            qkv3 = qkv.view(t, heads + 2 * kv_heads, head_dim)
            return qkv3.split([heads, kv_heads, kv_heads], 1)
        assert self.cos is not None and self.sin is not None
        qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        qk = qk.view(t, heads + kv_heads, head_dim)
        rotated = qk * self.cos + qk.roll(head_dim // 2, dims=-1) * self.sin
        q, k = rotated.split([heads, kv_heads], 1)
        return q, k, v.view(t, kv_heads, head_dim)
