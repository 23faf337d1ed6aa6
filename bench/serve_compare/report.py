"""The comparison's three outputs: results.json (everything), RESULTS.md (one table and the
headline ratio) and throughput.png (output tok/s and TTFT p50 against concurrency, per peer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from peers import LABELS, QPIPE_PEERS

from qpipe.bench.machine_speed import MachineSpeed
from qpipe.bench.runner import LevelResult

HEADLINE_CONCURRENCY = 32


@dataclass(frozen=True)
class PeerRun:
    """One peer's part of the run: its levels, or why it has none."""

    peer: str
    version: str
    command: tuple[str, ...] | None  # None for the in-process HF peer
    levels: list[LevelResult]
    error: str | None = None
    usage_in_stream: bool | None = None  # None: in-process, or never got that far
    speed: MachineSpeed | None = None  # probed just before the peer started

    def at(self, concurrency: int) -> LevelResult | None:
        return next((lv for lv in self.levels if lv.profile.concurrency == concurrency), None)

    def to_json(self) -> dict[str, object]:
        return {
            "peer": self.peer,
            "label": LABELS[self.peer],
            "version": self.version,
            "command": list(self.command) if self.command else None,
            "error": self.error,
            "usage_in_stream": self.usage_in_stream,
            "machine_speed_before": self.speed.to_json() if self.speed else None,
            "levels": [_level_json(level) for level in self.levels],
        }


def write_report(out_dir: Path, machine: dict[str, object], runs: list[PeerRun]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine, "peers": [run.to_json() for run in runs]}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "RESULTS.md").write_text(results_markdown(machine, runs))
    if any(run.levels for run in runs):
        write_plot(runs, out_dir / "throughput.png")


def results_markdown(machine: dict[str, object], runs: list[PeerRun]) -> str:
    lines = [
        "# Serving comparison: SmolLM2-135M-Instruct",
        "",
        f"{machine['date']}, {machine['cpu_model']} ({machine['cpu_count']} cores, load average "
        f"{machine['load_average_at_start']} at start), qpipe {machine['git_commit']}. "
        f"Random prompts of {machine['input_len']} tokens, {machine['output_len']} output tokens "
        "(greedy, ignore_eos).",
        "",
        "| peer | concurrency | prompts | failed | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for level in run.levels:
            m = level.metrics
            ttft, tpot = m.latencies["ttft"], m.latencies["tpot"]
            lines.append(
                f"| {LABELS[run.peer]} | {level.profile.concurrency} | {level.profile.num_prompts} "
                f"| {m.failed} | {m.output_throughput:.1f} | {ttft.median:.0f} "
                f"| {ttft.percentiles[99]:.0f} | {tpot.median:.1f} | {tpot.percentiles[99]:.1f} |"
            )
        if run.error:
            lines.append(f"| {LABELS[run.peer]} | – | – | – | failed: {_one_line(run.error)} |||||")
    lines += ["", *headline(runs), "", *speeds(runs)]
    return "\n".join(lines)


def speeds(runs: list[PeerRun]) -> list[str]:
    """The machine's speed before each peer: a VM that slowed down between peers shows here."""
    probed = [run for run in runs if run.speed is not None]
    if not probed:
        return []
    lines = ["Machine speed just before each peer (`qpipe.bench.machine_speed`):", ""]
    lines += [f"- {LABELS[run.peer]}: {run.speed.describe()}" for run in probed]
    return [*lines, ""]


def headline(runs: list[PeerRun]) -> list[str]:
    """`at concurrency 32, <qpipe row> = X× the best peer`, for each qpipe row measured there."""
    others = [(run, run.at(HEADLINE_CONCURRENCY)) for run in runs if run.peer not in QPIPE_PEERS]
    measured = [(run, level) for run, level in others if level is not None]
    if not measured:
        return [f"No non-qpipe peer was measured at concurrency {HEADLINE_CONCURRENCY}."]
    best, best_level = max(measured, key=lambda pair: pair[1].metrics.output_throughput)
    best_tps = best_level.metrics.output_throughput
    lines = []
    for run in runs:
        level = run.at(HEADLINE_CONCURRENCY)
        if run.peer in QPIPE_PEERS and level is not None and best_tps > 0:
            ratio = level.metrics.output_throughput / best_tps
            ttft = level.metrics.latencies["ttft"].median / 1e3
            best_ttft = best_level.metrics.latencies["ttft"].median / 1e3
            lines.append(
                f"At concurrency {HEADLINE_CONCURRENCY}, {LABELS[run.peer]} = {ratio:.2f}× the "
                "best peer "
                f"({LABELS[best.peer]}, {best_tps:.1f} output tok/s), with TTFT p50 {ttft:.2f} s "
                f"against its {best_ttft:.2f} s."
            )
    return lines or [f"qpipe was not measured at concurrency {HEADLINE_CONCURRENCY}."]


def write_plot(runs: list[PeerRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    concurrencies: set[int] = set()
    for run in runs:
        levels = sorted(run.levels, key=lambda lv: lv.profile.concurrency)
        if not levels:
            continue
        x = [lv.profile.concurrency for lv in levels]
        concurrencies.update(x)
        throughput.plot(x, [lv.metrics.output_throughput for lv in levels], "o-", label=run.peer)
        ttft.plot(x, [lv.metrics.latencies["ttft"].median for lv in levels], "o-", label=run.peer)
    ticks = sorted(concurrencies)
    for axes, ylabel, title in (
        (throughput, "output tokens / s", "Output throughput"),
        (ttft, "TTFT p50 (ms)", "Time to first token, median"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(c) for c in ticks])
        axes.set_xlabel("concurrency")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
    ttft.set_yscale("log")
    fig.suptitle("SmolLM2-135M-Instruct on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _level_json(level: LevelResult) -> dict[str, object]:
    p = level.profile
    return {
        "date": level.date,
        "max_concurrency": p.concurrency,
        "num_prompts": p.num_prompts,
        "input_len": p.input_len,
        "output_len": p.output_len,
        **level.metrics.to_json(),
    }


def _one_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return first.replace("|", "/")[:160]
