"""The CPU decode-attention kernel over each KV-cache dtype: SmolLM2's shapes (9 query heads, 3 KV
heads of 64, blocks of 16), one step of 32 sequences x 160 tokens over 30 layers' caches, so that
the caches come from DRAM as in serving. Not a test: prints the best of 7 and the median.

    .venv/bin/python bench/serve_engine/decode_attention.py [--batch 32 --context 160]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qpipe.serve.layers import cpu_kernels
from qpipe.serve.layers.attention import cache_views

LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64
# (compute dtype, cache dtype)
PAIRS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=160)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not build; see the warning above")
    gen = torch.Generator().manual_seed(0)
    width = -(-args.context // BLOCK)
    blocks = args.batch * width
    tables = torch.randperm(blocks, generator=gen).view(args.batch, width).to(torch.int32)
    lengths = torch.full((args.batch,), args.context, dtype=torch.int32)
    for dtype, cache_dtype in PAIRS:
        caches = [
            torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(cache_dtype)
            for _ in range(LAYERS)
        ]
        views = [cache_views(cache) for cache in caches]
        q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        out = torch.empty_like(q)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for k_cache, v_cache in views:
                cpu_kernels.ops.decode_attention(out, q, k_cache, v_cache, tables, lengths, 0.125)
            times.append(time.perf_counter() - start)
        mib = sum(cache.nbytes for cache in caches) / 2**20
        print(
            f"{str(dtype).removeprefix('torch.'):>8} over "
            f"{str(cache_dtype).removeprefix('torch.'):>13} ({mib:4.0f} MiB): "
            f"{min(times) * 1e3:5.2f} ms best, {statistics.median(times) * 1e3:5.2f} median"
        )


if __name__ == "__main__":
    main()
