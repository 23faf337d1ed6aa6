"""Bench history and regression detection on synthetic histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpipe.bench.cli import bench_app
from qpipe.bench.history import History, history_path
from qpipe.bench.regression import NoiseBand, compare

PROFILE = "random:in512:out256:c32:rateinf:n64"


def _metrics(throughput: float, ttft_p99: float = 100.0) -> dict[str, float]:
    return {
        "output_throughput": throughput,
        "request_throughput": throughput / 256,
        "p99_ttft_ms": ttft_p99,
        "median_ttft_ms": ttft_p99 / 2,
    }


def _history(tmp_path: Path, accepted: list[float], hardware: str = "1x H100") -> History:
    history = History(history_path(tmp_path))
    for value in accepted:
        history.record("llama3-8b-sm90-int8-tp1", hardware, PROFILE, _metrics(value), True)
    return history


def _candidate(history: History, throughput: float, ttft_p99: float = 100.0, **key: str) -> int:
    args = {"alias": "llama3-8b-sm90-int8-tp1", "hardware": "1x H100", "profile": PROFILE, **key}
    return history.record(metrics=_metrics(throughput, ttft_p99), **args)


def test_drop_beyond_the_noise_of_tight_repeats_is_a_regression(tmp_path: Path) -> None:
    history = _history(tmp_path, [98.0, 100.0, 102.0, 99.0, 101.0])
    band = NoiseBand(k=3.0, floor=0.02)
    result = compare(history, history.get(_candidate(history, 90.0)), band)
    assert result.regressed and result.repeats == 5
    (change,) = [c for c in result.regressions if c.metric == "output_throughput"]
    assert change.baseline == 101.0 and change.worse_by == pytest.approx(11 / 101)
    assert change.band == pytest.approx(3 * 1.5811 / 100, rel=1e-3)
    assert "output_throughput: 90 vs baseline 101" in result.describe()[0]
    assert not compare(history, history.get(_candidate(history, 97.0)), band).regressed


def test_noisy_repeats_widen_the_band(tmp_path: Path) -> None:
    history = _history(tmp_path, [80.0, 120.0, 100.0, 90.0, 110.0])
    noisy = compare(history, history.get(_candidate(history, 80.0)))
    assert not noisy.regressed  # 27% below the baseline, inside 3 x 15.8%
    assert compare(history, history.get(_candidate(history, 40.0))).regressed


def test_floor_applies_to_a_single_baseline_and_latency_counts_up(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0])
    assert not compare(history, history.get(_candidate(history, 96.0))).regressed
    assert compare(history, history.get(_candidate(history, 94.0))).regressed
    slower = compare(history, history.get(_candidate(history, 100.0, ttft_p99=120.0)))
    assert {c.metric for c in slower.regressions} == {"p99_ttft_ms", "median_ttft_ms"}
    assert NoiseBand(floor=0.25).width([100.0]) == 0.25


def test_only_accepted_runs_of_the_same_series_are_baselines(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0])
    history.record("llama3-8b-sm90-int8-tp1", "1x H100", PROFILE, _metrics(10.0))  # not accepted
    assert not compare(history, history.get(_candidate(history, 99.0))).regressed
    other_box = compare(history, history.get(_candidate(history, 10.0, hardware="1x L40S")))
    assert other_box.baseline is None and not other_box.regressed
    other_shape = _candidate(history, 10.0, profile=PROFILE.replace("c32", "c8"))
    assert compare(history, history.get(other_shape)).baseline is None


def test_cli_compare_exits_nonzero_on_regression_and_accepts_good_runs(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0, 101.0, 99.0])
    bad = _candidate(history, 70.0)
    runner = CliRunner()
    store = ["--store", str(tmp_path)]
    result = runner.invoke(bench_app, ["compare", "--run", str(bad), *store])
    assert result.exit_code == 1 and "REGRESSION" in result.output
    good = _candidate(history, 100.5)
    result = runner.invoke(bench_app, ["compare", *store, "--accept"])  # newest of the series
    assert result.exit_code == 0 and f"accepted run {good}" in result.output
    assert history.get(good).accepted and not history.get(bad).accepted
