"""Two-tier store and push/pull between stores, against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from qpipe.hashing import HashCache
from qpipe.pipeline import Pipeline
from qpipe.recipe import parse_recipe
from qpipe.stages.base import Stage, StageContext, StageResult
from qpipe.store.base import DanglingAlias, Store, StoreError
from qpipe.store.entry import EntryMeta
from qpipe.store.factory import open_store
from qpipe.store.local import LocalStore
from qpipe.store.tiered import TieredStore
from qpipe.store.transfer import copy_entries

if TYPE_CHECKING:
    from tests.s3_server import S3Server


KEY = "cd" + "fedcba9876543210" * 3 + "abcd"


def build(store: Store, key: str, payload: bytes, stage: str = "quantize") -> EntryMeta:
    with store.writer(key, stage) as tmp:
        (tmp / "model.safetensors").write_bytes(payload)
        (tmp / "config.json").write_text('{"hidden_size": 576}')
        return store.commit(key, stage, tmp, {"bits": 8}, {"passed": True}, {})


def test_second_machine_gets_a_hit_through_s3_and_downloads(
    s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    location = f"s3://{bucket}/ci"
    first = open_store(location, local_cache=str(tmp_path / "runner-1"))
    assert isinstance(first, TieredStore)
    payload = os.urandom(1 << 20)
    meta = build(first, KEY, payload)
    assert first.local.lookup(KEY) == meta  # the builder keeps its copy
    assert first.remote.lookup(KEY) is not None  # and shared it

    second = open_store(location, local_cache=str(tmp_path / "runner-2"))
    assert second.local.lookup(KEY) is None
    assert second.lookup(KEY) is not None  # hit via S3: the pipeline skips the stage
    opened = second.open(KEY)
    assert opened.is_relative_to(tmp_path / "runner-2")
    assert (opened / "model.safetensors").read_bytes() == payload
    assert second.local.lookup(KEY).files == meta.files  # downloaded into the local tier

    s3_env.client().delete_object(Bucket=bucket, Key=f"ci/entries/{KEY}.json")
    assert second.remote.lookup(KEY) is None  # later opens on this machine need no S3 at all
    assert (second.open(KEY) / "model.safetensors").read_bytes() == payload

    local = open_store(str(tmp_path / "dir"), local_cache=str(tmp_path / "unused"))
    assert isinstance(local, LocalStore)  # `--store DIR` overrides a recipe's S3 store


def test_corrupt_local_copy_is_replaced_from_s3(s3_env: S3Server, tmp_path: Path) -> None:
    store = open_store(f"s3://{s3_env.bucket()}/ci", local_cache=str(tmp_path / "runner"))
    payload = os.urandom(4096)
    build(store, KEY, payload)
    local_file = store.local.open(KEY) / "model.safetensors"
    local_file.write_bytes(bytes(4096))
    assert (store.open(KEY) / "model.safetensors").read_bytes() == payload


def test_push_and_pull_copy_entries_and_aliases_verified(s3_env: S3Server, tmp_path: Path) -> None:
    laptop = LocalStore(tmp_path / "laptop")
    payload = os.urandom(200_000)
    meta = build(laptop, KEY, payload, stage="build")
    other = build(laptop, "ee" * 32, b"other", stage="convert")
    laptop.set_alias("smollm2-sm90-int8-tp1", KEY, {"stage": "build"})
    remote = open_store(f"s3://{s3_env.bucket()}/shared")

    pushed = copy_entries(laptop, remote, ["smollm2-sm90-int8-tp1"])
    assert pushed.copied == [KEY] and pushed.aliases == ["smollm2-sm90-int8-tp1"]
    assert remote.lookup(other.key) is None  # only what was named
    assert copy_entries(laptop, remote, [KEY[:10]]).present == [KEY]

    server = LocalStore(tmp_path / "server")
    pulled = copy_entries(remote, server, [])
    assert pulled.copied == [KEY]
    assert server.lookup(KEY) == meta  # same marker: same checksums, same creation time
    assert (server.open(KEY) / "model.safetensors").read_bytes() == payload
    assert server.resolve_alias("smollm2-sm90-int8-tp1") == {"key": KEY, "stage": "build"}

    (laptop.open(KEY) / "model.safetensors").write_bytes(os.urandom(200_000))
    with pytest.raises(Exception, match="does not match its checksum"):
        copy_entries(laptop, LocalStore(tmp_path / "third"), [KEY])
    with pytest.raises(StoreError, match="is no key, key prefix or alias"):
        copy_entries(laptop, server, ["no-such-thing"])


class CountingStage(Stage):
    """A stand-in stage: writes its name after its inputs' text, counts its runs."""

    def __init__(self, name: str, needs: tuple[str, ...], runs: Counter[str]):
        self.name = name  # type: ignore[misc]
        self.needs = needs  # type: ignore[misc]
        self.runs = runs

    def run(self, ctx: StageContext) -> StageResult:
        self.runs[self.name] += 1
        text = "".join((p / "out.txt").read_text() for p in ctx.inputs.values()) + self.name
        (ctx.out_dir / "out.txt").write_text(text)
        return StageResult(metrics={"chars": len(text)})


