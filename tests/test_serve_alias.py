"""`qpipe serve ALIAS` finds the built-in server's artifact through the store's engine alias."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from qpipe.serve.cli import resolve_model_path
from qpipe.store.local import LocalStore


def aliased_build(tmp_path: Path, alias: str) -> tuple[LocalStore, str]:
    """A store holding one build entry with a qpipe artifact, under `alias`."""
    store = LocalStore(tmp_path / "store")
    key = "ab" * 32
    with store.writer(key, "build") as built:
        (built / "qpipe").mkdir()
        (built / "qpipe" / "config.json").write_text("{}")
        store.commit(key, "build", built, {}, None, {})
    store.set_alias(alias, key, {"stage": "build"})
    return store, key


def test_alias_resolves_to_the_build_entrys_qpipe_artifact(tmp_path: Path) -> None:
    store, key = aliased_build(tmp_path, "smollm2-135m-none-int8-tp1")
    path = resolve_model_path("smollm2-135m-none-int8-tp1", str(store.root))
    assert path == store.local_copy(key) / "qpipe"
    assert resolve_model_path(str(path), str(store.root)) == path  # a directory is itself
    with pytest.raises(typer.BadParameter, match="neither a directory nor an alias"):
        resolve_model_path("llama3-8b-sm90-int8-tp1", str(store.root))


def test_an_alias_in_a_mistyped_store_creates_no_store_there(tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter, match=r"no store at .*does not exist"):
        resolve_model_path("smollm2-135m-none-int8-tp1", str(tmp_path / "stroe"))
    assert not (tmp_path / "stroe").exists()


def test_an_alias_to_a_corrupt_entry_says_how_to_rebuild_it(tmp_path: Path) -> None:
    store, key = aliased_build(tmp_path, "tiny-none-int8-tp1")
    (store.local_copy(key) / "qpipe" / "config.json").write_text("[]")
    with pytest.raises(typer.BadParameter, match=r"corrupt.*`qpipe cache verify --quarantine"):
        resolve_model_path("tiny-none-int8-tp1", str(store.root))
