"""Incremental detokenization with stop strings, one instance per request.

Decoding only a short window of tokens per step keeps the cost flat in the output length. A
byte-level BPE token can end in the middle of a UTF-8 character: its decoded text then ends in
U+FFFD, and the text is held back until the next token completes the character, so a client never
sees a broken character. Text that could still become a stop string is held back too, so a stream
never shows half a stop string.

Tokenizers backed by the `tokenizers` library (every fast tokenizer) decode through its own
`DecodeStream`, one Rust call per token: the window decode through transformers' Python wrapper
costs ~24 µs per token against ~3.5 (SmolLM2, 2-core Zen 3), and the engine thread pays it for every
token of every stream between two steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from qpipe.serve.tokenizer import backend_of

# Prompt tokens decoded ahead of the output, for tokenizers whose spaces depend on context.
_PROMPT_CONTEXT_TOKENS = 5
# Tokens a stream may hold back at once: a UTF-8 character spans at most 4 byte tokens.
_MAX_HELD_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"
# What `DecodeStream.step` raises when a token changes the text decoded before it.
_INVALID_PREFIX = "Invalid prefix encountered"


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class _WindowDecoder:
    """Decodes the last few tokens twice, with and without the new one; the difference is its
    text (what transformers' and vLLM's Python detokenizers do)."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def step(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(
            self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full[len(prefix) :]


class _StreamDecoder:
    """`tokenizers`' incremental decoder. It refuses a token that changes the text before it (a
    decoder's clean-up can, `_INVALID_PREFIX`); the request then goes on in a `_WindowDecoder`,
    which sends only the new characters, as a stream cannot take back what it sent."""

    def __init__(self, tokenizer: Tokenizer, backend: BackendTokenizer, context: Sequence[int]):
        self._tokenizer = tokenizer
        self._backend = backend
        self._stream = DecodeStream(ids=list(context), skip_special_tokens=True)
        self._recent: deque[int] = deque(context, maxlen=_PROMPT_CONTEXT_TOKENS + _MAX_HELD_TOKENS)
        self._held = 0  # trailing tokens of `_recent` whose text is not complete yet
        self._fallback: _WindowDecoder | None = None
        if backend.decode(list(context), skip_special_tokens=True).endswith(_REPLACEMENT_CHAR):
            # a prompt that ends mid-character (token ids sent as the prompt) is no context to
            # DecodeStream, which would send its text with the first token
            self._fallback = _WindowDecoder(tokenizer, context)

    def step(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.step(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as err:  # tokenizers raises a bare Exception
            if _INVALID_PREFIX not in str(err):
                raise
            return self._fall_back(token_id)
        self._recent.append(token_id)
        self._held = 0 if text is not None else self._held + 1
        return text or ""

    def _fall_back(self, token_id: int) -> str:
        recent = list(self._recent)
        done = max(0, len(recent) - self._held)  # tokens skipped as special count as held
        self._fallback = _WindowDecoder(
            self._tokenizer, recent[max(0, done - _PROMPT_CONTEXT_TOKENS) : done]
        )
        for held in recent[done:]:
            self._fallback.step(held)
        return self._fallback.step(token_id)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        """Stop strings are looked for once more than `min_tokens` tokens came (vLLM's rule):
        text the first `min_tokens` tokens complete cannot stop the request. As in vLLM, the
        matched stop string and the text of a token that stopped the request (EOS, a stop token
        id) are left out unless `include_stop` (`include_stop_str_in_output`)."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        backend = backend_of(tokenizer)
        self._decoder: _StreamDecoder | _WindowDecoder = (
            _WindowDecoder(tokenizer, context)
            if backend is None
            else _StreamDecoder(tokenizer, backend, context)
        )
        self._num_output_tokens = 0
        self._min_tokens = min_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self._longest_stop = max(map(len, self._stop), default=0)
        self.text = ""  # all output text decoded so far (cut before a stop string once one is hit)
        self._emitted = 0  # how many characters of `text` were handed out
        self.stopped = False

    def add_tokens(self, token_ids: Sequence[int], stop_terminated: bool = False) -> str:
        """Adds sampled tokens; returns the text that is now safe to send (may be ""). With
        `stop_terminated`, the last token is the one that stopped the request."""
        if stop_terminated and not self._include_stop:
            token_ids = token_ids[:-1]
        for token_id in token_ids:
            if self.stopped:
                break
            self._num_output_tokens += 1
            if delta := self._decoder.step(token_id):
                self._add_text(delta)
        return self._take(hold_back=not self.stopped)

    def flush(self) -> str:
        """At the end of a request: all text not sent yet (never an incomplete character)."""
        return self._take(hold_back=False)

    def _add_text(self, delta: str) -> None:
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += delta
        if self._stop and self._num_output_tokens > self._min_tokens:
            self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + len(stop) if self._include_stop else at]
            self.stopped = True

    def _take(self, hold_back: bool) -> str:
        end = len(self.text)
        if hold_back and self._stop and not self._include_stop:  # shown either way: no hold
            end -= self._stop_prefix_len()
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
