"""`qpipe registry ls | show | pull | push`: published artifacts, for CI jobs and serving fleets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from qpipe.console import console, error, out
from qpipe.registry.registry import Registry, RegistryError, parse_ref
from qpipe.store.base import StoreError

registry_app = typer.Typer(
    no_args_is_help=True, help="Published artifacts: list, inspect, pull one verified artifact."
)

StoreOption = Annotated[
    str | None,
    typer.Option(
        "--store", help="Registry store: a directory or s3://bucket/prefix (default: $QPIPE_HOME)."
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


def _registry(location: str | None) -> Registry:
    from qpipe.store.factory import open_store

    try:
        return Registry(open_store(location))
    except StoreError as exc:
        raise error(str(exc)) from exc


@registry_app.command("ls")
def registry_ls(store: StoreOption = None, as_json: JsonOption = False) -> None:
    """Every published name with its latest version and targets."""
    registry = _registry(store)
    try:
        rows = []
        for name in registry.names():
            latest = registry.read(name)
            rows.append(
                {
                    "name": name,
                    "latest": latest.version,
                    "versions": registry.versions(name),
                    "targets": [f"{a.target}@{a.arch}" for a in latest.artifacts],
                    "created": latest.created,
                    "failed_gates_allowed": bool(latest.failed_gates_allowed),
                }
            )
    except (RegistryError, StoreError) as exc:
        raise error(str(exc)) from exc
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table(title=f"registry: {registry.store.location}", title_justify="left")
    for column in ("name", "latest", "versions", "targets", "published"):
        table.add_column(column)
    for row in rows:
        flag = " [red](gates overridden)[/]" if row["failed_gates_allowed"] else ""
        table.add_row(
            row["name"],
            row["latest"] + flag,
            str(len(row["versions"])),
            ", ".join(row["targets"]),
            row["created"],
        )
    out.print(table)


@registry_app.command("show")
def registry_show(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: latest).")],
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """One version's manifest: artifacts, lineage, accuracy and throughput results."""
    registry = _registry(store)
    try:
        manifest = registry.read(*parse_ref(ref))
    except (RegistryError, StoreError) as exc:
        raise error(str(exc)) from exc
    if as_json:
        out.print_json(manifest.model_dump_json())
        return
    out.print(f"[bold]{manifest.name}@{manifest.version}[/]  published {manifest.created}")
    table = Table(title="artifacts", title_justify="left")
    for column in ("target", "arch", "tp", "quant", "alias", "key", "size"):
        table.add_column(column)
    for a in manifest.artifacts:
        table.add_row(
            a.target, a.arch, str(a.tp), a.quant, a.alias, a.key[:12], f"{a.size / 2**20:.1f} MiB"
        )
    out.print(table)
    for label, record in (("accuracy", manifest.accuracy), ("throughput", manifest.throughput)):
        if record is not None:
            verdict = "failed" if record.gate_failed else "passed"
            metrics = ", ".join(f"{k}={v}" for k, v in sorted(record.metrics.items()))
            out.print(f"{label} (gate {verdict}): {metrics}", highlight=False)
    for failure in manifest.failed_gates_allowed:
        out.print(f"[red]published despite failed gate:[/] {failure}", highlight=False)
    lineage = manifest.lineage
    out.print(f"calibration set sha256: {lineage.calibration_set_sha256}", highlight=False)
    out.print(f"stage keys: {json.dumps({k: v[:12] for k, v in lineage.stage_keys.items()})}")


@registry_app.command("pull")
def registry_pull(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: latest).")],
    target: Annotated[str, typer.Option("--target", help="Build target, e.g. trtllm-engine.")],
    to: Annotated[Path, typer.Option("--to", help="New or empty directory for the artifact.")],
    arch: Annotated[
        str | None,
        typer.Option(
            "--arch",
            help="Arch it must be built for: sm80, sm90, ... or cpu (default: any, newest first).",
        ),
    ] = None,
    store: StoreOption = None,
) -> None:
    """Download exactly one artifact, every file checksum-verified."""
    registry = _registry(store)
    try:
        manifest, record = registry.pull(ref, target, to, arch)
    except (RegistryError, StoreError) as exc:
        raise error(str(exc)) from exc
    console.print(
        f"pulled {manifest.name}@{manifest.version} {record.target} ({record.arch}, "
        f"{record.files} files, {record.size / 2**20:.1f} MiB, verified) into {to}",
        highlight=False,
    )


@registry_app.command("push")
def registry_push(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: latest).")],
    to: Annotated[
        str, typer.Option("--to", help="Destination registry: dir or s3://bucket/prefix.")
    ],
    store: StoreOption = None,
) -> None:
    """Copy one published version and its artifacts to another registry (e.g. the shared one)."""
    registry = _registry(store)
    target = _registry(to)
    try:
        published = registry.push(ref, target)
    except (RegistryError, StoreError) as exc:
        raise error(str(exc)) from exc
    manifest = published.manifest
    state = "pushed" if published.new else "already there:"
    console.print(f"{state} {manifest.name}@{manifest.version} -> {to}", highlight=False)
