"""PNG plots of a benchmark: throughput against concurrency, TTFT / TPOT CDFs per level.

CDFs rather than histograms: levels overlay without sharing bins, and p50/p99 read off directly.
"""

from __future__ import annotations

from pathlib import Path

from qpipe.bench.runner import LevelResult


def write_plots(levels: list[LevelResult], out_dir: Path) -> list[Path]:
    """Three PNGs in `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    levels = sorted(levels, key=lambda level: level.profile.concurrency)
    concurrency = [level.profile.concurrency for level in levels]
    fig, left = plt.subplots(figsize=(7, 4.5))
    left.plot(
        concurrency, [lv.metrics.output_throughput for lv in levels], "o-", label="output tok/s"
    )
    left.plot(
        concurrency,
        [lv.metrics.total_token_throughput for lv in levels],
        "s--",
        label="total tok/s",
    )
    left.set_xlabel("max concurrency")
    left.set_ylabel("tokens / s")
    left.set_xscale("log", base=2)
    right = left.twinx()
    right.plot(
        concurrency,
        [lv.metrics.request_throughput for lv in levels],
        "^:",
        color="gray",
        label="requests/s",
    )
    right.set_ylabel("requests / s")
    lines = left.get_lines() + right.get_lines()
    left.legend(lines, [line.get_label() for line in lines], loc="best")
    left.set_xticks(sorted(set(concurrency)), [str(c) for c in sorted(set(concurrency))])
    left.set_title("Throughput vs concurrency")
    fig.tight_layout()
    written.append(_save(fig, out_dir / "throughput_vs_concurrency.png"))

    for name, series in (("ttft", "ttfts"), ("tpot", "tpots")):
        fig, axes = plt.subplots(figsize=(7, 4.5))
        for level in levels:
            values = [v * 1000 for v in getattr(level.metrics, series) if v > 0]
            if values:
                values.sort()
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axes.step(values, fractions, where="post", label=f"c={level.profile.concurrency}")
        axes.set_xlabel(f"{name.upper()} (ms)")
        axes.set_ylabel("fraction of requests at or below")
        axes.set_title(f"{name.upper()} distribution (CDF) per concurrency")
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{name}_distribution.png"))
    return written


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
