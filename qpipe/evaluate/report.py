"""The evaluation report on disk: report.json (machines), report.md (people), PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from qpipe.evaluate.config import EvaluateConfig
from qpipe.evaluate.evaluation import EvalReport
from qpipe.evaluate.significance import Comparison

PLOTS = ("metrics.png", "kld_histogram.png", "kld_per_position.png")


def report_dict(report: EvalReport, config: EvaluateConfig) -> dict[str, Any]:
    data: dict[str, Any] = {
        "baseline": report.baseline,
        "candidate": report.candidate,
        "passed": report.gate.passed,
        "gate": {
            "passed": report.gate.passed,
            "failures": list(report.gate.failures),
            "checked": dict(report.gate.checked),
            "max_drop": dict(config.max_drop),
        },
        "metrics": [c.as_dict() for c in report.comparisons],
        "notes": report.notes,
        "confidence": config.confidence,
        "settings": config.model_dump(mode="json"),
    }
    stats = report.distribution
    if stats is not None:
        counts, edges = np.histogram(stats.kld, bins=_kld_bins(stats.kld))
        data["distribution"] = {
            "text_file": report.text_file,
            "windows": int(stats.kld.shape[0]),
            "window": int(stats.kld.shape[1] + 1),
            "predictions": stats.predictions,
            "seconds": round(stats.seconds, 3),
            "load_seconds": round(stats.load_seconds, 3),
            "tokens_per_second": round(stats.kld.size / stats.seconds, 1),
            "position_kld": [round(float(v), 6) for v in stats.position_kld],
            "kld_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        }
    data["tasks"] = {
        name: {
            "items": len(base.doc_ids),
            "baseline": base.metrics,
            "candidate": cand.metrics,
            "seconds": {"baseline": round(base.seconds, 1), "candidate": round(cand.seconds, 1)},
            "samples": {
                "baseline": f"samples/baseline-{name}.jsonl",
                "candidate": f"samples/candidate-{name}.jsonl",
            },
        }
        for name, (base, cand) in report.tasks.items()
    }
    return data


def write_report(report: EvalReport, config: EvaluateConfig, out_dir: Path) -> dict[str, Any]:
    """Write report.json, report.md and the plots into out_dir; return the JSON data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report_dict(report, config)
    plots = write_plots(report, out_dir)
    (out_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(markdown(report, config, plots), encoding="utf-8")
    return data


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def markdown(report: EvalReport, config: EvaluateConfig, plots: list[str]) -> str:
    verdict = "PASSED" if report.gate.passed else "FAILED"
    level = f"{config.confidence:.0%}"
    lines = [
        "# Evaluation report",
        "",
        f"- baseline: `{report.baseline}`",
        f"- candidate: `{report.candidate}`",
        f"- gates: **{verdict}**" + ("" if config.max_drop else " (no max_drop gates set)"),
    ]
    if report.distribution is not None:
        stats = report.distribution
        lines.append(
            f"- held-out text: `{report.text_file}`, {stats.kld.shape[0]} windows of "
            f"{stats.kld.shape[1] + 1} tokens, scored in {stats.seconds:.1f} s "
            f"(+ {stats.load_seconds:.1f} s loading)"
        )
    lines += [f"- note: {note}" for note in report.notes]
    lines += [
        "",
        f"| metric | baseline | candidate | drop | {level} interval | p | verdict | unit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report.comparisons:
        interval = f"[{c.interval[0]:.4g}, {c.interval[1]:.4g}]" if c.interval else "—"
        lines.append(
            f"| {c.name} | {_fmt(c.baseline)} | {_fmt(c.candidate)} | {_fmt(c.drop)} | {interval} "
            f"| {_fmt(c.p_value)} | {c.verdict} | {c.unit} |"
        )
    lines += [
        "",
        "Drop is signed so that positive means worse: points for accuracy and top-1 agreement, "
        "candidate minus baseline for perplexity, the KLD itself for kld_*. Intervals are paired "
        "bootstrap percentiles (over items, or text windows); p is McNemar's exact test for "
        "right/wrong items, else the bootstrap's. *noise* = the interval contains 0.",
    ]
    if report.gate.failures:
        lines += ["", "## Gate failures", ""] + [f"- {f}" for f in report.gate.failures]
    if report.tasks:
        lines += ["", "## lm-eval tasks", ""]
        for name, (base, cand) in report.tasks.items():
            lines.append(
                f"- {name}: {len(base.doc_ids)} items ({base.seconds:.0f} s baseline, "
                f"{cand.seconds:.0f} s candidate); per-item samples in "
                f"`samples/baseline-{name}.jsonl`, `samples/candidate-{name}.jsonl`"
            )
    lines += ["", *(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(lines)


def _kld_bins(kld: np.ndarray) -> np.ndarray:
    top = float(kld.max())
    return np.linspace(0.0, top if top > 0 else 1.0, 51)


def write_plots(report: EvalReport, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if report.comparisons:
        _metric_bars(plt, report.comparisons, out_dir / PLOTS[0])
        written.append(PLOTS[0])
    stats = report.distribution
    if stats is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.hist(stats.kld.ravel(), bins=_kld_bins(stats.kld), color="tab:red")
        ax.set_yscale("log")
        ax.set_xlabel("KL(baseline || candidate), nats")
        ax.set_ylabel("tokens")
        ax.set_title(f"Per-token KLD ({stats.predictions} tokens)")
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS[1], dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(1, stats.kld.shape[1] + 1), stats.position_kld, color="tab:red")
        ax.set_xlabel("position in window (tokens of context)")
        ax.set_ylabel("mean KLD, nats")
        ax.set_title(f"KLD by position ({stats.kld.shape[0]} windows)")
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS[2], dpi=100)
        plt.close(fig)
        written += list(PLOTS[1:])
    return written


def _metric_bars(plt: Any, comparisons: list[Comparison], path: Path) -> None:
    """Baseline vs candidate per metric, each in its own panel (their scales differ)."""
    cols = min(4, len(comparisons))
    rows = -(-len(comparisons) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3 * rows), squeeze=False)
    for ax, c in zip(axes.ravel(), comparisons, strict=False):
        ax.bar(["baseline", "candidate"], [c.baseline, c.candidate], color=["tab:blue", "tab:red"])
        ax.set_title(f"{c.name}\ndrop {c.drop:.3g} ({c.verdict})", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(comparisons) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
