"""The machine-speed probe that benchmarks print beside their figures."""

from __future__ import annotations

import time

import torch

from qpipe.bench import machine_speed


def test_one_slow_repeat_does_not_set_the_figure() -> None:
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        time.sleep(0.25 if len(calls) == 3 else 0.01)  # the 2nd timed repeat is preempted

    seconds = machine_speed._median_seconds(work, 0.1)
    assert len(calls) >= 4  # warm-up plus at least three timed repeats
    assert 0.009 < seconds < 0.05


def test_figures_are_in_their_units() -> None:
    speed = machine_speed.measure(seconds=0.4)
    assert speed.threads == torch.get_num_threads()
    # any CPU from a phone's upwards, in GFLOP/s and GB/s: a unit slip (1e3) lands outside
    assert 1 < speed.gemm_gflops < 50_000
    assert 0.3 < speed.read_gbps < 2_000
    assert speed.describe().startswith(f"fp32 GEMM {speed.gemm_gflops:.0f} GFLOP/s")
    assert speed.to_json()["threads"] == speed.threads
