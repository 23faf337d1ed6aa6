"""fp8 W8A8 (llm-compressor's FP8_DYNAMIC and static FP8): the activations' fp8 round trip equals
compressed-tensors' own quantize-dequantize bit for bit, the layer survives an artifact round
trip with its weight still in fp8, and the fp8 tensor-core path (`fp8_linear`, one
`torch._scaled_mm`) computes what the expanded path computes: on CPU through torch's reference
`_scaled_mm`, which takes CUDA's operands, and on a GPU with fp8 tensor cores where there is one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from qpipe.serve.layers import cpu_kernels
from qpipe.serve.layers.fp8 import quantize_fp8
from qpipe.serve.layers.linear import (
    LINEAR_KINDS,
    Fp8Linear,
    _packed_dense,
    fake_quantize_fp8,
    fp8_linear,
    fp8_matmul_supported,
)

CPU = torch.device("cpu")


def activations(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[:, 5] *= 200.0  # an outlier channel, as SmolLM2 has
    x[4] = 0.0  # a row of zeros takes the epsilon scale
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_per_token_round_trip_equals_compressed_tensors(dtype: torch.dtype) -> None:
    x = activations(dtype)
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    batched = x.unsqueeze(0)  # [batch, tokens, hidden], the shape its token strategy expects
    scale, zero_point = compute_dynamic_scales_and_zp(batched, args, torch.nn.Module())
    expected = fake_quantize(batched, scale, zero_point, args)[0]
    got = fake_quantize_fp8(x, None)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    assert not torch.equal(got, x)  # it did round


def test_static_round_trip_equals_compressed_tensors() -> None:
    x = activations(torch.float32)
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    scale = torch.tensor([0.5])  # calibrated on smaller activations: the outliers saturate
    expected = fake_quantize(x, scale, torch.zeros(1), args)
    got = fake_quantize_fp8(x, scale)
    assert torch.equal(got, expected)
    assert got.abs().max() == 448 * 0.5


@pytest.mark.parametrize("input_scale", [None, torch.tensor(0.5)])
def test_layer_keeps_fp8_weights_through_an_artifact_round_trip(
    input_scale: torch.Tensor | None,
) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(64, 96, generator=gen) * 100).to(torch.float8_e4m3fn)
    weight_scale = torch.rand(64, generator=gen) * 1e-3
    bias = torch.randn(64, generator=gen)
    layer = Fp8Linear(weight, weight_scale, input_scale, bias).prepare_for(torch.float32, CPU)
    x = activations(torch.float32)
    expected = F.linear(
        fake_quantize_fp8(x, input_scale), weight.float() * weight_scale[:, None], bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)

    state = layer.state_dict()
    assert state["weight"].dtype == torch.float8_e4m3fn and "expanded" not in state
    assert ("input_scale" in state) == (input_scale is not None)
    loaded = LINEAR_KINDS[layer.kind].from_state(dict(state)).prepare_for(torch.float32, CPU)
    assert torch.equal(loaded(x), layer(x))
    with pytest.raises(RuntimeError, match="prepare_for"):
        LINEAR_KINDS[layer.kind].from_state(dict(state))(x)


def fp8_layer(
    input_scale: torch.Tensor | None, out_features: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(out_features, 96, generator=gen) * 100).to(torch.float8_e4m3fn)
    return weight, torch.rand(out_features, 1, generator=gen) * 1e-3, torch.randn(out_features)


@pytest.mark.parametrize("input_scale", [None, torch.tensor([0.5])])
def test_the_tensor_core_path_computes_what_the_expanded_path_does(
    input_scale: torch.Tensor | None,
) -> None:
    weight, weight_scale, bias = fp8_layer(input_scale)
    layer = Fp8Linear(weight, weight_scale, input_scale, bias).prepare_for(torch.float32, CPU)
    assert layer.expanded is not None  # no fp8 tensor cores on a CPU: expanded once at load
    x = activations(torch.float32)  # [tokens, hidden]
    got = fp8_linear(x, weight, weight_scale, input_scale, bias)
    assert got.shape == (9, 64) and got.dtype == torch.float32
    # exact fp8 products summed in fp32 either way; only the order of the scalings differs
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, F.linear(x, weight.float() * weight_scale, bias), rtol=1e-3)


def test_only_fp8_tensor_cores_keep_the_fp8_weight() -> None:
    assert not fp8_matmul_supported(CPU, 64, 96)
    if torch.cuda.is_available():
        capable = torch.cuda.get_device_capability() >= (8, 9)
        assert fp8_matmul_supported(torch.device("cuda"), 64, 96) == capable
        assert not fp8_matmul_supported(torch.device("cuda"), 64, 100)  # _scaled_mm: 16s only


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with fp8 tensor cores (sm89+)",
)
@pytest.mark.parametrize("input_scale", [None, torch.tensor([0.5])])
def test_fp8_tensor_cores_match_the_expanded_layer(input_scale: torch.Tensor | None) -> None:
    cuda = torch.device("cuda")
    weight, weight_scale, bias = fp8_layer(input_scale, out_features=128)
    layer = Fp8Linear(weight, weight_scale, input_scale, bias).prepare_for(torch.bfloat16, cuda)
    assert layer.expanded is None  # computes on the fp8 weight
    x = activations(torch.bfloat16)
    got = layer.to(cuda)(x.to(cuda))
    assert got.dtype == torch.bfloat16
    # the same fp8 operands multiplied out exactly in fp32: only the bf16 output rounding differs
    q, scale = quantize_fp8(x, input_scale)
    exact = (q.float() @ weight.float().t()) * scale.float() * weight_scale.t() + bias
    torch.testing.assert_close(got.float().cpu(), exact, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layer_computes_what_the_expanded_one_does(dtype: torch.dtype) -> None:
    """On CPU the expanded weight is packed as a dense layer's (tiles or oneDNN's layout where
    they are faster than torch's GEMM), replacing the expansion."""
    weight, weight_scale, bias = fp8_layer(None, out_features=72)  # 4.5 tiles: a padded one
    layer = Fp8Linear(weight, weight_scale, None, bias).prepare_for(dtype, CPU)
    x = activations(dtype)
    expected = layer(x)
    packable = _packed_dense(layer.expanded, 16) is not None
    assert layer.pack_for_cpu(16) == packable
    assert (layer.expanded is None) == packable
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


