"""The Llama-family variants the engine reads from config.json beyond Llama itself: Qwen2 (q/k/v
biases) and Mistral (a sliding attention window, which caps the context the engine serves), each
against transformers' greedy output on a tiny random checkpoint; and the profiling step that
sizes the KV cache when the context is shorter than one step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams

PROMPTS = ["Hello world, this is a test of", "abc", "The capital of France is"]


def save_tiny(kind: str, tokenizer_dir: Path, out: Path, **extra: object) -> PreTrainedModel:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, **extra,
    )  # fmt: skip
    model = model_cls(config).eval()
    if kind == "qwen2":  # zero-initialised biases would not show whether they are applied
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_variant_greedy_equals_transformers(
    kind: str, tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    extra = {"sliding_window": None} if kind == "mistral" else {}
    model = save_tiny(kind, tiny_llama_checkpoint, tmp_path / kind, **extra)
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path / kind), dtype="float32", kv_cache_memory_gib=0.01)
    )
    prompts = [engine.tokenizer(text).input_ids for text in PROMPTS]
    got = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    with torch.no_grad():
        expected = [
            model.generate(
                torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    assert got == expected
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_sliding_window_caps_the_context(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    save_tiny("mistral", tiny_llama_checkpoint, tmp_path / "m", sliding_window=48)
    config = EngineConfig(model=str(tmp_path / "m"), dtype="float32", kv_cache_memory_gib=0.01)
    engine = LLMEngine(config)
    assert engine.max_model_len == 48
    with pytest.raises(ValueError, match="prompt has 50 tokens but max_model_len is 48"):
        engine.add_request("long", list(range(100, 150)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="sliding_window=48"):
        LLMEngine(EngineConfig(**{**config.__dict__, "max_model_len": 64}))


def test_profiling_step_splits_into_prompts_that_fit_the_context(
    tiny_llama_checkpoint: Path,
) -> None:
    """With max_model_len below max_num_batched_tokens, the step that measures activation memory
    is several prompts, each within the rotary table: 100 tokens as 40 + 40 + 20, so its last
    logits are those of a fresh 20-token prompt (its tokens are its positions). It runs through
    the step's own attention path: the C++ kernel where it is built."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_checkpoint),
            dtype="float32",
            max_model_len=40,
            max_num_batched_tokens=100,
            kv_cache_memory_gib=0.01,
        )  # fmt: skip
    )
    logits = engine.model_runner.profile_forward(40)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.arange(20)[None]).logits[0, -1:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
