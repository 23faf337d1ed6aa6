"""Distribution checks and the evaluate stage on the real SmolLM2: itself, int8, a damaged copy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qpipe.evaluate.config import EvaluateConfig
from qpipe.evaluate.evaluation import evaluate
from qpipe.evaluate.models import ModelRef
from qpipe.recipe import parse_recipe
from qpipe.stages.base import StageContext
from qpipe.stages.evaluate import EvaluateStage
from qpipe.store.local import LocalStore
from tests.conftest import TEST_CACHE
from tests.model_cache import built_once

pytestmark = pytest.mark.slow

SMALL = {"max_tokens": 1024, "window": 256, "batch_size": 2, "bootstrap_iterations": 1000}


def int8_checkpoint(source: Path) -> Path:
    """SmolLM2 with int8 per-channel weights (RTN via llm-compressor), in compressed-tensors."""

    def build(tmp: Path) -> None:
        import torch
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        modifier = QuantizationModifier(
            config_groups={"int8": {"targets": ["Linear"], "weights": weights}},
            ignore=["lm_head"],
        )
        oneshot(model=model, recipe=modifier)
        model.save_pretrained(tmp, save_compressed=True)
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp)

    return built_once(TEST_CACHE / "smollm2-135m-w8-channel", build)


def damaged_checkpoint(source: Path, out: Path) -> Path:
    """SmolLM2 with one decoder block's MLP weights scrambled (a broken quantization, say)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mlp = model.model.layers[3].mlp
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            flat = linear.weight.view(-1)
            flat.copy_(flat[torch.randperm(flat.numel(), generator=generator)])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def test_a_model_against_itself_has_zero_kld_and_full_agreement(
    smollm2_checkpoint: Path, tmp_path: Path
) -> None:
    ref = ModelRef(str(smollm2_checkpoint))
    report = evaluate(ref, ref, EvaluateConfig(**SMALL), tmp_path)
    rows = {c.name: c for c in report.comparisons}
    stats = report.distribution
    assert stats is not None and stats.kld.shape == (4, 255)
    assert np.all(stats.kld == 0)
    assert rows["kld_mean"].candidate == 0 and rows["kld_max"].candidate == 0
    assert rows["top1_agreement"].candidate == 100.0
    assert rows["perplexity"].baseline == rows["perplexity"].candidate
    assert 5 < rows["perplexity"].baseline < 100  # a real language model on wikitext
    assert all(c.verdict in ("noise", "n/a") for c in report.comparisons)
    assert report.gate.passed


def test_int8_weights_give_a_small_positive_kld(smollm2_checkpoint: Path, tmp_path: Path) -> None:
    candidate = int8_checkpoint(smollm2_checkpoint)
    assert "quantization_config" in json.loads((candidate / "config.json").read_text())
    config = EvaluateConfig(**SMALL, max_drop={"kld_mean": 0.05, "ppl_ratio": 1.05})
    report = evaluate(ModelRef(str(smollm2_checkpoint)), ModelRef(str(candidate)), config, tmp_path)
    rows = {c.name: c for c in report.comparisons}
    assert 0 < rows["kld_mean"].candidate < 0.05
    assert rows["kld_mean"].interval[0] > 0  # a real, if small, change
    assert rows["kld_mean"].candidate <= rows["kld_p99"].candidate <= rows["kld_max"].candidate
    assert 85 < rows["top1_agreement"].candidate < 100
    assert abs(rows["ppl_ratio"].candidate - 1) < 0.05
    assert report.gate.passed, report.gate.failures


def test_stage_fails_the_gate_for_a_damaged_layer(smollm2_checkpoint: Path, tmp_path: Path) -> None:
    damaged = damaged_checkpoint(smollm2_checkpoint, tmp_path / "damaged")
    recipe = parse_recipe(
        f"""
name: smollm2-damaged
model: {{source: {smollm2_checkpoint}}}
evaluate:
  max_tokens: 1024
  window: 256
  batch_size: 2
  bootstrap_iterations: 1000
  max_drop: {{kld_mean: 0.05, ppl_ratio: 1.05, top1_agreement: 10}}
"""
    )
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(
        recipe=recipe,
        recipe_dir=tmp_path,
        out_dir=out,
        inputs={"convert": smollm2_checkpoint, "quantize": damaged},
        store=LocalStore(tmp_path / "store"),
    )
    result = EvaluateStage().run(ctx)
    assert result.gate is not None and not result.gate.passed
    failed = {line.split(":")[0] for line in result.gate.failures}
    assert {"kld_mean", "ppl_ratio"} <= failed
    kld = result.metrics["kld_mean"]
    assert isinstance(kld, float) and kld > 0.05
    assert f"kld_mean: {kld:.4g} > allowed 0.05" in "\n".join(result.gate.failures)
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["gate"]["failures"] == list(result.gate.failures)
    assert len(report["distribution"]["position_kld"]) == 255
    assert sum(report["distribution"]["kld_histogram"]["counts"]) == 4 * 255
    assert "**FAILED**" in (out / "report.md").read_text()
    for plot in ("metrics.png", "kld_histogram.png", "kld_per_position.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
