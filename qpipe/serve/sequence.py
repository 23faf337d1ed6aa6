"""One request as the engine sees it: its tokens, how many of them already have KV in the cache,
and which cache blocks hold them."""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Literal

from qpipe.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    import xgrammar

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        grammar: xgrammar.GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # NOTE: the generator lives with the sequence, so a preempted request resumes its random
        # stream where it stopped and a seeded request gives the same tokens whatever the batch.
        self.generator = generator
        # a structured output's matcher: fed every output token, so it also survives preemption
        self.grammar = grammar
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained digests of the full blocks registered so far
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted = False  # scheduled once at least (a preempted request comes back)
        self.finish_reason: FinishReason | None = None
        # [None, then {token: logprob} per prompt token] as prefill chunks compute them
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: every prompt token must then run
        through the model, none may come from the prefix cache."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size : (index + 1) * block_size]
