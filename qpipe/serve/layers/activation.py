"""The gated MLP activation: silu(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qpipe.serve.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * intermediate] -> [T, intermediate]."""
    if cpu_kernels.usable(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        cpu_kernels.ops.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
