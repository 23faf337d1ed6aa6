"""The registry: named, versioned manifests on top of a store, for CI jobs and serving fleets.

Documents: `registry/<name>/<version>/manifest.json` (immutable once written) and
`registry/<name>/latest` (the pointer, written after the manifest it points to). The artifacts
themselves stay store entries; a pull copies one target's files out of one entry, verified.
"""

from __future__ import annotations

import glob
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from qpipe.gpu import arch_name
from qpipe.registry.manifest import ArtifactRecord, Manifest, latest_doc, manifest_doc
from qpipe.store.base import DocumentExists, Store
from qpipe.store.entry import CorruptEntry

# A publish that loses the race for a version this many times in a row gives up, saying so.
PUBLISH_ATTEMPTS = 10


class RegistryError(Exception):
    """A registry request that cannot be served, with what exists instead."""


def parse_ref(ref: str) -> tuple[str, str | None]:
    """`name@version` or `name` (the latest version)."""
    name, _, version = ref.partition("@")
    if not name:
        raise RegistryError(f"{ref!r}: expected NAME or NAME@VERSION")
    return name, version or None


def _version_order(version: str) -> tuple[int, int, str]:
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    new: bool


@dataclass
class Registry:
    store: Store

    def names(self) -> list[str]:
        return sorted({doc.split("/")[1] for doc in self.store.list_documents("registry/")})

    def versions(self, name: str) -> list[str]:
        """Oldest first: integer versions numerically, then named ones."""
        found = [
            doc.split("/")[2]
            for doc in self.store.list_documents(f"registry/{name}/")
            if doc.endswith("/manifest.json") and doc.count("/") == 3
        ]
        return sorted(found, key=_version_order)

    def latest(self, name: str) -> str | None:
        data = self.store.read_document(latest_doc(name))
        return json.loads(data)["version"] if data else None

    def read(self, name: str, version: str | None = None) -> Manifest:
        version = version or self.latest(name)
        if version is None:
            known = ", ".join(self.names()) or "none"
            raise RegistryError(
                f"no artifact named {name!r} in {self.store.location} (published names: {known})"
            )
        data = self.store.read_document(manifest_doc(name, version))
        if data is None:
            versions = ", ".join(self.versions(name)) or "none"
            raise RegistryError(f"{name}@{version} does not exist (versions: {versions})")
        try:
            return Manifest.model_validate_json(data)
        except ValidationError as exc:
            raise RegistryError(f"{name}@{version}: unreadable manifest: {exc}") from exc

    def publish(
        self, draft: Manifest, version: str | None = None, make_latest: bool = True
    ) -> Published:
        """Store `draft` as `version` (default: the next integer) and point `latest` at it.
        Republishing content that an existing version already holds returns that version and
        points `latest` back at it: re-running a recipe after another one was published (a
        revert) must give consumers that recipe's artifacts again. A given version is immutable.
        `make_latest=False` leaves the pointer alone unless the name has none (a mirror's push
        of an older version).

        Concurrent publishers of one name: the version's manifest is created only if absent, so
        one wins it; the other reads the versions again and takes the next number (or finds its
        content published, or, for a named version, finds it taken)."""
        for _ in range(PUBLISH_ATTEMPTS):
            published = self._publish_once(draft, version)
            if published is not None:
                self._point_latest(draft.name, published.manifest.version, make_latest)
                return published
        raise RegistryError(
            f"{draft.name}: other publishers took {PUBLISH_ATTEMPTS} versions in a row while this "
            f"one was publishing to {self.store.location}: publish again (re-run the recipe)"
        )

    def _publish_once(self, draft: Manifest, version: str | None) -> Published | None:
        """One attempt; None when another publisher created the version first."""
        existing = {v: self.read(draft.name, v) for v in self.versions(draft.name)}
        digest = draft.content_digest
        for manifest in existing.values():
            if manifest.content_digest == digest and version in (None, manifest.version):
                return Published(manifest, new=False)
        if version is None:
            numbers = [int(v) for v in existing if v.isdigit()]
            version = str(max(numbers, default=0) + 1)
        elif version in existing:
            raise RegistryError(
                f"{draft.name}@{version} already exists with other content and versions are "
                "immutable: choose another publish.version, or leave it unset for the next one"
            )
        manifest = draft.model_copy(update={"version": version})
        try:
            self.store.create_document(
                manifest_doc(draft.name, version), manifest.model_dump_json(indent=2).encode()
            )
        except DocumentExists:
            return None
        return Published(manifest, new=True)

    def _point_latest(self, name: str, version: str, make_latest: bool) -> None:
        """`latest` := version (written only when it changes: a re-run that republishes nothing
        writes nothing); without `make_latest`, only where the name has no latest yet."""
        current = self.latest(name)
        if current != version and (make_latest or current is None):
            self.store.write_document(latest_doc(name), json.dumps({"version": version}).encode())

    def referenced_keys(self) -> set[str]:
        """Every store entry a published version names (its artifacts and reports): what a
        store's gc must keep whatever recipes it is told to keep."""
        keys: set[str] = set()
        for name in self.names():
            for version in self.versions(name):
                manifest = self.read(name, version)
                keys |= {a.key for a in manifest.artifacts}
                keys |= {r.key for r in (manifest.accuracy, manifest.throughput) if r is not None}
        return keys

    def push(self, ref: str, target: Registry) -> Published:
        """Copy one version (manifest and every entry it names, verified) to another registry."""
        from qpipe.store.transfer import copy_entries

        name, version = parse_ref(ref)
        manifest = self.read(name, version)
        reports = [r.key for r in (manifest.accuracy, manifest.throughput) if r is not None]
        try:
            copy_entries(self.store, target.store, [a.key for a in manifest.artifacts] + reports)
        except CorruptEntry as exc:
            raise RegistryError(f"{name}@{manifest.version} cannot be pushed: {exc}") from exc
        copied = manifest.model_copy(update={"store": target.store.location})
        # the mirror's latest follows the source's: pushing an older version adds it, and
        # moves nothing backwards
        return target.publish(copied, manifest.version, self.latest(name) == manifest.version)

    def find(
        self, ref: str, target: str, arch: str | None = None
    ) -> tuple[Manifest, ArtifactRecord]:
        """The artifact for `target` (and `arch`, named as arch_name() does: "cpu" or "none" for
        a CPU build): in the named version, or else the newest version that has one. Without
        `arch`, any arch will do."""
        name, version = parse_ref(ref)
        if version is not None:
            candidates = [self.read(name, version)]
        else:
            latest = self.read(name)
            others = [v for v in reversed(self.versions(name)) if v != latest.version]
            candidates = [latest, *(self.read(name, v) for v in others)]
        for manifest in candidates:
            record = manifest.artifact(target, arch)
            if record is not None:
                return manifest, record
        have = sorted({f"{a.target} ({a.arch})" for m in candidates for a in m.artifacts})
        wanted = target + (f" for {arch_name(arch)}" if arch else "")
        raise RegistryError(f"{ref} has no {wanted} artifact (it has: {', '.join(have) or 'none'})")

    def pull(
        self, ref: str, target: str, dest: Path, arch: str | None = None
    ) -> tuple[Manifest, ArtifactRecord]:
        """Download exactly one artifact into `dest` (new or empty), every file verified; `dest`
        appears only once the whole artifact is there."""
        manifest, record = self.find(ref, target, arch)
        if dest.exists() and not dest.is_dir():
            raise RegistryError(f"{dest} is a file, not a directory: pull into a new directory")
        if dest.exists() and any(dest.iterdir()):
            raise RegistryError(f"{dest} is not empty: pull into a new directory")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where a parent should be, or no permission
            raise RegistryError(
                f"cannot create the directory {dest.parent} ({exc.strerror}): pull into a new "
                "directory under one you can write to"
            ) from exc
        # NOTE: removes what interrupted pulls into this dest left (killed mid-download); a pull
        # into the same dest at the same moment loses its partial, but one of the two fails anyway
        for leftover in dest.parent.glob(f".{glob.escape(dest.name)}.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        partial = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            self.store.fetch(record.key, partial, record.path)
            if dest.exists():
                dest.rmdir()
            partial.rename(dest)
        except CorruptEntry as exc:
            raise RegistryError(
                f"{manifest.name}@{manifest.version} {target}: {exc}; the store entry must be "
                f"rebuilt: `qpipe cache verify --quarantine --store {self.store.location}` moves "
                "it aside, then `qpipe run RECIPE` rebuilds and republishes it (a run "
                "of a finished recipe does not checksum its cached entries again)"
            ) from exc
        except KeyError as exc:
            raise RegistryError(
                f"{manifest.name}@{manifest.version} {target}: store entry {record.key[:12]} is "
                f"missing from {self.store.location} ({exc.args[0]})"
            ) from exc
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return manifest, record
