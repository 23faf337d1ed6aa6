"""What a committed store entry records about itself (its `meta.json` commit marker)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

MARKER = "meta.json"
CHUNK = 1 << 20


class FileRecord(BaseModel):
    size: int
    sha256: str


class EntryMeta(BaseModel):
    """Written last: an entry without a readable marker does not exist for readers."""

    key: str
    stage: str
    created: str
    files: dict[str, FileRecord]
    metrics: dict[str, Any] = Field(default_factory=dict)
    gate: dict[str, Any] | None = None
    key_inputs: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of_built(
        cls,
        key: str,
        stage: str,
        built: Path,
        metrics: dict[str, Any],
        gate: dict[str, Any] | None,
        key_inputs: dict[str, Any],
    ) -> EntryMeta:
        """The marker for a finished build directory: its files' sizes and checksums, now."""
        return cls(
            key=key,
            stage=stage,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            files=record_files(built),
            metrics=metrics,
            gate=gate,
            key_inputs=key_inputs,
        )

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


class CorruptEntry(Exception):
    """An entry whose files do not match its marker; it must be rebuilt, never used."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"store entry {key[:12]} is corrupt: {problem}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_files(root: Path) -> dict[str, FileRecord]:
    """Size and checksum of every file below root (the marker itself excluded)."""
    records = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MARKER:
            records[rel] = FileRecord(size=path.stat().st_size, sha256=sha256_file(path))
    return records


def verify_files(root: Path, meta: EntryMeta, full: bool = True) -> None:
    """Raise CorruptEntry if a file is missing, has another size, or (full) another checksum."""
    for rel, record in meta.files.items():
        path = root / rel
        if not path.is_file():
            raise CorruptEntry(meta.key, f"{rel} is missing")
        size = path.stat().st_size
        if size != record.size:
            raise CorruptEntry(meta.key, f"{rel} has {size} bytes, expected {record.size}")
        if full and sha256_file(path) != record.sha256:
            raise CorruptEntry(meta.key, f"{rel} does not match its checksum")


def select_files(meta: EntryMeta, prefix: str) -> dict[str, FileRecord]:
    """The entry's files below `prefix` (a directory inside the entry), keyed by path under it."""
    prefix = prefix.strip("/")
    if not prefix:
        return dict(meta.files)
    selected = {
        rel[len(prefix) + 1 :]: record
        for rel, record in meta.files.items()
        if rel.startswith(prefix + "/")
    }
    if not selected:
        tops = sorted({rel.split("/")[0] for rel in meta.files if "/" in rel})
        raise KeyError(
            f"entry {meta.key[:12]} has no directory {prefix!r} "
            f"(it has: {', '.join(tops) or 'none'})"
        )
    return selected
