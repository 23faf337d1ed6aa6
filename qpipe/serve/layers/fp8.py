"""fp8 e4m3 as the served layers and the KV cache use it: its largest finite value, the GPUs that
compute with it, and the eager rounding of activations that every fp8 path reproduces (the C++
`fake_quantize_fp8` on CPU, the Triton `quantize_fp8` on GPU). A module of its own so that the
linear layers, attention and the kernels' modules share it without importing one another."""

from __future__ import annotations

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8_CAPABILITY = (8, 9)  # GPUs that compute with fp8 and read it in Triton: Ada (sm89), Hopper on


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x in fp8 e4m3 and its scale, per token (dynamic, scale = absmax / 448, in x's dtype) or
    one calibrated static scale: compressed-tensors' quantize step op for op, so results match
    what llm-compressor calibrated against."""
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    else:
        scale = scale.to(x.dtype)
    return torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
