"""fp8 W8A8 (llm-compressor's FP8_DYNAMIC and static FP8): the activations' fp8 round trip equals
compressed-tensors' own quantize-dequantize bit for bit, and the layer survives an artifact
round trip with its weight still in fp8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from qpipe.serve.layers.linear import LINEAR_KINDS, Fp8Linear, fake_quantize_fp8


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
    layer = Fp8Linear(weight, weight_scale, input_scale, bias).prepare_for(torch.float32)
    x = activations(torch.float32)
    expected = F.linear(
        fake_quantize_fp8(x, input_scale), weight.float() * weight_scale[:, None], bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)

    state = layer.state_dict()
    assert state["weight"].dtype == torch.float8_e4m3fn and "expanded" not in state
    assert ("input_scale" in state) == (input_scale is not None)
    loaded = LINEAR_KINDS[layer.kind].from_state(dict(state)).prepare_for(torch.float32)
    assert torch.equal(loaded(x), layer(x))
    with pytest.raises(RuntimeError, match="prepare_for"):
        LINEAR_KINDS[layer.kind].from_state(dict(state))(x)
