"""`qpipe cache push/pull` between two local stores: entries and aliases arrive verified."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from qpipe import cli
from qpipe.cli import app
from qpipe.store.base import DanglingAlias, MalformedAlias, StoreError
from qpipe.store.factory import open_store
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


def _entry(store: LocalStore, key: str, payload: bytes) -> str:
    with store.writer(key, "build") as built:
        (built / "weights.bin").write_bytes(payload)
        store.commit(key, "build", built, {}, None, {})
    return key


def test_gc_keep_recipe_removes_the_aliases_of_the_entries_it_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "store")
    kept, dropped = _entry(store, "aa" * 32, b"kept"), _entry(store, "bb" * 32, b"dropped")
    store.set_alias("smollm2-135m-cpu-int8-tp1", dropped, {"stage": "build", "arch": "cpu"})
    store.set_alias("smollm2-135m-cpu-fp8-tp1", kept, {"stage": "build", "arch": "cpu"})
    plan = SimpleNamespace(plan=lambda: [SimpleNamespace(key=kept), SimpleNamespace(key=None)])
    monkeypatch.setattr(cli, "_pipeline", lambda path, store: plan)
    runner = CliRunner()
    recipe = str(tmp_path / "recipe.yaml")  # read by the stubbed _pipeline only
    gc = runner.invoke(app, ["cache", "gc", "--keep-recipe", recipe, "--store", str(store.root)])
    assert gc.exit_code == 0, gc.output
    assert f"removed objects/{dropped}" in gc.output
    assert "removed aliases/smollm2-135m-cpu-int8-tp1" in gc.output and "2 removed" in gc.output

    listed = runner.invoke(app, ["cache", "ls", "--json", "--store", str(store.root)])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["aliases"] == {
        "smollm2-135m-cpu-fp8-tp1": {"key": kept, "stage": "build", "arch": "cpu"}
    }
    pushed = runner.invoke(
        app,
        ["cache", "push", "smollm2-135m-cpu-int8-tp1", "--store", str(store.root), "--to",
         str(tmp_path / "target")],
    )  # fmt: skip
    assert pushed.exit_code == 1 and "vanished" not in pushed.output
    assert "is no key, key prefix or alias" in pushed.output


def test_a_dangling_alias_says_which_entry_is_gone_and_how_to_fix_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = _entry(store, "cd" * 32, b"w")
    store.set_alias("tiny-cpu-int8-tp1", key, {"stage": "build"})
    store.quarantine(key, "corrupt")  # leaves the alias behind, as a gc before the fix did
    with pytest.raises(DanglingAlias, match=r"'tiny-cpu-int8-tp1' points at entry cdcdcdcdcdcd"):
        store.resolve_alias("tiny-cpu-int8-tp1")
    assert store.resolve_alias("no-such-alias") is None

    runner = CliRunner()
    target = str(tmp_path / "target")
    pushed = runner.invoke(
        app, ["cache", "push", "tiny-cpu-int8-tp1", "--store", str(store.root), "--to", target]
    )
    assert pushed.exit_code == 1 and "vanished" not in pushed.output
    message = " ".join(pushed.output.split())
    assert "alias 'tiny-cpu-int8-tp1' points at entry cdcdcdcdcdcd" in message
    assert "rebuild it" in message and "qpipe cache gc" in message
    everything = runner.invoke(app, ["cache", "push", "--store", str(store.root), "--to", target])
    # the console wraps at the terminal's width (80 columns under pytest-xdist)
    assert everything.exit_code == 0 and "0 aliases set" in " ".join(everything.output.split())
    assert LocalStore(Path(target)).aliases() == {}

    gc = runner.invoke(app, ["cache", "gc", "--store", str(store.root)])
    assert gc.exit_code == 0 and "removed aliases/tiny-cpu-int8-tp1" in " ".join(gc.output.split())
    assert store.aliases() == {}


@pytest.mark.parametrize(
    ("location", "says"),
    [
        ("ftp://x/y", "the scheme ftp: is not supported"),
        ("gs://b/p", "the scheme gs: is not supported"),
        ("S3://bucket/p", "did you mean s3://bucket/p?"),
        ("s3:/bucket/p", "did you mean s3://bucket/p?"),
    ],
)
def test_an_unknown_or_mistyped_scheme_is_an_error_not_a_directory(
    location: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="a local directory or s3://bucket/prefix"):
        open_store(location)
    listed = CliRunner().invoke(app, ["cache", "ls", "--store", location])
    assert listed.exit_code == 1 and says in " ".join(listed.output.split())
    assert list(tmp_path.iterdir()) == []
    assert isinstance(open_store("./a:b"), LocalStore)  # a colon in a directory name still works


def test_copying_from_a_store_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    runner = CliRunner()
    target = str(tmp_path / "target")
    for source, problem in [("missing", "does not exist"), ("plain", "is not a store")]:
        (tmp_path / "plain").mkdir(exist_ok=True)
        pulled = runner.invoke(
            app, ["cache", "pull", "--from", str(tmp_path / source), "--store", target]
        )
        message = " ".join(pulled.output.split())
        assert pulled.exit_code == 1 and f"no store at {tmp_path / source}" in message, message
        assert problem in message and "entries copied" not in message
    pushed = runner.invoke(
        app, ["cache", "push", "--store", str(tmp_path / "gone"), "--to", target]
    )
    assert pushed.exit_code == 1 and "does not exist" in " ".join(pushed.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing created


def test_an_unreadable_alias_record_is_skipped_with_a_warning_and_removed_by_gc(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path / "store")
    key = _entry(store, "cd" * 32, b"w")
    store.set_alias("tiny-cpu-int8-tp1", key, {"stage": "build"})
    (store.root / "aliases" / "broken.json").write_text("{not json")
    (store.root / "aliases" / "keyless.json").write_text("[]")
    runner = CliRunner()

    listed = runner.invoke(app, ["cache", "ls", "--json", "--store", str(store.root)])
    assert listed.exit_code == 0, listed.output
    assert list(json.loads(listed.stdout)["aliases"]) == ["tiny-cpu-int8-tp1"]
    warned = caplog.text
    assert f"{store.root}/aliases/broken.json is unreadable (not JSON" in warned
    assert f'{store.root}/aliases/keyless.json is unreadable (not a JSON object with a "key")' in (
        warned
    )
    with pytest.raises(MalformedAlias, match="broken.json is unreadable.*qpipe cache gc"):
        store.resolve_alias("broken")

    target = str(tmp_path / "target")
    pushed = runner.invoke(app, ["cache", "push", "--store", str(store.root), "--to", target])
    assert pushed.exit_code == 0 and "1 aliases set" in " ".join(pushed.output.split())

    gc = runner.invoke(app, ["cache", "gc", "--store", str(store.root)])
    output = " ".join(gc.output.split())
    assert gc.exit_code == 0 and "removed aliases/broken (unreadable record)" in output
    assert "removed aliases/keyless (unreadable record)" in output
    assert sorted(p.name for p in (store.root / "aliases").iterdir()) == ["tiny-cpu-int8-tp1.json"]


RECIPE = """\
name: ok-recipe
model: {source: gguf:model.gguf, dtype: float32}
calibration: {dataset: data.jsonl, num_samples: 8}
quantization: {method: int8-sq}
build: {targets: [compressed-tensors]}
"""


def test_gc_keep_recipe_that_cannot_be_planned_removes_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = _entry(store, "cd" * 32, b"w")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)  # its calibration dataset, data.jsonl, is not there
    (tmp_path / "model.gguf").write_bytes(b"")
    gc = CliRunner().invoke(
        app, ["cache", "gc", "--keep-recipe", str(recipe), "--store", str(store.root)]
    )
    message = " ".join(gc.output.split())
    assert gc.exit_code == 1 and isinstance(gc.exception, SystemExit), message
    assert f"error: --keep-recipe {recipe}: gc removed nothing" in message
    assert "data.jsonl does not exist" in message
    assert store.lookup(key) is not None


def test_a_store_that_cannot_be_changed_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store this user may read but not write (tests run as root: the denial is raised where
    the store renames an entry away)."""
    store = LocalStore(tmp_path / "store")
    _entry(store, "cd" * 32, b"w")

    def denied(self: LocalStore, *args: object) -> None:
        raise PermissionError(13, "Permission denied", str(self.root / "objects"))

    def fails_naming_the_store(doing: str, *command: str) -> None:
        result = CliRunner().invoke(app, ["cache", *command, "--store", str(store.root)])
        message = " ".join(result.output.split())
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), message
        assert f"error: cannot {doing} {store.root}: " in message
        assert "Permission denied" in message or "access denied" in message

    monkeypatch.setattr(cli, "_pipeline", lambda path, store: SimpleNamespace(plan=lambda: []))
    monkeypatch.setattr(LocalStore, "remove", denied)
    fails_naming_the_store("gc", "gc", "--keep-recipe", "r.yaml")
    monkeypatch.setattr(LocalStore, "entries", denied)
    fails_naming_the_store("verify", "verify")

    def refused(self: LocalStore) -> None:  # how an S3 store reports a denial
        raise StoreError(f"access denied to {self.location} when trying to list entries/")

    monkeypatch.setattr(LocalStore, "entries", refused)
    fails_naming_the_store("list", "ls")


