"""Structured outputs (OpenAI's `response_format`, vLLM's `structured_outputs`): the output is
held to a JSON schema, any JSON, a regex or an EBNF grammar, token by token.

xgrammar does the work, as in vLLM and SGLang: it compiles a constraint once against the
tokenizer's vocabulary, and a matcher per sequence gives the set of tokens that keep the output
valid at each step, as a bitmask over the vocabulary. The sampler sets the logits outside it to
-inf before the choice (greedy or sampled); the scheduler feeds each chosen token back to the
matcher and ends the request when the grammar is complete.

xgrammar is imported, and the vocabulary scanned (~2 s together on a 2-core CPU), when the first
constrained request arrives, so a server that never sees one does not pay for it.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING

import torch

from qpipe.serve.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from qpipe.serve.sequence import Sequence


# Whitespace allowed between two JSON elements: enough for the indentation of deeply nested
# pretty-printed JSON, and a bound on the runs of blanks a model can fall into under a JSON
# grammar (measured: a random model's outputs were whitespace to max_tokens without it).
MAX_JSON_WHITESPACE = 32


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (vLLM's `choice`): each one a string
    literal, escaped as JSON escapes it, which EBNF string literals read the same way."""
    if not choices or any(not c for c in choices):
        raise ValueError("choice must list at least one non-empty string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe, so the HTTP layer compiles
    (and checks) a request's constraint in a worker thread before queueing it, and the engine
    thread then finds it in xgrammar's cache."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which may be padded past the tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Raises ValueError, saying what is wrong, for a schema, regex or grammar that does
        not compile."""
        compiler = self._get_compiler()
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors for bad input
            what = spec.kind.replace("_", " ")
            raise ValueError(f"the {what} does not compile: {_reason(exc)}") from exc

    def matcher(self, spec: StructuredOutput) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence, at the start of the output."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._eos_token_ids,
                )
                # compiled grammars are cached, within a bound, so that a server fed ever new
                # schemas does not grow without limit
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=2, cache_limit_bytes=256 << 20
                )
            return self._compiler


def _reason(exc: Exception) -> str:
    """xgrammar's message without the time and C++ source location it starts with."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s+\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__


def apply_grammars(
    adjusted: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence]
) -> torch.Tensor:
    """`adjusted` ([rows, vocab], row i for seqs[i]) with every token that would break a row's
    grammar at -inf; a copy when `adjusted` is still the raw `logits` (kept for logprobs)."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return adjusted
    import xgrammar

    if adjusted is logits:
        adjusted = logits.clone()
    bitmask = xgrammar.allocate_token_bitmask(len(seqs), adjusted.shape[1])  # row i: seqs[i]
    for i in rows:
        grammar = seqs[i].grammar
        assert grammar is not None
        grammar.fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(
        adjusted, bitmask.to(adjusted.device, non_blocking=True), indices=rows
    )
    return adjusted
