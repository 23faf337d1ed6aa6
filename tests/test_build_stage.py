"""The build stage end to end on a quantized tiny Llama: every target, build.json, keys and alias,
the trtllm-build invocation (a test executable on PATH records its argv) and the refusals when the
engine toolchain or GPU is missing."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from qpipe import gpu
from qpipe.export.alias import engine_alias
from qpipe.export.config import BuildConfig
from qpipe.recipe import RecipeError, parse_recipe
from qpipe.stages.base import NotAvailable, StageContext
from qpipe.stages.build import BuildStage
from qpipe.store.entry import MARKER
from qpipe.store.local import LocalStore

FAKE_TRTLLM_BUILD = """#!{python}
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output_dir") + 1])
out.mkdir(parents=True, exist_ok=True)
(out / "argv.json").write_text(json.dumps(sys.argv))
for rank in range(int(args[args.index("--workers") + 1])):
    (out / f"rank{{rank}}.engine").write_bytes(b"engine")
(out / "config.json").write_text("{{}}")
"""


def recipe_text(targets: str, arch: str = "auto", tp: int = 1) -> str:
    return f"""
name: tiny-int8
model: {{source: dir:x, name: tiny-llama, dtype: float32}}
quantization: {{method: int8-sq}}
calibration: {{dataset: data.jsonl}}
build:
  targets: [{targets}]
  arch: {arch}
  tp: {tp}
  trtllm: {{max_batch_size: 8, max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
"""


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory: pytest.TempPathFactory, tiny_llama_checkpoint: Path) -> Path:
    """tiny_llama as the quantize stage leaves it in the store: int8 W8A8 compressed-tensors,
    tokenizer, and the store's commit marker."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("quantize")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W8A8",
                                                     ignore=["lm_head"]))  # fmt: skip
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(tiny_llama_checkpoint).save_pretrained(out)
    (out / "qpipe_quant.json").write_text(json.dumps({"method": "int8-sq"}))
    (out / MARKER).write_text(json.dumps({"key": "0" * 64, "stage": "quantize", "files": {}}))
    return out


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "detect_arch", lambda: gpu.NO_GPU)


def run_build(tmp_path: Path, text: str, quantized: Path) -> tuple:
    recipe = parse_recipe(text)
    out = tmp_path / "out"
    out.mkdir()
    store = LocalStore(tmp_path / "store")
    ctx = StageContext(recipe=recipe, recipe_dir=tmp_path, out_dir=out,
                       inputs={"quantize": quantized}, store=store)  # fmt: skip
    return BuildStage().run(ctx), out