def test_a_run_whose_manifest_the_store_cannot_take_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A no-op re-run on a store that cannot be written: the manifest write, after the stages,
    fails with the store and the problem, not a traceback."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "data.jsonl").write_text('{"text": "a sample"}\n')
    store = LocalStore(tmp_path / "store")
    (store.root / "docs" / "runs").write_text("a file where the runs directory should be")
    nothing_to_do = SimpleNamespace(store=store, run=lambda **options: [])
    monkeypatch.setattr(cli, "_pipeline", lambda path, location, recipe: nothing_to_do)
    result = CliRunner().invoke(app, ["run", str(recipe), "--store", str(store.root)])
    message = " ".join(result.output.split())
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), message
    assert "error: the stages are done, but the run's manifest was not written" in message
    assert "cannot write runs/ok-recipe/" in message and f"in the store {store.root}" in message
    assert "Not a directory" in message


def test_push_and_pull_say_which_store_option_they_need(tmp_path: Path) -> None:
    runner = CliRunner()
    for command, option in ((["push", "x"], "--to"), (["pull", "x"], "--from")):
        result = runner.invoke(app, ["cache", *command, "--store", str(tmp_path / "s")])
        assert result.exit_code == 2 and f"Missing option '{option}'" in result.output
        assert "same store" not in result.output
