"""`qpipe eval`: a candidate (checkpoint or endpoint) against its baseline, outside a recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qpipe.evaluate.config import EvaluateConfig

if TYPE_CHECKING:
    from qpipe.evaluate.evaluation import EvalReport


def eval_command(
    baseline: Annotated[
        str, typer.Option(help="Baseline checkpoint directory or http:// endpoint.")
    ],
    candidate: Annotated[
        str, typer.Option(help="Candidate checkpoint directory or http:// endpoint.")
    ],
    tasks: Annotated[
        str, typer.Option(help="Comma-separated lm-eval tasks (gsm8k ships with qpipe).")
    ] = "",
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N task items.")] = None,
    text: Annotated[
        Path | None, typer.Option(help="Held-out text for KLD/perplexity (default: wikitext-2).")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens of held-out text to score.")] = 16384,
    window: Annotated[int, typer.Option(help="Tokens per scored window.")] = 512,
    batch_size: Annotated[int, typer.Option(help="Windows / lm-eval requests per batch.")] = 4,
    dtype: Annotated[str, typer.Option(help="auto, bfloat16, float16 or float32.")] = "auto",
    max_drop: Annotated[
        list[str] | None,
        typer.Option(help="Gate NAME=LIMIT, repeatable (e.g. kld_mean=0.05, gsm8k=1.0)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where report.json/report.md/plots go.")] = Path(
        "qpipe-eval"
    ),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print per metric: baseline, candidate, drop, interval.")
    ] = False,
) -> None:
    """Compare CANDIDATE with BASELINE: perplexity, KLD, top-1 agreement, lm-eval tasks.

    With an http:// endpoint only the lm-eval tasks apply (the distribution checks need both
    models' logits).
    """
    from pydantic import ValidationError

    from qpipe.evaluate.evaluation import evaluate
    from qpipe.evaluate.models import ModelRef
    from qpipe.evaluate.report import write_report

    gates = {}
    for item in max_drop or []:
        name, sep, value = item.partition("=")
        try:
            gates[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected NAME=LIMIT", param_hint="--max-drop")
    task_names = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        config = EvaluateConfig(
            text=str(text) if text else None,
            max_tokens=max_tokens,
            window=window,
            batch_size=batch_size,
            dtype=dtype,  # type: ignore[arg-type]  # validated by pydantic
            tasks=[{"name": name, "limit": limit} for name in task_names],  # type: ignore[misc]
            max_drop=gates,
        )
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise typer.BadParameter(problems) from exc
    try:
        report = evaluate(ModelRef(baseline), ModelRef(candidate), config, out)
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    data = write_report(report, config, out)
    if as_json:
        typer.echo(json.dumps({"passed": data["passed"], "metrics": data["metrics"]}, indent=2))
    else:
        _print_table(report)
        typer.echo(f"report: {out / 'report.md'}")
    if not report.gate.passed:
        for failure in report.gate.failures:
            typer.echo(f"gate failed: {failure}", err=True)
        raise typer.Exit(1)


def _print_table(report: EvalReport) -> None:
    from rich.table import Table

    from qpipe.console import out

    table = Table("metric", "baseline", "candidate", "drop", "interval", "p", "verdict")
    for c in report.comparisons:
        interval = f"[{c.interval[0]:.4g}, {c.interval[1]:.4g}]" if c.interval else "—"
        p = f"{c.p_value:.3g}" if c.p_value is not None else "—"
        table.add_row(
            c.name,
            f"{c.baseline:.4g}",
            f"{c.candidate:.4g}",
            f"{c.drop:.4g}",
            interval,
            p,
            c.verdict,
        )
    out.print(table)
    for note in report.notes:
        out.print(f"note: {note}")
