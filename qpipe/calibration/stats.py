"""stats.json: what the calibration set is made of, so a user can see what the scales were fit on.

Counts add up by construction: samples_read = duplicates + empty + examined + unused, and
examined = kept + too_short + too_long.
"""

from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict

STATS_NAME = "stats.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DropCounts(_Frozen):
    duplicate: int
    empty: int
    too_short: int
    too_long: int


class TokenCounts(_Frozen):
    in_kept_samples: int
    in_rows: int
    padding: int
    truncated_away: int
    packing_left_over: int


class LengthSummary(_Frozen):
    min: int
    median: float
    mean: float
    max: int


class HistogramBin(_Frozen):
    """Kept samples whose token count lies in [low, high]."""

    low: int
    high: int
    count: int


class CalibrationStats(_Frozen):
    dataset: str
    format: str
    files: list[str]
    num_samples: int
    seq_len: int
    seed: int
    packing: bool
    samples_read: int
    examined: int
    kept: int
    unused: int
    dropped: DropCounts
    truncated: int
    chat_template_applied: int
    rows: int
    tokens: TokenCounts
    sample_tokens: LengthSummary
    histogram: list[HistogramBin]
    pad_token_id: int
    content_hash: str
    notes: list[str]


def length_summary(lengths: list[int]) -> LengthSummary:
    return LengthSummary(
        min=min(lengths),
        median=float(statistics.median(lengths)),
        mean=round(statistics.fmean(lengths), 2),
        max=max(lengths),
    )


def histogram(lengths: list[int]) -> list[HistogramBin]:
    """Power-of-two bins ([1,1], [2,3], [4,7], ...) from the shortest to the longest sample."""
    counts: dict[int, int] = {}
    for length in lengths:
        exponent = max(length, 1).bit_length() - 1
        counts[exponent] = counts.get(exponent, 0) + 1
    return [
        HistogramBin(low=2**e, high=2 ** (e + 1) - 1, count=counts.get(e, 0))
        for e in range(min(counts), max(counts) + 1)
    ]
