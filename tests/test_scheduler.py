"""Scheduler: admission limits, chunked prefill, decodes first, preemption by recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from qpipe.serve.config import EngineConfig
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.scheduler import ScheduledBatch, Scheduler
from qpipe.serve.sequence import Sequence, SequenceStatus

BS = 4
EOS = frozenset({0})


def make(tmp_path: Path, num_blocks: int = 64, **overrides: int) -> Scheduler:
    config = EngineConfig(model=str(tmp_path), block_size=BS, **overrides)
    return Scheduler(config, num_blocks=num_blocks, max_model_len=1024)


def add(scheduler: Scheduler, name: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    base = 1000 * sum(map(ord, name))  # distinct prompts: no prefix-cache hits between them
    seq = Sequence(
        name, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens)
    )
    scheduler.add(seq)
    return seq


def run_step(scheduler: Scheduler, token: int = 7) -> ScheduledBatch:
    """One step with a fake model that always samples `token`."""
    batch = scheduler.schedule()
    sampled = {item.seq.request_id: (token, None) for item in batch.items if item.samples}
    list(scheduler.postprocess(batch, sampled, EOS))
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in batch.items]


def test_admission_stops_at_max_num_seqs(tmp_path: Path) -> None:
    s = make(tmp_path, max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 5)
    assert plan(run_step(s)) == [("r0", 5), ("r1", 5)]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first(tmp_path: Path) -> None:
    s = make(tmp_path, max_num_batched_tokens=16, max_num_seqs=16)
    add(s, "a", 6)
    assert plan(run_step(s)) == [("a", 6)]
    add(s, "b", 40)
    assert plan(run_step(s)) == [("a", 1), ("b", 15)]
    assert plan(run_step(s)) == [("a", 1), ("b", 15)]
    batch = run_step(s)
    assert plan(batch) == [("a", 1), ("b", 10)] and batch.items[-1].samples
    assert plan(run_step(s)) == [("a", 1), ("b", 1)]


def test_admission_waits_for_free_blocks(tmp_path: Path) -> None:
    s = make(tmp_path, num_blocks=4)
    add(s, "a", 12, max_tokens=1)  # 3 blocks
    add(s, "b", 8, max_tokens=1)  # 2 blocks: must wait
    assert plan(run_step(s)) == [("a", 12)]
    assert s.block_manager.num_free_blocks == 4  # a finished after one token
    assert plan(run_step(s)) == [("b", 8)]


def test_preemption_by_recompute_requeues_the_newest(tmp_path: Path) -> None:
    s = make(tmp_path, num_blocks=4)
    a = add(s, "a", 4, max_tokens=8)
    b = add(s, "b", 4, max_tokens=8)
    run_step(s)  # both prefilled, 1 block each, each has 5 tokens now
    run_step(s)  # both need a 2nd block: 4 blocks used
    for _ in range(3):
        run_step(s)
    assert a.num_tokens == 9 and b.num_tokens == 9  # both need a 3rd block; none is free
    batch = run_step(s)
    assert plan(batch) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.num_preemptions == 1
    assert s.waiting[0] is b and b.completion_token_ids == [7] * 5  # generated tokens are kept
    while a.status is not SequenceStatus.FINISHED:
        run_step(s)
    batch = run_step(s)
    # Resumed: prompt + generated tokens are prefilled again, except the first block, which the
    # prefix cache still holds.
    assert plan(batch) == [("b", 5)] and batch.items[0].start == 4
    while b.status is not SequenceStatus.FINISHED:
        run_step(s)
    assert b.num_completion_tokens == 8 and s.block_manager.num_free_blocks == 4


def test_eos_and_stop_tokens_finish_unless_ignored(tmp_path: Path) -> None:
    s = make(tmp_path)
    plain = add(s, "plain", 3)
    stubborn = Sequence("stubborn", [1, 2], SamplingParams(ignore_eos=True, max_tokens=2))
    stop = Sequence("stop", [1, 2], SamplingParams(stop_token_ids=(7,), ignore_eos=True))
    s.add(stubborn)
    s.add(stop)
    run_step(s, token=0)
    assert plain.finish_reason == "stop" and stubborn.status is SequenceStatus.RUNNING
    assert stop.status is SequenceStatus.RUNNING
    run_step(s, token=7)
    assert stop.finish_reason == "stop" and stubborn.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 64


def test_abort_frees_blocks_of_running_and_waiting(tmp_path: Path) -> None:
    s = make(tmp_path, max_num_seqs=1)
    a = add(s, "a", 9)
    b = add(s, "b", 9)
    run_step(s)
    s.abort(a)
    s.abort(b)
    assert a.finish_reason == b.finish_reason == "abort"
    assert not s.running and not s.waiting and s.block_manager.num_free_blocks == 64


def test_the_default_token_budget_is_the_devices_and_covers_max_num_seqs(tmp_path: Path) -> None:
    cpu = make(tmp_path, num_blocks=512)
    for i in range(5):
        add(cpu, f"r{i}", 128)
    # 512 tokens on a CPU: four 128-token prompts fill the step, the fifth waits for the next
    assert plan(run_step(cpu)) == [(f"r{i}", 128) for i in range(4)]
    assert plan(run_step(cpu)) == [(f"r{i}", 1) for i in range(4)] + [("r4", 128)]
    gpu = Scheduler(
        EngineConfig(model=str(tmp_path), device="cuda", block_size=BS),
        num_blocks=512,
        max_model_len=1024,
    )
    for i in range(5):
        add(gpu, f"r{i}", 128)
    assert plan(run_step(gpu)) == [(f"r{i}", 128) for i in range(5)]
    assert make(tmp_path, max_num_batched_tokens=700).max_num_batched_tokens == 700
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is below max_num_seqs"):
        make(tmp_path, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"\(512, the cpu default\) is below max_num_seqs \(513\)"):
        make(tmp_path, max_num_seqs=513)


def test_a_request_preempted_mid_prefill_reports_no_cached_tokens_it_computed(
    tmp_path: Path,
) -> None:
    """Its own chunks registered before the preemption are hits when it is re-admitted; they
    are not prompt tokens the prefix cache served (the usage's `cached_tokens`)."""
    s = make(tmp_path, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=4)
    x = add(s, "x", 4, max_tokens=12)
    run_step(s)
    a = add(s, "a", 40, max_tokens=4)
    for _ in range(8):  # a is preempted with 28 of its 40 tokens computed, when x needs a block
        run_step(s)
    assert s.num_preemptions == 1 and a.status is SequenceStatus.WAITING
    for _ in range(16):  # x finishes, a comes back and hits its own 7 registered blocks
        if a.status is SequenceStatus.RUNNING:
            break
        run_step(s)
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 28 + 8  # hits + chunk
    assert a.num_cached_tokens == 0 and x.num_cached_tokens == 0
