"""The S3 store against a real S3 server (SeaweedFS): commits, credentials, crashes, corruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from qpipe.store.base import DanglingAlias, MalformedAlias, StoreError
from qpipe.store.entry import CorruptEntry
from qpipe.store.factory import open_store
from qpipe.store.local import LocalStore
from qpipe.store.s3 import S3Marker, S3Store

if TYPE_CHECKING:
    from tests.s3_server import S3Server


REPO = Path(__file__).resolve().parents[1]
KEY = "ab" + "0123456789abcdef" * 3 + "cdef"


def s3_store(server: S3Server, bucket: str, machine: Path, **options: object) -> S3Store:
    """An S3Store as a separate machine sees it: its own download cache."""
    return S3Store(f"s3://{bucket}/team/cache", LocalStore(machine), **options)


def make_entry(root: Path, payload: bytes) -> Path:
    (root / "trtllm-checkpoint").mkdir(parents=True)
    (root / "trtllm-checkpoint" / "config.json").write_text('{"architecture": "LlamaForCausalLM"}')
    (root / "trtllm-checkpoint" / "rank0.safetensors").write_bytes(payload)
    (root / "build.json").write_text('{"targets": ["trtllm-checkpoint"]}')
    return root


def commit(store: S3Store, key: str, payload: bytes, metrics: dict | None = None) -> S3Marker:
    with store.writer(key, "build") as tmp:
        make_entry(tmp, payload)
        return store.commit(key, "build", tmp, metrics or {}, None, {"section": {"tp": 1}})


def test_commit_then_another_machine_looks_up_and_opens(s3_env: S3Server, tmp_path: Path) -> None:
    bucket = s3_env.bucket()
    store = open_store(f"s3://{bucket}/team/cache")  # endpoint and keys from AWS_* variables
    assert isinstance(store, S3Store) and store.endpoint == s3_env.endpoint
    payload = os.urandom(300_000)
    meta = commit(store, KEY, payload, {"tokens_per_s": 12.5})
    assert store.lookup(KEY) is not None and store.lookup("ff" * 32) is None

    other = s3_store(s3_env, bucket, tmp_path / "machine-b")
    seen = other.lookup(KEY)
    assert seen is not None and seen.files == meta.files and seen.metrics == {"tokens_per_s": 12.5}
    opened = other.open(KEY)
    assert (opened / "trtllm-checkpoint" / "rank0.safetensors").read_bytes() == payload
    assert opened.is_relative_to(tmp_path / "machine-b")
    assert [m.key for m in other.entries()] == [KEY]
    with pytest.raises(KeyError):
        other.open("ff" * 32)

    fetched = tmp_path / "one-target"
    other.fetch(KEY, fetched, "trtllm-checkpoint")
    assert sorted(p.name for p in fetched.iterdir()) == ["config.json", "rank0.safetensors"]

    store.set_alias("smollm2-sm90-int8-tp1", KEY, {"target": "build"})
    assert other.resolve_alias("smollm2-sm90-int8-tp1") == {"key": KEY, "target": "build"}
    store.write_document("registry/smollm2/1/manifest.json", b"{}")
    assert other.list_documents("registry/") == ["registry/smollm2/1/manifest.json"]
    assert other.read_document("registry/smollm2/1/manifest.json") == b"{}"
    assert other.read_document("registry/nothing") is None


def test_credentials_bucket_and_endpoint_errors_say_what_to_fix(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_env.bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreError, match="access denied.*AWS_ACCESS_KEY_ID"):
        open_store(f"s3://{bucket}/x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(StoreError, match="access denied"):
        open_store(f"s3://{bucket}/x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/x")
    start = time.monotonic()
    with pytest.raises(StoreError, match="cannot reach the S3 endpoint http://127.0.0.1:9"):
        open_store(f"s3://{bucket}/x", endpoint_url="http://127.0.0.1:9")
    assert time.monotonic() - start < 15


CHILD = """
import sys
from pathlib import Path
from qpipe.store.factory import open_store
store = open_store(sys.argv[1])
store.commit(sys.argv[2], "build", Path(sys.argv[3]), {}, None, {})
print("committed", flush=True)
"""


def test_upload_killed_half_way_leaves_no_entry(s3_env: S3Server, tmp_path: Path) -> None:
    bucket = s3_env.bucket()
    location = f"s3://{bucket}/team/cache"
    built = make_entry(tmp_path / "built", os.urandom(48 << 20))
    env = {**os.environ, "QPIPE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, location, KEY, str(built)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    client = s3_env.client()
    deadline = time.monotonic() + 30
    while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        assert child.poll() is None, child.stdout.read().decode()
        assert time.monotonic() < deadline, "the child never started its multipart upload"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert b"committed" not in child.stdout.read()

    store = s3_store(s3_env, bucket, tmp_path / "machine-b", stale_upload_s=0)
    assert store.lookup(KEY) is None
    assert list(store.entries()) == []
    with pytest.raises(KeyError):
        store.open(KEY)
    leftovers = client.list_objects_v2(Bucket=bucket, Prefix="team/cache/blobs/").get("KeyCount")
    assert leftovers, "the killed upload left no garbage: it was not killed half-way"

    meta = commit(store, KEY, b"rebuilt")
    fresh = s3_store(s3_env, bucket, tmp_path / "machine-c")
    assert fresh.lookup(KEY) == meta
    assert (fresh.open(KEY) / "trtllm-checkpoint" / "rank0.safetensors").read_bytes() == b"rebuilt"

    removed = store.gc()
    assert any(name.startswith("blobs/") for name in removed)
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert all(f"/{meta.upload}/" in n for n in names if "/blobs/" in n)
    assert fresh.open(KEY).is_dir()


def test_corrupted_object_is_detected_quarantined_and_rebuilt(
    s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    payload = os.urandom(100_000)
    meta = commit(s3_store(s3_env, bucket, tmp_path / "a"), KEY, payload)
    name = f"team/cache/blobs/{KEY}/{meta.upload}/trtllm-checkpoint/rank0.safetensors"
    flipped = bytes([payload[0] ^ 0xFF]) + payload[1:]  # same size: only the checksum can tell
    s3_env.client().put_object(Bucket=bucket, Key=name, Body=flipped)

    reader = s3_store(s3_env, bucket, tmp_path / "b")
    with pytest.raises(CorruptEntry, match="rank0.safetensors does not match its checksum"):
        reader.open(KEY)
    assert reader.cache.lookup(KEY) is None  # nothing corrupt reached the download cache
    reader.quarantine(KEY, "checksum mismatch")
    assert reader.lookup(KEY) is None

    commit(reader, KEY, payload)  # the next run rebuilds
    again = s3_store(s3_env, bucket, tmp_path / "c")
    assert (again.open(KEY) / "trtllm-checkpoint" / "rank0.safetensors").read_bytes() == payload
    assert any(entry.startswith("team/cache/corrupt/") for entry in reader.gc())


def test_concurrent_committers_of_one_key_leave_one_valid_entry(
    s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    stores = [s3_store(s3_env, bucket, tmp_path / f"m{i}") for i in range(4)]
    payloads = [os.urandom(2 << 20) for _ in stores]
    barrier = threading.Barrier(len(stores))
    results: list[object] = [None] * len(stores)

    def build(i: int) -> None:
        barrier.wait()
        results[i] = commit(stores[i], KEY, payloads[i])

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    winner = s3_store(s3_env, bucket, tmp_path / "reader").lookup(KEY)
    assert winner is not None
    assert all(result == winner for result in results), "a loser did not reuse the winner"
    data = (stores[0].open(KEY) / "trtllm-checkpoint" / "rank0.safetensors").read_bytes()
    assert data in payloads
    for store in stores:  # the losers use the winner's bytes too, not their own build
        assert (store.open(KEY) / "trtllm-checkpoint" / "rank0.safetensors").read_bytes() == data
    uploads = {
        o["Key"].split("/")[4]
        for o in s3_env.client().list_objects_v2(Bucket=bucket, Prefix="team/cache/blobs/")[
            "Contents"
        ]
    }
    assert uploads == {winner.upload}, "losers must remove their uploads"

    late = commit(stores[1], KEY, os.urandom(10))  # a committer arriving after the winner
    assert late == winner


def test_gc_removes_the_aliases_of_removed_entries_and_dangling_ones_say_why(
    s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    store = s3_store(s3_env, bucket, tmp_path / "machine-a")
    other_key = "cd" * 32
    commit(store, KEY, b"kept")
    commit(store, other_key, b"dropped")
    store.set_alias("smollm2-cpu-fp8-tp1", KEY, {"stage": "build"})
    store.set_alias("smollm2-cpu-int8-tp1", other_key, {"stage": "build"})

    removed = store.gc(keep={KEY})
    assert f"entries/{other_key}" in removed and "aliases/smollm2-cpu-int8-tp1" in removed
    assert set(store.aliases()) == {"smollm2-cpu-fp8-tp1"}
    assert store.resolve_alias("smollm2-cpu-fp8-tp1") == {"key": KEY, "stage": "build"}

    store.quarantine(KEY, "corrupt")  # the marker goes, the alias stays until the next gc
    with pytest.raises(DanglingAlias, match=f"'smollm2-cpu-fp8-tp1' points at entry {KEY[:12]}"):
        s3_store(s3_env, bucket, tmp_path / "machine-b").resolve_alias("smollm2-cpu-fp8-tp1")
    assert "aliases/smollm2-cpu-fp8-tp1" in store.gc_remote(None)
    assert store.aliases() == {}


def test_a_forced_commit_replaces_the_entry_for_every_machine(
    s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    store = s3_store(s3_env, bucket, tmp_path / "machine-a", stale_upload_s=-1)
    old = commit(store, KEY, b"old build")
    with store.writer(KEY, "build") as tmp:
        make_entry(tmp, b"new build")
        new = store.commit(KEY, "build", tmp, {}, None, {}, replace=True)
    assert new.upload != old.upload and store.lookup(KEY) == new
    for machine in (store, s3_store(s3_env, bucket, tmp_path / "machine-b")):
        opened = machine.open(KEY)  # machine-a's download cache holds the new build too
        assert (opened / "trtllm-checkpoint" / "rank0.safetensors").read_bytes() == b"new build"
    assert store.gc_remote() == [f"blobs/{KEY}/{old.upload}"]  # the old files go with gc


def test_an_unreadable_alias_in_the_bucket_is_skipped_and_removed_by_gc(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3_env.bucket()
    store = s3_store(s3_env, bucket, tmp_path / "machine-a")
    commit(store, KEY, b"kept")
    store.set_alias("smollm2-cpu-fp8-tp1", KEY, {"stage": "build"})
    broken = "team/cache/aliases/broken.json"
    s3_env.client().put_object(Bucket=bucket, Key=broken, Body=b"{not json")
    assert set(store.aliases()) == {"smollm2-cpu-fp8-tp1"}
    assert f"s3://{bucket}/{broken} is unreadable (not JSON" in caplog.text
    with pytest.raises(MalformedAlias, match="qpipe cache gc"):
        store.resolve_alias("broken")
    assert store.gc_remote() == ["aliases/broken (unreadable record)"]
    assert set(store.aliases()) == {"smollm2-cpu-fp8-tp1"}


def test_cache_verify_checks_the_bucket_not_the_download_cache(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download cache holds an intact copy; the bucket's, which every other machine gets, is
    corrupt: verify reports it, and --quarantine takes it out of the bucket and the cache."""
    from typer.testing import CliRunner

    from qpipe.cli import app

    monkeypatch.setenv("QPIPE_HOME", str(tmp_path / "home"))
    bucket = s3_env.bucket()
    url = f"s3://{bucket}/team/cache"
    store = open_store(url)  # the download cache the CLI uses too
    payload = os.urandom(100_000)
    meta = commit(store, KEY, payload)
    assert store.local_copy(KEY) is not None
    runner = CliRunner()
    verified = runner.invoke(app, ["cache", "verify", "--store", url])
    assert verified.exit_code == 0 and "1 ok, 0 corrupt" in verified.output, verified.output

    name = f"team/cache/blobs/{KEY}/{meta.upload}/trtllm-checkpoint/rank0.safetensors"
    flipped = bytes([payload[0] ^ 0xFF]) + payload[1:]
    s3_env.client().put_object(Bucket=bucket, Key=name, Body=flipped)
    verified = runner.invoke(app, ["cache", "verify", "--store", url])
    message = " ".join(verified.output.split())
    assert verified.exit_code == 1 and "0 ok, 1 corrupt" in message, message
    assert (
        f"corrupt build {KEY[:12]}: trtllm-checkpoint/rank0.safetensors does not match" in message
    )
    assert store.lookup(KEY) is not None and store.local_copy(KEY) is not None  # reported only
    assert list((store.cache.root / "tmp").iterdir()) == []  # the checked download is gone

    quarantined = runner.invoke(app, ["cache", "verify", "--quarantine", "--store", url])
    assert quarantined.exit_code == 1, quarantined.output
    assert store.lookup(KEY) is None and store.local_copy(KEY) is None
    again = runner.invoke(app, ["cache", "verify", "--store", url])
    assert again.exit_code == 0 and "0 ok, 0 corrupt" in again.output


