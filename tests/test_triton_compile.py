"""Every Triton kernel of the server compiles to a cubin for the GPUs it serves on (sm_80: A100;
sm_89: L4, L40S; sm_90: H100, H200), here, without a GPU: Triton's compiler and ptxas run on the
CPU. The interpreter tests check what the kernels compute, but the interpreter runs Python and
accepts code the compiler rejects (a type it cannot lower, a constexpr misused, an fp8 cast on an
arch without fp8); without this, such a mistake would surface only on a lent GPU, as the first
engine start failing there. Arguments are typed as the engine passes them for SmolLM2's shapes."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qpipe.serve.layers import triton_attention, triton_elementwise, triton_weight_only  # noqa: E402

FP8_ARCHS = (89, 90)  # the engine refuses fp8 below compute capability 8.9
ARCHS = (80, *FP8_ARCHS)
I32 = "i32"


def _norm(dtype: str, add: bool) -> tuple[object, dict[str, str], dict[str, object]]:
    ptrs = dict.fromkeys(("out_ptr", "x_ptr", "res_ptr", "w_ptr"), f"*{dtype}")
    scalars = {"n": I32, "eps": "fp32", "stride_o": I32, "stride_x": I32, "stride_r": I32}
    return (
        triton_elementwise._rms_norm_kernel,
        {**ptrs, **scalars},
        {"ADD_RESIDUAL": add, "BLOCK": 1024},
    )


def _rotary(dtype: str) -> tuple[object, dict[str, str], dict[str, object]]:
    types = {"qkv_ptr": f"*{dtype}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    return (
        triton_elementwise._rotary_kernel,
        {**types, "stride_t": I32, "heads": I32},
        {"HEAD_DIM": 64, "HEADS_PAD": 16, "HALF_PAD": 32},
    )


def _silu(dtype: str) -> tuple[object, dict[str, str], dict[str, object]]:
    types = {"out_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "n": I32}
    return (
        triton_elementwise._silu_and_mul_kernel,
        {**types, "stride_o": I32, "stride_x": I32},
        {"BLOCK": 1024},
    )


def _write_kv(dtype: str, cache: str) -> tuple[object, dict[str, str], dict[str, object]]:
    types = {
        "k_cache_ptr": f"*{cache}",
        "v_cache_ptr": f"*{cache}",
        "k_ptr": f"*{dtype}",
        "v_ptr": f"*{dtype}",
        "slots_ptr": "*i64",
        "stride_k": I32,
        "stride_v": I32,
        "fp8_max": "fp32",
    }
    constants = {"ROW": 192, "ROW_PAD": 256, "BLOCK_SIZE": 16}
    constants |= {"NARROWER": cache != dtype, "FP8": cache == "fp8e4nv"}
    return triton_elementwise._write_kv_kernel, types, constants


def _quantize_fp8(dtype: str, static: bool) -> tuple[object, dict[str, str], dict[str, object]]:
    types = {"q_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "x_ptr": f"*{dtype}"}
    types |= {"static_ptr": "*fp32", "n": I32, "eps": "fp32", "fp8_max": "fp32"}
    types |= {"stride_q": I32, "stride_x": I32}
    return triton_elementwise._quantize_fp8_kernel, types, {"STATIC": static, "BLOCK": 2048}


def _paged(dtype: str, cache: str, chunks: bool) -> dict[str, str]:
    """The arguments both attention kernels take; `chunks`: the context kernel's query starts."""
    types = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}"}
    types |= {"k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "tables_ptr": "*i32", "lens_ptr": "*i32"}
    if chunks:
        types["starts_ptr"] = "*i32"
    types["scale"] = "fp32"
    for name in ("qt", "qh", "ot", "oh", "kb", "kh", "kd", "vb", "vt", "vh", "tb"):
        types[f"stride_{name}"] = I32
    return types


def _attention(dtype: str, cache: str) -> tuple[object, dict[str, str], dict[str, object]]:
    constants = {"GROUP": 3, "GROUP_PAD": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 16}
    constants["PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
    return triton_attention._decode_kernel, _paged(dtype, cache, chunks=False), constants


def _context(dtype: str, cache: str) -> tuple[object, dict[str, str], dict[str, object]]:
    constants = {"GROUP": 3, "GROUP_PAD": 4, "BLOCK_M": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 16}
    constants["PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
    return triton_attention._context_kernel, _paged(dtype, cache, chunks=True), constants


def _weight_only(dtype: str) -> tuple[object, dict[str, str], dict[str, object]]:
    types = {"out_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "w_ptr": "*i8"}
    types |= {"scale_ptr": "*fp32", "zero_ptr": "*fp32", "bias_ptr": f"*{dtype}"}
    for name in ("M", "N", "K", "GROUP", "stride_xm", "stride_om", "stride_wn", "stride_sn"):
        types[name] = I32
    constants = {"HAS_ZERO": True, "HAS_BIAS": True, "DOT_FP32": dtype == "fp32"}
    constants |= {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}
    return triton_weight_only._weight_only_kernel, types, constants


KERNELS = {
    "rms_norm bf16": _norm("bf16", add=False),
    "fused_add_rms_norm bf16": _norm("bf16", add=True),
    "fused_add_rms_norm fp32": _norm("fp32", add=True),
    "fused_add_rms_norm fp16": _norm("fp16", add=True),
    "rotary bf16": _rotary("bf16"),
    "rotary fp32": _rotary("fp32"),
    "silu_and_mul bf16": _silu("bf16"),
    "write_kv bf16": _write_kv("bf16", "bf16"),
    "write_kv fp32 into bf16": _write_kv("fp32", "bf16"),
    "write_kv bf16 into fp8": _write_kv("bf16", "fp8e4nv"),
    "write_kv fp16 into fp8": _write_kv("fp16", "fp8e4nv"),
    "quantize_fp8 bf16": _quantize_fp8("bf16", static=False),
    "quantize_fp8 bf16, static scale": _quantize_fp8("bf16", static=True),
    "quantize_fp8 fp16": _quantize_fp8("fp16", static=False),
    "decode_attention bf16": _attention("bf16", "bf16"),
    "decode_attention fp32": _attention("fp32", "fp32"),
    "decode_attention bf16 over fp8": _attention("bf16", "fp8e4nv"),
    "context_attention bf16": _context("bf16", "bf16"),
    "context_attention fp32": _context("fp32", "fp32"),
    "context_attention bf16 over fp8": _context("bf16", "fp8e4nv"),
    "weight_only bf16": _weight_only("bf16"),
    "weight_only fp32": _weight_only("fp32"),
}


@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: f"sm{arch}")
@pytest.mark.parametrize("name", KERNELS)
def test_triton_kernel_compiles_for_the_gpu(name: str, arch: int) -> None:
    if "fp8" in name and arch not in FP8_ARCHS:
        pytest.skip("the engine refuses fp8 below compute capability 8.9")
    kernel, types, constants = KERNELS[name]
    signature = {**types, **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == kernel.arg_names, "the test's arguments follow the kernel's"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"], name
    assert f".target sm_{arch}" in compiled.asm["ptx"]
