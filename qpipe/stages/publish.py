"""publish: the build's artifacts and their reports → a versioned registry manifest.

Refuses an artifact whose evaluate or bench gate failed, unless `publish.allow_failed_gates`
(`--allow-failed-gates`) says so, and then the overridden failures are written into the manifest
for every consumer to see. With a separate `publish.registry`, the entries are copied there so a
consumer needs nothing but the registry location.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from qpipe.recipe import Recipe
from qpipe.registry.config import PublishConfig
from qpipe.registry.manifest import ArtifactRecord, Lineage, Manifest, StageRecord
from qpipe.registry.registry import Registry, RegistryError
from qpipe.stages.base import Stage, StageContext, StageError, StageResult
from qpipe.store.base import Store, StoreError
from qpipe.store.entry import EntryMeta


class PublishStage(Stage):
    name = "publish"
    version = 1
    needs = ("build", "evaluate", "bench")  # evaluate and bench only when the recipe has them

    def section(self, recipe: Recipe) -> BaseModel | None:
        return recipe.publish

    def stale(self, recipe: Recipe, entry: Path, store: Store) -> str | None:
        """The registry is outside this entry: another recipe may have moved `latest` since
        (re-running this one must point consumers back at its artifacts), or the registry's
        documents may be gone. Either way the publish runs again; it republishes nothing new."""
        summary = json.loads((entry / "publish.json").read_text())
        name, version = summary["name"], summary["version"]
        config = recipe.publish or PublishConfig()
        try:
            registry = Registry(_registry_store(store, config))
            latest = registry.latest(name)
            if latest is None:
                return f"the registry at {registry.store.location} has no {name} any more"
            if latest != version:
                return f"{name}@{version} was published here, but the registry's latest is {latest}"
            if registry.read(name, version).content_digest != summary["content_digest"]:
                return f"{name}@{version} in the registry no longer holds this publish"
        except (RegistryError, StoreError) as exc:
            return f"the registry does not have {name}@{version} any more ({exc})"
        return None

    def run(self, ctx: StageContext) -> StageResult:
        config = ctx.recipe.publish or PublishConfig()
        name = config.name or ctx.recipe.name
        if "build" not in ctx.keys:
            raise StageError("publish: needs the build stage's output, and the run has none")
        accuracy = _stage_record(ctx, "evaluate")
        throughput = _stage_record(ctx, "bench")
        # a build target the recipe asks for and that could not be built (an engine without
        # its toolchain) stops a publish too: the entry would lack what its consumers pull
        gated = (("build", _stage_record(ctx, "build")), ("evaluate", accuracy),
                 ("bench", throughput))  # fmt: skip
        failures = [
            f"{stage}: {line}"
            for stage, record in gated
            if record is not None and record.gate_failed
            for line in (record.gate or {}).get("failures", []) or ["gate failed"]
        ]
        if failures and not config.allow_failed_gates:
            raise StageError(
                f"publish: refusing to publish {name}: its gates failed:\n  "
                + "\n  ".join(failures)
                + "\nfix the model or the recipe's limits, or publish anyway with "
                "--allow-failed-gates (publish.allow_failed_gates: true), which records the "
                "failures in the manifest"
            )
        build_key = ctx.keys["build"]
        draft = Manifest(
            name=name,
            version="unpublished",
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            store=ctx.store.location,
            recipe=ctx.recipe.model_dump(mode="json"),
            lineage=_lineage(ctx),
            artifacts=_artifacts(ctx, build_key),
            accuracy=accuracy,
            throughput=throughput,
            failed_gates_allowed=failures,
            environment=_environment(),
        )
        try:
            registry = Registry(_registry_store(ctx.store, config))
            if registry.store is not ctx.store:
                from qpipe.store.transfer import copy_entries

                upstream = [r.key for r in (accuracy, throughput) if r is not None]
                copy_entries(ctx.store, registry.store, [build_key, *upstream])
                draft = draft.model_copy(update={"store": registry.store.location})
            published = registry.publish(draft, config.version)
        except (RegistryError, StoreError) as exc:
            raise StageError(f"publish: {exc}") from exc
        manifest = published.manifest
        summary = {
            "name": manifest.name,
            "version": manifest.version,
            "new_version": published.new,
            "registry": registry.store.location,
            "content_digest": manifest.content_digest,
            "artifacts": [a.model_dump() for a in manifest.artifacts],
            "failed_gates_allowed": manifest.failed_gates_allowed,
        }
        (ctx.out_dir / "publish.json").write_text(json.dumps(summary, indent=2))
        return StageResult(
            metrics={
                "version": manifest.version,
                "new_version": published.new,
                "artifacts": len(manifest.artifacts),
                "failed_gates_allowed": len(manifest.failed_gates_allowed),
            }
        )


def _registry_store(store: Store, config: PublishConfig) -> Store:
    if config.registry is None or config.registry == store.location:
        return store
    from qpipe.store.factory import open_store

    return open_store(config.registry, endpoint_url=config.endpoint_url)


def _entry(ctx: StageContext, stage: str) -> EntryMeta | None:
    key = ctx.keys.get(stage)
    return ctx.store.lookup(key) if key else None


def _stage_record(ctx: StageContext, stage: str) -> StageRecord | None:
    meta = _entry(ctx, stage)
    if meta is None:
        return None
    return StageRecord(key=meta.key, metrics=meta.metrics, gate=meta.gate)


def _lineage(ctx: StageContext) -> Lineage:
    convert = _entry(ctx, "convert")
    calibrate = _entry(ctx, "calibrate")
    calibration = calibrate.files.get("calibration.safetensors") if calibrate else None
    return Lineage(
        stage_keys=dict(ctx.keys),
        source=dict(convert.key_inputs.get("files") or {}) if convert else {},
        checkpoint_sha256={
            rel: record.sha256
            for rel, record in (convert.files.items() if convert else ())
            if rel.endswith(".safetensors")
        },
        calibration_set_sha256=calibration.sha256 if calibration else None,
    )


def _build_info(ctx: StageContext) -> dict[str, Any]:
    path = ctx.inputs.get("build", Path("/nonexistent")) / "build.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _artifacts(ctx: StageContext, build_key: str) -> list[ArtifactRecord]:
    """One record per target directory the build entry holds."""
    meta = ctx.store.lookup(build_key)
    if meta is None:
        raise StageError(f"publish: build entry {build_key[:12]} is not in {ctx.store.location}")
    info = _build_info(ctx)
    build = ctx.recipe.build
    records = []
    for target in info.get("targets") or build.targets:
        files = [r for rel, r in meta.files.items() if rel.startswith(f"{target}/")]
        if not files:
            continue
        records.append(
            ArtifactRecord(
                target=target,
                key=build_key,
                path=target,
                alias=info.get("alias"),
                arch=info.get("arch", build.arch),
                tp=info.get("tp", build.tp),
                pp=info.get("pp", build.pp),
                quant=info.get("quant", ctx.recipe.quantization.method),
                files=len(files),
                size=sum(r.size for r in files),
            )
        )
    if not records:
        raise StageError(
            f"publish: build entry {build_key[:12]} holds none of the targets "
            f"{', '.join(build.targets)}: nothing to publish"
        )
    return records


def _environment() -> dict[str, Any]:
    from qpipe.pipeline import environment

    return environment()
