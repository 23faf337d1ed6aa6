"""The GPU weight-only linear kernel (Triton) against the eager layer (whole weight expanded,
then one GEMM), run on CPU by Triton's interpreter, and on a GPU where there is one. The
interpreter is chosen when a kernel is defined, so the CPU comparison runs in a child process
with TRITON_INTERPRET=1 (this file is also that child's script)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qpipe.serve.layers import triton_weight_only
from qpipe.serve.layers.linear import WeightOnlyLinear

CASES = [  # rows, out, in, group size, zero points, bias
    (1, 72, 128, 32, True, False),  # one decode row; a partial block of output features
    (5, 64, 192, 64, False, True),  # symmetric (GPTQ/int4-wo), with bias (Qwen2's qkv)
    (33, 130, 256, 128, True, True),  # prefill rows over two row blocks
    (16, 96, 80, 80, False, False),  # per-channel: one group of 80 inputs, steps of 16
]


def layer_for(out: int, inp: int, group: int, zeros: bool, bias: bool) -> WeightOnlyLinear:
    gen = torch.Generator().manual_seed(out * inp + group)
    groups = inp // group
    weight = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.int8)
    scale = torch.rand(out, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (out, groups), generator=gen).float() if zeros else None
    return WeightOnlyLinear(weight, scale, zero, torch.randn(out, generator=gen) if bias else None)


def compare(device: str) -> None:
    for rows, out, inp, group, zeros, bias in CASES:
        assert triton_weight_only.fits(inp, group)
        for dtype in (torch.float32, torch.bfloat16):
            layer = layer_for(out, inp, group, zeros, bias)
            if layer.bias is not None:
                layer.bias = layer.bias.to(dtype)
            x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = F.linear(x, layer.dequantized(dtype), layer.bias).float()
            layer = layer.to(device)
            q, scale, zero = layer.quantized()
            got = triton_weight_only.linear(x.to(device), q, scale, zero, layer.bias)
            assert got.shape == (rows, out) and got.dtype == dtype
            if device == "cuda":  # the layer takes the kernel on GPU
                assert torch.equal(layer(x.to(device)), got)
            # bf16: the two sums may round to neighbouring bf16 values (one ulp is 2^-8 of them)
            tolerance = 1e-5 if dtype is torch.float32 else 8e-3
            atol = tolerance * expected.abs().max().item()
            torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=tolerance)
            print(f"ok rows {rows}, {inp} -> {out}, groups of {group}, {dtype}")


def test_triton_weight_only_equals_the_eager_layer_in_the_interpreter() -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__)
    assert stdout.count("ok ") == 2 * len(CASES), stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_weight_only_equals_the_eager_layer_on_the_gpu() -> None:
    compare("cuda")


def test_group_sizes_it_takes() -> None:
    if not triton_weight_only.available():
        pytest.skip("Triton is not installed")
    assert triton_weight_only.block_k(128) == 64 and triton_weight_only.block_k(32) == 32
    assert triton_weight_only.block_k(80) == 16  # a step never straddles two groups
    assert not triton_weight_only.fits(576, 72)  # 72 = 8 x 9: no step of 16 divides it
    assert not triton_weight_only.fits(100, 64)  # the groups must tile the inputs


if __name__ == "__main__":
    compare("cpu")
