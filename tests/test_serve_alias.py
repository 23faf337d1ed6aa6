"""`qpipe serve ALIAS` finds the built-in server's artifact through the store's engine alias."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from qpipe.serve.cli import resolve_model_path
from qpipe.store.local import LocalStore


def test_alias_resolves_to_the_build_entrys_qpipe_artifact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = "ab" * 32
    with store.writer(key, "build") as built:
        (built / "qpipe").mkdir()
        (built / "qpipe" / "config.json").write_text("{}")
        store.commit(key, "build", built, {}, None, {})
    store.set_alias("smollm2-135m-none-int8-tp1", key, {"stage": "build"})
    path = resolve_model_path("smollm2-135m-none-int8-tp1", str(store.root))
    assert path == store.local_copy(key) / "qpipe"
    assert resolve_model_path(str(path), str(store.root)) == path  # a directory is itself
    with pytest.raises(typer.BadParameter, match="neither a directory nor an alias"):
        resolve_model_path("llama3-8b-sm90-int8-tp1", str(store.root))
