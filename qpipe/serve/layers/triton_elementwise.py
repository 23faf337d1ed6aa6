"""The elementwise steps of a decoder layer on GPUs, in Triton: RMSNorm (alone or after the
residual add), rotary embedding, SiLU * up, the KV cache write, and an fp8 layer's rounding of its
input, one kernel each.

Why: a decode step of a small model on a GPU is bound by how many kernels it launches, not by the
bytes they move. Eager torch ops spend 28 launches per layer on these steps (an RMSNorm is eight:
cast, square, mean, add, rsqrt, multiply, cast, weight; each residual add one; rotary four; the
cache write's index arithmetic and two scatters four; SiLU * up two), against five here; a SmolLM2
step on the H200 took 2.7 ms at one sequence for ~1,000 launches inside its CUDA graph. vLLM has
CUDA kernels for the same five steps for the same reason. An fp8 layer's per-token rounding of
its input is ten eager launches (absmax, scale, zero guard, divide, clamp, cast, the scales'
layout), one here: before it, SmolLM2 FP8_DYNAMIC on the H200 decoded at 4.2 ms a step at
concurrency 32 against bf16's 2.0 ms.

Each function has the signature and the rounding of its C++ twin in `qpipe/serve/csrc/`
(`torch.ops.qpipe_cpu`), so a layer calls whichever set serves its tensor (`fused_ops`): compute
in fp32, round to the model dtype where the eager path rounds.

Triton is on qpipe's GPU image, not a CPU dependency: `usable()` is False without it. Its
interpreter (`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors, which is how CI checks
them.
"""

from __future__ import annotations

import torch

from qpipe.serve.layers.fp8 import FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COLUMNS = 1024  # SiLU * up: output columns per program


