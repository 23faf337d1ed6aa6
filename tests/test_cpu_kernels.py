"""The C++ CPU kernels against the eager torch ops they replace, on shapes that reach every path
of them (GQA groups split into passes, head sizes with and without a compiled-in size, block
sizes above 16, lengths that end mid-block), and the engine's two paths against each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.layers import cpu_kernels, linear
from qpipe.serve.layers.activation import gated_mlp, silu_and_mul
from qpipe.serve.layers.attention import _gather, _write_kv, cache_views
from qpipe.serve.layers.linear import (
    DenseLinear,
    Int8Linear,
    WeightOnlyLinear,
    onednn_int8_is_exact,
    pack_linear_weights,
    quantize_per_token_int8,
)
from qpipe.serve.layers.norm import RMSNorm
from qpipe.serve.layers.rotary import RotaryTables
from qpipe.serve.sampling_params import SamplingParams

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels.load(), "the CPU kernels must build on the CI machine (g++ is there)"


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


# (compute dtype, cache dtype): the model's own, and the narrower caches of kv_cache_dtype
CACHES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e4m3fn),
]


# (tokens in the cache before the step, queries): decodes at lengths that end before, on and past
# a block's end, a fresh prompt, and chunks after cached context whose rows end mid-pass
SEQUENCES = [(0, 1), (14, 1), (15, 1), (16, 1), (69, 1), (160, 1), (0, 37), (45, 13), (100, 61)]


def paged_batch(
    sequences: list[tuple[int, int]],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of random K/V in scattered blocks, and each sequence's block table, length and
    first query row."""  # fmt: skip
    lengths = torch.tensor([c + n for c, n in sequences], dtype=torch.int32)
    batch, width = len(sequences), -(-int(lengths.max()) // block_size)
    num_blocks = batch * width + 3
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    starts = torch.tensor([0] + [n for _, n in sequences]).cumsum(0)
    return kv_cache.to(cache_dtype), tables.to(torch.int32), lengths, starts.to(torch.int32)


@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (32, 4, 128, 32), (10, 2, 80, 16), (6, 1, 64, 32)],
)
def test_paged_attention_equals_sdpa_over_gathered_cache(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Decodes and prefill chunks in one call, against causal SDPA over each sequence's cached
    values widened to fp32: a narrower cache changes what is stored, never how the kernel
    computes with it (fp8's 2^-8 widening is folded back exactly). randn puts ~1 % of the fp8
    values in e4m3's subnormal range (below 2^-6)."""
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    kv_cache, tables, lengths, starts = paged_batch(
        SEQUENCES, kv_heads, head_dim, block_size, cache_dtype, gen
    )
    k_cache, v_cache = cache_views(kv_cache)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    out = torch.full_like(q, float("nan"))
    cpu_kernels.ops.paged_attention(out, q, k_cache, v_cache, tables, lengths, starts, scale)

    ks, vs = _gather(k_cache, v_cache, tables, torch.float32)
    for s, (context, n) in enumerate(SEQUENCES):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        keys = torch.arange(ks.shape[2])
        sees = keys[None, :] <= torch.arange(context, context + n)[:, None]
        expected = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), ks[s], vs[s], attn_mask=sees, scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        close(out[rows], expected, dtype)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2), (4, 4), (12, 1)])
def test_a_tokens_attention_does_not_depend_on_how_its_step_was_chunked(
    heads: int, kv_heads: int
) -> None:
    """Every row of a prefill chunk, run again as a lone decode at its position, gives the same
    bits: so a prefix-cache hit, a chunk boundary, or a preempted sequence's recompute attends
    exactly as one pass over the prompt did. The rows of a chunk go through the kernel in passes
    of several positions, the decode in a pass of its own."""
    gen = torch.Generator().manual_seed(heads)
    sequences = [(45, 29), (0, 50)]
    kv_cache, tables, lengths, starts = paged_batch(sequences, kv_heads, 64, 16, torch.float32, gen)
    k_cache, v_cache = cache_views(kv_cache)
    q = torch.randn(int(starts[-1]), heads, 64, generator=gen)
    chunked = torch.empty_like(q)
    cpu_kernels.ops.paged_attention(chunked, q, k_cache, v_cache, tables, lengths, starts, 0.125)

    alone = torch.empty_like(q)
    for s, (context, n) in enumerate(sequences):
        for i in range(n):
            row = int(starts[s]) + i
            cpu_kernels.ops.paged_attention(
                alone[row : row + 1], q[row : row + 1], k_cache, v_cache, tables[s : s + 1],
                torch.tensor([context + i + 1], dtype=torch.int32), None, 0.125,
            )  # fmt: skip
    assert torch.equal(chunked, alone)


