"""The evaluate section and its gates: valid names, and failures that carry the numbers."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qpipe.cli import app
from qpipe.evaluate.config import EvaluateConfig
from qpipe.evaluate.gates import check_gates
from qpipe.evaluate.significance import Comparison
from qpipe.recipe import Recipe, RecipeError, parse_recipe

RECIPE = """\
name: smollm2-eval
model: {{source: /models/smollm2}}
evaluate:
  tasks: [gsm8k]
  max_drop:
{gates}
"""


def recipe_with(gates: str) -> Recipe:
    return parse_recipe(RECIPE.format(gates=gates), "r.yaml")


def test_task_shorthand_and_known_gates_validate() -> None:
    recipe = recipe_with("    gsm8k: 1.0\n    gsm8k/strict-match: 2\n    kld_mean: 0.05\n")
    assert recipe.evaluate is not None
    assert recipe.evaluate.tasks[0].name == "gsm8k"
    assert recipe.evaluate.max_drop == {"gsm8k": 1.0, "gsm8k/strict-match": 2.0, "kld_mean": 0.05}


def test_unknown_gate_names_the_valid_ones_and_the_line() -> None:
    with pytest.raises(RecipeError) as info:
        recipe_with("    kld_mean: 0.05\n    kl_mean: 0.05\n")
    message = str(info.value)
    assert message.startswith("r.yaml:")
    assert "unknown gate 'kl_mean'" in message
    for valid in ("kld_mean", "kld_p99", "ppl_ratio", "top1_agreement", "gsm8k"):
        assert valid in message


def test_gate_for_a_task_that_does_not_run_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown gate 'arc_easy'"):
        EvaluateConfig(max_drop={"arc_easy": 1.0})
    with pytest.raises(ValueError, match="ppl_ratio is candidate/baseline"):
        EvaluateConfig(max_drop={"ppl_ratio": 0.95})
    with pytest.raises(ValueError, match="data_files or config, not both"):
        EvaluateConfig(tasks=[{"name": "x", "data_files": {"test": "a.jsonl"}, "config": "t.yaml"}])


def test_max_tokens_below_one_window_is_refused_where_it_is_set() -> None:
    """A budget under one window scores nothing: a recipe error at its line, not a failure that
    blames the text after quantize has run."""
    text = "name: smollm2-eval\nmodel: {source: /models/smollm2}\nevaluate:\n  max_tokens: 100\n"
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "r.yaml")
    message = str(info.value)
    assert message.startswith("r.yaml:4 evaluate.max_tokens: max_tokens (100) is less than one")
    assert "use max_tokens 512 or more" in message
    assert parse_recipe(text + "  window: 64\n").evaluate is not None
    assert EvaluateConfig(max_tokens=0).max_tokens == 0  # 0 turns the checks off
    result = CliRunner().invoke(app, ["eval", "--baseline", "b", "--candidate", "c",
                                      "--max-tokens", "256"])  # fmt: skip
    assert result.exit_code == 2
    assert "max_tokens (256) is less than one window" in " ".join(result.output.split())


def _rows() -> list[Comparison]:
    return [
        Comparison("ppl_ratio", 1.0, 1.08, 0.08, (0.05, 0.11), 0.001),
        Comparison("kld_mean", 0.0, 0.02, 0.02, (0.01, 0.03), 0.001),
        Comparison("gsm8k/exact_match,strict-match", 40.0, 37.0, 3.0, (1.0, 5.0), 0.01),
        Comparison("gsm8k/exact_match,flexible-extract", 42.0, 41.5, 0.5, (-1.0, 2.0), 0.7),
    ]


def test_gates_compare_what_the_config_says() -> None:
    verdict = check_gates({"kld_mean": 0.05, "ppl_ratio": 1.1}, _rows())
    assert verdict.passed
    assert verdict.checked == {"kld_mean": 0.02, "ppl_ratio": 1.08}

    verdict = check_gates({"ppl_ratio": 1.05, "gsm8k": 1.0, "gsm8k/flexible-extract": 1.0}, _rows())
    assert not verdict.passed
    assert len(verdict.failures) == 2  # ppl_ratio, and gsm8k's strict-match metric only
    assert verdict.failures[0].startswith("ppl_ratio: 1.08 > allowed 1.05")
    assert "gsm8k/exact_match,strict-match: 3 > allowed 1" in verdict.failures[1]
    assert "baseline 40, candidate 37" in verdict.failures[1]


def test_a_gate_never_measured_fails() -> None:
    verdict = check_gates({"kld_mean": 0.05}, _rows()[2:])
    assert not verdict.passed
    assert "kld_mean: not measured" in verdict.failures[0]
