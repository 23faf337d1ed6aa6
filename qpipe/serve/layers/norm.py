"""RMSNorm as Llama computes it: statistics in fp32, scale applied in the model dtype.

With a residual it is the fused "residual += x; x = norm(residual)" that joins two layers (as in
vLLM), which the fused kernels (C++ on CPU, Triton on GPU) do in one pass over the row.
"""

from __future__ import annotations

import torch
from torch import nn

from qpipe.serve.layers.elementwise_ops import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized, residual stream): without `residual`, `x` is the stream. With it, both
        tensors are updated in place where a fused kernel runs."""
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2:
            if residual is None:
                out = torch.empty_like(x)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out, x
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        stream = x if residual is None else residual + x
        return self._eager(stream), stream

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
