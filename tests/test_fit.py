"""`qpipe fit` figures against hand computation and the published Llama-3-70B example."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpipe.cli import app
from qpipe.fit import GIB, FitError, FitRequest, ModelShape, fit, gpu_memory, kv_bytes_per_token

LLAMA3_70B = {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "tie_word_embeddings": False}  # fmt: skip
LLAMA3_8B = {**LLAMA3_70B, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32}  # fmt: skip


def test_llama3_70b_kv_bytes_per_token_matches_the_published_figure() -> None:
    shape = ModelShape.from_config(LLAMA3_70B)
    assert kv_bytes_per_token(shape, "fp16") == 327_680
    assert kv_bytes_per_token(shape, "fp8") == 163_840
    assert kv_bytes_per_token(shape, "fp16", tp=4) == 327_680 // 4
    assert kv_bytes_per_token(shape, "fp16", tp=16) == 327_680 // 8  # 8 KV heads: replicated


def test_parameter_count_is_llama3_8b() -> None:
    shape = ModelShape.from_config(LLAMA3_8B)
    total = shape.linear_params + shape.embedding_params + shape.norm_params
    assert total == 8_030_261_248  # Meta-Llama-3-8B's parameter count


def test_breakdown_adds_up_and_quantization_shrinks_weights() -> None:
    shape = ModelShape.from_config(LLAMA3_8B)
    bf16 = fit(FitRequest(shape, gpu_gib=80, gpu_name="H100", quant="bf16", max_model_len=8192,
                          concurrency=4))  # fmt: skip
    parts = bf16.weights_gib + bf16.kv_cache_gib + bf16.activations_gib + bf16.overhead_gib
    assert bf16.required_gib == pytest.approx(1.2 * parts)
    assert bf16.weights_gib == pytest.approx(8_030_261_248 * 2 / GIB)
    assert bf16.kv_cache_gib == pytest.approx(131_072 * 8192 * 4 / GIB)
    int4 = fit(FitRequest(shape, gpu_gib=80, gpu_name="H100", quant="int4", group_size=128))
    linear = shape.linear_params
    expected = linear * 0.5 + linear / 128 * 2 + (shape.embedding_params + shape.norm_params) * 2
    assert int4.weights_gib == pytest.approx(expected / GIB)


def test_fits_and_limits_are_consistent() -> None:
    shape = ModelShape.from_config(LLAMA3_70B)
    one = fit(FitRequest(shape, gpu_gib=80, gpu_name="H100", quant="bf16"))
    assert not one.fits and one.max_concurrency_at_len == 0
    four = fit(FitRequest(shape, gpu_gib=80, gpu_name="H100", quant="bf16", tp=4,
                          max_model_len=8192, concurrency=16))  # fmt: skip
    assert four.fits
    # the reported limits are exactly at the edge: one more sequence would not fit
    limit = four.max_concurrency_at_len
    edge = fit(FitRequest(shape, 80, "H100", quant="bf16", tp=4, max_model_len=8192,
                          concurrency=limit))  # fmt: skip
    over = fit(FitRequest(shape, 80, "H100", quant="bf16", tp=4, max_model_len=8192,
                          concurrency=limit + 1))  # fmt: skip
    assert edge.fits and not over.fits


def test_gpu_names_and_errors() -> None:
    assert gpu_memory("h200") == ("H200", pytest.approx(140.4, abs=0.1))
    assert gpu_memory("A100-80G")[1] == 80
    assert gpu_memory("24")[1] == 24.0
    with pytest.raises(FitError, match="unknown GPU 'V100'"):
        gpu_memory("V100")
    with pytest.raises(FitError, match="must divide the 64 attention heads"):
        fit(FitRequest(ModelShape.from_config(LLAMA3_70B), 80, "H100", tp=3))


def test_cli_on_the_real_checkpoint(smollm2_checkpoint: Path) -> None:
    result = CliRunner().invoke(app, ["fit", str(smollm2_checkpoint), "--gpu", "L4", "--json",
                                      "--quant", "fp32", "--kv-dtype", "fp32"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert report["weights_gib"] == pytest.approx(134_515_008 * 4 / GIB, rel=1e-3)
    assert report["fits"] is True
    bad = CliRunner().invoke(app, ["fit", str(smollm2_checkpoint), "--gpu", "potato"])
    assert bad.exit_code == 2 and "unknown GPU 'potato'" in bad.output


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpu_gib", 0.0, "GPU memory must be a positive number"),
        ("gpu_gib", float("inf"), "GPU memory must be a positive number"),
        ("tp", 0, "tp must be at least 1"),
        ("group_size", -7, "group_size must be at least 1"),
        ("max_model_len", 0, "max_model_len must be at least 1"),
        ("concurrency", -5, "concurrency must be at least 1"),
        ("overhead_gib", -100.0, "overhead_gib must be a finite number >= 0"),
        ("overhead_gib", float("nan"), "overhead_gib must be a finite number >= 0"),
    ],
)
def test_a_request_refuses_sizes_that_give_no_verdict(
    field: str, value: float, message: str
) -> None:
    shape = ModelShape.from_config(LLAMA3_8B)
    with pytest.raises(FitError, match=message):
        replace(FitRequest(shape, gpu_gib=80, gpu_name="H100"), **{field: value})


@pytest.mark.parametrize(
    "args",
    [
        ["--concurrency", "0"],
        ["--concurrency", "-5"],
        ["--max-model-len", "0"],
        ["--max-model-len", "-1"],
        ["--quant", "int4", "--group-size", "-7"],
        ["--overhead-gib", "-100"],
        ["--overhead-gib", "inf"],
        ["--tp", "0"],
        ["--gpu", "inf"],
        ["--gpu", "nan"],
        ["--gpu", "0"],
        ["--gpu", "-80"],
    ],
)
def test_cli_nonsense_values_are_usage_errors(args: list[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    result = CliRunner().invoke(app, ["fit", str(config), *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "does not fit" not in result.output and "fits" not in result.output
