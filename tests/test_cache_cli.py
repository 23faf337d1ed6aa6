"""`qpipe cache push/pull` between two local stores: entries and aliases arrive verified."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from qpipe.cli import app
from qpipe.store.local import LocalStore


def test_push_then_pull_by_alias(tmp_path: Path) -> None:
    source, target = LocalStore(tmp_path / "a"), tmp_path / "b"
    key = "cd" * 32
    with source.writer(key, "build") as built:
        (built / "weights.bin").write_bytes(b"w" * 100)
        source.commit(key, "build", built, {}, None, {})
    source.set_alias("tiny-cpu-int8-tp1", key, {"stage": "build"})
    runner = CliRunner()
    pushed = runner.invoke(
        app,
        ["cache", "push", "tiny-cpu-int8-tp1", "--store", str(source.root), "--to", str(target)],
    )
    assert pushed.exit_code == 0, pushed.output
    assert "1 entries copied" in pushed.output and "1 aliases set" in pushed.output
    copied = LocalStore(target)
    assert (copied.open(key) / "weights.bin").read_bytes() == b"w" * 100
    assert copied.resolve_alias("tiny-cpu-int8-tp1")["key"] == key
    again = runner.invoke(
        app, ["cache", "pull", key[:8], "--store", str(target), "--from", str(source.root)]
    )
    assert again.exit_code == 0 and "1 already there" in again.output
    same = runner.invoke(app, ["cache", "push", "--store", str(target), "--to", str(target)])
    assert same.exit_code == 1 and "same store" in same.output
