"""The engine loop: schedule -> run the model -> postprocess, one step at a time.

`LLMEngine` is synchronous and single-threaded on purpose: the HTTP layer drives `step()` from its
own loop and feeds requests in between steps, so the core never needs locks.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from qpipe.serve.config import EngineConfig
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qpipe.serve.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


class RequestOutput(NamedTuple):
    """What one request gained in one step. `new_logprobs[i]` maps token id -> logprob for the i-th
    new token: the sampled token plus the `logprobs` most likely ones (None when not asked for).
    `prompt_logprobs` comes once, with the first new token, when the request asked for it: None
    for the first prompt token, then the same kind of map for each prompt token. A tuple, as
    `ScheduledSeq`: one per running request per step, built in a fraction of a frozen
    dataclass's time."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics. Prefix-cache counters are cumulative, in tokens, like vLLM's."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from qpipe.serve.loader import read_config_json
        from qpipe.serve.model_runner import ModelRunner
        from qpipe.serve.scheduler import Scheduler
        from qpipe.serve.structured_output import GrammarCompiler
        from qpipe.serve.tokenizer import load_tokenizer

        self.config = config
        # NOTE: checked before the tokenizer, which reads config.json too and would report a
        # broken one as a tokenizer problem
        read_config_json(Path(config.model))
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(config.model)
        self.model_runner = ModelRunner(config)
        self.max_model_len: int = self.model_runner.max_model_len
        self.eos_token_ids: frozenset[int] = self.model_runner.eos_token_ids
        self.vocab_size: int = self.model_runner.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(
            config,
            num_blocks=self.model_runner.num_kv_blocks,
            max_model_len=self.max_model_len,
        )
        self._requests: dict[str, Sequence] = {}
        self._failed: BaseException | None = None  # a step that raised: see execute

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request. Raises ValueError for an id in use, an empty prompt, a prompt that
        leaves no room to generate within `max_model_len`, a token id (prompt, logit bias, stop
        id) outside the vocabulary, or a structured output that does not compile."""
        self._check_usable()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt has {len(prompt_token_ids)} tokens but "
                f"max_model_len is {self.max_model_len}; shorten the prompt"
            )
        # an id past the vocabulary would index out of the embedding or the logits mid-step
        for field, tokens in (
            ("the prompt", prompt_token_ids),
            ("logit_bias", [token for token, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if tokens and not (min(tokens) >= 0 and max(tokens) < self.vocab_size):
                outside = sorted({t for t in tokens if not 0 <= t < self.vocab_size})
                raise ValueError(
                    f"request {request_id!r}: {field} holds token ids {outside[:8]} outside this "
                    f"model's vocabulary of {self.vocab_size}"
                )
        spec = params.structured_output
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            self.model_runner.new_generator(params),
            None if spec is None else self.grammars.matcher(spec),
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks now (or, between `schedule` and `execute`, once
        the step ran: `Scheduler.abort`). Unknown or finished ids are ignored, so a client
        disconnect racing with completion is harmless."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def step(self) -> list[RequestOutput]:
        return self.execute(self.scheduler.schedule())

    def execute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Runs a batch the scheduler formed (`step` = schedule + execute; a server reads its
        queue between the two, while the batch's requests already count as running)."""
        self._check_usable()
        if not batch.items:
            return []
        try:
            result = self.model_runner.run(batch)
        except BaseException as exc:
            # the step published its blocks to the prefix cache before computing them, and its
            # requests wait for a postprocess that will not come: nothing after is trustworthy
            self._failed = exc
            raise
        for request_id, scored in result.prompt_logprobs.items():
            seq = self._requests.get(request_id)  # None: aborted while the step ran
            if seq is not None:
                assert seq.prompt_logprobs is not None  # the runner scores only those that asked
                seq.prompt_logprobs.extend(scored)
        outputs = []
        for seq, token_id, logprobs in self.scheduler.postprocess(
            batch, result.sampled, self.eos_token_ids
        ):
            if seq.is_finished:
                self._requests.pop(seq.request_id, None)
            first = seq.num_completion_tokens == 1
            outputs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    new_token_ids=[token_id],
                    new_logprobs=None if logprobs is None else [logprobs],
                    finished=seq.is_finished,
                    finish_reason=seq.finish_reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    prompt_logprobs=seq.prompt_logprobs if first else None,
                )
            )
        return outputs

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"this engine's step failed earlier ({self._failed!r}) and left its state "
                "undefined; create a new LLMEngine"
            ) from self._failed

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline batch generation: the completion token ids of each prompt, in prompt order."""
        base = uuid.uuid4().hex
        ids = [f"generate-{base}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt in zip(ids, prompts, strict=True):
                self.add_request(request_id, prompt, params)
        except ValueError:  # a bad prompt: the ones queued before it are not left behind
            for request_id in ids:
                self.abort_request(request_id)
            raise
        completions: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while any(request_id in self._requests for request_id in ids):
            for out in self.step():
                if out.request_id in completions:
                    completions[out.request_id].extend(out.new_token_ids)
        return [completions[request_id] for request_id in ids]
