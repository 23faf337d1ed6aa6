"""The local store's tmp/ liveness: gc tells a live writer from a dead one by its flock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qpipe.store.base import StoreError
from qpipe.store.local import LOCK_SUFFIX, LocalStore


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def test_gc_tells_live_writers_by_their_lock_not_their_pid(tmp_path: Path) -> None:
    """On a store shared by containers, a PID names another namespace's process (or none), and a
    run that was a container's PID 1 looks alive forever. gc removed a live writer's directory
    whose PID it could not see, and kept a killed PID-1 run's directory for good."""
    store = LocalStore(tmp_path / "store")
    tmp = store.root / "tmp"
    dead_pid_one = tmp / "quantize-0123456789abcdef.1.f3f53034"  # killed; PID 1 lives here
    dead_pid_one.mkdir()
    (tmp / (dead_pid_one.name + LOCK_SUFFIX)).touch()
    live = tmp / f"convert-0123456789abcdef.{_dead_pid()}.e87a6a44"  # alive elsewhere
    live.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom pathlib import Path\nfrom qpipe.store.local import _held\n"
         f"with _held(Path({str(live) + LOCK_SUFFIX!r})):\n"
         "    print('held', flush=True)\n    time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert store.gc() == [f"tmp/{dead_pid_one.name}"]
        assert live.is_dir() and not dead_pid_one.exists()
        assert sorted(p.name for p in tmp.iterdir()) == [live.name, live.name + LOCK_SUFFIX]
    finally:
        holder.kill()
        holder.wait()
    assert store.gc() == [f"tmp/{live.name}"]  # its holder died: the lock went with it
    assert list(tmp.iterdir()) == []


def test_a_writer_holds_its_lock_and_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with store.writer("ab" * 32, "convert") as built:
        (built / "f").write_text("x")
        assert store.gc() == []  # this process's writer: in use
        assert (built.parent / (built.name + LOCK_SUFFIX)).exists()
    assert list((store.root / "tmp").iterdir()) == []


def test_gc_keep_is_refused_while_a_run_builds(tmp_path: Path) -> None:
    """`cache gc --keep-recipe OTHER` during a run deleted the entries that run had just
    committed and was about to read; it now waits for no stage to be building."""
    store = LocalStore(tmp_path / "store")
    with store.writer("cd" * 32, "quantize"):
        with pytest.raises(StoreError, match=r"a run is building .*tmp/quantize-cdcd"):
            store.gc(keep=set())
        assert store.gc() == []  # plain gc stays safe
    assert store.gc(keep=set()) == []


def test_gc_drops_old_orphan_locks_only(tmp_path: Path) -> None:
    """A writer killed between removing its directory and its lock leaves the lock alone; gc
    drops it once it is old, and leaves a young one (a writer about to create its directory)."""
    store = LocalStore(tmp_path / "store")
    old, young = (store.root / "tmp" / f"convert-{n}.1.abcd{LOCK_SUFFIX}" for n in "ab")
    old.touch()
    young.touch()
    os.utime(old, (0, 0))
    store.gc()
    assert not old.exists() and young.exists()
