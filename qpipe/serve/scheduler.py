"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step first gives every running decode its one token (preempting the newest sequences by
recompute when the cache is full), then continues chunked prefills, then admits waiting requests
while free blocks, `max_num_seqs` and the `max_num_batched_tokens` budget allow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from qpipe.serve.block_manager import BlockManager
from qpipe.serve.config import EngineConfig
from qpipe.serve.sequence import FinishReason, Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step. A tuple: one is made per running sequence per step, and a
    frozen dataclass takes ~4x as long to build (the engine's host work per sequence is what a
    GPU step waits on between CUDA-graph replays)."""

    seq: Sequence
    start: int  # first position to compute (= tokens already in the cache)
    num_new_tokens: int
    samples: bool  # the chunk reaches the last token, so this step samples the next one


@dataclass(frozen=True)
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.token_budget
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._in_flight: set[Sequence] = set()  # the last batch's, until its postprocess
        self._deferred_aborts: set[Sequence] = set()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drops a request and frees its blocks: now, or, for one in the batch that `schedule`
        returned and `postprocess` has not taken yet, once that batch ran. Its step still writes
        the K/V of the blocks it registered, which a prompt admitted after it in the same step
        may share (`_register`)."""
        if seq in self._in_flight:
            self._deferred_aborts.add(seq)
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, requeue first; the tokens are kept, so the
        resumed request prefills prompt + generated tokens and continues exactly where it was."""
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        decodes = [s for s in self.running if s.num_computed_tokens == s.num_tokens - 1]
        for seq in decodes:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            while not self.block_manager.append_slot(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                items.append(_scheduled(seq, 1))
                budget -= 1
        items = [item for item in items if item.seq.status is SequenceStatus.RUNNING]
        for item in items:
            self._register(item)
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and budget > 0:
                chunk = min(remaining, budget)
                items.append(self._register(_scheduled(seq, chunk)))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            if not seq.admitted:  # a re-admission's hits include the chunks it computed itself
                seq.admitted = True
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            items.append(self._register(_scheduled(seq, chunk)))
            budget -= chunk
        self._in_flight = {item.seq for item in items}
        return ScheduledBatch(items)

    def _register(self, item: ScheduledSeq) -> ScheduledSeq:
        """Publish the blocks this step fills before admitting anyone else, so a prompt admitted
        later in the step hits them (the step writes them before anyone attends)."""
        self.block_manager.register_blocks(item.seq, item.start + item.num_new_tokens)
        return item

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: dict[str, tuple[int, dict[int, float] | None]],
        eos_token_ids: frozenset[int],
    ) -> list[tuple[Sequence, int, dict[int, float] | None]]:
        """After `batch` ran: finish the requests aborted while it did, advance the computed
        counts, append sampled tokens, finish what is done. Returns one (sequence, new token, its
        logprobs) per sequence that gained a token."""
        aborted, self._deferred_aborts, self._in_flight = self._deferred_aborts, set(), set()
        for seq in aborted:
            self.abort(seq)
        gained = []
        for item in batch.items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if not item.samples:
                continue
            token_id, logprobs = sampled[seq.request_id]
            seq.token_ids.append(token_id)
            if seq.grammar is not None:
                accepted = seq.grammar.accept_token(token_id)
                assert accepted, "the sampler keeps to the grammar's bitmask"
            reason = self._finish_reason(seq, token_id, eos_token_ids)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            gained.append((seq, token_id, logprobs))
        return gained

    def _finish_reason(
        self, seq: Sequence, token_id: int, eos_token_ids: frozenset[int]
    ) -> FinishReason | None:
        params = seq.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in eos_token_ids
        ):
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated():
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def _scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
    start = seq.num_computed_tokens
    return ScheduledSeq(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens)
