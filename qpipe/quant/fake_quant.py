"""Round-to-nearest fake quantization of chosen linears, undone on exit.

Sensitivity needs the error each block adds, one block at a time; running GPTQ/AWQ/SmoothQuant per
block would take hours on a CPU. RTN with the method's own scheme (same bits, group size, symmetry,
activation granularity) is the cheap proxy: it ranks blocks by how much their weights and inputs
resist that format. Smoothing and error compensation are not modelled, and static activation
scales are approximated by dynamic ones of the same granularity.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme


def rtn_weight(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """Quantize-dequantize a [out, in] weight with min/max scales of args' granularity."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        grouped = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        low, high = weight.min().reshape(1), weight.max().reshape(1)
    scale, zero_point = calculate_qparams(low, high, args)
    return fake_quantize(weight, scale, zero_point, args).to(torch.float32).to(weight.dtype)


def _input_quantizer(args: QuantizationArgs) -> Any:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        scale, zero_point = compute_dynamic_scales_and_zp(inputs[0], args, module)
        return (fake_quantize(inputs[0], scale, zero_point, args),)

    return hook


@contextmanager
def fake_quantized(
    model: torch.nn.Module, names: Iterable[str], scheme: QuantizationScheme
) -> Iterator[None]:
    """While active, the named linears compute with RTN-quantized weights (and inputs)."""
    saved: dict[str, torch.Tensor] = {}
    hooks = []
    try:
        for name in names:
            linear = model.get_submodule(name)
            saved[name] = linear.weight.data
            linear.weight.data = rtn_weight(linear.weight.data, scheme.weights)
            if scheme.input_activations is not None:
                quantizer = _input_quantizer(scheme.input_activations)
                hooks.append(linear.register_forward_pre_hook(quantizer))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for name, weight in saved.items():
            model.get_submodule(name).weight.data = weight
