"""The batched sampler: greedy, top-k/top-p filtering, seeded and shared random draws, logprobs."""

from __future__ import annotations

import pytest
import torch

from qpipe.serve.layers.sampler import sample
from qpipe.serve.sampling_params import SamplingParams


def logits_batch(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1000, generator=torch.Generator().manual_seed(0)) * 3


def test_filters_keep_only_allowed_tokens() -> None:
    logits = logits_batch(4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.5, top_k=5),
    ]
    for _ in range(5):
        tokens, logprobs = sample(logits, params, [None] * 4)
        best = logits.argmax(-1).tolist()
        assert tokens[:3] == best[:3]
        assert tokens[3] in logits[3].topk(5).indices.tolist()
        assert logprobs == [None] * 4


def test_seeded_rows_repeat_and_shared_rows_vary() -> None:
    logits = logits_batch(2)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
    draws = [sample(logits, params, [torch.Generator().manual_seed(7), None])[0] for _ in range(20)]
    assert len({d[0] for d in draws}) == 1
    assert len({d[1] for d in draws}) > 1


def test_logprobs_hold_the_chosen_and_the_top_tokens() -> None:
    logits = logits_batch(1)
    tokens, logprobs = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)], [None])
    expected = torch.log_softmax(logits[0], -1)
    (entry,) = logprobs
    assert set(entry) == set(expected.topk(3).indices.tolist()) and tokens[0] in entry
    for token, value in entry.items():
        assert abs(value - expected[token].item()) < 1e-5


def test_top_k_zero_means_off_and_below_minus_one_is_refused() -> None:
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_k must be -1 or 0"):
        SamplingParams(top_k=-2)
