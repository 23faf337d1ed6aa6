"""The CPU paged-attention kernel over each KV-cache dtype: SmolLM2's shapes (9 query heads, 3 KV
heads of 64, blocks of 16) over 30 layers' caches, so that the caches come from DRAM as in
serving. By default one decode step of 32 sequences x 160 tokens; `--queries N` makes each
sequence a prefill chunk of N queries after `--context` cached tokens, and `--sdpa` also times
what the eager path (GPU, no compiler) runs for it: torch's SDPA, causal over a fresh prompt's
K/V, masked over the context gathered from the cache for a chunk after it. Not a test: prints
the best of 7 and the median.

    .venv/bin/python bench/serve_engine/paged_attention.py [--batch 32 --context 160]
    .venv/bin/python bench/serve_engine/paged_attention.py --batch 1 --queries 512 \
        --context 512 --sdpa
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qpipe.serve.layers import cpu_kernels
from qpipe.serve.layers.attention import _gather, cache_views

LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64
# (compute dtype, cache dtype)
PAIRS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn),
]


def timed(step: Callable[[], None]) -> str:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return f"{min(times) * 1e3:6.2f} ms best, {statistics.median(times) * 1e3:6.2f} median"


def measure(
    args: argparse.Namespace, dtype: torch.dtype, cache_dtype: torch.dtype, gen: torch.Generator
) -> str:
    total = args.context + args.queries - (args.queries == 1)  # a decode's query is in context
    width = -(-total // BLOCK)
    blocks = args.batch * width
    tables = torch.randperm(blocks, generator=gen).view(args.batch, width).to(torch.int32)
    lengths = torch.full((args.batch,), total, dtype=torch.int32)
    starts = (torch.arange(args.batch + 1) * args.queries).to(torch.int32)
    queries = None if args.queries == 1 else starts
    caches = [
        torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(cache_dtype)
        for _ in range(LAYERS)
    ]
    views = [cache_views(cache) for cache in caches]
    q = torch.randn(args.batch * args.queries, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def kernel() -> None:
        for k_cache, v_cache in views:
            cpu_kernels.ops.paged_attention(
                out, q, k_cache, v_cache, tables, lengths, queries, 0.125
            )

    # a fresh prompt attends to its own K/V as the step computed them: no gather to time
    fresh = [_gather(*view, tables, dtype) for view in views] if args.context == 0 else []
    positions = torch.arange(total - args.queries, total)
    sees = torch.arange(width * BLOCK)[None, :] <= positions[:, None]

    def sdpa() -> None:
        qs = q.view(args.batch, args.queries, HEADS, HEAD_DIM).transpose(1, 2)
        for layer, (k_cache, v_cache) in enumerate(views):
            if fresh:
                ks, vs = (x[:, :, :total] for x in fresh[layer])
            else:
                ks, vs = _gather(k_cache, v_cache, tables, dtype)
            F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=None if fresh else sees, scale=0.125,
                is_causal=bool(fresh), enable_gqa=True,
            )  # fmt: skip

    mib = sum(cache.nbytes for cache in caches) / 2**20
    name = (
        f"{str(dtype).removeprefix('torch.'):>8} over "
        f"{str(cache_dtype).removeprefix('torch.'):>13} ({mib:4.0f} MiB)"
    )
    return f"{name}: kernel {timed(kernel)}" + (f"; SDPA {timed(sdpa)}" if args.sdpa else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=160, help="cached tokens before the step")
    parser.add_argument("--queries", type=int, default=1, help="per sequence; 1: a decode step")
    parser.add_argument("--sdpa", action="store_true", help="also time the eager path")
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not build; see the warning above")
    gen = torch.Generator().manual_seed(0)
    for dtype, cache_dtype in PAIRS:
        print(measure(args, dtype, cache_dtype, gen))


if __name__ == "__main__":
    main()
