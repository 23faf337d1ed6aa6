"""The GPU decode-attention kernel (Triton) against gather + SDPA, run on CPU by Triton's
interpreter. The interpreter is chosen when a kernel is defined, so the comparison runs in a
child process with TRITON_INTERPRET=1 (this file is also that child's script)."""

from __future__ import annotations

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


def test_triton_decode_attention_equals_sdpa_in_the_interpreter() -> None:
    from tests.triton_interpreter import run_interpreted  # not in the child, which runs this file

    stdout = run_interpreted(__file__)
    assert stdout.count("ok ") == len(DTYPES) * len(CASES), stdout


def test_kernel_sizes_it_takes() -> None:
    from qpipe.serve.layers import triton_attention

    assert triton_attention.fits(64, 16) and triton_attention.fits(128, 32)
    assert not triton_attention.fits(80, 16)  # tl.arange needs powers of two
    assert not triton_attention.fits(64, 8)  # tl.dot needs 16


if __name__ == "__main__":
    _compare_in_interpreter()
