"""The local directory store (default): `$QPIPE_HOME` or `~/.cache/qpipe`.

Layout: objects/<kk>/<key>/ (files + meta.json), tmp/ (entries being built), corrupt/
(quarantined), aliases/<alias>.json, docs/<name> (manifests, registry). A commit is one rename(2) of
a finished temp directory that already holds its marker, so readers see all of an entry or none.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qpipe.store.base import (
    DocumentExists,
    MalformedAlias,
    Store,
    StoreError,
    parse_alias_record,
    readable_aliases,
)
from qpipe.store.entry import MARKER, EntryMeta, select_files, verify_files

LOCK_SUFFIX = ".lock"
# A lock file older than this whose directory is gone is left over, not one being set up.
ORPHAN_LOCK_S = 3600


def default_home() -> Path:
    return Path(os.environ.get("QPIPE_HOME", Path.home() / ".cache" / "qpipe")).expanduser()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive flock on `lock` for the block: the kernel drops it when the holder dies, in
    any PID namespace, so `gc` on a store shared between containers (or a run that was PID 1)
    tells a live writer from a dead one by trying the lock, where a PID in a name cannot."""
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _lock_held(lock: Path) -> bool | None:
    """Whether a live process holds `lock`; None when there is no such file."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _in_use(tmp: Path) -> bool:
    """Whether a tmp/ directory's writer lives: its lock is held. Directories without a lock (an
    entry moved aside for a few milliseconds by a replacing commit, or one from a qpipe before
    the locks) fall back to the PID in their name."""
    held = _lock_held(tmp.with_name(tmp.name + LOCK_SUFFIX))
    if held is not None:
        return held
    pid = tmp.name.rsplit(".", 2)[-2] if tmp.name.count(".") >= 2 else ""
    return pid.isdigit() and _pid_alive(int(pid))


def _drop_orphan_lock(lock: Path) -> None:
    """Remove a lock whose directory is gone (its writer was killed between the two removals),
    once it is old enough not to be a writer's that is still creating its directory."""
    if lock.with_name(lock.name.removesuffix(LOCK_SUFFIX)).exists():
        return
    try:
        young = time.time() - lock.stat().st_mtime < ORPHAN_LOCK_S
    except FileNotFoundError:
        return  # its writer finished meanwhile
    if not young and not _lock_held(lock):
        lock.unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes, exclusive: bool = False) -> bool:
    """Write a temp file, then move it into place: readers see the old file or the new, never
    half of one. `exclusive` hard-links it instead, which never replaces an existing file: False
    then means `path` was there already (left as it is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(data)
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


class LocalStore(Store):
    def __init__(self, root: Path, create: bool = True):
        """`create=False` for a store that is only read from (a copy's source): a mistyped path
        is then an error instead of a new, empty store that silently has nothing."""
        self.root = root.expanduser().resolve()
        self.location = str(self.root)
        if not create and not (self.root / "objects").is_dir():
            problem = "is not a store" if self.root.exists() else "does not exist"
            raise StoreError(
                f"no store at {self.root}: the directory {problem} (a store holds objects/, "
                "aliases/ and docs/); check the path, e.g. with `qpipe cache ls --store DIR`"
            )
        try:
            for sub in ("objects", "tmp", "corrupt", "aliases", "docs"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot use {self.root} as a store: {exc.strerror}") from exc

    @property
    def local_root(self) -> Path:
        return self.root

    def _entry_dir(self, key: str) -> Path:
        return self.root / "objects" / key[:2] / key

    def lookup(self, key: str) -> EntryMeta | None:
        marker = self._entry_dir(key) / MARKER
        try:
            return EntryMeta.model_validate_json(marker.read_bytes())
        except (OSError, ValidationError, ValueError):
            return None

    def local_copy(self, key: str) -> Path | None:
        return self._entry_dir(key) if self.lookup(key) is not None else None

    def open(self, key: str, verify: bool = True) -> Path:
        meta = self.lookup(key)
        if meta is None:
            raise KeyError(key)
        path = self._entry_dir(key)
        verify_files(path, meta, full=verify)
        return path

    def verify(self, key: str) -> None:
        self.open(key, verify=True)

    @contextmanager
    def writer(self, key: str, stage: str) -> Iterator[Path]:
        tmp = self.root / "tmp" / f"{stage}-{key[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with _held(tmp.with_name(tmp.name + LOCK_SUFFIX)):  # before the directory: gc sees both
            tmp.mkdir(parents=True)
            try:
                yield tmp
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

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
        """With `replace`, the old entry is renamed aside and the new one renamed in right after:
        a reader in the instant between sees a miss, never a partial entry, and only a crash in
        that instant loses the old entry (tmp/, for gc) without installing the new one."""
        meta = EntryMeta.of_built(key, stage, built, metrics, gate, key_inputs)
        return self.adopt(meta, built, replace)

    def adopt(self, meta: EntryMeta, built: Path, replace: bool = False) -> EntryMeta:
        """Publish `built` (already holding meta's files, checked by the caller) with `meta` as its
        marker: how downloads and copies from other stores land here without hashing twice.
        `replace` swaps out an entry already under the key (see commit)."""
        marker = built / MARKER
        marker.unlink(missing_ok=True)  # a new file, never one hard-linked from another entry
        marker.write_text(meta.model_dump_json(indent=2))
        final = self._entry_dir(meta.key)
        final.parent.mkdir(parents=True, exist_ok=True)
        old = self._move_aside(final, meta.key) if replace else None
        try:
            os.rename(built, final)
        except OSError:
            existing = self.lookup(meta.key)
            if existing is None:
                if old is not None:
                    os.rename(old, final)  # the new entry cannot go in: keep the old one
                raise
            published = existing  # another process won the race; its entry is equivalent
        else:
            published = meta
            built.mkdir()  # the writer's cleanup expects its directory
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return published

    def _move_aside(self, entry: Path, key: str) -> Path | None:
        """Rename a committed entry into tmp/ (named like a writer's dir, so gc leaves it alone
        while this process lives); None when there is no entry to move."""
        aside = self.root / "tmp" / f"replacing-{key[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, aside)
        except FileNotFoundError:
            return None
        return aside

    def import_entry(self, meta: EntryMeta, files: Path) -> EntryMeta:
        existing = self.lookup(meta.key)
        if existing is not None:
            return existing
        with self.writer(meta.key, meta.stage) as tmp:
            for rel in meta.files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(files / rel, tmp / rel)
            verify_files(tmp, meta, full=False)
            return self.adopt(meta, tmp)

    def fetch(self, key: str, dest: Path, prefix: str = "") -> EntryMeta:
        meta = self.lookup(key)
        if meta is None:
            raise KeyError(key)
        prefix = prefix.strip("/")
        selected = select_files(meta, prefix)
        src = self._entry_dir(key) / prefix
        for rel in selected:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dest / rel)
        verify_files(dest, meta.model_copy(update={"files": selected}))
        return meta

    def quarantine(self, key: str, reason: str) -> None:
        src = self._entry_dir(key)
        if src.exists():
            dst = self.root / "corrupt" / f"{key}.{int(time.time())}"
            os.rename(src, dst)
            (dst / "QUARANTINED").write_text(reason + "\n")

    def entries(self) -> Iterator[EntryMeta]:
        for marker in sorted((self.root / "objects").glob(f"*/*/{MARKER}")):
            meta = self.lookup(marker.parent.name)
            if meta is not None:
                yield meta

    def remove(self, key: str) -> None:
        src = self._entry_dir(key)
        if src.exists():
            doomed = self.root / "tmp" / f"removing-{key}.{uuid.uuid4().hex[:8]}"
            os.rename(src, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def gc(self, keep: set[str] | None = None) -> list[str]:
        """With `keep`, refused while any stage is being built here: that run reads entries of
        its own recipe, which `keep` (the recipes named) may not hold."""
        if keep is not None:
            busy = sorted(t.name for t in (self.root / "tmp").iterdir()
                          if not t.name.endswith(LOCK_SUFFIX) and _in_use(t))  # fmt: skip
            if busy:
                raise StoreError(
                    f"a run is building in {self.root} (tmp/{busy[0]}); deleting the entries "
                    "other recipes use could remove what it reads next. Run `cache gc "
                    "--keep-recipe` when no run is in progress (plain `cache gc` is safe now)"
                )
        removed = []
        for tmp in (self.root / "tmp").iterdir():
            if tmp.name.endswith(LOCK_SUFFIX):
                _drop_orphan_lock(tmp)
                continue
            if _in_use(tmp):
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.with_name(tmp.name + LOCK_SUFFIX).unlink(missing_ok=True)
            removed.append(f"tmp/{tmp.name}")
        for bad in (self.root / "corrupt").iterdir():
            shutil.rmtree(bad, ignore_errors=True)
            removed.append(f"corrupt/{bad.name}")
        if keep is not None:
            for meta in list(self.entries()):
                if meta.key not in keep:
                    self.remove(meta.key)
                    removed.append(f"objects/{meta.key}")
        return removed + self._drop_dangling_aliases()

    def _drop_dangling_aliases(self) -> list[str]:
        """Delete aliases whose entry is gone: left behind, they are listed by `cache ls --json`
        and make `cache push ALIAS` fail far from the cause. A run commits its entry before it
        moves the alias, so only an alias moved in the instant between check and unlink is lost."""
        removed = []
        for path in sorted((self.root / "aliases").glob("*.json")):
            try:
                record = self._alias_record(path.stem)
            except MalformedAlias:
                path.unlink(missing_ok=True)
                removed.append(f"aliases/{path.stem} (unreadable record)")
                continue
            if record is None or self.lookup(record["key"]) is not None:
                continue
            path.unlink(missing_ok=True)
            removed.append(f"aliases/{path.stem}")
        return removed

    def set_alias(self, alias: str, key: str, info: dict[str, Any]) -> None:
        record = {"key": key, **info}
        _write_atomic(
            self.root / "aliases" / f"{alias}.json", json.dumps(record, indent=2).encode()
        )

    def resolve_alias(self, alias: str) -> dict[str, Any] | None:
        return self._checked_alias(alias, self._alias_record(alias))

    def _alias_record(self, alias: str) -> dict[str, Any] | None:
        """The stored record, whether or not its entry exists (resolve_alias checks that)."""
        path = self.root / "aliases" / f"{alias}.json"
        try:
            return parse_alias_record(str(path), path.read_bytes())
        except FileNotFoundError:
            return None

    def aliases(self) -> dict[str, dict[str, Any]]:
        names = (path.stem for path in sorted((self.root / "aliases").glob("*.json")))
        return readable_aliases(names, self._alias_record)

    def write_document(self, name: str, data: bytes) -> None:
        self._write_document(name, data, exclusive=False)

    def create_document(self, name: str, data: bytes) -> None:
        if not self._write_document(name, data, exclusive=True):
            raise DocumentExists(name, self.location)

    def _write_document(self, name: str, data: bytes, exclusive: bool) -> bool:
        """A store this user cannot write (read-only mount, another owner) is a StoreError that
        names it, not an OSError traceback after the run's stages are done."""
        try:
            return _write_atomic(self._doc_path(name), data, exclusive)
        except OSError as exc:
            raise StoreError(
                f"cannot write {name} in the store {self.location} ({exc.strerror}: "
                f"{exc.filename}): this user must be able to write there; fix its permissions, "
                "or use another store (--store DIR)"
            ) from exc

    def read_document(self, name: str) -> bytes | None:
        path = self._doc_path(name)
        return path.read_bytes() if path.is_file() else None

    def list_documents(self, prefix: str) -> list[str]:
        base = self.root / "docs"
        return sorted(
            p.relative_to(base).as_posix()
            for p in base.glob(f"{prefix}**/*")
            if p.is_file() and not p.name.startswith(".")
        )

    def _doc_path(self, name: str) -> Path:
        path = (self.root / "docs" / name).resolve()
        if not path.is_relative_to(self.root / "docs"):
            raise StoreError(f"document name {name!r} leaves the store")
        return path
