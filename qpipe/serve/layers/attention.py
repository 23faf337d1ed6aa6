"""Attention over the paged KV cache: a paged kernel (C++ on CPU, Triton on GPU) where one is
built, torch SDPA elsewhere.

One layer's cache is one `[2, num_blocks, block_size, kv_heads, head_dim]` allocation; a V block
is read as `[block_size, kv_heads, head_dim]`, a K block as `[kv_heads, head_dim, block_size]`
(token-minor, so a kernel's q.K over a block needs no horizontal sums). New K/V are scattered
into their slots first; then
- on CPU, the C++ kernel runs every query of the step in one call, decodes and prefill chunks
  alike, reading K/V where they lie through the block tables: a chunk after cached context needs
  no gathered copy of it and no mask, and its threads are dealt equal shares of the work;
- on GPU, one Triton kernel runs the single-token queries (decodes) as one batch, another every
  prefill chunk in one call, fresh prompts and chunks that continue a cached context (a
  prefix-cache hit, a long prompt's later chunks) alike, reading K/V through the block tables.
  Fresh prompts went to SDPA once: on the H200 its cuDNN backend spent ~1.2 ms of host time per
  call, and a step with prompts took 28-115 ms (p50 by concurrency), 18-29 ms since;
- without a kernel (no compiler, no Triton, a head size it cannot take), decodes run as one SDPA
  call over a padded `[batch, kv_heads, context, head_dim]` gather with a length mask, where the
  query heads of a KV group ride as the query-length axis, so GQA needs no repeated K/V; fresh
  prompts through SDPA with a causal mask, those of one length batched into one call, and chunks
  after cached context one by one, with that context gathered from the cache first.
The cache may hold a narrower dtype than the model computes in (`kv_cache_dtype`): new K/V are
rounded to it before they are written, and fresh prompts attend to the rounded values too, so a
prefix-cache hit or a later chunk reads what the first pass used. An fp8 cache holds K / k_scale
and V / v_scale when the checkpoint calibrated those scales (one per layer each, or one per KV
head; else 1); every path then attends over the stored values as they are, with k_scale folded
into the softmax scale (per head: into the query heads of its group) and v_scale into the output,
so no kernel reads a scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qpipe.serve.layers import cpu_kernels, triton_attention
from qpipe.serve.layers.elementwise_ops import fused_ops
from qpipe.serve.layers.fp8 import FP8_MAX


class KVScales(NamedTuple):
    """A checkpoint's fp8 KV-cache scales for one layer: one per tensor (floats), or one per KV
    head (llm-compressor's `attn_head` strategy: [kv_heads] tensors in the compute dtype, so
    the division of K and V and its fold into q and the output use the same rounded values)."""

    k: float | torch.Tensor
    v: float | torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> KVScales:
        if isinstance(self.k, float):
            return self
        return KVScales(self.k.to(device, dtype), self.v.to(device, dtype))

    def values(self) -> tuple[list[float], list[float]]:
        """Every k and v scale, for the log."""
        k, v = (torch.as_tensor(x, dtype=torch.float32).reshape(-1).tolist() for x in self)
        return k, v


class LayerCache(NamedTuple):
    """One layer's K and V as the kernels read them (`cache_views`), views made once for the
    engine's life: made per layer and step they cost three tensor ops, ~0.2 ms of a SmolLM2
    step (30 layers)."""

    k: torch.Tensor  # [blocks, kv_heads, head_dim, block_size]
    v: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]


def layer_caches(kv_cache: torch.Tensor) -> tuple[LayerCache, ...]:
    """Views of each layer of a `[layers, 2, blocks, block_size, kv_heads, head_dim]` cache."""
    return tuple(LayerCache(*cache_views(layer)) for layer in kv_cache)


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill chunk, or `num_seqs` whole fresh prompts of equal length laid out one after
    another, which attend in one batched SDPA call instead of one call (and its slicing) each:
    a step of 16 fresh 128-token prompts in bf16 took 5 % less time here."""

    token_start: int  # offset of the chunk in the flat batch of tokens
    num_tokens: int  # per sequence
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor | None  # [blocks covering context_start + num_tokens] if any
    num_seqs: int = 1  # > 1 only for fresh prompts (context_start 0)


@dataclass(frozen=True)
class PrefillChunks:
    """The prefill chunks that the GPU's Triton kernel runs in one call, fresh prompts (no cached
    context) and chunks after cached context alike: the last rows of the step, from `row_start`
    on (the runner orders them there)."""

    row_start: int
    block_tables: torch.Tensor  # [chunks, max_blocks] int32
    seq_lens: torch.Tensor  # [chunks] int32: cached context + the chunk
    query_starts: torch.Tensor  # [chunks + 1] int32, counted from row_start
    max_queries: int  # the longest chunk


