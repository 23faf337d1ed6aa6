"""Two tiers: a local store in front of an S3 store (`store.local_cache` with an s3:// location).

Lookups try the local tier first (no network for what this machine has), a remote hit is downloaded
once into the local tier, and every commit lands locally and is pushed to S3, so a CI job with a
hit downloads instead of rebuilding and a job with a miss shares what it built.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qpipe.store.base import Store, StoreError
from qpipe.store.entry import CorruptEntry, EntryMeta
from qpipe.store.local import LocalStore
from qpipe.store.s3 import S3Store

log = logging.getLogger(__name__)
# The local tier's directory of entries committed here and not yet in the bucket (_unshared).
UNSHARED = "unshared"


class TieredStore(Store):
    def __init__(self, remote: S3Store):
        self.remote = remote
        self.local: LocalStore = remote.cache  # the remote's download cache is the local tier
        self.location = remote.location

    @property
    def local_root(self) -> Path:
        return self.local.root

    def lookup(self, key: str) -> EntryMeta | None:
        return self.local.lookup(key) or self.remote.lookup(key)

    def local_copy(self, key: str) -> Path | None:
        return self.local.local_copy(key)

    def open(self, key: str, verify: bool = True) -> Path:
        if self.local.lookup(key) is not None:
            try:
                path = self.local.open(key, verify)
            except CorruptEntry as exc:
                if self.remote.lookup(key) is None:
                    raise
                self.local.quarantine(key, f"local tier: {exc.problem}")
            else:
                self._share_if_unshared(key)
                return path
        return self.remote.open(key, verify)

    def _unshared(self, key: str) -> Path:
        """Marks an entry committed here whose upload has not finished: written before the
        upload, removed after it, so a bucket that was unreachable (or a run killed between the
        two) leaves a note that the next open acts on, without asking the bucket every time."""
        return self.local.root / UNSHARED / key

    def _share_if_unshared(self, key: str) -> None:
        if not self._unshared(key).exists():
            return
        try:
            meta = self.local.lookup(key)
            if meta is not None and self.remote.lookup(key) is None:
                self.remote.import_entry(meta, self.local.open(key, verify=False))
        except StoreError as exc:
            log.warning("%s is still not shared to %s: %s", key[:12], self.remote.location, exc)
            return
        self._unshared(key).unlink(missing_ok=True)

    def verify(self, key: str) -> None:
        """Each tier that holds the entry (KeyError if neither does): either copy can be the
        corrupt one. quarantine() then moves both aside."""
        held = [tier for tier in (self.local, self.remote) if tier.lookup(key) is not None]
        if not held:
            raise KeyError(key)
        for tier in held:
            tier.verify(key)

    def fetch(self, key: str, dest: Path, prefix: str = "") -> EntryMeta:
        if self.local.lookup(key) is not None:
            return self.local.fetch(key, dest, prefix)
        return self.remote.fetch(key, dest, prefix)

    @contextmanager
    def writer(self, key: str, stage: str) -> Iterator[Path]:
        with self.local.writer(key, stage) as tmp:
            yield tmp

    def commit(
        self,
        key: str,
        stage: str,
        built: Path,
        metrics: dict[str, Any],
        gate: dict[str, Any] | None,
        key_inputs: dict[str, Any],
        replace: bool = False,
    ) -> EntryMeta:
        """With `replace`, each tier swaps its entry as LocalStore and S3Store do, local tier
        first: if the bucket cannot be reached the new build is cached here and the bucket keeps
        the old one, still complete."""
        self._unshared(key).parent.mkdir(exist_ok=True)
        self._unshared(key).touch()
        meta = self.local.commit(key, stage, built, metrics, gate, key_inputs, replace)
        try:
            published = self.remote.import_entry(meta, self.local.open(key, verify=False), replace)
        except StoreError as exc:
            share = (
                "Force the rebuild again to replace the bucket's copy"
                if replace
                else "The next run that uses it shares it, or now: `qpipe cache push "
                f"{key[:12]} --store {self.local.location} --to {self.remote.location}`"
            )
            raise StoreError(
                f"{stage} {key[:12]} is cached locally in {self.local.location} but was not "
                f"shared: {exc}. {share}"
            ) from exc
        self._unshared(key).unlink(missing_ok=True)
        if published.files != meta.files:
            # another machine committed first: use its bytes, as every other machine will
            self.local.remove(key)
            self.remote.open(key)
            return published
        return meta

    def import_entry(self, meta: EntryMeta, files: Path) -> EntryMeta:
        local = self.local.import_entry(meta, files)
        self.remote.import_entry(local, self.local.open(meta.key, verify=False))
        return local

    def quarantine(self, key: str, reason: str) -> None:
        self.local.quarantine(key, reason)
        self.remote.quarantine(key, reason)

    def entries(self) -> Iterator[EntryMeta]:
        seen = set()
        for meta in self.local.entries():
            seen.add(meta.key)
            yield meta
        for meta in self.remote.entries():
            if meta.key not in seen:
                yield meta

    def remove(self, key: str) -> None:
        self.remote.remove(key)
        self.local.remove(key)

    def gc(self, keep: set[str] | None = None) -> list[str]:
        """Prunes the local tier by `keep`; in the shared bucket only garbage (other machines'
        entries are not this run's to judge — prune the bucket with `--store s3://...` itself).
        Each tier drops its own aliases whose entry it lost; a local alias copy can go while the
        bucket still holds the entry, since resolve_alias reads the bucket's alias first."""
        return self.local.gc(keep) + self.remote.gc_remote(None)

    def set_alias(self, alias: str, key: str, info: dict[str, Any]) -> None:
        self.local.set_alias(alias, key, info)
        self.remote.set_alias(alias, key, info)

    def resolve_alias(self, alias: str) -> dict[str, Any] | None:
        """The bucket's record, else the local tier's (an entry that was built here but not
        shared); an entry in either tier will do, since open() downloads a remote one."""
        records = [self.remote._alias_record(alias), self.local._alias_record(alias)]
        for record in records:
            if record is not None and self.lookup(record["key"]) is not None:
                return record
        return self._checked_alias(alias, next((r for r in records if r is not None), None))

    def aliases(self) -> dict[str, dict[str, Any]]:
        return {**self.local.aliases(), **self.remote.aliases()}

    def write_document(self, name: str, data: bytes) -> None:
        self.local.write_document(name, data)
        self.remote.write_document(name, data)

    def create_document(self, name: str, data: bytes) -> None:
        """The bucket decides who created it (it is what every machine reads); the local tier
        keeps a copy."""
        self.remote.create_document(name, data)
        self.local.write_document(name, data)

    def read_document(self, name: str) -> bytes | None:
        remote = self.remote.read_document(name)
        return remote if remote is not None else self.local.read_document(name)

    def list_documents(self, prefix: str) -> list[str]:
        return sorted(
            set(self.local.list_documents(prefix)) | set(self.remote.list_documents(prefix))
        )
