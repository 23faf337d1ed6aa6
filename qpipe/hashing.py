"""Content hashes of input files, remembered by (path, size, mtime, inode).

Keys must follow content, not paths, but re-hashing a 140 GB checkpoint on every `qpipe plan` would
make a no-op re-run take minutes; like DVC, a file whose stat is unchanged keeps its hash.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping
from pathlib import Path

from qpipe.store.entry import sha256_file


class HashCache:
    def __init__(self, db_path: Path | None):
        self._db: sqlite3.Connection | None = None
        if db_path is not None:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(db_path, timeout=30, isolation_level=None)
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS hashes (path TEXT PRIMARY KEY, size INTEGER, "
                "mtime_ns INTEGER, inode INTEGER, sha256 TEXT)"
            )

    def file_hash(self, path: Path) -> str:
        path = path.resolve()
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self._db is not None:
            row = self._db.execute(
                "SELECT size, mtime_ns, inode, sha256 FROM hashes WHERE path = ?", (str(path),)
            ).fetchone()
            if row is not None and tuple(row[:3]) == stamp:
                return row[3]
        digest = sha256_file(path)
        if self._db is not None:
            self._db.execute(
                "INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?)", (str(path), *stamp, digest)
            )
        return digest

    def files_hash(self, inputs: Mapping[str, Path]) -> dict[str, str]:
        """role → sha256 for each input file; a directory contributes every file below it, as
        role/relative path. Keyed by the role a file plays, not its name: the same bytes renamed
        or moved keep the key, and two inputs that share a name are both in it."""
        hashes: dict[str, str] = {}
        for role, path in inputs.items():
            if not path.is_dir():
                hashes[role] = self.file_hash(path)
                continue
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                hashes[f"{role}/{file.relative_to(path).as_posix()}"] = self.file_hash(file)
        return dict(sorted(hashes.items()))


def digest_json(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
