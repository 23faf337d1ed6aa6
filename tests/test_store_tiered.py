"""Two-tier store and push/pull between stores, against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from qpipe.store.base import Store, StoreError
from qpipe.store.entry import EntryMeta
from qpipe.store.factory import open_store
from qpipe.store.local import LocalStore
from qpipe.store.tiered import TieredStore
from qpipe.store.transfer import copy_entries

if TYPE_CHECKING:
    from tests.s3_server import S3Server

pytest_plugins = ["tests.s3_server"]  # the s3_server and s3_env fixtures

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

    with pytest.raises(StoreError, match="only for an s3:// location"):
        open_store(str(tmp_path / "dir"), local_cache=str(tmp_path / "cache"))


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
