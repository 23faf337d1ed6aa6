"""`qpipe eval` as a user runs it: JSON on stdout, reports on disk, exit codes with a meaning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qpipe.evaluate.cli import eval_command

app = typer.Typer()
app.command()(eval_command)
FAST = ["--max-tokens", "256", "--window", "128"]


@pytest.fixture(scope="module")
def perturbed_tiny(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("perturbed-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint)
    with torch.no_grad():
        weight = model.model.layers[0].mlp.down_proj.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_checkpoint).save_pretrained(out)
    return out


@pytest.mark.slow
def test_json_lists_every_metric_with_its_interval(
    tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    tiny = str(tiny_llama_checkpoint)
    result = CliRunner().invoke(
        app, ["--baseline", tiny, "--candidate", tiny, *FAST, "--json", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {row["name"]: row for row in data["metrics"]}
    assert set(rows) == {
        "perplexity",
        "ppl_ratio",
        "kld_mean",
        "kld_p99",
        "kld_max",
        "top1_agreement",
    }
    assert rows["kld_mean"]["candidate"] == 0.0 and rows["kld_mean"]["interval"] == [0.0, 0.0]
    assert set(rows["top1_agreement"]) >= {"baseline", "candidate", "drop", "interval", "p_value"}
    assert json.loads((tmp_path / "report.json").read_text())["metrics"] == data["metrics"]


@pytest.mark.slow
def test_a_failing_gate_exits_1_with_the_numbers(
    tiny_llama_checkpoint: Path, perturbed_tiny: Path, tmp_path: Path
) -> None:
    args = ["--baseline", str(tiny_llama_checkpoint), "--candidate", str(perturbed_tiny), *FAST]
    result = CliRunner().invoke(
        app, [*args, "--max-drop", "kld_mean=0.0001", "--out", str(tmp_path)]
    )
    assert result.exit_code == 1, result.output
    assert "gate failed: kld_mean:" in result.output
    assert "> allowed 0.0001" in result.output


def test_bad_inputs_say_what_to_fix(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    tiny = str(tiny_llama_checkpoint)
    result = CliRunner().invoke(
        app, ["--baseline", tiny, "--candidate", tiny, "--max-drop", "kld=0.1"]
    )
    assert result.exit_code == 2
    assert "unknown gate 'kld'" in result.output and "kld_mean" in result.output
    result = CliRunner().invoke(app, ["--baseline", str(tmp_path), "--candidate", tiny])
    assert result.exit_code == 2
    assert "not an HF checkpoint directory" in result.output


def test_a_checkpoint_without_weights_is_named(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    candidate = tmp_path / "no-weights"
    candidate.mkdir()
    (candidate / "config.json").write_bytes((tiny_llama_checkpoint / "config.json").read_bytes())
    result = CliRunner().invoke(
        app,
        ["--baseline", str(tiny_llama_checkpoint), "--candidate", str(candidate),
         "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"{candidate}: has config.json but no weight files (*.safetensors" in result.output
