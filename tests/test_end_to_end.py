"""The default recipe, trimmed for time, through every stage on the real SmolLM2 (as `make run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def trimmed_recipe(tmp_path: Path) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2-135m-int8.yaml").read_text())
    recipe["name"] = "smollm2-135m-int8-e2e"
    recipe["calibration"].update(num_samples=16, seq_len=128)
    # GSM8K through lm-eval has its own tests (test_eval_gsm8k.py); here the distribution checks
    recipe["evaluate"].update(max_tokens=2048, tasks=[])
    recipe["bench"]["profiles"] = [
        {"input_len": 32, "output_len": 16, "concurrency": 4, "num_prompts": 8}
    ]
    (tmp_path / "recipes").mkdir()
    (tmp_path / "calibration").symlink_to(REPO / "calibration")
    path = tmp_path / "recipes" / "e2e.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def qpipe(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qpipe", *args, "--store", str(store)],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def test_default_recipe_runs_every_stage_then_nothing(tmp_path: Path) -> None:
    recipe, store = trimmed_recipe(tmp_path), tmp_path / "store"
    first = qpipe("run", str(recipe), "--json", store=store)
    assert first.returncode == 0, first.stderr[-4000:]
    manifest = json.loads(first.stdout)
    stages = {s["name"]: s for s in manifest["stages"]}
    assert [s["name"] for s in manifest["stages"]] == [
        "convert", "calibrate", "quantize", "build", "evaluate", "bench", "publish"]  # fmt: skip
    assert all(s["status"] == "ran" for s in stages.values()), stages
    assert manifest["gates_failed"] == []

    quantized = json.loads((Path(stages["quantize"]["path"]) / "config.json").read_text())
    assert quantized["quantization_config"]["quant_method"] == "compressed-tensors"
    build = Path(stages["build"]["path"])
    assert {"trtllm-checkpoint", "compressed-tensors", "qpipe"} <= {p.name for p in build.iterdir()}
    assert (build / "trtllm-checkpoint" / "rank0.safetensors").is_file()
    report = json.loads((Path(stages["evaluate"]["path"]) / "report.json").read_text())
    assert "kld_mean" in json.dumps(report)
    bench = json.loads((Path(stages["bench"]["path"]) / "summary.json").read_text())
    assert bench["alias"] == "smollm2-135m-cpu-int8-tp1"  # the build's engine alias
    (profile,) = bench["profiles"].values()
    assert profile["completed"] == 8 and profile["failed"] == 0
    assert profile["total_output_tokens"] == 8 * 16

    shown = subprocess.run(
        [sys.executable, "-m", "qpipe", "registry", "show", "smollm2-135m-int8-e2e", "--json",
         "--store", str(store)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    entry = json.loads(shown.stdout)
    assert "smollm2-135m" in json.dumps(entry)

    copy = tmp_path / "ci" / "artifacts" / "manifest.json"  # a folder that is not there yet
    again = qpipe("run", str(recipe), "--json", "--manifest", str(copy), store=store)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {s["status"] for s in json.loads(again.stdout)["stages"]} == {"hit"}
    assert json.loads(copy.read_text())["stages"] == json.loads(again.stdout)["stages"]
