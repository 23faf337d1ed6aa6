"""The store: bytes under content keys. It knows keys and files, not stages or recipes.

Entries become visible all at once (local: rename of a finished temp dir; S3: files first, marker
last), so a crash never leaves something that looks complete.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qpipe.store.entry import EntryMeta

log = logging.getLogger(__name__)


class StoreError(Exception):
    """The store cannot be used (unreachable, no permission, bad location)."""


class DocumentExists(StoreError):
    """create_document found the name taken: another writer got there first (a concurrent publish
    of the same registry version), and what it wrote stays."""

    def __init__(self, name: str, location: str):
        self.name = name
        super().__init__(f"document {name} already exists in {location}")


class DanglingAlias(StoreError):
    """An alias whose entry is gone (removed by gc, quarantined, lost): says which, and what to do,
    instead of a KeyError or a "vanished during the copy" far from the cause."""

    def __init__(self, alias: str, key: str, location: str):
        self.alias, self.key, self.location = alias, key, location
        super().__init__(
            f"alias {alias!r} points at entry {key[:12]}, which is no longer in {location} "
            "(garbage-collected, quarantined or deleted): rebuild it with "
            "`qpipe run` on its recipe (which moves the alias to the new entry), or drop the "
            "alias with `qpipe cache gc`, which removes aliases whose entry is gone"
        )


class MalformedAlias(StoreError):
    """An alias record that is not a JSON object with a "key" (a hand edit, a disk error): it names
    the file, so listing can skip it and gc can remove it instead of every command crashing."""

    def __init__(self, where: str, problem: str):
        self.where = where
        super().__init__(
            f"alias record {where} is unreadable ({problem}): fix or delete it, or run "
            "`qpipe cache gc`, which removes unreadable alias records"
        )


def parse_alias_record(where: str, data: bytes) -> dict[str, Any]:
    """The alias record stored at `where`, or MalformedAlias saying what is wrong with it."""
    try:
        record = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise MalformedAlias(where, f"not JSON: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise MalformedAlias(where, 'not a JSON object with a "key"')
    return record


def readable_aliases(
    names: Iterable[str], read: Callable[[str], dict[str, Any] | None]
) -> dict[str, dict[str, Any]]:
    """The records `read` finds for `names`; an unreadable one is logged, naming it, and left out
    (listing must not stop at one bad file; gc removes it)."""
    found = {}
    for alias in names:
        try:
            record = read(alias)
        except MalformedAlias as exc:
            log.warning("warning: %s; skipping it", exc)
            continue
        if record is not None:
            found[alias] = record
    return found


class Store(ABC):
    """Content-addressed entries, human aliases, and small named documents (manifests, registry)."""

    location: str

    @abstractmethod
    def lookup(self, key: str) -> EntryMeta | None:
        """The committed entry's marker, or None. Cheap: no checksums."""

    @abstractmethod
    def local_copy(self, key: str) -> Path | None:
        """Where the committed entry already is on this machine (no download), or None."""

    @abstractmethod
    def open(self, key: str, verify: bool = True) -> Path:
        """A local directory holding the entry's files, checksums verified; CorruptEntry if not."""

    @abstractmethod
    def verify(self, key: str) -> None:
        """Checksum the entry where it lives (for S3, the bucket's files, not the download
        cache's copy); CorruptEntry if a file does not match, KeyError if the entry is gone."""

    @abstractmethod
    @contextmanager
    def writer(self, key: str, stage: str) -> Iterator[Path]:
        """An empty temp dir to build the entry in; use commit() from inside the block."""

    @abstractmethod
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
        """Publish `built` under key. If another process committed it first, theirs is kept.

        With `replace` (a forced rebuild), an entry already under key is swapped for `built`
        only now that `built` is complete, so an interrupted rebuild leaves the old entry, and
        the aliases and registry artifacts that point at it, intact. What a reader sees during
        the swap depends on the store: see each store's commit."""

    @abstractmethod
    def import_entry(self, meta: EntryMeta, files: Path) -> EntryMeta:
        """Commit a copy of another store's entry (`files` holds it, verified), keeping its marker.

        Used by push/pull and the two-tier store; if the key exists here already, that entry stays.
        """

    @abstractmethod
    def fetch(self, key: str, dest: Path, prefix: str = "") -> EntryMeta:
        """Copy the entry's files below `prefix` into `dest` (prefix stripped), checksums verified.

        One artifact out of a multi-target entry, without downloading the others.
        """

    @abstractmethod
    def quarantine(self, key: str, reason: str) -> None:
        """Move a corrupt entry out of the way so the next run rebuilds it."""

    @abstractmethod
    def entries(self) -> Iterator[EntryMeta]: ...

    @abstractmethod
    def remove(self, key: str) -> None: ...

    @abstractmethod
    def gc(self, keep: set[str] | None = None) -> list[str]:
        """Remove abandoned temp dirs and quarantined entries (and, given `keep`, all others),
        then every alias whose entry is gone or whose record is unreadable (`aliases/<name>` in
        the result), so no alias is left pointing at nothing."""

    @abstractmethod
    def set_alias(self, alias: str, key: str, info: dict[str, Any]) -> None: ...

    @abstractmethod
    def resolve_alias(self, alias: str) -> dict[str, Any] | None:
        """The alias record ({"key": ..., plus info}), or None; DanglingAlias when the alias
        exists but its entry does not, MalformedAlias when its record is unreadable."""

    @abstractmethod
    def aliases(self) -> dict[str, dict[str, Any]]:
        """Every alias record as stored, dangling ones included (gc drops those); an unreadable
        record is logged as a warning naming it and left out (gc removes it)."""

    def _checked_alias(self, alias: str, record: dict[str, Any] | None) -> dict[str, Any] | None:
        """`record` if its entry exists here; a resolved alias is about to be opened, and a
        missing entry must name the alias rather than surface later as a bare key."""
        if record is not None and self.lookup(record["key"]) is None:
            raise DanglingAlias(alias, record["key"], self.location)
        return record

    @abstractmethod
    def write_document(self, name: str, data: bytes) -> None:
        """A small named document (run manifests, registry entries), written atomically."""

    @abstractmethod
    def create_document(self, name: str, data: bytes) -> None:
        """Write a document only if `name` does not exist yet, atomically with that check;
        DocumentExists otherwise. What makes a registry version immutable under concurrent
        publishers: the loser learns it lost instead of overwriting the winner."""

    @abstractmethod
    def read_document(self, name: str) -> bytes | None: ...

    @abstractmethod
    def list_documents(self, prefix: str) -> list[str]: ...

    @property
    def local_root(self) -> Path | None:
        """The local directory behind this store, where one exists (for SQLite history etc.)."""
        return None
