"""The accuracy gates: each `max_drop` entry against the measured comparisons.

What each gate compares is defined in qpipe/evaluate/config.py. A gate whose metric was not
measured fails: a run must not pass a check it never made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qpipe.evaluate.significance import Comparison
from qpipe.stages.base import GateVerdict


def _rows_for(gate: str, comparisons: Sequence[Comparison]) -> list[Comparison]:
    if "/" in gate:
        task, filter_name = gate.split("/", 1)
        return [
            c
            for c in comparisons
            if c.name.startswith(f"{task}/") and c.name.endswith(f",{filter_name}")
        ]
    return [c for c in comparisons if c.name == gate or c.name.startswith(f"{gate}/")]


def gate_value(gate: str, row: Comparison) -> float:
    """The number a gate compares: ppl_ratio is candidate/baseline, every other gate the drop."""
    return row.candidate if gate == "ppl_ratio" else row.drop


def check_gates(max_drop: Mapping[str, float], comparisons: Sequence[Comparison]) -> GateVerdict:
    failures: list[str] = []
    checked: dict[str, float | None] = {}
    for gate, limit in max_drop.items():
        rows = _rows_for(gate, comparisons)
        if not rows:
            failures.append(
                f"{gate}: not measured (limit {limit:g}); was it skipped for an endpoint?"
            )
            checked[gate] = None
            continue
        for row in rows:
            value = gate_value(gate, row)
            checked[row.name if row.name != gate else gate] = value
            if value > limit:
                interval = (
                    f", {row.verdict}, interval [{row.interval[0]:.4g}, {row.interval[1]:.4g}]"
                    if row.interval
                    else ""
                )
                failures.append(
                    f"{row.name}: {value:.4g} > allowed {limit:g} (baseline {row.baseline:.4g}, "
                    f"candidate {row.candidate:.4g}{interval})"
                )
    return GateVerdict(passed=not failures, failures=tuple(failures), checked=checked)
