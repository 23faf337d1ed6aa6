"""The GPU elementwise kernels (Triton: RMSNorm with and without the residual add, rotary, SiLU *
up, the KV cache write, an fp8 layer's rounding of its input) against the eager torch ops they
replace, run on CPU by Triton's interpreter and on a GPU where there is one. The interpreter is
chosen when a kernel is defined, so the CPU comparison runs in a child process with
TRITON_INTERPRET=1 (this file is also that child's script). tests/test_gpu_path_interpreted.py
runs them in the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# none (a step's final norm may have no row), one decode row, a few, a prefill chunk
ROWS = [0, 1, 5, 33]
WIDTHS = [576, 64]  # SmolLM2's hidden size (not a power of two: masked lanes), a tiny one
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # --dtype float16 serves on GPU too
# (model dtype, cache dtype) of the KV write: the model's own, and kv_cache_dtype's narrower ones
KV_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e4m3fn),
]
# rows of a wider buffer: the kernels follow row strides (the residual stream's rows are dense,
# but a norm's input may be a slice of the batch, as the final norm's is)
PADDING = 8


def _rows(rows: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, width + PADDING, generator=gen) * 3).to(dtype)[:, :width]


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: sums in another order; 16-bit: an fp32 value one ulp apart may round to the
    neighbouring 16-bit value before a second rounded product (2^-7 relative each in bf16,
    2^-10 in fp16)."""
    if dtype is torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype is torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 1e-2, "rtol": 1.6e-2}


def _norms(gen: torch.Generator, device: str) -> None:
    from qpipe.serve.layers import triton_elementwise
    from qpipe.serve.layers.norm import RMSNorm

    for rows in ROWS:
        for width in WIDTHS:
            for dtype in DTYPES:
                norm = RMSNorm(torch.rand(width, generator=gen).to(dtype) + 0.5, 1e-5).to(device)
                x, residual = _on(
                    device, _rows(rows, width, dtype, gen), _rows(rows, width, dtype, gen)
                )
                out = torch.full_like(x, float("nan"))
                triton_elementwise.rms_norm(out, x, norm.weight, norm.eps)
                torch.testing.assert_close(out, norm._eager(x), **_tolerance(dtype))

                stream = residual + x  # the eager add, rounded to dtype
                expected = norm._eager(stream)
                triton_elementwise.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
                assert torch.equal(residual, stream)
                torch.testing.assert_close(x, expected, **_tolerance(dtype))
                print(f"ok norm {rows} x {width} {dtype}")


def _silu(gen: torch.Generator, device: str) -> None:
    from qpipe.serve.layers import triton_elementwise

    for rows in ROWS:
        for n in (1536, 96):  # SmolLM2's intermediate size (two programs a row), a small one
            for dtype in DTYPES:
                (x,) = _on(device, _rows(rows, 2 * n, dtype, gen))
                out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
                triton_elementwise.silu_and_mul(out, x)
                gate, up = x.chunk(2, dim=-1)
                torch.testing.assert_close(out, F.silu(gate) * up, **_tolerance(dtype))
                print(f"ok silu {rows} x {n} {dtype}")


