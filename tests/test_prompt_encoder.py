"""Prompts encoded off the event loop: the tokenizer's own ids, batched, the loop free meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qpipe.serve.prompt_encoder import PromptEncoder

TEXTS = [
    "Hello world",
    " a leading space",
    "<|im_start|>user\nspecial tokens in the text<|im_end|>",
    "Grüße 🦙 日本語",
    "",
    "word " * 300,
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_checkpoint)


class EncodeOnly:
    """A tokenizer with no `tokenizers` backend: only `encode`, which refuses texts with "boom"."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "boom" in text:
            raise ValueError(f"cannot encode {text!r}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("in_worker", [True, False])
@pytest.mark.parametrize("kind", ["fast", "encode-only"])
def test_gathered_prompts_get_the_tokenizers_own_ids(
    kind: str, in_worker: bool, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Both flags in one batch, in the order sent; SmolLM2's template adds no BOS, so the flag is
    checked on a tokenizer told to add one."""
    tokenizer.add_bos_token = True
    try:
        encoder = PromptEncoder(tokenizer if kind == "fast" else EncodeOnly(tokenizer), in_worker)
        flags = [i % 2 == 0 for i in range(len(TEXTS) * 2)]

        async def gathered() -> list[list[int]]:
            calls = [
                encoder.encode(text, flag) for text, flag in zip(TEXTS * 2, flags, strict=True)
            ]
            return await asyncio.gather(*calls)

        got = asyncio.run(gathered())
        want = [
            tokenizer.encode(t, add_special_tokens=f) for t, f in zip(TEXTS * 2, flags, strict=True)
        ]
        assert got == want
        assert got[0][0] == tokenizer.bos_token_id and got[1][0] != tokenizer.bos_token_id
    finally:
        tokenizer.add_bos_token = False


def test_the_loop_runs_while_a_prompt_encodes(tokenizer: PreTrainedTokenizerBase) -> None:
    """A prompt that takes ~0.4 s to encode: the loop keeps its 5 ms ticks meanwhile."""
    encoder = PromptEncoder(tokenizer, in_worker=True)
    text = "Grüße 🦙 naïve café, and some words. " * 12000

    async def ticks_while_encoding() -> tuple[int, float, int]:
        ticks = 0
        task = asyncio.ensure_future(encoder.encode(text))
        start = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.005)
            ticks += 1
        return ticks, time.perf_counter() - start, len(task.result())

    ticks, seconds, count = asyncio.run(ticks_while_encoding())
    assert count == len(tokenizer.encode(text))
    assert seconds > 0.1, "the prompt must take long enough to tell"
    assert ticks >= seconds / 0.005 / 3, f"{ticks} ticks in {seconds:.2f} s: the loop was held"


def test_a_prompt_that_fails_fails_alone(tokenizer: PreTrainedTokenizerBase) -> None:
    encoder = PromptEncoder(EncodeOnly(tokenizer), in_worker=True)

    async def gathered() -> list[list[int] | BaseException]:
        calls = [encoder.encode(text) for text in ("fine", "boom", "fine too")]
        return await asyncio.gather(*calls, return_exceptions=True)

    fine, failed, fine_too = asyncio.run(gathered())
    assert fine == tokenizer.encode("fine") and fine_too == tokenizer.encode("fine too")
    assert isinstance(failed, ValueError) and "boom" in str(failed)
