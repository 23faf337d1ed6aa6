"""Linear layers, one per weight format the engine serves.

Each layer stores its weights already fused (qkv, gate_up) and in the layout its kernel wants, and
names its format in `kind`, so a qpipe artifact can save the buffers and load them back unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qpipe.serve.huge_pages import HugePageArena
from qpipe.serve.layers import cpu_kernels, triton_elementwise, triton_weight_only
from qpipe.serve.layers.fp8 import FP8_CAPABILITY, quantize_fp8

log = logging.getLogger(__name__)


class LinearBase(nn.Module):
    """`forward` takes the model's flat tokens, [tokens, in_features], and returns [tokens,
    out_features]: no reshapes around the kernels, two tensor ops (~5 µs here) for each of the
    121 products of a SmolLM2 step, ~0.6 ms of a 30 ms decode step at concurrency 1."""

    kind: ClassVar[str]
    optional_buffers: ClassVar[tuple[str, ...]] = ("bias",)  # absent from a saved state: None
    packed: torch.Tensor | None = None

    def prepare_for(self, dtype: torch.dtype, device: torch.device) -> LinearBase:
        """Readies a loaded layer to compute in `dtype` on `device` (what a format keeps in
        another form on disk, or in a form only some devices compute on); returns the layer."""
        return self

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """Puts the weight once into the form this CPU's GEMM takes best (oneDNN's blocked
        layout, where the format gains from it); returns whether it did. A packed layer serves,
        it is not saved: the packed weight replaces the plain one so memory does not double."""
        return False

    def pack(self, batch_hint: int, arena: HugePageArena) -> bool:
        """`pack_for_cpu`, then the packed weight, where it is a plain tensor (not oneDNN's),
        copied onto huge pages (`huge_pages.py`); returns whether it packed."""
        if not self.pack_for_cpu(batch_hint):
            return False
        packed = self.packed
        if isinstance(packed, torch.Tensor) and packed.layout is torch.strided:  # not oneDNN's
            self.packed = arena.copy_of(packed)
        return True

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """`forward(x)` in fp32: an LM head's logits, which `DenseLinear` on the CPU kernels
        keeps as their fp32 sums instead of rounding them to the model's 16 bits first."""
        return self(x).float()

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> LinearBase:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for name, tensor in state.items():
            layer.register_buffer(name, tensor)
        for name in cls.optional_buffers:
            if name not in state:
                layer.register_buffer(name, None)
        return layer


class DenseLinear(LinearBase):
    """16/32-bit weights; also where weight-only fp8 lands, expanded once at load."""

    kind = "dense"
    out_features: int  # set at packing: the fp32 tiles' last tile may be padded

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def pack_for_cpu(self, batch_hint: int) -> bool:
        self.out_features = self.weight.shape[0]
        self.packed = _packed_dense(self.weight, batch_hint)
        if self.packed is None:
            return False
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return _dense_product(x, self.weight, self.bias)
        return _packed_product(x, self.packed, self.bias, self.out_features)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """On the kernels' tiles a bf16 product sums in fp32 anyway; rounding those sums to bf16
        logits made 3.8 % of SmolLM2's next-token positions exact top-2 ties (wikitext, bf16
        hidden states), and its argmax agreed with the fp32 model's at 96.7 % of positions
        against 98.1 % for the same products left in fp32. Elsewhere (oneDNN, GPUs) the logits
        are rounded to the model's dtype first, as transformers' and vLLM's are."""
        if self.packed is None or self.packed.is_mkldnn:
            return super().float_output(x)
        return cpu_kernels.ops.dense_linear(x, self.packed, self.bias, self.out_features, True)


def _packed_dense(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """A 16/32-bit weight laid out once for a faster GEMM than torch's, or None where none is:
    - fp32 in the weight-only kernels' tiles, whose panel micro-kernel then reads it as it is
      (`dense_linear`), where that beats MKL (`_fp32_tiles_beat_mkl`):
      - on CPUs where MKL runs generic code (not Intel's). Measured on an AMD Zen 3 (AVX2) with
        the weights from DRAM, as in serving, against oneDNN's GEMM on its packed weight:
        1.3-2x at 1-16 rows, 1-1.5x at 32-64, even at 160, 0.8-0.9x at 512; SmolLM2 offline
        at concurrency 1 / 8 / 32: 14.5 / 65.4 / 110.4 -> 23.9 / 74.0 / 124.5 output tok/s.
        oneDNN in turn had been 1.3-3x MKL's generic code at decode batch sizes; where the
        kernels cannot be built, fp32 still goes to oneDNN there;
      - on AVX-512 CPUs, where the kernel takes two tiles at a time. Measured on a Sapphire
        Rapids VM, SmolLM2's 120 products per step from DRAM against MKL: 4 / 8 / 16 / 32 /
        64 rows 1.55 / 1.64 / 1.41 / 1.26 / 1.14x, 160 rows 0.97x, 512 rows 0.91x; offline at
        concurrency 8 / 32: 108.3 / 252 -> 159.0 / 269 output tok/s, even at 1;
    - an fp32 weight whose values are all bf16 (a 16-bit checkpoint served in fp32) in bf16
      tiles: the same fp32 products from half the memory (SmolLM2 in bf16: 513 -> 256 MiB),
      level in throughput on a Zen 3; not measured against the paired fp32 tiles of AVX-512;
    - bf16 in the same tiles where the CPU has no bf16 dot product (AVX512-BF16 or AMX), so
      torch's bf16 GEMM is emulated: `dense_linear` widens the weight and sums in fp32.
      Measured on a Zen 3 (AVX2), SmolLM2 in bf16 at concurrency 8: 13.6 output tok/s on
      torch's GEMM, 56.5 on the tiles (fp32: 57.9); ~8 % behind fp32 at 32;
    - bf16 in the kernels' pair tiles on AVX512-BF16 CPUs without AMX (`bf16_pair_tiles_serve`);
    - bf16 reordered for oneDNN's GEMM (measured on an AMX CPU: 1.3-1.6x per GEMM for 1-256
      rows, the same results bit for bit, no change at 2048 rows), where oneDNN takes bf16:
      AVX-512 or AVX-NE-CONVERT.
    An Intel CPU without AVX-512 keeps MKL for fp32: neither is measured there."""
    if weight.dtype is torch.float32 and _fp32_tiles_beat_mkl() and cpu_kernels.load():
        return cpu_kernels.tiled(weight.to(torch.bfloat16) if _bf16_exact(weight) else weight)
    if weight.dtype is torch.bfloat16 and not has_bf16_dot_product() and cpu_kernels.load():
        return cpu_kernels.tiled(weight)
    if weight.dtype is torch.bfloat16 and bf16_pair_tiles_serve(weight.shape[1]):
        return cpu_kernels.tiled_bf16_pairs(weight)
    return _packed_for_onednn(weight, batch_hint)


def _packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ weight.T + bias on the `_packed_dense` form of the weight (tiles: the last one may be
    padded, hence out_features)."""
    if packed.is_mkldnn:
        return _dense_product(x, packed, bias)
    return cpu_kernels.ops.dense_linear(x, packed, bias, out_features)


def pack_linear_weights(
    model: nn.Module, batch_hint: int, arena: HugePageArena | None = None
) -> int:
    """Packs the linear layers of a CPU model where their format gains from it (`LinearBase.pack`,
    into `arena` or a new one); returns how many were packed."""
    arena = arena or HugePageArena()
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.packed is None]
    return sum(layer.pack(batch_hint, arena) for layer in layers)


def _packed_for_onednn(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """`weight` reordered for oneDNN's GEMM where that gains (see `_packed_dense`),
    else None."""
    if weight.dtype is torch.bfloat16:
        gains = (
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    else:
        gains = weight.dtype is torch.float32 and _mkl_runs_generic_code()
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if gains else None


def _dense_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias, on oneDNN for a weight it packed, else on torch's GEMM."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _fp32_tiles_beat_mkl() -> bool:
    return _mkl_runs_generic_code() or _has_avx512()


def _has_avx512() -> bool:
    return "avx512f" in (cpu_kernels.cpuinfo("flags") or "").split()


def _bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every fp32 value is a bf16 value: its low 16 bits are zero. Checked 256 rows at a
    time: a mask of the whole weight would be one more copy of it at the loading peak."""
    return not any((rows.view(torch.int32) & 0xFFFF).any() for rows in weight.split(256))


def has_bf16_dot_product() -> bool:
    """Whether the CPU multiplies bf16 pairs in hardware (AVX512-BF16 or AMX), so that oneDNN's
    bf16 GEMM is native there, not emulated."""
    flags = (cpu_kernels.cpuinfo("flags") or "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_pair_tiles_serve(in_features: int) -> bool:
    """Whether bf16 products go to the kernels' AVX512-BF16 pair tiles (`cpu_kernels.
    tiled_bf16_pairs`) rather than oneDNN's bf16 GEMM: on AVX512-BF16 CPUs without AMX. Both
    multiply with the same instruction (on a Zen 4, 0-0.08 % of outputs differ by one bf16
    rounding, where oneDNN splits the sum); the tiles read the weight faster at decode sizes.
    SmolLM2's 120 bf16 products per step (weights from DRAM), ms, oneDNN / pair tiles, three
    runs: 1 row 14-19 / 10, 8 rows 15-16 / 11-12, 32 rows 24-30 / 23-25, 64-512 rows level within
    the drift (512: 266-330 / 293-303). Served in bf16 offline, c=1 35-38 -> 52-55 output tok/s,
    c=32 288-312 -> 318-329. AMX CPUs keep oneDNN (not measured against these)."""
    return _kernel_tiles_serve("avx512_bf16", "amx_bf16", cpu_kernels.BF16_PAIR, in_features)


def _kernel_tiles_serve(dot_product: str, amx: str, group: int, in_features: int) -> bool:
    """Whether the CPU has the `dot_product` flag but not `amx` (where oneDNN's AMX kernels are
    kept), in_features comes in whole groups of the instruction's inputs, and the kernels load."""
    flags = (cpu_kernels.cpuinfo("flags") or "").split()
    return (
        dot_product in flags
        and amx not in flags
        and in_features % group == 0
        and cpu_kernels.load()
    )


def _mkl_runs_generic_code() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkl.is_available()
        and cpu_kernels.cpuinfo("vendor_id") not in (None, "GenuineIntel")
    )


def _onednn_int8_product(
    q: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """(q @ weight.T) * weight_scale in fp32 on oneDNN's int8 GEMM, activation scale 1. q goes in
    as uint8 q + 128 (flipping the sign bit) with zero point 128: oneDNN's VNNI kernels multiply
    u8 by s8, and on a VNNI CPU without AMX an s8 input falls to its reference GEMM (measured on
    a Zen 4: 0.1 GOP/s at 32 rows, against 300 for u8). The packed weight already carries the
    compensation for an input zero point, so u8 adds no pass (not measured on AMX)."""
    shifted = torch.bitwise_xor(q.view(torch.uint8), 128)
    return torch.ops.onednn.qlinear_pointwise(
        shifted, 1.0, 128, packed, weight_scale, zero_points, None, 1.0, 0,
        torch.float32, "none", [], "",
    )  # fmt: skip


@functools.cache
def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's int8 GEMM returns exact sums on this CPU. It does with VNNI (AVX512-VNNI,
    AVX-VNNI, AMX). Without it (AVX2-only CPUs such as AMD Zen 3) oneDNN shifts the int8
    activations to uint8 and multiplies pairs with `vpmaddubsw`, whose int16 pair sums saturate:
    measured on a Zen 3, errors of ~20 % of the output's range on random operands. One product
    at the saturating corner (both operands 127) tells which."""
    if not torch.backends.mkldnn.is_available():
        return False
    rows, cols, depth = 32, 64, 256  # decode-like, so oneDNN picks the kernels serving will use
    weight = torch.full((cols, depth), 127, dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(weight, [rows, depth])
    q = torch.full((rows, depth), 127, dtype=torch.int8)
    zero_points = torch.zeros(cols, dtype=torch.long)
    product = _onednn_int8_product(q, packed, torch.ones(cols), zero_points)
    exact = bool((product == 127 * 127 * depth).all())
    if not exact:
        log.warning(
            "oneDNN's int8 GEMM saturates on this CPU (no VNNI): W8A8 layers multiply their int8 "
            "values in fp32 instead (the same results, at fp32 compute speed)"
        )
    return exact


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 per row, with compressed-tensors' scale (absmax / 127.5) so results
    match what llm-compressor calibrated against."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.5
    q = torch.div(x, scale).round_().clamp_(-128, 127).to(torch.int8)
    return q, scale


def vnni_tiles_serve(in_features: int) -> bool:
    """Whether W8A8 products go to the kernels' AVX512-VNNI tiles (`cpu_kernels.tiled_vnni`)
    rather than oneDNN's int8 GEMM: on AVX512-VNNI CPUs without AMX. Measured on a Zen 4,
    SmolLM2's 120 W8A8 products per step (bf16 inputs, weights from DRAM), ms, oneDNN (u8) /
    VNNI tiles, two runs each: 1 row 16 / 8, 8 rows 18 / 8-11, 32 rows 29 / 15-17, 128 rows
    52-65 / 44, 512 rows 183-240 / 162-178. oneDNN read the weight at ~7 GB/s at one row.
    AMX CPUs keep oneDNN (its AMX kernels not measured against these)."""
    return _kernel_tiles_serve("avx512_vnni", "amx_int8", cpu_kernels.VNNI_GROUP, in_features)


class Int8Linear(LinearBase):
    """W8A8 int8: per-output-channel weight scales, activations quantized per token at run time.
    On CPU with AVX512-VNNI and no AMX the product runs in the kernels' VNNI tiles
    (`vnni_tiles_serve`); with AMX on oneDNN's int8 GEMM with the weight packed once (measured
    2-4x `torch._int_mm` at 2048 rows, up to 1.7x at 32); on a CPU without VNNI, where that GEMM
    saturates and `_int_mm` is ~10x slower than fp32, in fp32 over the int8 values (products and
    sums of integers are exact in fp32 below 2^24, far above what per-token quantized activations
    reach): the weight-only kernels read the weight in their tiles, one byte per value, with
    unit scales, so decode reads a quarter of an fp32 copy's bytes (or, without those kernels, an
    fp32 copy on an fp32 GEMM); on GPU on `torch._int_mm`. All compute
    (acc * weight_scale) * token_scale in fp32, rounded once to the model dtype."""

    kind = "int8_w8a8"

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float())
        self.register_buffer("bias", bias)

    def pack_for_cpu(self, batch_hint: int) -> bool:
        if vnni_tiles_serve(self.weight.shape[1]):
            self.packed = cpu_kernels.tiled_vnni(self.weight)
        elif onednn_int8_is_exact():
            self.packed = torch.ops.onednn.qlinear_prepack(
                self.weight, [batch_hint, self.weight.shape[1]]
            )
        elif cpu_kernels.load():  # the weight-only kernels take the int8 values in their tiles
            self.packed = cpu_kernels.tiled(self.weight)
        else:
            values = self.weight.float()
            packed = _packed_for_onednn(values, batch_hint)
            self.packed = values if packed is None else packed
        self.weight = None
        self.weight_zero_points = torch.zeros(self.weight_scale.numel(), dtype=torch.long)
        if self.bias is not None:  # added to the fp32 product either way
            self.bias = self.bias.float()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and cpu_kernels.usable(x) and x.stride(-1) == 1:
            return cpu_kernels.ops.int8_linear(x, *self.cpu_operands(), self.bias)
        q, scale = quantize_per_token_int8(x.float())
        y = self._scaled_product(q).mul_(scale)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the packed layer hands the CPU kernels' int8 product: weight (oneDNN-packed int8,
        the int8 values in the weight-only kernels' tiles, or those values in fp32), per-channel
        scales, zero points."""
        return self.packed, self.weight_scale.view(-1), self.weight_zero_points

    def _scaled_product(self, q: torch.Tensor) -> torch.Tensor:
        """(q @ weight.T) * weight_scale in fp32: the int32 accumulator never leaves the GEMM."""
        packed = self.packed
        if packed is not None and packed.is_mkldnn and packed.dtype is torch.int8:
            return _onednn_int8_product(q, *self.cpu_operands())
        if packed is not None and packed.dtype is not torch.int8:  # the int8 values in fp32
            return _dense_product(q.float(), packed, None).mul_(self.weight_scale)
        if packed is None:
            weight = self.weight
        else:  # the int8 values in the weight-only kernels' tiles or in VNNI tiles
            weight = cpu_kernels.untiled(packed, self.weight_scale.numel())
        rows = q.shape[0]
        if q.is_cuda and rows <= 16:  # cuBLAS int8 GEMM needs M > 16
            q = F.pad(q, (0, 0, 0, 17 - rows))
        # GPU, or a CPU layer not packed for oneDNN. NOTE: `_int_mm` gets the [in, out] operand as
        # a transposed view of the row-major [out, in] weight: ~1.5x faster on this CPU than a
        # contiguous copy.
        return torch._int_mm(q, weight.t())[:rows].float().mul_(self.weight_scale)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [tokens, features] rounded through fp8 e4m3 and back (`quantize_fp8`), in x's dtype.
    On CPU one kernel pass gives the eager ops' bits: measured on a Zen 3 with SmolLM2
    FP8_DYNAMIC at concurrency 32, the eager round trip's ~10 ops took ~20 % of the serving time,
    the kernel 2 %."""
    if cpu_kernels.usable(x) and x.shape[-1] > 0 and x.stride(-1) == 1:
        out = torch.empty_like(x)
        cpu_kernels.ops.fake_quantize_fp8(out, x, scale)
        return out
    q, scale = quantize_fp8(x, scale)
    return q.to(x.dtype) * scale


def fp8_matmul_supported(device: torch.device, out_features: int, in_features: int) -> bool:
    """Whether `fp8_linear` runs on `device`: fp8 tensor cores (Ada, sm89, and Hopper, sm90,
    onwards), and the dimensions `torch._scaled_mm` takes (multiples of 16)."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY
        and out_features % 16 == 0
        and in_features % 16 == 0
    )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x rounded through fp8 (`quantize_fp8`; on a GPU its Triton twin, one launch instead of
    ten) times the fp8 weight [out, in] with its per-channel scales [out, 1], plus bias, as one
    `torch._scaled_mm`: fp8 products summed in fp32, scaled per row and column, rounded once.
    Its operand contract (CUDA's): the input row-major, the weight column-major (a transposed
    view of the row-major weight), fp32 scales [rows, 1] and [1, out]; with per-row scales CUDA
    writes bf16 only. torch's CPU reference implementation takes the same operands, which is how
    CI checks them."""
    if triton_elementwise.usable(x) and x.dim() == 2 and x.stride(-1) == 1:
        q, row_scales = triton_elementwise.quantize_fp8(x, input_scale)
    else:
        q, scale = quantize_fp8(x, input_scale)
        row_scales = scale.float().reshape(-1, 1).expand(q.shape[0], 1).contiguous()
    y = torch._scaled_mm(
        q,
        weight.t(),
        scale_a=row_scales,
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=torch.bfloat16 if x.is_cuda else x.dtype,
    ).to(x.dtype)
    if bias is not None:
        y += bias
    return y


class Fp8Linear(LinearBase):
    """fp8 e4m3 weights with per-channel scales and fp8 activations (dynamic per token, or one
    calibrated scale): llm-compressor's FP8_DYNAMIC and FP8 schemes. The artifact keeps the fp8
    weight (half of bf16's bytes). On GPUs with fp8 tensor cores the layer computes on it
    (`fp8_linear`); elsewhere (CPUs, older GPUs) `prepare_for` expands it once to the model dtype
    and each call rounds its input through fp8, which is what the checkpoint computes. torch's
    CPU `_scaled_mm` is a reference implementation, 1.4-45x slower here than the expanded GEMM."""

    kind = "fp8_w8a8"
    optional_buffers = ("bias", "input_scale")
    prepared = False
    out_features: int  # set at packing

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", weight_scale.reshape(-1, 1).float())
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("bias", bias)
        # not persistent: the artifact stores the fp8 weight, not this expansion of it
        self.register_buffer("expanded", None, persistent=False)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> LinearBase:
        layer = super().from_state(state)
        layer.register_buffer("expanded", None, persistent=False)
        return layer

    def prepare_for(self, dtype: torch.dtype, device: torch.device) -> LinearBase:
        if not fp8_matmul_supported(device, *self.weight.shape):
            self.expanded = (self.weight.float() * self.weight_scale).to(dtype)
        if self.bias is not None:
            self.bias = self.bias.to(dtype)
        self.prepared = True
        return self

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """The expanded weight laid out as a dense layer's (`_packed_dense`), replacing it.
        Measured on a Zen 3, SmolLM2 FP8_DYNAMIC offline: TPOT at concurrency 4 211 -> 78 ms,
        and 56 ms with the one-pass round trip of `fake_quantize_fp8` (the fp32 checkpoint's:
        55 ms); at concurrency 32 57 -> 89 -> 101 output tok/s (fp32: 116)."""
        if self.expanded is None:
            return False
        self.out_features = self.expanded.shape[0]
        self.packed = _packed_dense(self.expanded, batch_hint)
        if self.packed is None:
            return False
        self.expanded = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepared:
            raise RuntimeError("Fp8Linear.prepare_for(dtype, device) was not called after loading")
        if self.packed is None and self.expanded is None:  # fp8 tensor cores
            return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        x = fake_quantize_fp8(x, self.input_scale)
        if self.packed is not None:
            return _packed_product(x, self.packed, self.bias, self.out_features)
        return F.linear(x, self.expanded, self.bias)


class WeightOnlyLinear(LinearBase):
    """int4/int8 weights with per-group scales (and zero points when asymmetric), 16/32-bit
    activations. Values are loaded unpacked, one per byte. On CPU the layer is packed into the
    kernels' tiles at load, int4 values two to a byte (`cpu_kernels.tiled_int4`), int8 one
    (`cpu_kernels.tiled`), and the kernels expand one tile at a time inside the product, so the
    weight is read at its own bit width and never written out in fp32
    (measured on a Zen 3, SmolLM2 W4A16: 166 -> 40 ms per token at concurrency 1 against the eager
    expansion). On a CPU with a bf16 dot product, bf16 inputs of up to 64 rows (8 with AMX) take
    it on the tiles themselves, two tile rows per instruction (`pairs_bf16_product`); more rows
    go to oneDNN's micro-GEMM, each block of 64 output features expanded once per call to bf16
    (`weight_only_brgemm`; groups of odd length expand the whole weight above 32 rows and run
    one GEMM); elsewhere they stay on fp32 FMAs. On GPU a
    Triton kernel (`triton_weight_only`) likewise dequantizes one tile of the weight at a time in
    registers.
    Elsewhere (no kernels, or groups the kernel does not take) the weight is expanded in torch
    on each call."""

    kind = "weight_only"
    optional_buffers = ("bias", "weight_zero_point")
    out_features: int
    packed_scale: torch.Tensor | None = None
    packed_zero_point: torch.Tensor | None = None

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_zero_point: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.int8).contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        zero = None if weight_zero_point is None else weight_zero_point.float().contiguous()
        self.register_buffer("weight_zero_point", zero)
        self.register_buffer("bias", bias)

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """The weight, scales and zero points in the kernels' tiles, replacing the plain ones."""
        if not cpu_kernels.load():
            return False
        self.out_features, in_features = self.weight.shape
        group = in_features // self.weight_scale.shape[1]
        if cpu_kernels.int4_pairs_fit(self.weight, group):
            self.packed = cpu_kernels.tiled_int4(self.weight)
        else:
            self.packed = cpu_kernels.tiled(self.weight)
        self.packed_scale = cpu_kernels.tiled(self.weight_scale)
        if self.weight_zero_point is not None:
            self.packed_zero_point = cpu_kernels.tiled(self.weight_zero_point)
        self.weight = self.weight_scale = self.weight_zero_point = None
        return True

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Weight [out, in], scales and zero points [out, groups], as loaded or out of the tiles."""
        if self.packed is None:
            return self.weight, self.weight_scale, self.weight_zero_point
        zero = self.packed_zero_point
        return (
            cpu_kernels.untiled(self.packed, self.out_features),
            cpu_kernels.untiled(self.packed_scale, self.out_features),
            None if zero is None else cpu_kernels.untiled(zero, self.out_features),
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        weight, scale, zero = self.quantized()
        out_features, in_features = weight.shape
        groups = scale.shape[1]
        w = weight.reshape(out_features, groups, -1).to(scale.dtype)
        if zero is not None:
            w = w - zero.reshape(out_features, groups, 1)
        w = w * scale.reshape(out_features, groups, 1)
        return w.view(out_features, in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.packed is None:
            in_features, groups = self.weight.shape[1], self.weight_scale.shape[1]
            if triton_weight_only.fits(in_features, in_features // groups):
                return triton_weight_only.linear(
                    x, self.weight, self.weight_scale, self.weight_zero_point, self.bias
                )
        if self.packed is None or not (cpu_kernels.usable(x) and x.stride(-1) == 1):
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        return cpu_kernels.ops.weight_only_product(
            x, self.packed, self.packed_scale, self.packed_zero_point, self.bias,
            self.out_features,
        )  # fmt: skip


LINEAR_KINDS: dict[str, type[LinearBase]] = {
    cls.kind: cls for cls in (DenseLinear, Int8Linear, Fp8Linear, WeightOnlyLinear)
}
