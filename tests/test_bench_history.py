"""Bench history and regression detection on synthetic histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpipe.bench.cli import bench_app
from qpipe.bench.history import History, history_path
from qpipe.bench.regression import NoiseBand, compare

PROFILE = "random:in512:out256:c32:rateinf:n64"


def _metrics(throughput: float, ttft_p99: float = 100.0, failed: int = 0) -> dict[str, float]:
    return {
        "output_throughput": throughput,
        "request_throughput": throughput / 256,
        "p99_ttft_ms": ttft_p99,
        "median_ttft_ms": ttft_p99 / 2,
        "completed": 12 - failed if throughput else 0,
        "failed": failed,
    }


def _history(tmp_path: Path, accepted: list[float], hardware: str = "1x H100") -> History:
    history = History(history_path(tmp_path))
    for value in accepted:
        history.record("llama3-8b-sm90-int8-tp1", hardware, PROFILE, _metrics(value), True)
    return history


def _candidate(
    history: History, throughput: float, ttft_p99: float = 100.0, failed: int = 0, **key: str
) -> int:
    args = {"alias": "llama3-8b-sm90-int8-tp1", "hardware": "1x H100", "profile": PROFILE, **key}
    return history.record(metrics=_metrics(throughput, ttft_p99, failed), **args)


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


def test_failed_requests_are_a_regression_and_never_a_baseline(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0, 101.0, 99.0])
    partial = _candidate(history, 100.0, failed=4)  # figures within noise, 4 of 12 got HTTP 500
    result = compare(history, history.get(partial))
    assert result.regressed and not result.acceptable and not result.regressions
    assert result.describe() == ["requests: 4 of 12 requests failed"]
    runner, store = CliRunner(), ["--store", str(tmp_path)]
    output = runner.invoke(bench_app, ["compare", *store, "--accept"])
    assert output.exit_code == 1 and "requests: 4 of 12 requests failed" in output.output
    assert not history.get(partial).accepted


def test_accept_without_a_baseline_refuses_a_run_that_completed_nothing(tmp_path: Path) -> None:
    history = History(history_path(tmp_path))
    nothing = _candidate(history, 0.0)
    output = CliRunner().invoke(bench_app, ["compare", "--store", str(tmp_path), "--accept"])
    assert output.exit_code == 1, output.output
    assert "no accepted baseline yet" in output.output
    assert "not accepted: no request completed" in output.output
    assert not history.get(nothing).accepted


def test_an_accepted_zero_run_does_not_disable_comparisons(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0])
    history.record("llama3-8b-sm90-int8-tp1", "1x H100", PROFILE, _metrics(0.0, 0.0), True)
    result = compare(history, history.get(_candidate(history, 50.0)))  # accepted before the rule
    assert result.baseline is not None and result.baseline.metrics["output_throughput"] == 100.0
    assert "output_throughput" in {c.metric for c in result.regressions}


def test_a_zero_baseline_figure_still_flags_a_worse_candidate(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0], hardware="cpu")
    history.record("llama3-8b-sm90-int8-tp1", "cpu", PROFILE, _metrics(100.0, 0.0), True)
    slower = compare(history, history.get(_candidate(history, 100.0, 30.0, hardware="cpu")))
    assert {c.metric for c in slower.regressions} == {"p99_ttft_ms", "median_ttft_ms"}
    assert "+inf% worse" in slower.describe()[0]
    same = compare(history, history.get(_candidate(history, 100.0, 0.0, hardware="cpu")))
    assert not same.regressed and len(same.changes) == 4


def test_cli_compare_prints_the_series_of_each_run(tmp_path: Path) -> None:
    history = _history(tmp_path, [100.0])
    bad = _candidate(history, 50.0)
    output = CliRunner().invoke(bench_app, ["compare", "--store", str(tmp_path)])
    head = f"run {bad} [llama3-8b-sm90-int8-tp1 | 1x H100 | {PROFILE}]: REGRESSION vs run 1"
    assert head in output.output