def test_all_targets_without_engine_toolchain(
    tmp_path: Path, quantized_tiny: Path, no_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    text = recipe_text("trtllm-engine, compressed-tensors, qpipe, trtllm-checkpoint")
    result, out = run_build(tmp_path, text, quantized_tiny)
    info = json.loads((out / "build.json").read_text())
    targets = info["targets"]
    assert [t["status"] for t in targets.values()] == ["built", "failed", "built", "built"]
    assert list(targets) == ["trtllm-checkpoint", "trtllm-engine", "compressed-tensors", "qpipe"]
    # The engine is refused with what is missing and how to get it; no engine file exists.
    reason = targets["trtllm-engine"]["reason"]
    assert "no NVIDIA GPU" in reason and "trtllm-build is not on PATH" in reason
    assert "tensorrt_llm==1.2.*" in reason
    assert not list(out.rglob("*.engine"))
    assert result.gate is not None and not result.gate.passed
    assert result.gate.failures == (f"trtllm-engine: {reason}",)
    # The checkpoint is still produced.
    assert targets["trtllm-checkpoint"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert (out / "trtllm-checkpoint" / "rank0.safetensors").is_file()
    assert (info["arch"], info["tp"], info["quant"], info["alias"]) == (
        "none",
        1,
        "int8",
        "tiny-llama-cpu-int8-tp1",
    )
    assert result.metrics["alias"] == info["alias"]
    built = result.aliases[info["alias"]]["targets"]  # the alias lists only what was built
    assert "trtllm-checkpoint" in built and "trtllm-engine" not in built
    assert result.metrics["compressed-tensors_mib"] > 0
    # qpipe target: the built-in server's artifact.
    assert json.loads((out / "qpipe" / "qpipe_artifact.json").read_text())["format_version"] == 1


def test_compressed_tensors_target_loads_and_generates(
    tmp_path: Path, quantized_tiny: Path, no_gpu: None
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = run_build(tmp_path, recipe_text("compressed-tensors"), quantized_tiny)
    package = out / "compressed-tensors"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (package / name).is_file(), name
    assert json.loads((package / "config.json").read_text())["quantization_config"]
    assert not (package / MARKER).exists()  # the store's marker describes its entry, not the model
    # Hard links when the store shares the filesystem: packaging copies nothing.
    assert (package / "model.safetensors").stat().st_ino == (
        quantized_tiny / "model.safetensors").stat().st_ino  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(package)
    model = AutoModelForCausalLM.from_pretrained(package)
    assert model.model.layers[0].self_attn.q_proj.weight_scale.numel() > 0  # quantized layers
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)


def test_trtllm_build_invocation(
    tmp_path: Path, quantized_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "trtllm-build"
    script.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu, "detect_arch", lambda: "sm80")
    result, out = run_build(tmp_path, recipe_text("trtllm-engine", arch="sm80", tp=2),
                            quantized_tiny)  # fmt: skip
    engine = out / "trtllm-engine"
    argv = json.loads((engine / "argv.json").read_text())
    assert argv == [
        str(script),
        "--checkpoint_dir", str(out / "trtllm-checkpoint"),
        "--output_dir", str(engine),
        "--max_batch_size", "8",
        "--max_input_len", "256",
        "--max_seq_len", "512",
        "--max_num_tokens", "1024",
        "--gemm_plugin", "auto",
        "--paged_kv_cache", "enable",
        "--use_paged_context_fmha", "enable",
        "--workers", "2",
        "--output_timing_cache", str(engine / "timing.cache"),
    ]  # fmt: skip
    info = json.loads((out / "build.json").read_text())
    assert info["targets"]["trtllm-engine"]["engines"] == ["rank0.engine", "rank1.engine"]
    assert info["alias"] == "tiny-llama-sm80-int8-tp2"
    assert result.gate is None
    ranks = sorted(p.name for p in (out / "trtllm-checkpoint").glob("rank*.safetensors"))
    assert ranks == ["rank0.safetensors", "rank1.safetensors"]


def test_engine_blockers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from qpipe.export import trtllm_engine

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtllm-build").write_text("#!/bin/sh\n")
    (bin_dir / "trtllm-build").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(gpu, "detect_arch", lambda: "sm90")
    monkeypatch.setattr(trtllm_engine, "distribution_version", lambda *names: "1.3.0rc1")
    problems, toolchain = trtllm_engine.engine_blockers("sm80")
    assert toolchain is None
    assert len(problems) == 2
    assert "build.arch is sm80 but this machine's GPU is sm90" in problems[0]
    assert "tensorrt_llm 1.3.0rc1 has no engine builder" in problems[1]
    monkeypatch.setattr(trtllm_engine, "distribution_version", lambda *names: "1.2.0")
    problems, toolchain = trtllm_engine.engine_blockers("sm90")
    assert problems == [] and toolchain is not None
    assert toolchain.executable == str(bin_dir / "trtllm-build")


def test_key_extras_and_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = BuildStage()
    monkeypatch.setattr(gpu, "detect_arch", lambda: "sm86")
    auto = parse_recipe(recipe_text("compressed-tensors", tp=4))
    extras = stage.key_extras(auto)
    assert (extras["arch"], extras["tp"], extras["pp"], extras["quant"]) == (
        "sm86",
        "4",
        "1",
        "int8",
    )
    assert {"tensorrt_llm", "tensorrt", "cuda"} <= set(extras) and "trtllm_build" not in extras
    pinned = parse_recipe(recipe_text("trtllm-engine", arch="sm90", tp=4))
    assert stage.key_extras(pinned)["arch"] == "sm90"
    assert "trtllm_build" in stage.key_extras(pinned)
    assert engine_alias(pinned, "sm90") == "tiny-llama-sm90-int8-tp4"
    base = "name: llama3-70b\nmodel: {source: dir:x, dtype: bfloat16}\n"
    for quant, name in [
        ("{method: none}", "bf16"),
        ("{method: awq}", "awq"),
        ("{method: gptq, bits: 8}", "gptq-w8"),
        ("{method: int4-wo}", "int4-wo"),
        ("{method: int8-sq, kv_cache: fp8}", "int8-fp8kv"),
        ("{method: none, kv_cache: fp8}", "bf16-fp8kv"),
        ("{method: awq, kv_cache: fp8-head}", "awq-fp8kv"),  # per-head scales: the same engine
    ]:
        recipe = parse_recipe(base + f"quantization: {quant}\ncalibration: {{dataset: d}}\n"
                              "build: {tp: 4, pp: 2}\n")  # fmt: skip
        assert engine_alias(recipe, "sm80") == f"llama3-70b-sm80-{name}-tp4-pp2"


def test_formats_without_trtllm_layout_are_refused_at_plan_time() -> None:
    base = "name: x\nmodel: {source: dir:x}\ncalibration: {dataset: d}\n"
    fp8 = parse_recipe(base + "quantization: {method: fp8, activations: dynamic}\n"
                       "build: {targets: [trtllm-checkpoint, qpipe]}\n")  # fmt: skip
    with pytest.raises(NotAvailable, match="activations: static"):
        BuildStage().check_available(fp8)
    gptq8 = parse_recipe(base + "quantization: {method: gptq, bits: 8, group_size: 128}\n"
                         "build: {targets: [trtllm-engine]}\n")  # fmt: skip
    with pytest.raises(NotAvailable, match="per channel"):
        BuildStage().check_available(gptq8)
    # The SmoothQuant plugin quantizes every decoder layer: a layer kept 16-bit has no place.
    kept = r"keep_16bit: [lm_head, 're:model\.layers\.0\..*']"
    sq = parse_recipe(base + f"quantization: {{method: int8-sq, {kept}}}\n"
                      "build: {targets: [trtllm-checkpoint]}\n")  # fmt: skip
    with pytest.raises(NotAvailable, match=r"(?s)re:model.*activations: static"):
        BuildStage().check_available(sq)
    static = sq.quantization.model_copy(update={"activations": "static"})
    BuildStage().check_available(sq.model_copy(update={"quantization": static}))
    # Without a TensorRT-LLM target the same quantization builds.
    BuildStage().check_available(fp8.model_copy(update={"build": BuildConfig()}))


def test_gpu_arch_detection(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert gpu.arch_from_compute_capability("8.9") == "sm89"
    assert gpu.arch_from_compute_capability("12.0") == "sm120"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 9.0\necho 8.0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    gpu.detect_arch.cache_clear()
    try:
        assert gpu.detect_arch() == "sm90"  # GPU 0, the one trtllm-build uses
        smi.unlink()
        gpu.detect_arch.cache_clear()
        expected = gpu._from_torch() or gpu.NO_GPU
        assert gpu.detect_arch() == expected
    finally:
        gpu.detect_arch.cache_clear()
    with pytest.raises(RecipeError, match="not 'auto' or an sm name"):
        parse_recipe(recipe_text("qpipe", arch="ampere"))