def usable(x: torch.Tensor) -> bool:
    """True where these kernels handle `x`: a GPU tensor of a dtype they take."""
    return x.is_cuda and x.dtype in DTYPES and triton is not None


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """fp32 `x` rounded to the nearest `dtype` value (ties to even), still as fp32. bf16 and
        fp8 e4m3 are rounded by hand, to the values the GPU's conversions give: the
        interpreter's casts truncate, and CI checks these kernels in the interpreter."""
        if dtype == tl.bfloat16:  # keep 7 of fp32's 23 mantissa bits
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        if dtype == tl.float8e4nv:  # 3 mantissa bits; below 2^-6, steps of 2^-9
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
            # fp32's own rounding at a 2^-9 step: 2^14 + |x| has that spacing, 2^14 - |x| half
            magnitude = tl.abs(x)
            subnormal = tl.where(x < 0, -1.0, 1.0) * ((magnitude + 16384.0) - 16384.0)
            return tl.where(magnitude < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        out_ptr, x_ptr, res_ptr, w_ptr, n, eps,
        stride_o, stride_x, stride_r,
        ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if ADD_RESIDUAL:  # residual += x, rounded as the eager add
            res_ptrs = res_ptr + row * stride_r + cols
            res = tl.load(res_ptrs, mask=inside, other=0.0)
            x = _rounded(res.to(tl.float32) + x.to(tl.float32), res.dtype).to(res.dtype)
            tl.store(res_ptrs, x, mask=inside)
        v = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(v * v, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        normed = _rounded(_rounded(v * inv, x.dtype) * w, x.dtype)
        tl.store(out_ptr + row * stride_o + cols, normed.to(x.dtype), mask=inside)

    @triton.jit
    def _rotary_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, heads,
        HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        half = HEAD_DIM // 2
        h = tl.arange(0, HEADS_PAD)[:, None]
        i = tl.arange(0, HALF_PAD)[None, :]
        inside = (h < heads) & (i < half)
        table = tl.load(pos_ptr + token) * HEAD_DIM
        x = qkv_ptr + token * stride_t + h * HEAD_DIM + i
        a = tl.load(x, mask=inside, other=0.0)
        b = tl.load(x + half, mask=inside, other=0.0)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        c1 = tl.load(cos_ptr + table + i, mask=i < half, other=0.0)
        c2 = tl.load(cos_ptr + table + half + i, mask=i < half, other=0.0)
        s1 = tl.load(sin_ptr + table + i, mask=i < half, other=0.0)
        s2 = tl.load(sin_ptr + table + half + i, mask=i < half, other=0.0)
        tl.store(x, _rounded(af * c1 + bf * s1, a.dtype).to(a.dtype), mask=inside)
        tl.store(x + half, _rounded(bf * c2 + af * s2, a.dtype).to(a.dtype), mask=inside)

    @triton.jit
    def _silu_and_mul_kernel(out_ptr, x_ptr, n, stride_o, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=inside, other=0.0)
        g = gate.to(tl.float32)
        silu = _rounded(g / (1.0 + tl.exp(-g)), gate.dtype)
        out = _rounded(silu * up.to(tl.float32), gate.dtype)
        tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=inside)

    @triton.jit
    def _as_cached(src, inside, cache_ty, fp8_max, NARROWER: tl.constexpr, FP8: tl.constexpr):
        """The values at `src` as a cache of `cache_ty` holds them; where that is narrower, `src`
        is overwritten with them."""
        x = tl.load(src, mask=inside, other=0.0)
        value = x.to(tl.float32)
        if FP8:  # saturate: the cast would make NaN of anything beyond +-448
            value = tl.clamp(value, -fp8_max, fp8_max)
        stored = _rounded(value, cache_ty).to(cache_ty)
        if NARROWER:
            tl.store(src, stored.to(x.dtype), mask=inside)
        return stored

    @triton.jit
    def _write_kv_kernel(
        k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slots_ptr, stride_k, stride_v, fp8_max,
        ROW: tl.constexpr, ROW_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NARROWER: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, ROW_PAD)  # h * head_dim + d over the token's kv heads
        inside = i < ROW
        slot = tl.load(slots_ptr + token)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        cache_ty = k_cache_ptr.dtype.element_ty
        k = _as_cached(k_ptr + token * stride_k + i, inside, cache_ty, fp8_max, NARROWER, FP8)
        # K blocks are token-minor: [kv_heads * head_dim, block_size]
        tl.store(k_cache_ptr + block * ROW * BLOCK_SIZE + i * BLOCK_SIZE + offset, k, mask=inside)
        v = _as_cached(v_ptr + token * stride_v + i, inside, cache_ty, fp8_max, NARROWER, FP8)
        tl.store(v_cache_ptr + slot * ROW + i, v, mask=inside)

    @triton.jit
    def _quantize_fp8_kernel(
        q_ptr, scales_ptr, x_ptr, static_ptr, n, eps, fp8_max, stride_q, stride_x,
        STATIC: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        v = x.to(tl.float32)
        # the scale in x's dtype, as the eager ops compute it; divisions rounded as IEEE's
        if STATIC:
            scale = _rounded(tl.load(static_ptr).to(tl.float32), x.dtype)
        else:
            scale = _rounded(tl.math.div_rn(tl.max(tl.abs(v), 0), fp8_max), x.dtype)
            scale = tl.where(scale == 0, eps, scale)
        scaled = tl.clamp(_rounded(tl.math.div_rn(v, scale), x.dtype), -fp8_max, fp8_max)
        q = _rounded(scaled, tl.float8e4nv).to(tl.float8e4nv)
        tl.store(q_ptr + row * stride_q + cols, q, mask=inside)
        tl.store(scales_ptr + row, scale)


def _rows(*tensors: torch.Tensor) -> int:
    """The row count of [rows, columns] tensors whose rows are contiguous. A step may have none
    (a final norm when no sequence samples), and Triton launches no empty grid."""
    for x in tensors:
        assert x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous"
    return tensors[0].shape[0]


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = RMSNorm(x) * weight, rows [T, n]."""
    rows, n = _rows(x, out), x.shape[1]
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](
        out, x, x, weight, n, eps, out.stride(0), x.stride(0), 0,
        ADD_RESIDUAL=False, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual += x, then x = RMSNorm(residual) * weight, both in place."""
    rows, n = _rows(x, residual), x.shape[1]
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](
        x, x, residual, weight, n, eps, x.stride(0), x.stride(0), residual.stride(0),
        ADD_RESIDUAL=True, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip


def rotary(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
) -> None:
    """Rotates the first `heads` heads of each row of qkv [T, ...] in place by the fp32 tables
    [max_positions, head_dim] at `positions` (int64), `sin` carrying rotate_half's sign."""
    assert cos.dtype == sin.dtype == torch.float32 and positions.dtype == torch.int64
    tokens = _rows(qkv)
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](
        qkv, positions, cos, sin, qkv.stride(0), heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(heads), HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [T, n] = silu(gate) * up for x = [gate | up] [T, 2n]."""
    rows, n = _rows(out, x), out.shape[1]
    assert x.shape[1] == 2 * n, "x must be [rows, 2 * out columns]"
    if rows == 0:
        return
    block = min(COLUMNS, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        out, x, n, out.stride(0), x.stride(0), BLOCK=block
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's k and v [T, kv_heads, head_dim] into its slot of the caches (K
    [blocks, kv_heads, head_dim, block_size], V [blocks, block_size, kv_heads, head_dim]); where
    the cache is narrower, k and v are overwritten with the values it now holds."""
    tokens, kv_heads, head_dim = k.shape
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "each token's heads must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert slot_mapping.dtype == torch.int64
    if tokens == 0:
        return
    row = kv_heads * head_dim
    _write_kv_kernel[(tokens,)](
        k_cache, v_cache, k, v, slot_mapping, k.stride(0), v.stride(0), FP8_MAX,
        ROW=row, ROW_PAD=triton.next_power_of_2(row), BLOCK_SIZE=k_cache.shape[3],
        NARROWER=k_cache.dtype != k.dtype, FP8=k_cache.dtype == torch.float8_e4m3fn,
    )  # fmt: skip


def quantize_fp8(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, n] rounded to fp8 e4m3 per token (or by one calibrated `static_scale`) and the fp32
    scales [T, 1] that `torch._scaled_mm` takes: `fp8.quantize_fp8`'s bits in one launch."""
    rows, n = _rows(x), x.shape[1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scales
    block = triton.next_power_of_2(n)
    _quantize_fp8_kernel[(rows,)](
        q, scales, x, x if static_scale is None else static_scale, n, torch.finfo(x.dtype).eps,
        FP8_MAX, q.stride(0), x.stride(0), STATIC=static_scale is not None, BLOCK=block,
        num_warps=min(16, max(4, block // 1024)),
    )  # fmt: skip
    return q, scales
