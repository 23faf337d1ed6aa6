"""The gated MLP: down(silu(gate) * up) over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qpipe.serve.layers import cpu_kernels
from qpipe.serve.layers.elementwise_ops import fused_ops
from qpipe.serve.layers.linear import Int8Linear, LinearBase


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * intermediate] -> [T, intermediate]."""
    ops = fused_ops(gate_up)
    if ops is not None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        ops.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_mlp(gate_up: LinearBase, down: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """Two packed W8A8 projections on CPU run as one kernel call that keeps the activation in
    int8 between them (the same result, two full-size passes fewer); anything else runs layer by
    layer."""
    if (
        isinstance(gate_up, Int8Linear)
        and isinstance(down, Int8Linear)
        and gate_up.packed is not None
        and down.packed is not None
        and gate_up.bias is None
        and cpu_kernels.usable(x)
        and x.stride(-1) == 1
    ):
        return cpu_kernels.ops.int8_gated_mlp(
            x, *gate_up.cpu_operands(), *down.cpu_operands(), down.bias
        )
    return down(silu_and_mul(gate_up(x)))
