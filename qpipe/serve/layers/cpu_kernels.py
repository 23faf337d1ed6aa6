"""The engine's C++ CPU kernels (`qpipe/serve/csrc/`, one file per job), compiled at first use.

Why by hand: on a 2-core CPU a decode step of a small model is dominated not by its GEMMs but by
gathering each sequence's K/V blocks into a padded copy for SDPA and by ~30 small eager ops per
layer (norms, rotary, SiLU, residual adds), each a full pass over memory plus dispatch; and
quantized weights expanded to the model dtype on every call cost more than their products. The
kernels read the paged cache in place, do each of those steps in one pass, and multiply weights
where they lie in their own bit width. They compute in fp32 and round once to the model dtype
where the eager path rounds the same way.

They are built with torch's extension builder for the CPU they will run on (`-march=native`), so
the build directory carries a digest of the source, the compiler flags and the CPU's feature
flags: a home directory shared between machines never loads a binary built for another CPU. A
machine without a C++ compiler still serves through the eager torch path, with a warning that
says what is missing; `QPIPE_CPU_KERNELS=0` asks for the eager path on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-std=c++17",
]
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS.append("-mprefer-vector-width=512")  # GCC otherwise stays at 256-bit on AVX-512 CPUs
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpuinfo(field: str) -> str | None:
    """A field of the first CPU in /proc/cpuinfo (`flags`, `vendor_id`); None off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return None


def build_name() -> str:
    digest = hashlib.sha256()
    flags = cpuinfo("flags") or platform.processor()
    for path in sorted(CSRC.glob("*.[ch]*")):  # the headers too: a changed one rebuilds
        digest.update(path.name.encode() + path.read_bytes())
    for part in (" ".join(CFLAGS).encode(), flags.encode()):
        digest.update(part)
    return f"qpipe_cpu_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (once per machine, ~1 min on 2 cores) and load the kernels; False if they can't be."""
    if os.environ.get("QPIPE_CPU_KERNELS", "1") == "0":
        log.info("QPIPE_CPU_KERNELS=0: serving through eager torch ops")
        return False
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        cpp_extension.load(
            name=build_name(),
            sources=[str(path) for path in sorted(CSRC.glob("*.cpp"))],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as err:
        log.warning(
            "qpipe's CPU kernels could not be built (%s); serving through eager torch ops, "
            "which is ~1.5x slower. Install a C++ compiler (g++) and ninja to get them.",
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return False
    return True


def _put_ninja_on_path() -> None:
    """torch calls `ninja` from PATH; the pip-installed one sits in the venv's bin, which is not
    on PATH when the venv's python is run directly (as `make` does)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def usable(x: torch.Tensor) -> bool:
    """True where the kernels handle `x`: a CPU tensor of a dtype they take."""
    return serves(x.device, x.dtype)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in DTYPES and load()


TILE = 16  # output features per tile in the weight-only kernels' layout (kTile in the C++)
VNNI_GROUP = 4  # input features per int32 lane of a VNNI dot product (kVnniGroup in the C++)
BF16_PAIR = 2  # input features per fp32 lane of AVX512-BF16's dot product (kPairGroup in the C++)


def tiled(t: torch.Tensor) -> torch.Tensor:
    """[out, cols] -> [ceil(out / TILE), cols, TILE], zero-padded: the layout in which the
    weight-only kernels read a weight and its scales and zero points, column-major inside a tile
    so that one vector load holds one value of each of TILE output features."""
    return _padded_to_tiles(t).view(-1, TILE, t.shape[1]).transpose(1, 2).contiguous()


def _padded_to_tiles(t: torch.Tensor) -> torch.Tensor:
    """[out, cols] with zero rows added up to a whole number of tiles (a copy only then)."""
    pad = -t.shape[0] % TILE
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def untiled(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `tiled`, of `tiled_int4`, of `tiled_vnni` and of `tiled_bf16_pairs`:
    [out_features, cols]."""
    for group, values in ((VNNI_GROUP, t[:, :-1]), (BF16_PAIR, t)):  # VNNI: less compensations
        if t.shape[2] == group * TILE:
            values = values.reshape(t.shape[0], -1, TILE, group).permute(0, 2, 1, 3)
            return values.reshape(t.shape[0] * TILE, -1)[:out_features]
    if t.dtype == torch.uint8:
        t = torch.stack([t & 15, t >> 4], dim=2).flatten(1, 2).to(torch.int8) - 8
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:out_features]


def int4_pairs_fit(weight: torch.Tensor, group: int) -> bool:
    """Whether an int8-held weight's values are int4 ([-8, 7]) in groups of even length, which
    `tiled_int4` stores two to a byte."""
    low, high = torch.aminmax(weight)
    return group % 2 == 0 and int(low) >= -8 and int(high) <= 7


def tiled_int4(weight: torch.Tensor) -> torch.Tensor:
    """[out, cols] int4 values held as int8 -> [ceil(out / TILE), cols / 2, TILE] uint8: `tiled`,
    then rows 2m and 2m + 1 of each tile's feature as the low and high nibble of one byte, each
    value + 8 (the kernels fold the 8 into the zero point). Half the bytes per weight, which is
    what a product at decode sizes waits on."""
    tiles = (tiled(weight).to(torch.int16) + 8).to(torch.uint8)
    return tiles[:, 0::2] | (tiles[:, 1::2] << 4)


def tiled_vnni(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] int8 W8A8 values -> [ceil(out / TILE), in / 4 + 1, 4 * TILE] int8: per tile, the
    four consecutive inputs of each of its TILE output features side by side (the operand order
    of AVX512-VNNI's u8 x s8 dot product), then the tile's compensations 128 * sum(w) per feature
    as int32 bytes, which the kernel subtracts because its input is q + 128."""
    if weight.shape[1] % VNNI_GROUP:
        raise ValueError(f"VNNI tiles need in_features divisible by 4, got {weight.shape[1]}")
    compensation = tiled(128 * weight.sum(dim=1, dtype=torch.int32).reshape(-1, 1))
    return torch.cat([_grouped_tiles(weight, VNNI_GROUP), compensation.view(torch.int8)], dim=1)


def tiled_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out_features, in_features] weight as [tiles, in_features / 2, 2 * TILE]: in each
    tile, two consecutive inputs of each of its TILE output features side by side (the operand
    order of AVX512-BF16's dot product, 32 multiply-adds per instruction into TILE fp32 sums)."""
    if weight.shape[1] % BF16_PAIR:
        raise ValueError(f"bf16 pair tiles need an even in_features, got {weight.shape[1]}")
    return _grouped_tiles(weight, BF16_PAIR)


def _grouped_tiles(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in] -> [tiles, in / group, group * TILE]: per tile, `group` consecutive inputs of
    each of its TILE output features side by side, in one copy of the weight."""
    grouped = _padded_to_tiles(weight).view(-1, TILE, weight.shape[1] // group, group)
    return grouped.permute(0, 2, 1, 3).reshape(grouped.shape[0], -1, group * TILE)


def attention_fits(head_dim: int, block_size: int) -> bool:
    """The attention kernel works in vectors of 16 floats (8 on AVX2) along heads and blocks."""
    return head_dim % 16 == 0 and head_dim <= 256 and block_size % 16 == 0


ops = torch.ops.qpipe_cpu
