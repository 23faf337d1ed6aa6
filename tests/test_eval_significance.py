"""Paired significance on synthetic samples whose answers are known in advance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qpipe.evaluate.significance import compare_items, mcnemar_exact, mean_drop, paired_bootstrap


def test_identical_models_read_as_noise() -> None:
    right = np.random.default_rng(1).integers(0, 2, 200)
    result = compare_items("gsm8k", right, right.copy())
    assert result.drop == 0
    assert result.interval == (0.0, 0.0)
    assert result.p_value == 1.0
    assert result.verdict == "noise"


def test_mcnemar_exact_matches_the_binomial_tail() -> None:
    # 10 items only the baseline gets right, none the other way: p = 2 * 0.5**10
    base = np.array([1] * 10 + [0] * 5 + [1] * 5)
    cand = np.array([0] * 10 + [0] * 5 + [1] * 5)
    assert mcnemar_exact(base, cand) == pytest.approx(2 / 2**10)
    # 5 vs 3 discordant: p = 2 * P(X <= 3), X ~ Bin(8, 1/2)
    base = np.array([1] * 5 + [0] * 3)
    cand = np.array([0] * 5 + [1] * 3)
    expected = 2 * sum(math.comb(8, k) for k in range(4)) / 2**8
    assert mcnemar_exact(base, cand) == pytest.approx(expected)
    assert mcnemar_exact(cand, base) == pytest.approx(expected)


def test_one_item_on_fifty_is_noise_and_a_large_shift_is_significant() -> None:
    base = np.array([1] * 30 + [0] * 20)
    cand = base.copy()
    cand[0] = 0  # 2 points on 50 items
    small = compare_items("task", base, cand)
    assert small.drop == pytest.approx(2.0)
    assert small.interval[0] <= 0 <= small.interval[1]
    assert small.verdict == "noise"

    rng = np.random.default_rng(0)
    base = (rng.random(400) < 0.8).astype(int)
    cand = base * (rng.random(400) < 0.5)  # the candidate loses about half of the right answers
    large = compare_items("task", base, cand)
    true_drop = (base.mean() - cand.mean()) * 100
    assert large.drop == pytest.approx(true_drop)
    assert large.interval[0] > 0 and large.interval[0] < true_drop < large.interval[1]
    assert large.p_value < 1e-6
    assert large.verdict == "significant"


def test_bootstrap_interval_agrees_with_the_normal_approximation_and_is_seeded() -> None:
    rng = np.random.default_rng(3)
    base = rng.normal(0.0, 1.0, 2000)
    cand = base - 0.1 + rng.normal(0.0, 0.5, 2000)
    stat = mean_drop(base, cand)
    boot = paired_bootstrap(2000, stat, iterations=4000, seed=7)
    diff = base - cand
    half = 1.96 * diff.std(ddof=1) / math.sqrt(len(diff))
    assert boot.estimate == pytest.approx(diff.mean())
    assert boot.interval[0] == pytest.approx(diff.mean() - half, abs=0.15 * half)
    assert boot.interval[1] == pytest.approx(diff.mean() + half, abs=0.15 * half)
    assert paired_bootstrap(2000, stat, iterations=4000, seed=7) == boot
    assert paired_bootstrap(2000, stat, iterations=4000, seed=8).interval != boot.interval


def test_paired_samples_must_line_up() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        compare_items("task", np.ones(5), np.ones(6))