def rounding_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), one fp32 step either side
    of each midpoint, and values past +-448 that the clamp must catch."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].unique()
    mid = (values[1:] + values[:-1]) / 2
    near = torch.cat([mid.nextafter(mid - 1), mid.nextafter(mid + 1)])
    return torch.cat([values, mid, near, torch.tensor([449.0, -470.0, 1e6])])


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_cpu_kernel_gives_the_eager_round_trips_bits(dtype: torch.dtype, static: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 1100, generator=gen) * torch.logspace(-12, 3, 6)[:, None]
    cases = rounding_cases()
    rows[0, : cases.numel()] = cases  # the static scale is 1: x / scale is exact
    inside = cases[cases.abs() <= 448]
    rows[1, : inside.numel()] = inside  # absmax 448: the dynamic scale is 1 too
    rows[2] = 0.0  # scale = the dtype's epsilon
    rows[3, 4] = float("nan")  # eager: absmax NaN, so the whole row
    rows[4, 9] = float("inf")
    x = rows.to(dtype)
    scale = torch.tensor([1.0]) if static else None
    q, s = quantize_fp8(x, scale)
    eager = q.to(dtype) * s
    out = torch.empty_like(x)
    cpu_kernels.ops.fake_quantize_fp8(out, x, scale)
    same = (out == eager) | (out.isnan() & eager.isnan())
    assert same.all(), f"{(~same).sum().item()} values differ"
    assert out[3].isnan().all() == (not static)
    torch.testing.assert_close(fake_quantize_fp8(x, scale), out, rtol=0, atol=0, equal_nan=True)
