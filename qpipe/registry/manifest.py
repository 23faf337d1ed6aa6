"""What a registry version records: where its artifacts are, where they came from, how they did.

Consumers (CI jobs, serving fleets) read only this document, so it names every artifact by store
key and alias, with its target, GPU arch and parallelism, and carries the lineage and the results
that justified publishing it — including any failed gate that was explicitly overridden.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field, field_validator

from qpipe.gpu import arch_name


def manifest_doc(name: str, version: str) -> str:
    return f"registry/{name}/{version}/manifest.json"


def latest_doc(name: str) -> str:
    return f"registry/{name}/latest"


class ArtifactRecord(BaseModel):
    """One build target: the files under `path` inside the build entry `key`."""

    target: str
    key: str
    path: str
    alias: str | None = None
    arch: str | None = None
    tp: int = 1
    pp: int = 1
    quant: str | None = None
    files: int
    size: int

    @field_validator("arch")
    @classmethod
    def _arch(cls, value: str | None) -> str | None:
        """One name per arch (a CPU build is "cpu"), whether the build recorded "none" (what
        detection returns) or the manifest was published before: `ls`, `pull --arch` and the
        content digest then agree across old and new versions."""
        return arch_name(value) if value is not None else None


class StageRecord(BaseModel):
    """An upstream stage's entry: its key, measured metrics and gate verdict."""

    key: str
    metrics: dict[str, Any] = Field(default_factory=dict)
    gate: dict[str, Any] | None = None

    @property
    def gate_failed(self) -> bool:
        return self.gate is not None and not self.gate.get("passed", True)


class Lineage(BaseModel):
    stage_keys: dict[str, str]
    source: dict[str, Any] = Field(
        default_factory=dict, description="The convert stage's key inputs: source file hashes."
    )
    checkpoint_sha256: dict[str, str] = Field(default_factory=dict)
    calibration_set_sha256: str | None = None


class Manifest(BaseModel):
    name: str
    version: str
    created: str
    store: str
    recipe: dict[str, Any]
    lineage: Lineage
    artifacts: list[ArtifactRecord]
    accuracy: StageRecord | None = None
    throughput: StageRecord | None = None
    failed_gates_allowed: list[str] = Field(default_factory=list)
    environment: dict[str, Any] = Field(default_factory=dict)

    @property
    def content_digest(self) -> str:
        """What the version is about, without when/where it was published: equal digests mean
        republishing the same content, which reuses the existing version."""
        content = self.model_dump(
            mode="json",
            include={
                "recipe",
                "lineage",
                "artifacts",
                "accuracy",
                "throughput",
                "failed_gates_allowed",
            },  # fmt: skip
        )
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def artifact(self, target: str, arch: str | None = None) -> ArtifactRecord | None:
        """The first `target` artifact, built for `arch` when given ("none" and "cpu" both mean a
        CPU build)."""
        wanted = arch_name(arch) if arch is not None else None
        for record in self.artifacts:
            if record.target == target and (wanted is None or record.arch == wanted):
                return record
        return None
