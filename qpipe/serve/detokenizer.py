"""Incremental detokenization with stop strings, one instance per request.

Decoding only a short window of tokens per step keeps the cost flat in the output length. A
byte-level BPE token can end in the middle of a UTF-8 character: its decoded text then ends in
U+FFFD, and the text is held back until the next token completes the character, so a client never
sees a broken character. Text that could still become a stop string is held back too, so a stream
never shows half a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded ahead of the output, for tokenizers whose spaces depend on context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        """Stop strings are looked for once more than `min_tokens` tokens came (vLLM's rule):
        text the first `min_tokens` tokens complete cannot stop the request."""
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output_tokens = 0
        self._min_tokens = min_tokens
        self._stop = [s for s in stop if s]
        self.text = ""  # all output text decoded so far (cut before a stop string once one is hit)
        self._emitted = 0  # how many characters of `text` were handed out
        self.stopped = False

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Adds sampled tokens; returns the text that is now safe to send (may be "")."""
        for token_id in token_ids:
            if self.stopped:
                break
            self._token_ids.append(token_id)
            self._num_output_tokens += 1
            self._decode_next()
        return self._take(hold_back=not self.stopped)

    def flush(self) -> str:
        """At the end of a request: all text not sent yet (never an incomplete character)."""
        return self._take(hold_back=False)

    def _decode_next(self) -> None:
        decode = self._tokenizer.decode
        prefix = decode(
            self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        search_from = max(0, len(self.text) - max((len(s) for s in self._stop), default=0) + 1)
        self.text += delta
        if self._num_output_tokens > self._min_tokens:
            self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, hold_back: bool) -> str:
        end = len(self.text)
        if hold_back:
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
