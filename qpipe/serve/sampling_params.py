"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# Temperatures below this sample greedily, as in vLLM: dividing fp32 logits by a smaller one
# overflows them (1e-50 is 0 in fp32), and the distribution is a point mass long before that.
GREEDY_BELOW = 1e-5
FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # normal range


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint the output's text must satisfy (`structured_output.py` enforces it):
    `value` is the JSON schema as JSON text, the regex, or the EBNF grammar; unused for
    `json_object` (any JSON object, OpenAI's JSON mode)."""

    kind: Literal["json_object", "json_schema", "regex", "grammar"]
    value: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling knobs. Stop *strings* are the HTTP layer's job: it watches the detokenized
    text and calls `LLMEngine.abort_request`, because only it knows where text boundaries fall."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS, stop token ids and stop strings count only after this many tokens
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # also {token: logprob} for each prompt token but the first
    # OpenAI's penalties count the generated tokens only; the repetition penalty (HF's and vLLM's)
    # also the prompt's. logit_bias is (token id, added logit) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # written so that NaN fails it too
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}"
            )
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"SamplingParams.top_k must be -1 or 0 (off, as in vLLM) or >= 1, got {self.top_k}"
            )
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"SamplingParams.{name} must be in [0, 20], got {value}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be > 0 (1 is off) and a normal fp32 "
                f"number, which the logits are divided or multiplied by; got "
                f"{self.repetition_penalty}"
            )
        bias = tuple((int(token), float(value)) for token, value in self.logit_bias)
        for token, value in bias:
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"SamplingParams.logit_bias maps token ids >= 0 to values in [-100, 100], "
                    f"got {token}: {value}"
                )
        object.__setattr__(self, "logit_bias", bias)
        if self.structured_output is not None and self.min_tokens:
            raise ValueError(
                "SamplingParams.min_tokens cannot be combined with a structured output: the "
                "grammar decides where the output ends"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the token history, a bias or `min_tokens` changes the logits before the
        choice."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )
