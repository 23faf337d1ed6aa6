"""Quantization recipe validation, group-size checks, method -> scheme mapping, the CPU shim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from qpipe.quant.config import QuantizationConfig
from qpipe.quant.group_size import GroupSizeError, check_group_size
from qpipe.quant.schemes import kv_cache_args
from qpipe.recipe import RecipeError, parse_recipe


def test_parameter_of_another_method_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="bits is a parameter of gptq, not of method 'awq'"):
        QuantizationConfig(method="awq", bits=8)
    with pytest.raises(ValidationError, match="smoothquant_alpha is a parameter of int8-sq"):
        QuantizationConfig(method="fp8", smoothquant_alpha=0.8)
    with pytest.raises(ValidationError, match="multiple of 8"):
        QuantizationConfig(method="gptq", group_size=100)
    with pytest.raises(ValidationError, match="not a valid regex"):
        QuantizationConfig(method="int8-wo", keep_16bit=["re:model.layers.(0"])


def test_recipe_error_points_at_the_quantization_line() -> None:
    text = "name: t\nmodel: {source: x}\nquantization:\n  method: int4-wo\n  act_order: true\n"
    with pytest.raises(RecipeError) as error:
        parse_recipe(text, "r.yaml")
    assert "r.yaml:" in str(error.value) and "act_order is a parameter of gptq" in str(error.value)


def test_method_defaults_resolve() -> None:
    assert QuantizationConfig(method="awq").parameters == {"group_size": 128, "symmetric": False}
    gptq8 = QuantizationConfig(method="gptq", bits=8)
    assert gptq8.parameters["bits"] == 8 and gptq8.parameters["group_size"] is None
    assert QuantizationConfig(method="fp8").method_calibrates is False
    assert QuantizationConfig(method="fp8", activations="static").method_calibrates is True
    auto = QuantizationConfig(method="int4-wo", auto_keep_16bit={"max_kld": 0.1})
    assert auto.needs_calibration and not auto.method_calibrates


def test_an_fp8_kv_cache_calibrates_with_any_method() -> None:
    """Its scales come from activations, so even 16-bit weights need the calibration set; int8
    K/V is not offered (no engine here reads it)."""
    kv_only = QuantizationConfig(kv_cache="fp8")
    assert kv_only.quantizes and kv_only.method_calibrates
    assert not QuantizationConfig().quantizes
    assert QuantizationConfig(method="int4-wo", kv_cache="fp8").method_calibrates
    with pytest.raises(RecipeError, match="method 'none' with kv_cache 'fp8' needs a calibration"):
        parse_recipe("name: t\nmodel: {source: x}\nquantization: {kv_cache: fp8}\n")
    with pytest.raises(RecipeError, match="kv_cache: Input should be 'none', 'fp8' or 'fp8-head'"):
        parse_recipe("name: t\nmodel: {source: x}\nquantization: {kv_cache: int8}\n")
    per_head = QuantizationConfig(method="int8-sq", kv_cache="fp8-head")
    assert per_head.method_calibrates
    assert [kv_cache_args(QuantizationConfig(kv_cache=kv)).strategy for kv in ("fp8", "fp8-head")] \
        == ["tensor", "attn_head"]  # fmt: skip
    assert kv_cache_args(QuantizationConfig()) is None


def test_group_size_check_names_layer_field_and_fix(smollm2_checkpoint: Path) -> None:
    with pytest.raises(GroupSizeError) as error:
        check_group_size(smollm2_checkpoint, QuantizationConfig(method="awq"))  # default 128
    message = str(error.value)
    assert message.startswith("quantization.group_size: 128 does not divide hidden_size 576 of")
    assert "model.layers.*.self_attn.q_proj" in message and "use 64 or 32" in message
    check_group_size(smollm2_checkpoint, QuantizationConfig(method="gptq", group_size=64))
    check_group_size(smollm2_checkpoint, QuantizationConfig(method="gptq", bits=8))


def test_group_size_check_honours_keep_16bit() -> None:
    config = {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
    }
    quant = QuantizationConfig(method="gptq", group_size=64)
    with pytest.raises(GroupSizeError, match="intermediate_size 1376 of model.layers.*.mlp.down"):
        check_group_size(config, quant)
    kept = QuantizationConfig(
        method="gptq", group_size=64, keep_16bit=["lm_head", r"re:.*mlp\.down_proj"]
    )
    check_group_size(config, kept)


def test_schemes_follow_the_recipe() -> None:
    from qpipe.quant.schemes import modifiers, quantization_scheme

    awq = quantization_scheme(QuantizationConfig(method="awq", group_size=64))
    assert (awq.weights.num_bits, awq.weights.group_size, awq.weights.symmetric) == (4, 64, False)
    assert awq.input_activations is None
    sq = quantization_scheme(QuantizationConfig(method="int8-sq", activations="static"))
    assert sq.weights.strategy == "channel" and sq.input_activations.strategy == "tensor"
    assert sq.input_activations.dynamic is False
    fp8 = quantization_scheme(QuantizationConfig(method="fp8", weights="per-tensor"))
    assert fp8.weights.type == "float" and fp8.weights.strategy == "tensor"
    assert fp8.input_activations.strategy == "token" and fp8.input_activations.dynamic is True
    recipe = modifiers(QuantizationConfig(method="int8-sq", smoothquant_alpha=0.7), ["lm_head"])
    assert [type(m).__name__ for m in recipe] == ["SmoothQuantModifier", "QuantizationModifier"]
    assert recipe[0].smoothing_strength == 0.7 and recipe[1].ignore == ["lm_head"]
    gptq = modifiers(QuantizationConfig(method="gptq", act_order=True, dampening=0.05), [])[0]
    assert gptq.dampening_frac == 0.05 and gptq.actorder == "static"


def test_cpu_pinning_shim_is_scoped() -> None:
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    from qpipe.quant.compat import cpu_safe_pinning

    if torch.accelerator.is_available():
        pytest.skip("the shim only acts on machines without an accelerator")
    original = IntermediatesCache.pin_memory
    cache = IntermediatesCache.empty(1, torch.device("cpu"))
    cache.update(0, {"hidden": torch.ones(2)})
    with pytest.raises(RuntimeError, match="accelerator"):
        cache.pin_memory(0)  # upstream behaviour the shim exists for
    with cpu_safe_pinning() as patched:
        assert patched
        cache.pin_memory(0)
        assert torch.equal(cache.fetch(0)["hidden"], torch.ones(2))
    assert IntermediatesCache.pin_memory is original


def test_sensitivity_choice_is_the_fewest_blocks(tiny_llama_checkpoint: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from qpipe.quant.divergence import log_probs
    from qpipe.quant.schemes import quantization_scheme
    from qpipe.quant.sensitivity import block_linears, choose_blocks_to_keep, rank_blocks

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint).eval()
    windows = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = log_probs(model, windows)
    scheme = quantization_scheme(QuantizationConfig(method="int4-wo", group_size=32))
    blocks = block_linears(model, ["lm_head", r"re:.*\.1\.mlp\.down_proj"])
    assert sorted(blocks) == [0, 1] and len(blocks[0]) == 7 and len(blocks[1]) == 6
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    ranked = rank_blocks(model, scheme, windows, reference, blocks)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # restored
    assert ranked[0].kld >= ranked[1].kld > 0
    loose = choose_blocks_to_keep(model, scheme, windows, reference, blocks, ranked, 10.0)
    assert loose.blocks == [] and loose.met_budget
    all_kld = loose.trials[0]
    assert all_kld > ranked[0].kld
    # Between "only the less sensitive block quantized" and "both": keeping the top one suffices.
    budget = (all_kld + ranked[1].kld) / 2
    one = choose_blocks_to_keep(model, scheme, windows, reference, blocks, ranked, budget)
    assert one.blocks == [ranked[0].block] and one.met_budget
    assert one.proxy_kld == pytest.approx(ranked[1].kld)
    assert one.keep_patterns == [rf"re:.*layers\.{ranked[0].block}\..*"]
    json.dumps(one.trials)  # recorded in qpipe_quant.json
