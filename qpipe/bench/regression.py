"""Is a benchmark run worse than the accepted baseline by more than the measurement noise?

The noise band of a metric is k × the relative standard deviation of the accepted runs that form
the baseline (repeats of the same alias, hardware and profile), never less than a floor: one noisy
p99 on a shared box must not fail CI, and a baseline of a single run still gets a band.

A run with failed requests is never a baseline (`baseline_refusal`), and against a baseline it is a
regression whatever its figures: they cover only the requests that survived.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from qpipe.bench.history import History, HistoryRow

# metric -> +1 when higher is better, -1 when lower is better
WATCHED: dict[str, int] = {
    "output_throughput": +1,
    "request_throughput": +1,
    "median_ttft_ms": -1,
    "p99_ttft_ms": -1,
    "median_tpot_ms": -1,
    "p99_tpot_ms": -1,
    "median_itl_ms": -1,
}


def baseline_refusal(metrics: Mapping[str, object]) -> str | None:
    """Why a run cannot stand as a baseline, or None. Failed requests mean the figures measured a
    server that broke; a run where nothing completed measured nothing (every figure is 0, and a 0
    baseline has no relative change to compare with)."""
    failed = metrics.get("failed") or 0
    completed = metrics.get("completed")
    if failed:
        return f"{failed} of {failed + (completed or 0)} requests failed"
    if completed == 0:
        return "no request completed"
    return None


@dataclass(frozen=True)
class NoiseBand:
    k: float = 3.0
    floor: float = 0.05
    window: int = 5

    def __post_init__(self) -> None:
        if self.k < 0 or self.floor < 0 or self.window < 1:
            raise ValueError(f"noise band needs k >= 0, floor >= 0, window >= 1; got {self}")

    def width(self, values: list[float]) -> float:
        """Relative band from repeated measurements of one metric."""
        mean = statistics.fmean(values) if values else 0.0
        if len(values) < 2 or mean == 0:
            return self.floor
        return max(self.k * statistics.stdev(values) / abs(mean), self.floor)


@dataclass(frozen=True)
class MetricChange:
    metric: str
    baseline: float
    candidate: float
    worse_by: float  # relative; > 0 means the candidate is worse
    band: float

    @property
    def regressed(self) -> bool:
        return self.worse_by > self.band


@dataclass(frozen=True)
class Comparison:
    candidate: HistoryRow
    baseline: HistoryRow | None
    repeats: int
    changes: tuple[MetricChange, ...]

    @property
    def refusal(self) -> str | None:
        """Why the candidate cannot become a baseline (see `baseline_refusal`)."""
        return baseline_refusal(self.candidate.metrics)

    @property
    def regressions(self) -> tuple[MetricChange, ...]:
        return tuple(c for c in self.changes if c.regressed)

    @property
    def regressed(self) -> bool:
        return bool(self.regressions) or (self.baseline is not None and self.refusal is not None)

    @property
    def acceptable(self) -> bool:
        """May the candidate become the series' baseline: the one rule `bench compare --accept`
        and the bench stage share."""
        return self.refusal is None and not self.regressed

    def describe(self) -> list[str]:
        """One line per regression, with the numbers; failed requests first."""
        lines = [f"requests: {self.refusal}"] if self.regressed and self.refusal else []
        return lines + [
            f"{c.metric}: {c.candidate:.4g} vs baseline {c.baseline:.4g} "
            f"({c.worse_by:+.1%} worse, noise band {c.band:.1%} from {self.repeats} run(s))"
            for c in self.regressions
        ]


def compare(history: History, candidate: HistoryRow, band: NoiseBand | None = None) -> Comparison:
    """Against the newest accepted run of the same series that is older than the candidate. Accepted
    runs that `baseline_refusal` rejects (accepted before it existed) are passed over: an all-zero
    baseline would otherwise leave nothing to compare."""
    band = band or NoiseBand()
    accepted = [
        row
        for row in history.series(
            candidate.alias, candidate.hardware, candidate.profile, accepted_only=True
        )
        if row.id < candidate.id and baseline_refusal(row.metrics) is None
    ][: band.window]
    if not accepted:
        return Comparison(candidate, None, 0, ())
    baseline = accepted[0]
    changes = []
    for metric, direction in WATCHED.items():
        base, cand = baseline.metrics.get(metric), candidate.metrics.get(metric)
        if not isinstance(base, int | float) or not isinstance(cand, int | float):
            continue
        repeats = [float(r.metrics[metric]) for r in accepted if metric in r.metrics]
        worse_by = _worse_by(float(base), float(cand), direction)
        changes.append(
            MetricChange(metric, float(base), float(cand), worse_by, band.width(repeats))
        )
    return Comparison(candidate, baseline, len(accepted), tuple(changes))


def _worse_by(base: float, cand: float, direction: int) -> float:
    """Relative change, > 0 when the candidate is worse; from a 0 baseline (e.g. ITL of one-token
    outputs) any worsening is unbounded rather than skipped."""
    worse = base - cand if direction > 0 else cand - base
    if base == 0:
        return math.copysign(math.inf, worse) if worse else 0.0
    return worse / abs(base)
