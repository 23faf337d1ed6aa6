"""Which fused kernels run a decoder layer's elementwise steps (RMSNorm, rotary, SiLU * up, the
KV cache write) on a tensor: qpipe's C++ kernels on CPU, Triton's on GPU, none elsewhere (the
layers then run eager torch ops). Both sets take the same arguments and round the same way, so a
layer calls whichever this returns."""

from __future__ import annotations

from typing import Protocol

import torch

from qpipe.serve.layers import cpu_kernels, triton_elementwise


class ElementwiseOps(Protocol):
    def rms_norm(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None: ...

    def rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        head_dim: int,
    ) -> None: ...

    def silu_and_mul(self, out: torch.Tensor, x: torch.Tensor) -> None: ...

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


def fused_ops(x: torch.Tensor) -> ElementwiseOps | None:
    """The kernel set that takes `x` (its device and dtype), or None."""
    if cpu_kernels.usable(x):
        return cpu_kernels.ops
    if triton_elementwise.usable(x):
        return triton_elementwise
    return None
