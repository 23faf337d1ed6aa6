"""Prometheus metrics under vLLM's names and labels with `qpipe:` for `vllm:`: a vLLM dashboard
works once its queries say `qpipe:`, for the series qpipe has (the issue's list, not vLLM's whole
set: no per-request token histograms, no queue-time histogram).

Each server owns its own registry (several servers can live in one test process). The engine reports
cumulative counts (prefix-cache queries, preemptions); they become Prometheus counters by deltas.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from qpipe.serve.engine import EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

# No `_created` gauge beside each counter and histogram, as in vLLM's exposition (process-wide in
# prometheus_client; the server process has no other registry).
disable_created_metrics()


class StepHistogram(Collector):
    """A Prometheus histogram that takes a whole engine step's values in one call. The engine
    thread records one inter-token gap per running stream per step, and prometheus_client's
    `observe` takes a lock and scans the buckets for each value. Measured on a Zen 4: 0.70 us a
    value through `observe`, 0.14 through `observe_many` (the list of gaps included), so 0.18 ->
    0.04 ms of host time per step at 256 streams. Rendered as prometheus_client renders a
    `Histogram` (`le` buckets, `_sum`, `_count`), without its `_created` series."""

    def __init__(
        self,
        name: str,
        documentation: str,
        model_name: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name, self._documentation, self._model_name = name, documentation, model_name
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf's own
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self._bounds, [0] * len(self._counts)
        total = 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # le: a value on a bound counts in its bucket
            total += value
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self._model_name], buckets, sum_value=total)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                f"qpipe:{name}", doc, labels, buckets=buckets, registry=self.registry
            )
            return metric.labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"qpipe:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"qpipe:{name}", doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = StepHistogram(
            "qpipe:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            model_name,
            _ITL_BUCKETS,
            self.registry,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E_BUCKETS
        )
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for blocks.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache blocks in use (1 = all).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by recompute.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "qpipe:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM's: rate() needs a series
            self._request_success.labels(model_name, reason)
        self._model_name = model_name
        self._last_cumulative: dict[str, float] = {}

    def describe_cache(
        self, block_size: int, cache_dtype: str, num_blocks: int, enable_prefix_caching: bool
    ) -> None:
        """vLLM's cache_config_info: a gauge of 1 whose labels say what the KV cache is, so a
        dashboard can turn kv_cache_usage_perc into tokens. `num_gpu_blocks` is vLLM's label
        name, kept on CPU too."""
        info = {
            "block_size": str(block_size),
            "cache_dtype": cache_dtype,
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
        }
        Gauge(
            "qpipe:cache_config_info",
            "What the KV cache is: block size, dtype, blocks, prefix caching.",
            ["model_name", *info],
            registry=self.registry,
        ).labels(self._model_name, *info.values()).set(1)

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()

    def observe_engine(self, stats: EngineStats) -> None:
        """Copies the engine's `stats()` into the gauges and its cumulative counts into counters."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        for key, counter in (
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("num_preemptions", self.num_preemptions),
        ):
            value = getattr(stats, key)
            delta = value - self._last_cumulative.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._last_cumulative[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
