"""The inter-token-latency histogram that takes a step's values at once renders as
prometheus_client's own Histogram would for the same values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qpipe.serve.metrics import StepHistogram

NAME = "qpipe:inter_token_latency_seconds"
BUCKETS = (0.01, 0.025, 0.05, 0.1, 1.0)


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_step_histogram_renders_what_a_prometheus_histogram_would() -> None:
    # below the first bound, on bounds (le: counted in that bucket), between, above the last
    steps = [[0.001, 0.01, 0.0100001, 0.025], [], [0.07, 0.1, 0.1, 2.5, 40.0], [0.05]]
    reference_registry, step_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(
        NAME, "gaps", ["model_name"], buckets=BUCKETS, registry=reference_registry
    ).labels("m")
    batched = StepHistogram(NAME, "gaps", "m", BUCKETS, step_registry)
    for step in steps:
        for value in step:
            reference.observe(value)
        batched.observe_many(step)
        want, got = samples(reference_registry), samples(step_registry)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), key
    got = samples(step_registry)
    assert got[(f"{NAME}_bucket", "0.01")] == 2
    assert got[(f"{NAME}_bucket", "0.1")] == 8
    assert got[(f"{NAME}_bucket", "+Inf")] == got[(f"{NAME}_count", "")] == 10


def test_finish_reasons_start_at_zero_and_no_created_series() -> None:
    """`rate(qpipe:request_success_total{finished_reason="abort"}[5m])` has a series before the
    first abort (vLLM's are created at 0), and no `_created` gauge doubles every counter."""
    from qpipe.serve.metrics import ServerMetrics

    def success(metrics: ServerMetrics) -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        assert "_created" not in text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return {
            s.labels["finished_reason"]: s.value
            for s in families["qpipe:request_success"].samples
            if s.name.endswith("_total")
        }

    metrics = ServerMetrics("m")
    assert success(metrics) == {"stop": 0.0, "length": 0.0, "abort": 0.0}
    metrics.request_finished("length")
    assert success(metrics) == {"stop": 0.0, "length": 1.0, "abort": 0.0}