def test_paged_attention_rejects_what_it_cannot_read() -> None:
    k_cache = torch.zeros(2, 2, 24, 16)
    q = torch.zeros(1, 2, 24)
    one_block = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        cpu_kernels.ops.paged_attention(
            q.clone(), q, k_cache, k_cache.clone(), one_block, torch.ones(1, dtype=torch.int32),
            None, 1.0,
        )  # fmt: skip
    k_cache = torch.zeros(2, 2, 64, 16)
    q = torch.zeros(3, 2, 64)
    with pytest.raises(RuntimeError, match="sequence 0 has 3 queries but 2 tokens"):
        cpu_kernels.ops.paged_attention(
            q.clone(), q, k_cache, k_cache.clone(), one_block,
            torch.tensor([2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 1.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="narrower than the longest sequence"):
        cpu_kernels.ops.paged_attention(
            q.clone(), q, k_cache, k_cache.clone(), one_block,
            torch.tensor([17], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 1.0,
        )  # fmt: skip
    assert not cpu_kernels.attention_fits(24, 16)
    assert not cpu_kernels.attention_fits(64, 8)
    assert cpu_kernels.attention_fits(80, 32)


# Widths that are and are not a multiple of the kernels' 16-float vectors (their scalar tails).
WIDTHS = [576, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_norms_equal_the_eager_norm(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(37, width, generator=gen).to(dtype)
    norm = RMSNorm(torch.rand(width, generator=gen).to(dtype) + 0.5, 1e-5)

    plain, stream = norm(x)
    assert stream is x
    close(plain, norm._eager(x), dtype)

    expected_stream = residual + x
    expected = norm._eager(expected_stream)
    fused, new_stream = norm(x.clone(), residual)
    assert new_stream is residual  # updated in place, as the layer loop relies on
    assert torch.equal(new_stream, expected_stream)  # the add rounds exactly as the eager add
    close(fused, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_equals_the_eager_rotation(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, positions = 9, 3, torch.tensor([0, 5, 300, 2047, 7])
    angles = torch.rand(2048, head_dim // 2, generator=gen) * 6.3
    emb = torch.cat([angles, angles], dim=-1)
    sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
    cos_cache, sin_cache = emb.cos(), emb.sin() * sign
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)

    eager = RotaryTables(
        positions, cos_cache, sin_cache,
        cos_cache[positions].unsqueeze(1).to(dtype), sin_cache[positions].unsqueeze(1).to(dtype),
    )  # fmt: skip
    expected = eager.apply(qkv, heads, kv_heads, head_dim)
    kernel = RotaryTables(positions, cos_cache, sin_cache, None, None, cpu_kernels.ops)
    actual = kernel.apply(qkv.clone(), heads, kv_heads, head_dim)
    for a, e in zip(actual, expected, strict=True):
        close(a, e, dtype)
    assert torch.equal(actual[2], expected[2])  # V is not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 100])
def test_silu_and_mul_equals_the_eager_activation(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(33, 2 * width, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(silu_and_mul(gate_up), F.silu(gate) * up, dtype)


def test_a_failed_build_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels.load.__wrapped__() is False
    assert "could not be built" in caplog.text and "eager torch ops" in caplog.text
    monkeypatch.setenv("QPIPE_CPU_KERNELS", "0")
    assert cpu_kernels.load.__wrapped__() is False


def test_engine_gives_the_same_tokens_with_and_without_kernels(
    smollm2_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 in fp32, greedy, a batch of decodes and prefills: the kernel path and the eager
    path (GPU's and a compiler-less machine's) produce the same tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [
        "The capital of France is",
        "List three prime numbers:",
        "In 1969, the first person to walk on the Moon was",
    ]

    def run() -> tuple[list[list[int]], bool]:
        config = EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", kv_cache_memory_gib=0.05
        )
        engine = LLMEngine(config)
        outputs = engine.generate([engine.tokenizer(p).input_ids for p in prompts], params)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        return outputs, engine.model_runner.attention_kernel

    with_kernels, used = run()
    assert used
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    without, used = run()
    assert not used
    assert with_kernels == without


@pytest.fixture(params=["vnni-tiles", "onednn", "int8-values", "fp32-onednn", "fp32"])
def int8_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU forms of a packed W8A8 weight: the kernels' VNNI tiles (AVX512-VNNI CPUs without
    AMX only); oneDNN's int8 GEMM (only where it is exact; forced here on any such CPU); on a
    CPU without VNNI (forced here on any CPU) the plain int8 values that the weight-only kernels
    multiply in fp32, or, without those kernels, the values in fp32 on oneDNN's GEMM (non-Intel
    CPUs) or torch's."""
    if request.param == "vnni-tiles" and not linear.vnni_tiles_serve(576):
        pytest.skip("no AVX512-VNNI without AMX here: W8A8 products go to oneDNN's int8 GEMM")
    if request.param != "vnni-tiles":
        monkeypatch.setattr(linear, "vnni_tiles_serve", lambda in_features: False)
    if request.param == "onednn" and not onednn_int8_is_exact():
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI)")
    if request.param != "onednn":
        monkeypatch.setattr(linear, "onednn_int8_is_exact", lambda: False)
    if request.param.startswith("fp32"):
        on_onednn = request.param == "fp32-onednn"
        monkeypatch.setattr(linear, "_mkl_runs_generic_code", lambda: on_onednn)
    return request.param


def pack_w8a8(int8_backend: str, *layers: Int8Linear) -> int:
    """`pack_linear_weights` as a CPU of the backend's kind does it: the fp32 forms are what a
    layer gets when the CPU kernels cannot be loaded at that point."""
    with pytest.MonkeyPatch.context() as patch:
        if int8_backend.startswith("fp32"):
            patch.setattr(cpu_kernels, "load", lambda: False)
        return pack_linear_weights(torch.nn.Sequential(*layers), batch_hint=32)


def test_w8a8_takes_the_vnni_tiles_on_avx512_vnni_cpus_without_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernels = cpu_kernels.load()  # built under the real flags before they are faked
    for flags, in_features, tiles in [
        ("fpu avx512f avx512_bf16 avx512_vnni", 576, True),  # Zen 4
        ("fpu avx512f avx512_vnni", 576, True),  # Cascade Lake
        ("fpu avx512f avx512_vnni", 578, False),  # inputs not in fours: oneDNN
        ("fpu avx512f avx512_vnni amx_int8 amx_tile", 576, False),  # Sapphire Rapids: AMX
        ("fpu avx2 fma avx_vnni", 576, False),  # 256-bit VNNI only
        ("fpu avx2 fma", 576, False),  # Zen 3: no VNNI
    ]:
        monkeypatch.setattr(cpu_kernels, "cpuinfo", lambda key, f=flags: f)
        assert linear.vnni_tiles_serve(in_features) is (tiles and kernels), flags


def test_the_int8_exactness_probe_tells_what_a_full_range_product_shows() -> None:
    """The probe's one corner product must agree with oneDNN on full-range random operands: exact
    on a VNNI CPU, off where `vpmaddubsw` saturates (measured on an AVX2-only Zen 3)."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randint(-128, 128, (256, 576), generator=gen, dtype=torch.int8)
    q = torch.randint(-128, 128, (32, 576), generator=gen, dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(weight, [32, 576])
    zero = torch.zeros(256, dtype=torch.long)
    product = linear._onednn_int8_product(q, packed, torch.ones(256), zero)
    exact = torch._int_mm(q, weight.t()).float()
    assert onednn_int8_is_exact() == torch.equal(product, exact)


ONEDNN_PRODUCTS = """
import torch
from qpipe.serve.layers import linear
from qpipe.serve.layers.linear import Int8Linear, pack_linear_weights
linear.vnni_tiles_serve = lambda in_features: False  # oneDNN's route, as on AMX CPUs
for dtype in (torch.float32, torch.bfloat16):
    layer = Int8Linear(torch.ones(1536, 576, dtype=torch.int8), torch.ones(1536), None)
    pack_linear_weights(torch.nn.Sequential(layer), batch_hint=32)
    for rows in (1, 32, 512):
        layer(torch.randn(rows, 576).to(dtype))
"""


def test_w8a8_products_run_on_a_onednn_jit_kernel_not_its_reference_one() -> None:
    """oneDNN answers a configuration none of its kernels takes with its reference GEMM, exact and
    thousands of times slower: int8 inputs did so on a VNNI CPU without AMX (a Zen 4), 0.1 GOP/s,
    and every W8A8 engine load there took minutes. Its verbose log names the kernel each product
    ran on; every W8A8 product, as served, must name a JIT one."""
    if not onednn_int8_is_exact():
        pytest.skip("no VNNI: W8A8 layers multiply in the CPU kernels' tiles, not on oneDNN")
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", ONEDNN_PRODUCTS], env=env, capture_output=True, text=True, check=True
    )
    kernels = {
        line.split(",")[6] for line in run.stdout.splitlines() if ",exec,cpu,matmul," in line
    }
    assert kernels, run.stdout[-2000:]
    assert not [k for k in kernels if k.startswith("ref")], kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activations", ["outlier", "full-range"])
@pytest.mark.parametrize("packed", [False, True])
def test_int8_linear_kernels_equal_the_eager_w8a8_path(
    dtype: torch.dtype,
    with_bias: bool,
    activations: str,
    packed: bool,
    int8_backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quantization is bit-exact (same scale rule and rounding); the product, packed (oneDNN, int8
    values or fp32) or on `_int_mm`, with the kernel epilogue equals the exact int32 rule up to
    the final rounding to the model dtype. Activations with an outlier channel, as SmolLM2 has,
    quantize to small values; full-range ones reach the corner where a GEMM without VNNI
    saturates. 5 rows take the kernels' direct path, 19 and 40 their panels; the int8 values in
    tiles give the eager bits, their weight and token scales applied in the product's epilogue."""
    gen = torch.Generator().manual_seed(4)
    if activations == "outlier":
        x = torch.randn(40, 576, generator=gen)
        x[:, 7] *= 300.0
    else:
        x = torch.rand(40, 576, generator=gen) + 0.5
    x = x.to(dtype)
    weight = torch.randint(-127, 128, (192, 576), generator=gen, dtype=torch.int8)
    weight[:, :64] = 127
    weight_scale = torch.rand(192, generator=gen) * 1e-2
    bias = torch.randn(192, generator=gen) if with_bias else None
    layer = Int8Linear(weight, weight_scale, bias)
    if packed:
        assert pack_w8a8(int8_backend, layer) == 1
        assert layer.weight is None
        int8 = int8_backend in ("vnni-tiles", "onednn", "int8-values")
        assert layer.packed.dtype == (torch.int8 if int8 else torch.float32)
        assert layer.packed.is_mkldnn == (int8_backend in ("onednn", "fp32-onednn"))
        vnni_layout = layer.packed.dim() == 3 and layer.packed.shape[2] == 4 * cpu_kernels.TILE
        assert vnni_layout == (int8_backend == "vnni-tiles")

    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(40)
    cpu_kernels.ops.quantize_per_token_int8(q, scale, x)
    expected_q, expected_scale = quantize_per_token_int8(x.float())
    assert torch.equal(q, expected_q)
    assert torch.equal(scale, expected_scale.view(-1))

    eager = (torch._int_mm(q, weight.t()).float() * layer.weight_scale) * expected_scale
    if bias is not None:
        eager += bias
    for rows in (5, 19, 40):
        got = layer(x[:rows])
        close(got, eager[:rows].to(dtype), dtype)
        if packed and int8_backend in ("vnni-tiles", "int8-values"):  # exact integer sums,
            assert torch.equal(got, eager[:rows].to(dtype))  # then the eager epilogue
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    close(layer(x), eager.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("in_features", "group"), [(192, 32), (200, 40), (210, 42), (195, 39)])
def test_weight_only_kernels_equal_the_exact_product(
    dtype: torch.dtype, zero_points: bool, bits: int, in_features: int, group: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """int4/int8 weight-only layers: the kernels (one tile of the packed weight expanded at a
    time, every block of input rows against it; all at once above 32 rows in bf16) and the eager
    expansion, before packing and back out of the tiles, all equal the product in fp64, for row
    counts that reach each path and the tails of the row blocks, 130 output features (not a whole
    number of tiles), an in_features that is no multiple of a vector (200), groups of a length
    that the single-row blocks' four partial sums do not divide (42), and of odd length (39),
    which int4 values cannot be paired in and stay one to a byte."""
    gen = torch.Generator().manual_seed(5)
    out_features = 130
    groups = in_features // group
    low = -(2 ** (bits - 1))
    weight = torch.randint(low, -low, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, groups, generator=gen) * 1e-2 + 1e-3
    zero = torch.randint(-8, 8, (out_features, groups), generator=gen) if zero_points else None
    bias = torch.randn(out_features, generator=gen).to(dtype)
    layer = WeightOnlyLinear(weight, scale, zero, bias)
    grouped = weight.double().view(out_features, groups, group)
    if zero is not None:
        grouped = grouped - zero.double().unsqueeze(-1)
    exact_weight = (grouped * scale.double().unsqueeze(-1)).view(out_features, in_features)

    def check(x: torch.Tensor, rounded_once: bool = False) -> None:
        exact = F.linear(x.double(), exact_weight, bias.double())
        # a GEMM's rounding error scales with its outputs' magnitude, not each element's
        atol = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2}[dtype] * exact.abs().max().item()
        got = layer(x).double()
        torch.testing.assert_close(got, exact, atol=atol, rtol=0)
        if rounded_once:  # fp32 sums over the exact weights, one rounding to bf16 per element
            bound = 2.0**-8 * exact.abs() + 1e-5 * exact.abs().max()
            assert ((got - exact).abs() <= bound).all()

    for rows in (1, 5, 33):  # the eager path of an unpacked layer (GPU)
        check(torch.randn(rows, in_features, generator=gen).to(dtype))
    assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=32) == 1
    paired = bits == 4 and group % 2 == 0  # int4 values two to a byte
    assert layer.weight is None and layer.packed.dtype == (torch.uint8 if paired else torch.int8)
    assert layer.packed.shape == (9, in_features // (2 if paired else 1), cpu_kernels.TILE)
    assert torch.equal(layer.quantized()[0], weight)
    # 1-12: every tail of a block of rows; 17-32: panels; 33, 100: panels in fp32, expanded in bf16
    # (bf16 above 8 rows: brgemm on AMX or AVX512-BF16, 300 in two calls of 256 and 44 rows; on
    # AVX512-BF16 without AMX int4 pairs go to its dot product up to 64 rows, in blocks of 8)
    for rows in (*range(1, 13), 32, 33, 100, 300):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        # bf16 up to 8 rows: the direct blocks (on AVX512-BF16 int4 pairs enter its dot product)
        check(x, rounded_once=dtype == torch.bfloat16 and rows <= 8)
        with monkeypatch.context() as eager:  # no kernels: eager, from the tiles
            eager.setattr(cpu_kernels, "load", lambda: False)
            check(x)
    assert layer(torch.zeros(0, in_features, dtype=dtype)).shape == (0, out_features)


def test_weight_only_kernel_rejects_what_it_cannot_read() -> None:
    weight = cpu_kernels.tiled(torch.zeros(20, 64, dtype=torch.int8))
    scales = cpu_kernels.tiled(torch.ones(20, 2))
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="weight must be contiguous int8 tiles"):
        cpu_kernels.ops.weight_only_linear(x, torch.zeros(20, 64, dtype=torch.int8), scales,
                                           None, None, 20)  # fmt: skip
    with pytest.raises(RuntimeError, match="out_features 33 does not fit 2 tiles"):
        cpu_kernels.ops.weight_only_linear(x, weight, scales, None, None, 33)
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_kernels.ops.weight_only_linear(x, weight, cpu_kernels.tiled(torch.ones(20, 3)),
                                           None, None, 20)  # fmt: skip
    with pytest.raises(RuntimeError, match="zero points must be"):
        cpu_kernels.ops.weight_only_expand(weight, scales, cpu_kernels.tiled(torch.ones(20, 1)), 20)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        cpu_kernels.ops.weight_only_linear(torch.zeros(1, 32), weight, scales, None, None, 20)
    no_groups = torch.zeros(2, 0, cpu_kernels.TILE)  # routing many bf16 rows reads the groups
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_kernels.ops.weight_only_product(torch.zeros(40, 64, dtype=torch.bfloat16), weight,
                                            no_groups, None, None, 20)  # fmt: skip
    pairs = cpu_kernels.tiled_int4(torch.zeros(20, 78, dtype=torch.int8))
    two_groups = cpu_kernels.tiled(torch.ones(20, 2))
    with pytest.raises(RuntimeError, match="int4 pairs need groups of even length, got 39"):
        cpu_kernels.ops.weight_only_linear(torch.zeros(1, 78), pairs, two_groups, None, None, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "intermediate"), [(128, 192), (120, 200)])
@pytest.mark.parametrize("rows", [5, 37])
def test_fused_int8_gated_mlp_equals_the_layer_by_layer_path(
    dtype: torch.dtype, hidden: int, intermediate: int, rows: int, int8_backend: str
) -> None:
    """The one-call W8A8 MLP keeps the activation in int8 between the projections; it must give
    the bits of gate_up -> silu_and_mul -> down, each a separate kernel call (at decode and
    prefill row counts: the int8 values are read in place up to 32 rows)."""
    gen = torch.Generator().manual_seed(7)

    def layer(out_features: int, in_features: int) -> Int8Linear:
        weight = torch.randint(-127, 128, (out_features, in_features), generator=gen)
        return Int8Linear(
            weight.to(torch.int8), torch.rand(out_features, generator=gen) * 1e-2, None
        )

    gate_up, down = layer(2 * intermediate, hidden), layer(hidden, intermediate)
    assert pack_w8a8(int8_backend, gate_up, down) == 2
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    x[:, 5] *= 100.0  # an outlier channel
    with torch.profiler.profile() as profile:
        fused = gated_mlp(gate_up, down, x)
    assert "qpipe_cpu::int8_gated_mlp" in {event.name for event in profile.events()}
    unfused = down(silu_and_mul(gate_up(x)))
    assert fused.dtype == dtype and fused.shape == (rows, hidden)
    assert torch.equal(fused, unfused)
    assert fused.abs().max() > 0


@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHES)
def test_write_kv_fills_the_same_slots_with_the_same_bits_as_the_torch_ops(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The kernel against `_write_kv`, the torch ops of the GPU path: the same cache bytes, and k
    and v left holding what the cache holds (the kernel rounds them in place). Values span fp8's
    subnormals, its rounding ties, and past its +-448 (saturated)."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, head_dim, block_size, blocks = 3, 64, 16, 6
    qkv = torch.randn(7, (9 + 2 * kv_heads) * head_dim, generator=gen)
    qkv *= torch.tensor([1e-3, 1.0, 50.0, 1e3]).repeat(qkv.numel() // 4).view(qkv.shape)
    qkv = qkv.to(dtype)
    _, k, v = qkv.view(7, 9 + 2 * kv_heads, head_dim).split([9, kv_heads, kv_heads], 1)
    # fp8 ties (to 1.0, to 1.25, a subnormal's to 2 * 2^-9), saturated magnitudes, a zero
    k[0, 0, :8] = torch.tensor([1.0625, 1.1875, -1.0625, 3 * 2**-10, 460, -1e9, 0.0, 2**-12])
    slots = torch.tensor([0, 15, 16, 33, 47, 80, 95])
    kernel = torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    eager = kernel.clone()

    k_cache, v_cache = cache_views(eager)
    expected_k, expected_v = _write_kv(k_cache, v_cache, k.clone(), v.clone(), slots)
    k_cache, v_cache = cache_views(kernel)
    cpu_kernels.ops.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(kernel.view(torch.uint8), eager.view(torch.uint8))
    assert kernel.float().count_nonzero() > 0 and not kernel.float().isnan().any()
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    if cache_dtype == torch.float8_e4m3fn:
        assert kernel.float().abs().max() == 448 and k.abs().max() == 448


@pytest.mark.parametrize(("dtype", "cache_dtype"), [c for c in CACHES if c[0] != c[1]])
def test_widen_kv_gives_torch_casts_values_for_every_bit_pattern(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """Every fp8 bit pattern but the two NaNs (bf16: 4096 patterns that include subnormals and
    both zeros), repeated past one of the kernel's chunks and ending off the vector width."""
    if cache_dtype == torch.float8_e4m3fn:
        bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    else:
        bits = torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16)
        bits = bits[~bits.view(torch.bfloat16).isnan()]
    x = bits.repeat(9000 // len(bits) + 1)[: 9000 + 7].view(cache_dtype)
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    cpu_kernels.ops.widen_kv(out, x)
    assert torch.equal(out, x.to(dtype))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_packed_bf16_linear_gives_the_same_bits(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU with a bf16 dot product, bf16 weights go to oneDNN where it takes them (AMX CPUs;
    AVX512-BF16 ones without AMX take the pair tiles, forced off here)."""
    monkeypatch.setattr(linear, "has_bf16_dot_product", lambda: True)
    monkeypatch.setattr(linear, "bf16_pair_tiles_serve", lambda in_features: False)
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(960, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    plain = DenseLinear(weight, bias)
    expected = plain(x)
    packed = DenseLinear(weight, bias)
    # oneDNN packs bf16 only with AVX-512 or AVX-NE-CONVERT: elsewhere the plain weight serves
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert pack_linear_weights(torch.nn.Sequential(packed), batch_hint=64) == int(supported)
    assert (packed.weight is None) == supported == (packed.packed is not None)
    assert torch.equal(packed(x), expected)


@pytest.mark.parametrize(
    ("generic_mkl", "avx512", "kernels"),
    [(False, False, True), (True, False, True), (True, False, False), (False, True, True),
     (False, True, False)],
)  # fmt: skip
def test_fp32_weights_leave_mkl_where_the_tiles_beat_it(
    generic_mkl: bool, avx512: bool, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 leaves MKL on non-Intel CPUs (MKL's generic code there is 1.3-3x slower at decode
    batch sizes) and on AVX-512 CPUs (the tile kernel's pairs of tiles beat MKL at 1-64 rows): for
    the tile kernel, or, on non-Intel CPUs where the kernels cannot be built, for oneDNN's packed
    GEMM; the same results up to summation order. An Intel CPU without AVX-512 keeps MKL."""
    monkeypatch.setattr(linear, "_mkl_runs_generic_code", lambda: generic_mkl)
    monkeypatch.setattr(linear, "_has_avx512", lambda: avx512)
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    gen = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    x = torch.randn(32, 576, generator=gen)
    expected = F.linear(x, weight, bias)
    layer = DenseLinear(weight, bias)
    tiles = kernels and (generic_mkl or avx512)
    onednn = not kernels and generic_mkl
    assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=64) == int(tiles or onednn)
    if tiles:
        assert layer.packed.shape == (60, 576, cpu_kernels.TILE) and not layer.packed.is_mkldnn
    elif onednn:
        assert layer.packed.is_mkldnn
    else:
        assert layer.packed is None
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


def assert_rounded_once_to_bf16(
    layer: DenseLinear, weight: torch.Tensor, bias: torch.Tensor | None, gen: torch.Generator
) -> None:
    """Every output of the bf16 layer is the exact product rounded once to bf16 (within half a
    bf16 ulp, plus the fp32 sums' error), at every row count up to a block of rows and its
    tails, 32 and 100 rows; `float_output` (an LM head's logits) gives the fp32 sums that
    rounding starts from: within their own error of the exact product, and finer than bf16."""
    for rows in (*range(1, 18), 32, 100):
        x = torch.randn(rows, weight.shape[1], generator=gen).to(torch.bfloat16)
        y = layer(x)
        assert y.dtype is torch.bfloat16
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        bound = exact.abs() * 2**-8 + 1e-6 * exact.abs().max()
        assert ((y.double() - exact).abs() <= bound).all(), rows
        sums = layer.float_output(x)
        assert sums.dtype is torch.float32 and torch.equal(sums.bfloat16(), y), rows
        torch.testing.assert_close(
            sums.double(), exact, atol=1e-6 * exact.abs().max().item(), rtol=0
        )
        assert (sums != sums.bfloat16().float()).float().mean() > 0.9, rows


@pytest.mark.parametrize(("dot_product", "kernels"), [(False, True), (True, True), (False, False)])
def test_bf16_weights_take_the_tiles_without_a_bf16_dot_product(
    dot_product: bool, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU has no bf16 dot product (AVX512-BF16, AMX), torch's bf16 GEMM is emulated
    (on a Zen 3 SmolLM2 served 4.2x slower in bf16 than in fp32), so bf16 weights go into the
    tiles and are summed in fp32: every output is the exact product rounded once to bf16 (within
    half a bf16 ulp, plus the fp32 sums' error), at every row count up to a block of rows and its
    tails, 32 and 100 rows, a tile of padding, an in_features of no whole vector; with and
    without bias."""
    monkeypatch.setattr(linear, "has_bf16_dot_product", lambda: dot_product)
    monkeypatch.setattr(linear, "bf16_pair_tiles_serve", lambda in_features: False)
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    gen = torch.Generator().manual_seed(10)
    weight = torch.randn(130, 201, generator=gen).to(torch.bfloat16)
    for bias in (None, torch.randn(130, generator=gen).to(torch.bfloat16)):
        layer = DenseLinear(weight, bias)
        pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8)
        tiles = kernels and not dot_product
        if not tiles:
            assert layer.packed is None or layer.packed.is_mkldnn
            continue
        assert layer.weight is None and layer.packed.dtype is torch.bfloat16
        assert layer.packed.shape == (9, 201, cpu_kernels.TILE)
        assert_rounded_once_to_bf16(layer, weight, bias, gen)


def test_bf16_weights_take_the_pair_tiles_on_avx512_bf16_cpus_without_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernels = cpu_kernels.load()  # built under the real flags before they are faked
    for flags, in_features, tiles in [
        ("fpu avx512f avx512_bf16 avx512_vnni", 576, True),  # Zen 4, Cooper Lake
        ("fpu avx512f avx512_bf16", 201, False),  # inputs not in pairs: oneDNN
        ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", 576, False),  # Sapphire Rapids: AMX
        ("fpu avx512f avx512_vnni", 576, False),  # Cascade Lake: no bf16 dot product
        ("fpu avx2 fma", 576, False),  # Zen 3
    ]:
        monkeypatch.setattr(cpu_kernels, "cpuinfo", lambda key, f=flags: f)
        assert linear.bf16_pair_tiles_serve(in_features) is (tiles and kernels), flags


def test_bf16_pair_tiles_give_the_product_rounded_once() -> None:
    """bf16 weights in the AVX512-BF16 pair tiles: every output is the exact product rounded once
    to bf16 (within half a bf16 ulp, plus the fp32 sums' error), at every row count up to a
    block of rows and its tails, 32 and 100 rows, an odd number of tiles and a padded one, with
    and without bias; the layout inverts; fp32 inputs are refused, not misread."""
    if not linear.bf16_pair_tiles_serve(202):
        pytest.skip("no AVX512-BF16 without AMX here: bf16 products go to oneDNN or the tiles")
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(130, 202, generator=gen).to(torch.bfloat16)
    for bias in (None, torch.randn(130, generator=gen).to(torch.bfloat16)):
        layer = DenseLinear(weight, bias)
        assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8) == 1
        assert layer.weight is None and layer.packed.shape == (9, 101, 2 * cpu_kernels.TILE)
        assert torch.equal(cpu_kernels.untiled(layer.packed, 130), weight)
        assert_rounded_once_to_bf16(layer, weight, bias, gen)
    with pytest.raises(RuntimeError, match="takes bf16 x"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 202), layer.packed, None, 130)
    with pytest.raises(ValueError, match="even in_features"):
        cpu_kernels.tiled_bf16_pairs(weight[:, :201])


def test_fp32_weights_of_bf16_values_take_bf16_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 weight whose values are all bf16 (a 16-bit checkpoint served in fp32) goes into
    bf16 tiles, half the bytes, and gives the fp32 product of fp32 inputs; one value that is not
    a bf16, in the first or in the last block of rows checked, keeps the weight in fp32 tiles."""
    monkeypatch.setattr(linear, "_mkl_runs_generic_code", lambda: True)
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(300, 201, generator=gen).to(torch.bfloat16).float()
    bias = torch.randn(300, generator=gen)
    layer = DenseLinear(weight, bias)
    assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8) == 1
    assert layer.packed.dtype is torch.bfloat16
    assert layer.packed.shape == (19, 201, cpu_kernels.TILE)
    for rows in (1, 5, 16, 17, 100):
        x = torch.randn(rows, 201, generator=gen)
        y = layer(x)
        assert y.dtype is torch.float32
        exact = F.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(y.double(), exact, atol=1e-6 * exact.abs().max().item(), rtol=0)
    for row, col in ((7, 3), (290, 200)):
        changed = weight.clone()
        changed[row, col] += 2**-20 * changed[row, col].abs()  # no longer a bf16 value
        layer = DenseLinear(changed, bias)
        pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8)
        assert layer.packed.dtype is torch.float32


def test_dense_tile_kernel_equals_the_exact_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 weights in tiles: every row count up to a block of rows and its tails, 32 and 100
    rows, 130 output features (not a whole number of tiles), in_features 200 (no multiple of a
    vector), with and without bias, leading dims kept; and what the kernel refuses."""
    monkeypatch.setattr(linear, "_mkl_runs_generic_code", lambda: True)
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(130, 200, generator=gen)
    for bias in (None, torch.randn(130, generator=gen)):
        layer = DenseLinear(weight, bias)
        assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8) == 1
        assert layer.weight is None and layer.packed.shape == (9, 200, cpu_kernels.TILE)
        for rows in (*range(1, 14), 32, 100):
            x = torch.randn(rows, 200, generator=gen)
            exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
            atol = 1e-6 * exact.abs().max().item()
            torch.testing.assert_close(layer(x).double(), exact, atol=atol, rtol=0)
        assert layer(torch.zeros(0, 200)).shape == (0, 130)  # a step in which no row samples
    tiles = cpu_kernels.tiled(weight)
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16 inputs"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 200, dtype=torch.float16), tiles, None, 130)
    with pytest.raises(RuntimeError, match="weight must be contiguous bfloat16 tiles"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 200, dtype=torch.bfloat16), tiles, None, 130)
    with pytest.raises(RuntimeError, match="weight must be contiguous float32 tiles"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 200), weight, None, 130)
    with pytest.raises(RuntimeError, match="out_features 145 does not fit 9 tiles"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 200), tiles, None, 145)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 192), tiles, None, 130)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.ops.dense_linear(torch.zeros(1, 200), tiles, torch.zeros(129), 130)
