"""Benchmark figures with `vllm bench serve`'s names, units and JSON keys, so results diff
against it.

Latencies are in milliseconds (`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, ...), throughputs
per second over the whole run's duration. TPOT of a request is (latency − TTFT) / (output_len − 1),
defined only for requests with more than one output token; ITL pools every inter-chunk gap of
every request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from qpipe.bench.client import LoadResult, RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """One latency metric over the run, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[int, float]

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in PERCENTILES})
        ms = np.asarray(seconds, dtype=float) * 1000.0
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            {p: float(np.percentile(ms, p)) for p in PERCENTILES},
        )


@dataclass(frozen=True)
class BenchMetrics:
    duration: float
    completed: int
    failed: int
    failed_reasons: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    latencies: dict[str, Distribution]
    # per-request series kept for plots and for diffing with vLLM's result files (seconds)
    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    tpots: list[float]
    itls: list[list[float]]
    errors: list[str]

    def summary(self) -> dict[str, float | int | dict[str, int] | None]:
        """The scalar figures, keyed as vLLM keys them (what history stores and gates read)."""
        out: dict[str, float | int | dict[str, int] | None] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "failed_reasons": self.failed_reasons,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name, dist in self.latencies.items():
            out[f"mean_{name}_ms"] = dist.mean
            out[f"median_{name}_ms"] = dist.median
            out[f"std_{name}_ms"] = dist.std
            for p, value in dist.percentiles.items():
                out[f"p{p}_{name}_ms"] = value
        return out

    def to_json(self) -> dict[str, object]:
        return {
            **self.summary(),
            "input_lens": self.input_lens,
            "output_lens": self.output_lens,
            "ttfts": self.ttfts,
            "tpots": self.tpots,
            "itls": self.itls,
            "errors": self.errors,
        }


def parse_goodput(spec: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50` → SLOs in ms; vLLM's space-separated form is accepted too."""
    slos = {}
    for item in (spec or "").replace(",", " ").split():
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput SLO {item!r}: the value must be milliseconds") from exc
    return validated_slos(slos)


def validated_slos(slos: dict[str, float]) -> dict[str, float]:
    for name, value in slos.items():
        if name not in SLO_NAMES:
            raise ValueError(f"goodput SLO {name!r}: use {', '.join(SLO_NAMES)} (e.g. ttft:500)")
        if value <= 0:
            raise ValueError(f"goodput SLO {name}:{value:g}: must be > 0 ms")
    return dict(slos)


def compute_metrics(load: LoadResult, goodput_slos: dict[str, float] | None = None) -> BenchMetrics:
    """Figures for one load level. A successful request without a token count is an error here:
    counting chunks instead would silently misreport servers that send several tokens per chunk."""
    done = [r for r in load.results if r.success]
    missing = [r for r in done if r.output_len is None]
    if missing:
        raise ValueError(
            f"{len(missing)} responses carried no usage and no tokenizer was given to count their "
            "tokens: pass --tokenizer DIR (the model's checkpoint or artifact directory)"
        )
    output_lens = [int(r.output_len or 0) for r in done]
    tpots = [_tpot(r) for r in done if (r.output_len or 0) > 1]
    duration = load.duration_s
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(output_lens)
    latencies = {
        "ttft": Distribution.of([r.ttft for r in done]),
        "tpot": Distribution.of(tpots),
        "itl": Distribution.of([gap for r in done for gap in r.itl]),
        "e2el": Distribution.of([r.latency for r in done]),
    }
    goodput = None
    if goodput_slos:
        good = sum(1 for r in done if _meets(r, goodput_slos))
        goodput = good / duration if duration > 0 else 0.0
    failures = [r.error for r in load.results if not r.success]
    return BenchMetrics(
        duration=duration,
        completed=len(done),
        failed=len(failures),
        failed_reasons=dict(Counter(_reason_class(e) for e in failures)),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration if duration > 0 else 0.0,
        request_goodput=goodput,
        output_throughput=total_out / duration if duration > 0 else 0.0,
        total_token_throughput=(total_in + total_out) / duration if duration > 0 else 0.0,
        latencies=latencies,
        input_lens=[r.prompt_len for r in load.results],
        output_lens=[int(r.output_len or 0) if r.success else 0 for r in load.results],
        ttfts=[r.ttft for r in load.results],
        tpots=tpots,
        itls=[r.itl for r in load.results],
        errors=[r.error for r in load.results],
    )


def _tpot(result: RequestResult) -> float:
    return (result.latency - result.ttft) / (int(result.output_len or 0) - 1)


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft * 1000, "e2el": result.latency * 1000}
    if (result.output_len or 0) > 1:
        values_ms["tpot"] = _tpot(result) * 1000
    return all(values_ms.get(name, 0.0) <= limit for name, limit in slos.items())


def _reason_class(error: str) -> str:
    """`HTTP 500: body...` → `HTTP 500`: failures group by kind, details stay in `errors`."""
    return error.split(":", 1)[0] or "unknown"
