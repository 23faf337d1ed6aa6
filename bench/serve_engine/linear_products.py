"""SmolLM2's 120 linear products of one decode or prefill step (30 layers x qkv, o, gate_up, down),
random weights packed as the engine packs them, bf16 inputs (fp32 for fp32 weights), at several
row counts; the weights come from DRAM as in serving (W8A8 106 MB, W4A16 53 MB plus scales, bf16
212 MB, fp32 424 MB). Not a test: prints the best of 5 and the median.

    .venv/bin/python bench/serve_engine/linear_products.py [--format w8a8|w4a16|bf16|fp32]
        [--route served|onednn] [--rows 1,8,32]

`--route onednn` forces oneDNN's GEMM where the engine would take the kernels' VNNI tiles (W8A8)
or their AVX512-BF16 pair tiles (bf16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qpipe.serve.layers import linear
from qpipe.serve.layers.linear import (
    DenseLinear,
    Int8Linear,
    LinearBase,
    WeightOnlyLinear,
    pack_linear_weights,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # [out, in], as served
DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32}
W4A16_GROUP = 64  # SmolLM2's hidden size 576 is not a multiple of 128


def make_layer(shape: tuple[int, int], weight_format: str, gen: torch.Generator) -> LinearBase:
    if weight_format in DENSE:
        return DenseLinear(torch.randn(shape, generator=gen).to(DENSE[weight_format]), None)
    if weight_format == "w4a16":
        weight = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
        scales = torch.rand(shape[0], shape[1] // W4A16_GROUP, generator=gen) * 1e-2
        return WeightOnlyLinear(weight, scales, None, None)
    weight = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    return Int8Linear(weight, torch.rand(shape[0], generator=gen) * 1e-2, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=["w8a8", "w4a16", "bf16", "fp32"], default="w8a8")
    parser.add_argument("--route", choices=["served", "onednn"], default="served")
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    args = parser.parse_args()
    if args.route == "onednn":
        linear.vnni_tiles_serve = lambda in_features: False
        linear.bf16_pair_tiles_serve = lambda in_features: False
    gen = torch.Generator().manual_seed(0)
    layers = [make_layer(shape, args.format, gen) for shape in SHAPES]
    pack_linear_weights(torch.nn.Sequential(*layers), batch_hint=32)
    packed = layers[0].packed
    described = "oneDNN" if packed is None or packed.is_mkldnn else tuple(packed.shape)
    print(f"{args.format}, route {args.route}: {described} weights")
    for rows in (int(r) for r in args.rows.split(",")):
        dtype = torch.float32 if args.format == "fp32" else torch.bfloat16
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
        times = []
        with torch.inference_mode():
            for _ in range(5):
                start = time.perf_counter()
                for layer, (_, in_features) in zip(layers, SHAPES, strict=True):
                    layer(inputs[in_features])
                times.append(time.perf_counter() - start)
        print(
            f"{rows:4d} rows: {min(times) * 1e3:6.1f} ms best, "
            f"{statistics.median(times) * 1e3:6.1f} median"
        )


if __name__ == "__main__":
    main()