def test_pipeline_on_two_runners_shares_stages_and_rebuilds_a_corrupt_one(
    s3_env: S3Server, tmp_path: Path
) -> None:
    recipe = parse_recipe("name: ci\nmodel: {source: gguf:m.gguf}\nquantization: {method: none}")
    needs = {"convert": (), "calibrate": ("convert",), "quantize": ("convert",),
             "build": ("quantize",)}  # fmt: skip
    location = f"s3://{s3_env.bucket()}/ci"

    def runner(name: str) -> tuple[Pipeline, Counter[str]]:
        runs: Counter[str] = Counter()
        stages = {n: CountingStage(n, deps, runs) for n, deps in needs.items()}
        store = open_store(location, local_cache=str(tmp_path / name))
        hashes = HashCache(tmp_path / name / "hashes.db")
        return Pipeline(recipe, tmp_path, store, hashes, stages.get), runs

    first, first_runs = runner("runner-1")
    first.run(until="build")
    assert first_runs == Counter(convert=1, quantize=1, build=1)

    second, second_runs = runner("runner-2")
    planned = {p.name: p for p in second.run(until="build")}
    assert not second_runs  # every stage was a hit through S3
    assert planned["build"].status == "hit"
    assert planned["build"].path is None  # a plan/run of hits downloads nothing
    assert "remote store" in planned["build"].reason
    build_dir = second.store.open(planned["build"].key)  # a consumer pulls it on demand
    assert (build_dir / "out.txt").read_text() == "convertquantizebuild"

    marker = json.loads(second.store.remote._get(f"ci/entries/{planned['quantize'].key}.json"))
    s3_env.client().put_object(
        Bucket=second.store.remote.bucket,
        Key=f"ci/blobs/{marker['key']}/{marker['upload']}/out.txt",
        Body=b"convertquantizX",
    )
    third, third_runs = runner("runner-3")
    replanned = {p.name: p for p in third.run(until="build", force=("build",))}
    assert third_runs == Counter(quantize=1, build=1)  # corrupt quantize detected and rebuilt
    assert replanned["quantize"].status == "ran"
    assert (Path(replanned["build"].path) / "out.txt").read_text() == "convertquantizebuild"


def test_gc_drops_aliases_only_where_their_entry_is_gone(s3_env: S3Server, tmp_path: Path) -> None:
    bucket = s3_env.bucket()
    store = open_store(f"s3://{bucket}/ci", local_cache=str(tmp_path / "runner"))
    assert isinstance(store, TieredStore)
    other_key = "ee" * 32
    build(store, KEY, b"shared", stage="build")
    build(store, other_key, b"pruned here", stage="build")
    store.set_alias("smollm2-cpu-int8-tp1", other_key, {"stage": "build"})

    removed = store.gc(keep={KEY})  # prunes the local tier only
    assert f"objects/{other_key}" in removed and "aliases/smollm2-cpu-int8-tp1" in removed
    assert store.local.aliases() == {}  # the local copy of the alias went with the entry,
    record = store.resolve_alias("smollm2-cpu-int8-tp1")  # the bucket's still resolves
    assert record == {"key": other_key, "stage": "build"}

    store.remote.quarantine(other_key, "corrupt")
    with pytest.raises(DanglingAlias, match=r"'smollm2-cpu-int8-tp1' points at entry eeee"):
        store.resolve_alias("smollm2-cpu-int8-tp1")
    with pytest.raises(DanglingAlias, match="rebuild it"):
        copy_entries(store, LocalStore(tmp_path / "elsewhere"), ["smollm2-cpu-int8-tp1"])
    assert "aliases/smollm2-cpu-int8-tp1" in store.gc()  # garbage in the bucket too
    assert store.aliases() == {}


def test_a_forced_commit_replaces_the_entry_in_both_tiers(s3_env: S3Server, tmp_path: Path) -> None:
    location = f"s3://{s3_env.bucket()}/ci"
    store = open_store(location, local_cache=str(tmp_path / "runner-1"))
    build(store, KEY, b"old build")
    with store.writer(KEY, "quantize") as tmp:
        (tmp / "model.safetensors").write_bytes(b"new build")
        new = store.commit(KEY, "quantize", tmp, {}, None, {}, replace=True)
    assert store.local.lookup(KEY) == new and store.remote.lookup(KEY).files == new.files
    other = open_store(location, local_cache=str(tmp_path / "runner-2"))
    assert (other.open(KEY) / "model.safetensors").read_bytes() == b"new build"


def test_an_entry_the_bucket_missed_is_shared_when_next_opened(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket unreachable at commit time (or the run killed between the local commit and the
    upload) left the entry in the local tier only: every later run hit it locally and the bucket
    never got it. A note written before the upload now makes the next open share it."""
    location = f"s3://{s3_env.bucket()}/ci"
    store = open_store(location, local_cache=str(tmp_path / "runner-1"))
    assert isinstance(store, TieredStore)
    upload = store.remote.import_entry

    def unreachable(*args: object, **kwargs: object) -> EntryMeta:
        raise StoreError("cannot reach the bucket")

    monkeypatch.setattr(store.remote, "import_entry", unreachable)
    with pytest.raises(StoreError, match="not shared") as failed:
        build(store, KEY, b"weights")
    assert f"--store {store.local.location} --to {location}" in str(failed.value)
    assert store.remote.lookup(KEY) is None and store.local.lookup(KEY) is not None

    store.open(KEY)  # still unreachable: a warning, and the entry serves from here
    assert store.remote.lookup(KEY) is None
    monkeypatch.setattr(store.remote, "import_entry", upload)
    store.open(KEY)
    assert store.remote.lookup(KEY) is not None
    other = open_store(location, local_cache=str(tmp_path / "runner-2"))
    assert (other.open(KEY) / "model.safetensors").read_bytes() == b"weights"
    assert not (store.local.root / "unshared" / KEY).exists()  # later opens ask no bucket
