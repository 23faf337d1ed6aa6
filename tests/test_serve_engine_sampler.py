"""The batched sampler: greedy, top-k/top-p/min-p filtering, seeded and shared random draws,
logprobs, logit bias, min_tokens and the presence, frequency and repetition penalties."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from qpipe.serve.layers.penalties import apply_penalties
from qpipe.serve.layers.sampler import sample
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.sequence import Sequence

NO_EOS: frozenset[int] = frozenset()


def logits_batch(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1000, generator=torch.Generator().manual_seed(0)) * 3


def seqs_for(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    histories: list[tuple[list[int], list[int]]] | None = None,
) -> list[Sequence]:
    """Sequences with (prompt, generated) token histories; the generated ones appended as the
    engine appends them."""
    seqs = []
    for i, p in enumerate(params):
        prompt, generated = histories[i] if histories else ([1], [])
        seq = Sequence(f"r{i}", prompt, p, generators[i] if generators else None)
        seq.token_ids += generated
        seqs.append(seq)
    return seqs


def test_filters_keep_only_allowed_tokens() -> None:
    logits = logits_batch(4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.5, top_k=5),
    ]
    for _ in range(5):
        tokens, logprobs = sample(logits, seqs_for(params), NO_EOS)
        best = logits.argmax(-1).tolist()
        assert tokens[:3] == best[:3]
        assert tokens[3] in logits[3].topk(5).indices.tolist()
        assert logprobs == [None] * 4


def test_seeded_rows_repeat_and_shared_rows_vary() -> None:
    logits = logits_batch(2)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
    draws = [
        sample(logits, seqs_for(params, [torch.Generator().manual_seed(7), None]), NO_EOS)[0]
        for _ in range(20)
    ]
    assert len({d[0] for d in draws}) == 1
    assert len({d[1] for d in draws}) > 1


def test_logprobs_hold_the_chosen_and_the_top_tokens() -> None:
    logits = logits_batch(1)
    params = [SamplingParams(temperature=0.0, logprobs=3)]
    tokens, logprobs = sample(logits, seqs_for(params), NO_EOS)
    expected = torch.log_softmax(logits[0], -1)
    (entry,) = logprobs
    assert set(entry) == set(expected.topk(3).indices.tolist()) and tokens[0] in entry
    for token, value in entry.items():
        assert abs(value - expected[token].item()) < 1e-5


def test_top_k_zero_means_off_and_below_minus_one_is_refused() -> None:
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_k must be -1 or 0"):
        SamplingParams(top_k=-2)


def test_penalties_and_bias_follow_the_documented_rules_row_by_row() -> None:
    logits = logits_batch(4)
    histories = [([5, 6, 7, 7], [7, 8, 8, 8]), ([9], [3, 3, 4]), ([1, 2], [2]), ([10, 11], [12])]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logit_bias=((8, 2.5), (999, -4.0))),
        SamplingParams(temperature=0.9, frequency_penalty=0.75, presence_penalty=-0.5),
        SamplingParams(temperature=0.0),  # untouched
        SamplingParams(repetition_penalty=0.6, frequency_penalty=1.5, presence_penalty=2.0),
    ]
    before = logits.clone()
    adjusted = apply_penalties(logits, seqs_for(params, histories=histories), NO_EOS)
    assert torch.equal(logits, before), "the raw logits stay as they were, for logprobs"

    expected = logits.clone()
    for row, (p, (prompt, generated)) in enumerate(zip(params, histories, strict=True)):
        for token, bias in p.logit_bias:
            expected[row, token] += bias
        if p.repetition_penalty != 1.0:  # HF's processor: prompt and generated tokens alike
            history = torch.tensor([prompt + generated])
            rule = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
            expected[row] = rule(history, expected[row : row + 1].clone())[0]
        for token, count in Counter(generated).items():  # OpenAI's: the generated tokens only
            expected[row, token] -= count * p.frequency_penalty + p.presence_penalty
    assert torch.equal(adjusted, expected)
    assert not torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[2], logits[2])
    assert apply_penalties(logits, seqs_for([SamplingParams()] * 4), NO_EOS) is logits


def test_greedy_follows_the_bias_and_logprobs_stay_those_of_the_model() -> None:
    logits = logits_batch(2)
    weakest = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logprobs=1, logit_bias=((weakest, 100.0),)),
        SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=2.0),
    ]
    best = int(logits[1].argmax())
    seqs = seqs_for(params, histories=[([1], []), ([1], [best] * 40)])
    tokens, logprobs = sample(logits, seqs, NO_EOS)
    assert tokens[0] == weakest
    assert tokens[1] != best, "40 repeats at frequency_penalty 2 push the argmax down"
    raw = torch.log_softmax(logits, -1)
    for row, token in enumerate(tokens):
        assert logprobs[row][token] == pytest.approx(raw[row, token].item(), abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias maps"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias maps"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be in"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": 1e-44}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be in"),
    ],
)
def test_out_of_range_penalties_and_bias_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_p_keeps_the_tokens_within_its_share_of_the_best_one() -> None:
    logits = logits_batch(1) / 2
    probs = torch.softmax(logits[0] / 0.7, -1)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < 50
    draws = {
        p.min_p: {sample(logits, seqs_for([p]), NO_EOS)[0][0] for _ in range(300)}
        for p in (SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0.7))
    }
    assert draws[0.1] <= allowed and len(draws[0.1]) > 1
    assert not draws[0.0] <= allowed, "without min_p the tail is drawn too"


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 3], logits[:, 7], logits[:, 5] = 9.0, 8.0, 7.0  # EOS 3 first, stop id 7 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    rows = [
        params,  # 1 token so far: both banned
        replace(params, ignore_eos=True),  # EOS ignored anyway: only the stop id is banned
        params,  # 2 tokens so far: min_tokens reached
        replace(params, min_tokens=0),
    ]
    histories = [([1], [4]), ([1], [4]), ([1], [4, 4]), ([1], [])]
    tokens, _ = sample(logits, seqs_for(rows, histories=histories), frozenset({3}))
    assert tokens == [5, 3, 3, 3]


def test_extreme_but_valid_parameters_never_fail_the_draw() -> None:
    """A temperature or top_p that rounds to 0 in fp32, and a repetition penalty that pushes a
    logit past fp32's range, once made the batch's multinomial raise on the engine thread (NaN
    probabilities), which took the server down for every client."""
    logits = logits_batch(4)
    best = logits.argmax(-1).tolist()
    seen = torch.tensor([best[2]])  # row 2's best token, seen in its prompt
    params = [
        SamplingParams(temperature=1e-50),  # below vLLM's greedy threshold: greedy
        SamplingParams(temperature=1.0, top_p=1e-50, seed=3),  # keeps only the best token
        SamplingParams(temperature=1.0, repetition_penalty=2e-38, seed=4),  # 1/2e-38 overflows
        SamplingParams(temperature=1e-4),  # a sharp but finite distribution
    ]
    assert params[0].greedy and not params[3].greedy
    generators = [None, *(torch.Generator().manual_seed(i) for i in (3, 4)), None]
    histories = [([1], []), ([1], []), (seen.tolist(), []), ([1], [])]
    for _ in range(3):
        tokens, _ = sample(logits, seqs_for(params, generators, histories), NO_EOS)
        # row 2: the seen token's positive logit became the largest finite float, so it wins
        assert tokens == [best[0], best[1], best[2], best[3]]
