"""The GPU attention kernels (Triton: decodes, and prefill chunks with or without cached
context) against gather + SDPA, run on CPU by Triton's interpreter. The interpreter is chosen
when a kernel is defined, so each comparison runs in a child process with TRITON_INTERPRET=1
(this file is also that child's script)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

CASES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2: groups of 3, padded to tl.dot's 16 rows
    (8, 8, 32, 32),  # no GQA, bigger blocks
    (32, 8, 128, 16),  # Llama 3 8B
]
LENGTHS = [1, 15, 16, 17, 50, 96]  # first token only, mid-block, block edges, several blocks
# (compute dtype, cache dtype): the model's own, and the narrower caches of kv_cache_dtype
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn),
]


def _compare_in_interpreter() -> None:
    from qpipe.serve.layers import triton_attention
    from qpipe.serve.layers.attention import _gather, cache_views

    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, head_dim, block_size in CASES:
        for dtype, cache_dtype in DTYPES:
            blocks = 64
            cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
            cache = cache.to(cache_dtype)
            k_cache, v_cache = cache_views(cache)
            lens = torch.tensor(LENGTHS, dtype=torch.int32)
            width = -(-max(LENGTHS) // block_size)
            tables = torch.randperm(blocks, generator=gen)[: len(LENGTHS) * width]
            tables = tables.view(len(LENGTHS), width).to(torch.int32)
            q = torch.randn(len(LENGTHS), heads, head_dim, generator=gen).to(dtype)
            out = torch.full_like(q, float("nan"))
            scale = head_dim**-0.5
            triton_attention.decode_attention(out, q, k_cache, v_cache, tables, lens, scale)

            ks, vs = _gather(k_cache, v_cache, tables, torch.float32)
            beyond = torch.arange(width * block_size)[None, :] >= lens[:, None]
            mask = torch.zeros(beyond.shape).masked_fill_(beyond, float("-inf"))[:, None, None]
            group = heads // kv_heads
            ref = F.scaled_dot_product_attention(
                q.float().view(len(LENGTHS), kv_heads, group, head_dim),
                ks.float(),
                vs.float(),
                attn_mask=mask,
                scale=scale,
            ).view(q.shape)
            tolerance = 1e-5 if dtype is torch.float32 else 1.6e-2
            torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance)
            print(
                f"ok {heads}/{kv_heads} heads, head_dim {head_dim}, blocks of {block_size}, "
                f"{dtype}, cache {cache_dtype}"
            )


# (tokens already in the cache, new queries) per chunk: a block's worth, mid-block, several query
# blocks of the kernel (16 tokens each), a single query, and fresh prompts (no context) of several
# blocks and of two tokens
CHUNKS = [(16, 5), (15, 17), (3, 40), (50, 1), (0, 37), (0, 2)]
LEADING_ROWS = 3  # rows of the step before the chunks (decodes, fresh prompts): left alone


def _compare_chunks(device: str) -> None:
    from qpipe.serve.layers import triton_attention
    from qpipe.serve.layers.attention import _gather, cache_views

    gen = torch.Generator().manual_seed(1)
    lengths = [context + n for context, n in CHUNKS]
    counts = [n for _, n in CHUNKS]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    for heads, kv_heads, head_dim, block_size in CASES:
        for dtype, cache_dtype in DTYPES:
            blocks = 64
            cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
            k_cache, v_cache = cache_views(cache.to(cache_dtype))
            width = -(-max(lengths) // block_size)
            tables = torch.randperm(blocks, generator=gen)[: len(CHUNKS) * width]
            tables = tables.view(len(CHUNKS), width).to(torch.int32)
            q = torch.randn(LEADING_ROWS + sum(counts), heads, head_dim, generator=gen).to(dtype)
            out = torch.full_like(q, float("nan"), device=device)
            scale = head_dim**-0.5
            on = [t.to(device) for t in (q, k_cache, v_cache, tables, starts)]
            lens = torch.tensor(lengths, dtype=torch.int32, device=device)
            triton_attention.context_attention(
                out[LEADING_ROWS:], on[0][LEADING_ROWS:], on[1], on[2], on[3], lens, on[4],
                max(counts), scale,
            )  # fmt: skip
            out = out.cpu()
            assert out[:LEADING_ROWS].isnan().all()
            ks, vs = _gather(k_cache, v_cache, tables, torch.float32)  # [chunks, kv, len, D]
            group = heads // kv_heads
            tolerance = 1e-5 if dtype is torch.float32 else 1.6e-2
            for i, (context, n) in enumerate(CHUNKS):
                rows = slice(LEADING_ROWS + int(starts[i]), LEADING_ROWS + int(starts[i + 1]))
                total = context + n
                seen = torch.arange(total)[None, :] <= torch.arange(context, total)[:, None]
                ref = F.scaled_dot_product_attention(
                    q[rows].float().transpose(0, 1),  # [heads, n, D]
                    ks[i, :, :total].repeat_interleave(group, 0),
                    vs[i, :, :total].repeat_interleave(group, 0),
                    attn_mask=seen,
                    scale=scale,
                ).transpose(0, 1)
                torch.testing.assert_close(out[rows].float(), ref, atol=tolerance, rtol=tolerance)
            print(f"ok chunks {heads}/{kv_heads} heads of {head_dim}, {dtype}, {cache_dtype}")


def test_triton_decode_attention_equals_sdpa_in_the_interpreter() -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__)
    assert stdout.count("ok ") == len(DTYPES) * len(CASES), stdout


def test_triton_context_attention_equals_sdpa_in_the_interpreter() -> None:
    from tests.triton_interpreter import run_interpreted

    stdout = run_interpreted(__file__, "chunks")
    assert stdout.count("ok chunks ") == len(DTYPES) * len(CASES), stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_context_attention_equals_sdpa_on_the_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _compare_chunks("cuda")
    assert capsys.readouterr().out.count("ok chunks ") == len(DTYPES) * len(CASES)


def test_kernel_sizes_it_takes() -> None:
    from qpipe.serve.layers import triton_attention

    assert triton_attention.fits(64, 16) and triton_attention.fits(128, 32)
    assert not triton_attention.fits(80, 16)  # tl.arange needs powers of two
    assert not triton_attention.fits(64, 8)  # tl.dot needs 16


if __name__ == "__main__":
    if sys.argv[1:] == ["chunks"]:
        _compare_chunks("cpu")
    else:
        _compare_in_interpreter()
