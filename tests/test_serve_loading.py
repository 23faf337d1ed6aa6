"""What `qpipe serve` and the engine say about a model they cannot serve as asked: one `error:` line
naming the file, tensor or flag and the fix, never a traceback, a quietly changed setting or a
silently wrong model."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qpipe.cli import app
from qpipe.serve import ARTIFACT_FORMAT_VERSION, http_server
from qpipe.serve.artifact import ARTIFACT_MARKER, ArtifactWeights
from qpipe.serve.cli import in_flags
from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine


def linked_copy(checkpoint: Path, into: Path) -> Path:
    """`checkpoint`'s files linked into a fresh directory, config.json copied (to be edited)."""
    into.mkdir()
    for file in checkpoint.iterdir():
        if file.name == "config.json":
            (into / file.name).write_text(file.read_text())
        else:
            (into / file.name).symlink_to(file)
    return into


def edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config | changes))

    return edit


def replace_weights(data: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        weights = model / "model.safetensors"
        whole = weights.read_bytes()
        weights.unlink()
        weights.write_bytes(data(whole))

    return edit


def truncate_config(model: Path) -> None:
    config = model / "config.json"
    config.write_text(config.read_text()[:100])


def remove(name: str) -> Callable[[Path], None]:
    return lambda model: (model / name).unlink()


def unchanged(model: Path) -> None:
    pass


def started(*args: object) -> None:
    raise AssertionError("the server started")


@pytest.mark.parametrize(
    ("damage", "flags", "message"),
    [
        (replace_weights(lambda whole: whole[: len(whole) // 2]), [],
         r"model\.safetensors is not a readable safetensors file \(.*\); copy the checkpoint "
         r"again"),
        (replace_weights(lambda whole: b"\xff" * 4096), [],
         r"model\.safetensors is not a readable safetensors file \(.*header too large\)"),
        (remove("config.json"), [], r"no config\.json; is this a checkpoint directory\?"),
        (lambda model: (model / "config.json").write_text("[]"), [],
         r"config\.json holds a list, not an object; copy the checkpoint again"),
        (remove("model.safetensors"), [], r"no \*\.safetensors files"),
        (truncate_config, [], r"config\.json is not valid JSON \(.*\); copy the checkpoint again"),
        (edit_config(num_key_value_heads=4), [],
         r"config\.json says num_key_value_heads=4 x head_dim=16 = 64 rows but \S+"
         r"model\.safetensors holds \[32, 64\] for model\.layers\.\d\.self_attn\.[kv]_proj\.weight"
         r": config\.json belongs to another model"),
        (edit_config(num_hidden_layers=3), [],
         r"config\.json says num_hidden_layers=3 but \S+model\.safetensors holds layers 0-1 "
         r"\(model\.layers\.2\.\* is missing\)"),
        (edit_config(vocab_size=50000), [],
         r"vocab_size=50000 rows but \S+ holds \[49152, 64\] for model\.embed_tokens"),
        (edit_config(tie_word_embeddings=False), [],
         r"tie_word_embeddings=false but the weights hold no lm_head\.weight"),
        (unchanged, ["--kv-cache-memory", "inf"],
         r"--kv-cache-memory must be a finite number > 0, got inf"),
        (unchanged, ["--block-size", "7"], r"^error: --block-size must be a power of two, got 7"),
        (unchanged, ["--max-model-len", "3000"],
         r"^error: --max-model-len=3000 exceeds the checkpoint's max_position_embeddings=2048"),
    ],
    ids=[
        "truncated-weights", "random-bytes", "no-config", "config-not-an-object", "no-weights",
        "truncated-config",
        "kv-heads-edited", "layers-edited", "vocab-edited", "untied-without-lm-head",
        "kv-cache-memory-inf", "block-size-7", "max-model-len-past-the-checkpoint",
    ],
)  # fmt: skip
def test_a_model_that_cannot_be_served_is_one_error_line(
    tiny_llama_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: Callable[[Path], None],
    flags: list[str],
    message: str,
) -> None:
    model = linked_copy(tiny_llama_checkpoint, tmp_path / "model")
    damage(model)
    monkeypatch.setattr(http_server, "DrainingServer", started)  # a regression fails, not serves
    result = CliRunner().invoke(app, ["serve", str(model), "--dtype", "float32", *flags])
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 1
    assert re.search(message, result.output, re.MULTILINE), result.output


def test_a_port_out_of_range_is_refused_before_the_model_loads(
    tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "DrainingServer", started)
    result = CliRunner().invoke(app, ["serve", str(tiny_llama_checkpoint), "--port", "99999"])
    assert result.exit_code == 2, result.output
    assert "--port" in result.output and "65535" in result.output


def test_a_damaged_artifact_says_to_rebuild_it(tmp_path: Path) -> None:
    marker = {"format_version": ARTIFACT_FORMAT_VERSION, "dtype": "float32", "linears": {}}
    (tmp_path / ARTIFACT_MARKER).write_text(json.dumps(marker))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable .*; rebuild the"):
        ArtifactWeights(tmp_path, torch.float32, torch.device("cpu"))


def tiny_engine(checkpoint: Path, **config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", **config))


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_and_the_default_is_capped(
    tiny_llama_checkpoint: Path,
) -> None:
    with pytest.raises(
        ValueError, match=r"max_model_len=128 but the KV cache holds 64 tokens"
    ) as e:
        tiny_engine(tiny_llama_checkpoint, num_kv_blocks=4, max_model_len=128)
    assert "lower --max-model-len" in in_flags(str(e.value))  # as `qpipe serve` says it
    assert tiny_engine(tiny_llama_checkpoint, num_kv_blocks=4).max_model_len == 64


def test_max_concurrency_counts_whole_blocks_per_request(
    tiny_llama_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="qpipe.serve.model_runner"):
        # 300 tokens take 2 blocks of 256: 2 such requests fit in 5 blocks, not 1280 / 300
        tiny_engine(tiny_llama_checkpoint, num_kv_blocks=5, block_size=256, max_model_len=300)
    assert "max concurrency at max_model_len 300: 2;" in caplog.text


def test_an_fp8_kv_cache_without_calibrated_scales_is_warned_about(
    tiny_llama_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="qpipe.serve.model_runner"):
        tiny_engine(tiny_llama_checkpoint, num_kv_blocks=8)
        assert "KV scales" not in caplog.text
        tiny_engine(tiny_llama_checkpoint, num_kv_blocks=8, kv_cache_dtype="fp8")
    assert "--kv-cache-dtype fp8 but the checkpoint calibrated no KV scales" in caplog.text
