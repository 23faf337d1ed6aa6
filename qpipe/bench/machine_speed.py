"""How fast the machine is right now: fp32 GEMM GFLOP/s and memory read GB/s, taken in a few
seconds beside a benchmark.

Why: on a shared VM both drift by up to a third between days. On this project's 2-core Zen 3 VM
the same qpipe commit served SmolLM2 offline at concurrency 32 at 124 output tok/s one day and at
80-96 the next, when torch's fp32 GEMM ran at 78-93 GFLOP/s (the day before, a profile had the
model's GEMMs at 110-120). Figures taken apart can only be compared with the machine's speed
beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A prefill step's MLP-sized GEMM in SmolLM2's shapes: 512 tokens x 576 -> 1536.
GEMM_SHAPE = (512, 576, 1536)
READ_BYTES = 256 * 2**20  # well past any last-level cache


@dataclass(frozen=True)
class MachineSpeed:
    gemm_gflops: float  # fp32 torch.mm of GEMM_SHAPE on torch's threads, median
    read_gbps: float  # torch.sum over READ_BYTES of fp32, median
    threads: int

    def describe(self) -> str:
        return (
            f"fp32 GEMM {self.gemm_gflops:.0f} GFLOP/s, memory read {self.read_gbps:.1f} GB/s "
            f"({self.threads} threads)"
        )

    def to_json(self) -> dict[str, float | int]:
        return {
            "gemm_gflops": round(self.gemm_gflops, 1),
            "read_gbps": round(self.read_gbps, 2),
            "threads": self.threads,
        }


def measure(seconds: float = 2.0) -> MachineSpeed:
    """About `seconds` of work split between the two probes; medians over repeats so that one
    preempted repeat does not set the figure."""
    m, k, n = GEMM_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    gemm_s = _median_seconds(lambda: torch.mm(a, b), seconds / 2)
    data = torch.ones(READ_BYTES // 4)
    read_s = _median_seconds(lambda: data.sum(), seconds / 2)
    return MachineSpeed(
        gemm_gflops=2 * m * k * n / gemm_s / 1e9,
        read_gbps=READ_BYTES / read_s / 1e9,
        threads=torch.get_num_threads(),
    )


def _median_seconds(fn: Callable[[], object], budget_s: float) -> float:
    fn()  # warm-up: first-touch page faults, oneDNN/MKL initialisation
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