@dataclass(frozen=True)
class AttentionMetadata:
    """What the paged kernel reads (`block_tables`, `seq_lens`, `query_starts`) covers the
    sequences it runs: every one of the step on CPU, the decodes on GPU and without a kernel."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int  # the first tokens of the batch are single-token queries
    block_tables: torch.Tensor | None  # [seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor | None  # [seqs] int32: tokens in the cache, this step's included
    # [seqs + 1] int32: each sequence's rows of the batch; None: one row each (decodes only)
    query_starts: torch.Tensor | None
    # [decodes, 1, 1, max_blocks * block_size], 0 or -inf; only for the SDPA path
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillSpan, ...]  # chunks that SDPA runs
    chunks: PrefillChunks | None = None  # every prefill chunk, on GPU


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; cache: this layer's; kv_scales:
    the checkpoint's, used when the cache is fp8.
    Returns [T, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_cache, v_cache = cache
    v_scale: float | torch.Tensor = 1.0
    if kv_scales is not None and k_cache.dtype == torch.float8_e4m3fn:
        k_scale, v_scale = kv_scales
        if isinstance(k_scale, torch.Tensor):  # per KV head, onto the query heads of its group
            k, v = k.div_(k_scale[:, None]), v.div_(v_scale[:, None])
            q = (q.unflatten(1, (num_kv_heads, group)) * k_scale[:, None, None]).flatten(1, 2)
        else:
            k, v = k.div_(k_scale), v.div_(v_scale)
            scale *= k_scale
    ops = fused_ops(k)
    if ops is not None:  # rounds k and v in place to what the cache holds
        ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        k, v = _write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = q.new_empty(q.shape)

    decodes = meta.num_decode_tokens
    if meta.seq_lens is not None and meta.decode_mask is None:
        if triton_attention.usable(q):
            triton_attention.decode_attention(
                out[:decodes], q[:decodes], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                scale,
            )  # fmt: skip
        else:
            cpu_kernels.ops.paged_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_starts,
                scale,
            )  # fmt: skip
    elif decodes:
        ctx_k, ctx_v = _gather(k_cache, v_cache, meta.block_tables, q.dtype)
        q_groups = q[:decodes].reshape(decodes, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            q_groups, ctx_k, ctx_v, attn_mask=meta.decode_mask, scale=scale
        )
        out[:decodes] = o.reshape(decodes, num_heads, head_dim)

    if meta.chunks is not None:
        c = meta.chunks
        triton_attention.context_attention(
            out[c.row_start :], q[c.row_start :], k_cache, v_cache, c.block_tables, c.seq_lens,
            c.query_starts, c.max_queries, scale,
        )  # fmt: skip
    for span in meta.prefills:
        n, seqs = span.num_tokens, span.num_seqs
        rows = slice(span.token_start, span.token_start + seqs * n)
        qs = q[rows].view(seqs, n, num_heads, head_dim).transpose(1, 2)  # [seqs, heads, n, D]
        if span.context_start == 0:
            ks, vs = k[rows], v[rows]
            mask = None
        else:
            assert span.block_table is not None
            total = span.context_start + n
            ks = k_cache[span.block_table].permute(0, 3, 1, 2).flatten(0, 1)[:total]
            vs = v_cache[span.block_table].flatten(0, 1)[:total]
            ks, vs = _widened(ks, q.dtype), _widened(vs, q.dtype)
            q_pos = torch.arange(span.context_start, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qs,
            ks.view(seqs, -1, num_kv_heads, head_dim).transpose(1, 2),
            vs.view(seqs, -1, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = o.transpose(1, 2).reshape(seqs * n, num_heads, head_dim)
    if isinstance(v_scale, torch.Tensor):
        out.unflatten(1, (num_kv_heads, group)).mul_(v_scale[:, None, None])
    elif v_scale != 1.0:
        out.mul_(v_scale)
    return out.view(num_tokens, num_heads * head_dim)


def _write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' `write_kv` in torch ops (where none takes this device and dtype):
    writes k and v into their slots and returns them as the cache now holds them, in their own
    dtype."""
    stored_k, stored_v = _as_cached(k, k_cache.dtype), _as_cached(v, v_cache.dtype)
    block_size = k_cache.shape[3]
    k_cache.permute(0, 3, 1, 2).index_put_((slots // block_size, slots % block_size), stored_k)
    v_cache.flatten(0, 1).index_put_((slots,), stored_v)  # CPU: no index_copy_ for fp8
    return stored_k.to(k.dtype), stored_v.to(v.dtype)


def _widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values gathered from the cache in the compute dtype, widened by the kernels on CPU."""
    if x.dtype == dtype:
        return x
    if not cpu_kernels.serves(x.device, dtype):
        return x.to(dtype)
    out = torch.empty(x.shape, dtype=dtype)
    cpu_kernels.ops.widen_kv(out, x.contiguous())
    return out


def _as_cached(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded to the KV cache's dtype; fp8 saturates at its largest finite value (torch's
    cast would make NaN of anything beyond it)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K as [blocks, kv_heads, head_dim, block_size] and V as [blocks, block_size,
    kv_heads, head_dim], both views of its [2, blocks, block_size, kv_heads, head_dim] cache."""
    _, blocks, block_size, kv_heads, head_dim = kv_cache.shape
    return kv_cache[0].view(blocks, kv_heads, head_dim, block_size), kv_cache[1]


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, kv_heads, blocks * block_size, head_dim] copies of the K and V blocks listed in
    `tables` in `dtype`, for SDPA."""
    batch, width = tables.shape
    _, kv_heads, head_dim, block_size = k_cache.shape
    flat = tables.flatten()
    ks = k_cache.index_select(0, flat).view(batch, width, kv_heads, head_dim, block_size)
    ks = ks.permute(0, 2, 1, 4, 3).reshape(batch, kv_heads, width * block_size, head_dim)
    vs = v_cache.index_select(0, flat).view(batch, width * block_size, kv_heads, head_dim)
    return _widened(ks, dtype), _widened(vs, dtype).transpose(1, 2)
