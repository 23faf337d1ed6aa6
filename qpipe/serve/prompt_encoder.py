"""Prompts encoded off the event loop, in batches, when the engine leaves the host's cores free.

Encoding a 128-token prompt holds the GIL for ~0.6 ms in transformers' `encode` (SmolLM2, 2-core
Zen 3), on the one thread that serves every stream: at a GPU's request rate (hundreds a second at
concurrency 256) that is a fifth of the loop. With a GPU engine, prompts wait in a list while one
worker thread encodes whatever has gathered in one `encode_batch` of `tokenizers`, which releases
the GIL and spreads the batch over cores (vLLM's micro-batching tokenizer has the same aim). A CPU
engine's OpenMP team holds every core, and a third busy thread slowed its steps more than the loop
gained (tests' tiny model, c=64, 512-token prompts, 8 output tokens: 373-419 against 453 output
tok/s, ~10 % more CPU per token in all), so there the loop encodes, through the same backend call.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from qpipe.serve.api_errors import APIError
from qpipe.serve.tokenizer import backend_of


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


# prompts per batch: when hundreds arrive at once, the first need not wait for the last
_MAX_BATCH = 32
_Future = asyncio.Future[list[int]]
_Waiting = tuple[str, bool, _Future]


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, in_worker: bool) -> None:
        self._tokenizer = tokenizer
        self._backend = backend_of(tokenizer)
        # one worker: a batch has the cores to itself; its thread ends with the encoder
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpipe-encoder")
            if in_worker
            else None
        )
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._draining = False

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids as the tokenizer's own `encode(text, add_special_tokens)`. Text that is
        not Unicode is the client's error (400), not the tokenizer's TypeError (a 500)."""
        check_unicode(text)
        if self._worker is None:
            return self._encode_all([text], add_special_tokens)[0]
        future: _Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append((text, add_special_tokens, future))
            start, self._draining = not self._draining, True
        if start:
            self._worker.submit(self._drain)
        return await future

    def _drain(self) -> None:
        """Encodes what has gathered, then what gathered meanwhile, until nothing waits."""
        while True:
            with self._lock:
                batch, self._waiting = self._waiting[:_MAX_BATCH], self._waiting[_MAX_BATCH:]
                if not batch:
                    self._draining = False
                    return
            for add_special_tokens in (True, False):
                group = [item for item in batch if item[1] is add_special_tokens]
                if group:
                    self._answer(group, add_special_tokens)

    def _answer(self, group: list[_Waiting], add_special_tokens: bool) -> None:
        texts = [text for text, _, _ in group]
        try:
            outcomes: list[list[int] | Exception] = [*self._encode_all(texts, add_special_tokens)]
        except Exception:  # noqa: BLE001 - one by one, so only the prompt at fault fails
            outcomes = [self._encode_one(text, add_special_tokens) for text in texts]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Future, list[int] | Exception]]] = {}
        for (_, _, future), outcome in zip(group, outcomes, strict=True):
            by_loop.setdefault(future.get_loop(), []).append((future, outcome))
        for loop, results in by_loop.items():  # one wake-up of each loop per batch
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody waits there
                loop.call_soon_threadsafe(_settle, results)

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if self._backend is None:
            return [
                self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
                for text in texts
            ]
        encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def _encode_one(self, text: str, add_special_tokens: bool) -> list[int] | Exception:
        try:
            return self._encode_all([text], add_special_tokens)[0]
        except Exception as exc:  # noqa: BLE001 - handed to the request that sent it
            return exc


def check_unicode(text: str) -> None:
    """JSON's \\u escapes can carry a lone UTF-16 surrogate (`"\\ud800"`), which Python keeps in a
    str but which is not a character: no tokenizer encodes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400,
            f"the text holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
            f"{exc.start}), which is not a Unicode character: send well-formed text",
        ) from None


def _settle(results: list[tuple[_Future, list[int] | Exception]]) -> None:
    for future, outcome in results:
        if future.done():  # a request whose client left
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
