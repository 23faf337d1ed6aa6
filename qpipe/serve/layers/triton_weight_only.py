"""Weight-only quantized linear layers (AWQ, GPTQ, int4-wo/int8-wo) on GPUs, in Triton: each
program dequantizes one tile of the weight in registers and multiplies it in, so the weight is read
at one byte per value and never written out in 16 bits.

Why: the eager fallback expands the whole weight to the model dtype on every call, which moves
five bytes per weight (read one, write two, read two in the GEMM) against a 16-bit model's two,
so a 4-bit checkpoint would serve slower than its 16-bit original. Dequantization follows
`WeightOnlyLinear.dequantized` step for step ((q - zero) * scale in fp32, rounded to the model
dtype), and the products sum in fp32, as the eager GEMM's do.

Triton is on qpipe's GPU image, not a CPU dependency: `available()` is False without it. Its
interpreter (`TRITON_INTERPRET=1`) runs the same kernel on CPU tensors, which is how CI checks it.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_M_MAX = 64  # rows per program: decode steps of up to 16 rows take one block of 16
BLOCK_N = 64  # output features per program
BLOCK_K_MAX = 64  # inputs per step: one group's scales serve a whole step


def available() -> bool:
    return triton is not None


if triton is not None:
    # the row count changes with every step: see triton_attention.STEP_VARYING
    @triton.jit(do_not_specialize=["M"])
    def _weight_only_kernel(
        out_ptr, x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr,
        M, N, K, GROUP,
        stride_xm, stride_om, stride_wn, stride_sn,
        HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        in_m = rm < M
        in_n = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=in_m[:, None], other=0.0)
            q = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=in_n[None, :], other=0)
            group = start // GROUP  # BLOCK_K divides the group: one scale per output feature
            scale = tl.load(scale_ptr + rn * stride_sn + group, mask=in_n, other=0.0)
            w = q.to(tl.float32)
            if HAS_ZERO:
                w = w - tl.load(zero_ptr + rn * stride_sn + group, mask=in_n, other=0.0)[None, :]
            w = (w * scale[None, :]).to(x_ptr.dtype.element_ty)  # the eager expansion's rounding
            if DOT_FP32:  # exact: the 16-bit values widen without loss, products sum in fp32
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=in_m[:, None] & in_n[None, :],
        )


def block_k(group_size: int) -> int | None:
    """Inputs per kernel step for a group size: the largest power of two up to 64 that divides
    it, so that a step never straddles two groups; None below 16 (tl.dot's least)."""
    size = BLOCK_K_MAX
    while size >= 16 and group_size % size:
        size //= 2
    return size if size >= 16 else None


def fits(in_features: int, group_size: int) -> bool:
    return available() and in_features % group_size == 0 and block_k(group_size) is not None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ dequant(weight).T + bias. weight: [out, in] int8 (one int4/int8 value per byte);
    scale and zero: [out, groups] fp32; x: [..., in] in the model dtype."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    group_size = in_features // scale.shape[1]
    block_m = min(BLOCK_M_MAX, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, BLOCK_N))
    unread = scale  # a pointer for the absent zero points or bias, which the kernel skips
    _weight_only_kernel[grid](
        out, x2, weight, scale, unread if zero is None else zero, unread if bias is None else bias,
        rows, out_features, in_features, group_size,
        x2.stride(0), out.stride(0), weight.stride(0), scale.stride(0),
        HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        # fp32 models keep full fp32 products (the eager GEMM's); 16-bit ones run on 16-bit tensor
        # cores, except in Triton's interpreter, whose tl.dot misreads bf16 operands (3.9: sums
        # of ~1e10 for values of ~1) and gets the same products in fp32 instead
        DOT_FP32=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k(group_size),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], out_features)
