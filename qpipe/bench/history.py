"""Every benchmark result, in a SQLite file in the store (`<store>/bench/history.sqlite`).

One row per load level: which artifact (alias), on which hardware, under which load profile, the
scalar figures, when, and whether someone accepted it as a baseline. Comparisons only ever look at
rows with the same alias, hardware and profile: numbers from different boxes or shapes never mix.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    alias TEXT NOT NULL,
    hardware TEXT NOT NULL,
    profile TEXT NOT NULL,
    metrics TEXT NOT NULL,
    created TEXT NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS runs_key ON runs (alias, hardware, profile, id);
"""


@dataclass(frozen=True)
class HistoryRow:
    id: int
    alias: str
    hardware: str
    profile: str
    metrics: dict[str, float]
    created: str
    accepted: bool


def history_path(store_dir: Path) -> Path:
    return store_dir / "bench" / "history.sqlite"


def hardware_string() -> str:
    """What the numbers were measured on: GPU names when there are GPUs, else the CPU model and core
    count (a benchmark of the same artifact on a different box is a different series)."""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.split("\n")
            gpus = [n.strip() for n in names if n.strip()]
            if gpus:
                return f"{len(gpus)}x {gpus[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    return f"cpu:{cpu_model()} x{os.cpu_count()}"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class History:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        try:
            with db:
                yield db
        finally:
            db.close()

    def record(
        self,
        alias: str,
        hardware: str,
        profile: str,
        metrics: dict[str, object],
        accepted: bool = False,
        created: str | None = None,
    ) -> int:
        created = created or dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            cursor = db.execute(
                "INSERT INTO runs (alias, hardware, profile, metrics, created, accepted) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (alias, hardware, profile, json.dumps(metrics), created, int(accepted)),
            )
            return int(cursor.lastrowid or 0)

    def accept(self, run_id: int) -> None:
        with self._connect() as db:
            if db.execute("UPDATE runs SET accepted = 1 WHERE id = ?", (run_id,)).rowcount == 0:
                raise KeyError(f"no benchmark run with id {run_id} in {self.path}")

    def get(self, run_id: int) -> HistoryRow:
        rows = self._select("id = ?", (run_id,))
        if not rows:
            raise KeyError(f"no benchmark run with id {run_id} in {self.path}")
        return rows[0]

    def runs(self, alias: str | None = None, limit: int = 50) -> list[HistoryRow]:
        """Newest first."""
        if alias is None:
            return self._select("1", (), limit)
        return self._select("alias = ?", (alias,), limit)

    def series(
        self, alias: str, hardware: str, profile: str, accepted_only: bool = False
    ) -> list[HistoryRow]:
        """Runs of one (alias, hardware, profile), newest first."""
        where = "alias = ? AND hardware = ? AND profile = ?"
        if accepted_only:
            where += " AND accepted = 1"
        return self._select(where, (alias, hardware, profile))

    def _select(self, where: str, args: tuple, limit: int = -1) -> list[HistoryRow]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT id, alias, hardware, profile, metrics, created, accepted FROM runs "
                f"WHERE {where} ORDER BY id DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [
            HistoryRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], bool(r[6])) for r in rows
        ]
