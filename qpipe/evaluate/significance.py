"""Is a baseline-vs-candidate difference real or noise?

Both models are scored on the same items, so the tests are paired: a paired bootstrap of the drop
(resampling items, or text windows, with the same indices for both models) and, for per-item
right/wrong, McNemar's exact test on the items where the two models disagree. A 0.3-point change on
50 items then reads as what it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Statistic = Callable[[np.ndarray], np.ndarray]
"""Maps resampled index rows [B, n] to one drop per row [B]."""


@dataclass(frozen=True)
class Comparison:
    """One metric of baseline vs candidate; `drop` is signed so that positive means worse."""

    name: str
    baseline: float
    candidate: float
    drop: float
    interval: tuple[float, float] | None
    p_value: float | None
    unit: str = ""

    @property
    def verdict(self) -> str:
        """`significant` when the interval excludes 0 (or McNemar's p < 0.05), else `noise`."""
        if self.interval is None and self.p_value is None:
            return "n/a"
        if self.p_value is not None and self.p_value < 0.05:
            return "significant"
        if self.interval is not None and (self.interval[0] > 0 or self.interval[1] < 0):
            return "significant"
        return "noise"

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "drop": self.drop,
            "interval": list(self.interval) if self.interval is not None else None,
            "p_value": self.p_value,
            "verdict": self.verdict,
            "unit": self.unit,
        }


@dataclass(frozen=True)
class BootstrapResult:
    estimate: float
    interval: tuple[float, float]
    p_value: float


def paired_bootstrap(
    n: int,
    statistic: Statistic,
    *,
    iterations: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    chunk: int = 500,
) -> BootstrapResult:
    """Percentile interval and two-sided p-value of a paired statistic over n resampled units.

    The p-value is the bootstrap's: twice the smaller share of resampled drops on either side of 0
    (with the +1 correction, so it is never exactly 0 and is 1 when every resample is 0).
    """
    if n < 1:
        raise ValueError("paired_bootstrap needs at least one item")
    rng = np.random.default_rng(seed)
    drops = np.concatenate(
        [
            statistic(rng.integers(0, n, size=(min(chunk, iterations - start), n)))
            for start in range(0, iterations, chunk)
        ]
    )
    alpha = (1 - confidence) / 2
    low, high = np.quantile(drops, [alpha, 1 - alpha])
    at_most_zero = (np.count_nonzero(drops <= 0) + 1) / (iterations + 1)
    at_least_zero = (np.count_nonzero(drops >= 0) + 1) / (iterations + 1)
    estimate = float(statistic(np.arange(n)[None, :])[0])
    return BootstrapResult(
        estimate=estimate,
        interval=(float(low), float(high)),
        p_value=min(1.0, 2 * min(at_most_zero, at_least_zero)),
    )


def mean_drop(baseline: np.ndarray, candidate: np.ndarray, scale: float = 1.0) -> Statistic:
    """The statistic `mean(baseline) - mean(candidate)` (times scale) over resampled items."""
    difference = (np.asarray(baseline, dtype=np.float64) - candidate) * scale
    return lambda rows: difference[rows].mean(axis=1)


def mcnemar_exact(baseline_correct: np.ndarray, candidate_correct: np.ndarray) -> float:
    """Two-sided exact McNemar p-value: a binomial test on the discordant items.

    Only items one model gets right and the other wrong carry information about which is better;
    under "no difference" each of those is equally likely to go either way.
    """
    base = np.asarray(baseline_correct, dtype=bool)
    cand = np.asarray(candidate_correct, dtype=bool)
    if base.shape != cand.shape:
        raise ValueError(f"paired samples differ in length: {base.shape} vs {cand.shape}")
    only_base = int(np.count_nonzero(base & ~cand))
    only_cand = int(np.count_nonzero(~base & cand))
    discordant = only_base + only_cand
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(only_base, only_cand) + 1))
    return min(1.0, 2 * tail / 2**discordant)


def compare_items(
    name: str,
    baseline: np.ndarray,
    candidate: np.ndarray,
    *,
    iterations: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Comparison:
    """Per-item scores (0/1 for right/wrong, or any per-item value) of two models, in points.

    The drop and its interval come from the paired bootstrap; the p-value from McNemar when the
    scores are right/wrong, else from the bootstrap.
    """
    base = np.asarray(baseline, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if base.shape != cand.shape:
        raise ValueError(f"{name}: paired samples differ in length: {base.shape} vs {cand.shape}")
    boot = paired_bootstrap(
        len(base),
        mean_drop(base, cand, 100.0),
        iterations=iterations,
        confidence=confidence,
        seed=seed,
    )
    binary = np.isin(base, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all()
    return Comparison(
        name=name,
        baseline=float(base.mean() * 100),
        candidate=float(cand.mean() * 100),
        drop=boot.estimate,
        interval=boot.interval,
        p_value=mcnemar_exact(base, cand) if binary else boot.p_value,
        unit="points",
    )
