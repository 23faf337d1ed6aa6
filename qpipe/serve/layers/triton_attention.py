"""Paged attention for GPUs, in Triton: each program reads one sequence's K/V blocks where they
lie, through its block table, for one KV head and all the query heads of its GQA group. One
kernel runs a step's decodes (one query each; the one CUDA graphs capture), another its prefill
chunks (many queries each, causal): fresh prompts and chunks that continue a cached context.

Why: the SDPA fallback first gathers every sequence's context into a padded copy, which on a GPU
costs as much memory traffic as the attention itself; decode attention is bandwidth-bound, so
reading each block once is the whole game (vLLM's paged attention does the same). The K block
layout qpipe stores, `[kv_heads, head_dim, block_size]`, is already the right operand of `q @ K`.

Triton is on qpipe's GPU image, not a CPU dependency: `available()` is False without it. Its
interpreter (`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors, which is how CI checks
them.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


CONTEXT_BLOCK_M = 16  # query tokens per `context_attention` program, times the GQA group
# Triton compiles a kernel anew for an integer argument that is 1 or a multiple of 16. The block
# tables' width changes from step to step (the longest context's blocks), so each of those would
# compile mid-serving, stalling every running request (~0.4-0.9 s per compile on a 2-core host);
# it only indexes the tables, where the hint gains nothing.
STEP_VARYING = ["stride_tb"]


def available() -> bool:
    return triton is not None


def usable(q: torch.Tensor) -> bool:
    """True where these kernels run on `q`'s device: a GPU, with Triton installed."""
    return q.is_cuda and triton is not None


if triton is not None:

    @triton.jit
    def _attend_block(
        q, acc, m, total, seen, scale, k_block, v_block, start, length, stride_kd, stride_vt,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One K/V block of the online softmax for the query rows `q` [rows, HEAD_DIM] (fp32):
        their scores against the block's keys where `seen` [rows, BLOCK_SIZE], the running max
        `m` and sum `total` rescaled, the block's values added into `acc`. `k_block` and
        `v_block` point at this KV head in the block; its tokens are start.. of `length`."""
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        k = tl.load(k_block + d[:, None] * stride_kd + t[None, :]).to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION)
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite from the first block on: key 0 is seen
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(
            v_block + t[:, None] * stride_vt + d[None, :],
            mask=(start + t < length)[:, None],
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return acc, m_new, total

    @triton.jit(do_not_specialize=STEP_VARYING)
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
            seen = tl.broadcast_to((start + t < length)[None, :], (GROUP_PAD, BLOCK_SIZE))
            acc, m, total = _attend_block(
                q, acc, m, total, seen, scale, k_ptr + block * stride_kb + kv_head * stride_kh,
                v_ptr + block * stride_vb + kv_head * stride_vh, start, length,
                stride_kd, stride_vt, HEAD_DIM, BLOCK_SIZE, PRECISION,
            )  # fmt: skip
        out = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=in_group[:, None],
        )

    @triton.jit(do_not_specialize=STEP_VARYING)
    def _context_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, starts_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh,
        stride_tb,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        query_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        first = tl.load(starts_ptr + seq)
        num_queries = tl.load(starts_ptr + seq + 1) - first
        if query_block * BLOCK_M < num_queries:
            length = tl.load(lens_ptr + seq)
            context = length - num_queries
            # rows: BLOCK_M tokens x the GROUP query heads of this KV head, token-major
            r = tl.arange(0, BLOCK_M * GROUP_PAD)
            token = query_block * BLOCK_M + r // GROUP_PAD
            g = r % GROUP_PAD
            valid = (token < num_queries) & (g < GROUP)
            heads = kv_head * GROUP + g
            rows = (first + token).to(tl.int64)
            d = tl.arange(0, HEAD_DIM)
            t = tl.arange(0, BLOCK_SIZE)
            q = tl.load(
                q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            position = context + token  # each row's own position: it sees keys up to it
            m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
            end = tl.minimum(context + (query_block + 1) * BLOCK_M, length)
            for start in range(0, end, BLOCK_SIZE):
                block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE).to(tl.int64)
                key = start + t
                seen = (key[None, :] <= position[:, None]) & (key[None, :] < length)
                acc, m, total = _attend_block(
                    q, acc, m, total, seen, scale, k_ptr + block * stride_kb + kv_head * stride_kh,
                    v_ptr + block * stride_vb + kv_head * stride_vh, start, length,
                    stride_kd, stride_vt, HEAD_DIM, BLOCK_SIZE, PRECISION,
                )  # fmt: skip
            out = acc / total[:, None]
            tl.store(
                out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=valid[:, None],
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


def context_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    max_queries: int,
    scale: float,
) -> None:
    """A step's prefill chunks, fresh prompts and those that continue a sequence already in the
    cache (a prefix-cache hit, the second chunk of a long prompt), all in one call: chunk i's
    queries are rows query_starts[i]..query_starts[i + 1] of q and out ([rows, heads,
    head_dim]), its K/V (this step's included, written first) are seq_lens[i] tokens read
    through block_tables[i], and each query sees the keys up to its own position.
    `max_queries`: the longest chunk.

    Why: SDPA needs each chunk after context gathered into a contiguous copy, a causal mask
    materialized, and one call per chunk or per length of fresh prompts; on the H200 its cuDNN
    backend also spent ~1.2 ms of host time per call (vLLM's Triton backend reads the paged
    cache for every prefill the same way)."""
    _, heads, head_dim = q.shape
    _, kv_heads, _, block_size = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    group = heads // kv_heads
    chunks = seq_lens.shape[0]
    _context_kernel[(chunks, triton.cdiv(max_queries, CONTEXT_BLOCK_M), kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=CONTEXT_BLOCK_M,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
