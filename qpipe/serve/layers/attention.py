"""Attention over the paged KV cache, in plain torch (SDPA).

The cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]` for K and for V. New K/V
are scattered into their slots first; then
- all single-token queries (decodes) run as ONE batched SDPA call: their blocks are gathered into
  a padded `[batch, kv_heads, context, head_dim]` tensor with a length mask, and the query heads
  of a KV group ride as the query-length axis, so GQA needs no repeated K/V;
- each multi-token chunk (prefill) runs on its own: fresh prompts attend to their own K/V with a
  causal mask, chunks after cached context gather that context from the cache first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    token_start: int  # offset of the chunk in the flat batch of tokens
    num_tokens: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [blocks covering context_start + num_tokens]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int  # the first tokens of the batch are single-token queries
    decode_block_tables: torch.Tensor | None  # [decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_blocks * block_size], 0 or -inf
    prefills: tuple[PrefillSpan, ...]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; kv_cache: this layer's
    [2, blocks, block_size, kv_heads, head_dim]. Returns [T, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache, v_cache = kv_cache
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(q.shape)
    group = num_heads // num_kv_heads

    decodes = meta.num_decode_tokens
    if decodes:
        ctx_k, ctx_v = _gather(kv_cache, meta.decode_block_tables)
        q_groups = q[:decodes].reshape(decodes, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            q_groups, ctx_k, ctx_v, attn_mask=meta.decode_mask, scale=scale
        )
        out[:decodes] = o.reshape(decodes, num_heads, head_dim)

    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        if span.context_start == 0:
            ks, vs = k[rows], v[rows]
            mask = None
        else:
            total = span.context_start + span.num_tokens
            ks = k_cache[span.block_table].flatten(0, 1)[:total]
            vs = v_cache[span.block_table].flatten(0, 1)[:total]
            q_pos = torch.arange(span.context_start, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(kv_cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[2, batch, kv_heads, blocks * block_size, head_dim] copy of the K and V blocks listed in
    `tables`, in one pass."""
    batch, width = tables.shape
    blocks = kv_cache.index_select(1, tables.flatten())
    return blocks.view(2, batch, width * kv_cache.shape[2], *kv_cache.shape[3:]).transpose(2, 3)