def _rotary(gen: torch.Generator, device: str) -> None:
    from transformers import LlamaConfig

    from qpipe.serve.layers import triton_elementwise
    from qpipe.serve.layers.rotary import RotaryEmbedding

    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 2, 128), (2, 1, 48)):
        config = LlamaConfig(
            hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=100000.0
        )
        rope = RotaryEmbedding(config, head_dim, 512).to(device)
        for rows in ROWS:
            for dtype in DTYPES:
                width = (heads + 2 * kv_heads) * head_dim
                qkv, positions = _on(
                    device,
                    _rows(rows, width, dtype, gen),
                    torch.randint(0, 512, (rows,), generator=gen),
                )
                # x * cos + roll(x, half) * sin in fp32, rounded once (the C++ kernel's rounding)
                heads_of = qkv.float().view(rows, heads + 2 * kv_heads, head_dim)
                expected = heads_of.clone()
                rotated = heads_of[:, : heads + kv_heads]
                cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]
                expected[:, : heads + kv_heads] = (
                    rotated * cos + rotated.roll(head_dim // 2, dims=-1) * sin
                )
                expected = expected.flatten(1).to(dtype)
                triton_elementwise.rotary(
                    qkv, positions, rope.cos, rope.sin, heads + kv_heads, head_dim
                )
                torch.testing.assert_close(qkv, expected, **_tolerance(dtype))
                print(f"ok rotary {heads}/{kv_heads} heads of {head_dim}, {rows} rows {dtype}")


def _write_kv(gen: torch.Generator, device: str) -> None:
    from qpipe.serve.layers import triton_elementwise
    from qpipe.serve.layers.attention import _write_kv, cache_views

    for kv_heads, head_dim, block_size in ((3, 64, 16), (2, 48, 32)):
        for rows in ROWS:
            for dtype, cache_dtype in KV_PAIRS:
                blocks = 8
                (slots,) = _on(device, torch.randperm(blocks * block_size, generator=gen)[:rows])
                # k and v as the layer hands them over: views into the fused projection's rows
                # magnitudes from 1e-4 (fp8's subnormals) to 1e3 (beyond its 448)
                qkv = torch.randn(rows, 4 * kv_heads * head_dim, generator=gen)
                qkv *= 10 ** (torch.rand(qkv.shape, generator=gen) * 7 - 4)
                qkv = qkv.to(device, dtype).view(rows, 4 * kv_heads, head_dim)
                k, v = qkv[:, 2 * kv_heads : 3 * kv_heads], qkv[:, 3 * kv_heads :]
                caches = []
                for _ in range(2):
                    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
                    caches.append(cache.to(device, cache_dtype))
                caches[1].copy_(caches[0])
                want_k, want_v = _write_kv(*cache_views(caches[0]), k, v, slots)
                triton_elementwise.write_kv(*cache_views(caches[1]), k, v, slots)
                for got, want in ((caches[1], caches[0]), (k, want_k), (v, want_v)):
                    assert torch.equal(got.float(), want.float())
                print(f"ok write_kv {kv_heads} x {head_dim}, {rows} rows {dtype} -> {cache_dtype}")


def _quantize_fp8(gen: torch.Generator, device: str) -> None:
    from qpipe.serve.layers import fp8, triton_elementwise

    for rows in ROWS:
        for width in (1536, 64):  # SmolLM2's down projection input, a small one
            for dtype in DTYPES:
                # magnitudes from 1e-6 (fp8's subnormals after scaling) to 1e3 (past 448 with
                # the static scale), and a row of zeros (the dynamic scale's zero guard)
                x = torch.randn(rows, width + PADDING, generator=gen)
                x *= 10 ** (torch.rand(x.shape, generator=gen) * 9 - 6)
                x[rows // 2 :][:1] = 0
                (x,) = _on(device, x.to(dtype)[:, :width])
                for static in (None, torch.tensor([0.75])):
                    want_q, want_scale = fp8.quantize_fp8(x, static)
                    q, scales = triton_elementwise.quantize_fp8(
                        x, None if static is None else static.to(device)
                    )
                    want_scales = want_scale.float().reshape(-1, 1).expand(rows, 1)
                    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
                    assert torch.equal(q.float(), want_q.float()), (rows, width, dtype, static)
                    assert torch.equal(scales, want_scales), (rows, width, dtype, static)
                print(f"ok quantize_fp8 {rows} x {width} {dtype}")


def _compare(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for check in (_norms, _silu, _rotary, _write_kv, _quantize_fp8):
        check(gen, device)


EXPECTED = {
    "norm": len(ROWS) * len(WIDTHS) * len(DTYPES),
    "silu": len(ROWS) * 2 * len(DTYPES),
    "rotary": 3 * len(ROWS) * len(DTYPES),
    "write_kv": 2 * len(ROWS) * len(KV_PAIRS),
    "quantize_fp8": len(ROWS) * 2 * len(DTYPES),
}


def test_triton_elementwise_kernels_equal_the_eager_ops_in_the_interpreter() -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__)
    for name, count in EXPECTED.items():
        assert stdout.count(f"ok {name} ") == count, stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_elementwise_kernels_equal_the_eager_ops_on_the_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _compare("cuda")
    stdout = capsys.readouterr().out
    for name, count in EXPECTED.items():
        assert stdout.count(f"ok {name} ") == count, stdout


if __name__ == "__main__":
    _compare("cpu")