def test_access_denied_during_an_upload_says_so_with_the_credentials_hint(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """Keys that stop being valid after the store opened (rotated, or an identity that may not
    write): boto3 reports it as an upload failure, qpipe as the access denial it is."""
    import boto3

    store = s3_store(s3_env, s3_env.bucket(), tmp_path / "machine-a")
    store.client = boto3.client(
        "s3",
        endpoint_url=s3_env.endpoint,
        aws_access_key_id=s3_env.access_key,
        aws_secret_access_key="not-the-secret",
        region_name="us-east-1",
    )
    with store.writer(KEY, "build") as tmp:
        make_entry(tmp, b"weights")
        with pytest.raises(StoreError) as raised:  # replace: the upload is the first request
            store.commit(KEY, "build", tmp, {}, None, {}, replace=True)
    message = str(raised.value)
    assert "access denied to s3://" in message and "when trying to upload build.json" in message
    assert "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in message
    assert "S3UploadFailedError" not in message and "upload failed" not in message


def test_the_two_tier_store_verifies_each_tier_that_holds_the_entry(
    s3_env: S3Server, tmp_path: Path
) -> None:
    from qpipe.store.tiered import TieredStore

    bucket = s3_env.bucket()
    store = TieredStore(s3_store(s3_env, bucket, tmp_path / "machine-a"))
    payload = os.urandom(10_000)
    meta = commit(store.remote, KEY, payload)  # in the bucket and machine-a's local tier
    store.verify(KEY)
    with pytest.raises(KeyError):
        store.verify("ff" * 32)
    local = store.local.local_copy(KEY) / "trtllm-checkpoint" / "rank0.safetensors"
    local.write_bytes(bytes([payload[0] ^ 0xFF]) + payload[1:])
    with pytest.raises(CorruptEntry, match="rank0.safetensors does not match its checksum"):
        store.verify(KEY)
    local.write_bytes(payload)
    name = f"team/cache/blobs/{KEY}/{meta.upload}/trtllm-checkpoint/rank0.safetensors"
    s3_env.client().put_object(Bucket=bucket, Key=name, Body=b"short")
    with pytest.raises(CorruptEntry, match="rank0.safetensors has 5 bytes"):
        store.verify(KEY)
