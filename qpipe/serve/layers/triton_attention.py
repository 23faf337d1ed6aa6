"""Paged decode attention for GPUs, in Triton: each program reads one sequence's K/V blocks where
they lie, through its block table, for one KV head and all the query heads of its GQA group.

Why: the SDPA fallback first gathers every sequence's context into a padded copy, which on a GPU
costs as much memory traffic as the attention itself; decode attention is bandwidth-bound, so
reading each block once is the whole game (vLLM's paged attention does the same). The K block
layout qpipe stores, `[kv_heads, head_dim, block_size]`, is already the right operand of `q @ K`.

Triton is on qpipe's GPU image, not a CPU dependency: `available()` is False without it. Its
interpreter (`TRITON_INTERPRET=1`) runs the same kernel on CPU tensors, which is how CI checks it.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh,
        stride_tb,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        in_group = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=in_group[:, None],
            other=0.0,
        ).to(tl.float32)
        length = tl.load(lens_ptr + seq)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, length, BLOCK_SIZE):
            block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE).to(tl.int64)
            valid = start + t < length
            k = tl.load(
                k_ptr
                + block * stride_kb
                + kv_head * stride_kh
                + d[:, None] * stride_kd
                + t[None, :]
            ).to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr
                + block * stride_vb
                + t[:, None] * stride_vt
                + kv_head * stride_vh
                + d[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        out = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=in_group[:, None],
        )


def fits(head_dim: int, block_size: int) -> bool:
    """tl.arange and tl.dot want power-of-two sizes of at least 16."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))


@functools.cache
def _group_pad(group: int) -> int:
    """tl.dot needs at least 16 rows: the query heads of a group are padded with masked rows."""
    return max(16, 1 << (group - 1).bit_length())


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """out, q: [decodes, heads, head_dim]; k_cache: [blocks, kv_heads, head_dim, block_size];
    v_cache: [blocks, block_size, kv_heads, head_dim]; block_tables [decodes, max_blocks] and
    context_lens [decodes] (the new token included) as int32."""
    decodes, heads, head_dim = q.shape
    _, kv_heads, _, block_size = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    group = heads // kv_heads
    _decode_kernel[(decodes, kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        # K/V are widened to fp32 on load (bandwidth, not FLOPs, bounds decode attention): TF32
        # tensor cores hold bf16/fp16 values exactly, fp32 caches keep full fp32 products (the
        # tests compare fp32 serving with HF token for token)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
