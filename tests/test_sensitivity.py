"""Per-block sensitivity and auto_keep_16bit on the real SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from tests.test_quantize_stage import run_stage


@pytest.fixture(scope="module")
def heldout_text(tmp_path_factory, shared_data: Path) -> Path:
    """The end of wikitext-2 (the quantize tests calibrate on its beginning)."""
    text = (shared_data / "wikitext-2" / "test.txt").read_text(encoding="utf-8")[-20000:]
    path = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.slow
def test_sensitivity_command_ranks_every_block(
    tmp_path: Path, smollm2_checkpoint: Path, heldout_text: Path
) -> None:
    import typer

    from qpipe.quant.cli import sensitivity

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: s\nmodel: {source: x}\nquantization: {method: int4-wo, group_size: 64}\n"
    )
    app = typer.Typer()
    app.command()(sensitivity)
    out = tmp_path / "sens"
    args = [str(recipe), "--text", str(heldout_text), "--out", str(out), "--num-windows", "2",
            "--seq-len", "128", "--checkpoint", str(smollm2_checkpoint)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "sensitivity.json").read_text())
    klds = [b["kld"] for b in report["blocks"]]
    assert sorted(b["block"] for b in report["blocks"]) == list(range(30))
    assert klds == sorted(klds, reverse=True) and klds[-1] > 0
    # one block alone adds less than all thirty together
    assert klds[0] < report["all_blocks_kld"]
    assert (out / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "sensitivity.md").read_text()
    assert table.count("\n| ") == 31 and f"| 1 | {report['blocks'][0]['block']} |" in table


@pytest.mark.slow
def test_auto_keep_16bit_meets_budget_on_smollm2(
    tmp_path: Path, smollm2_checkpoint: Path, heldout_text: Path
) -> None:
    quantization = (
        "{method: int4-wo, group_size: 64, auto_keep_16bit: "
        f"{{max_kld: 0.2, heldout: '{heldout_text}', num_windows: 2, seq_len: 128}}}}"
    )
    out, record, result = run_stage(tmp_path, smollm2_checkpoint, None, quantization)
    auto = record["auto_keep_16bit"]
    assert auto["trials"]["0"] > 0.2, "the budget should need some blocks in 16-bit"
    assert auto["blocks"] and auto["met_budget"]
    assert record["probe"]["source"] == "held-out text heldout.txt"
    # RTN int4 is both the proxy and the real method here: the choice must hold on the real output
    assert auto["measured_kld"] == pytest.approx(auto["proxy_kld"], rel=0.1)
    assert result.gate.passed == (auto["measured_kld"] <= 0.2)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        for block in auto["blocks"]:
            assert handle.get_tensor(f"model.layers.{block}.mlp.up_proj.weight").dtype in (
                torch.float32,
                torch.bfloat16,
            )
    assert len(record["layers_16bit"]) == 1 + 7 * len(auto["blocks"])
