"""The S3 store: entries in a bucket, shared by CI jobs and machines, through boto3.

Layout under `s3://bucket/prefix/`: `entries/<key>.json` (commit markers), `blobs/<key>/<upload>/`
(the files of one upload attempt), `aliases/<alias>.json`, `docs/<name>`, `corrupt/<key>.<t>.json`.
Each commit uploads its files under a fresh upload id, checks them, then puts the marker with
`If-None-Match: *`: the first marker wins, a loser deletes its own upload and reuses the winner's
entry, and no upload ever overwrites files that a committed marker describes. Reads go through a
local download cache (a LocalStore), so open() returns a directory and verifies every checksum.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)
from pydantic import ValidationError
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from qpipe.store.base import (
    DocumentExists,
    MalformedAlias,
    Store,
    StoreError,
    parse_alias_record,
    readable_aliases,
)
from qpipe.store.entry import (
    CorruptEntry,
    EntryMeta,
    FileRecord,
    select_files,
    verify_files,
)
from qpipe.store.local import LocalStore

MiB = 1 << 20
PROGRESS_MIN_BYTES = 32 * MiB
STALE_UPLOAD_S = 6 * 3600
ACCESS_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "403",
}
PRECONDITION_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
UNCONDITIONAL_CODES = {"NotImplemented", "501"}


class S3Marker(EntryMeta):
    """The S3 commit marker: the entry's metadata plus which upload attempt holds its files."""

    upload: str


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise StoreError(f"not an S3 location: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise StoreError(f"S3 location {url!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _part_size(size: int) -> int:
    """16 MiB parts, larger for huge files so an upload stays well under S3's 10,000 parts."""
    return max(16 * MiB, -(-size // 2000))


class S3Store(Store):
    def __init__(
        self,
        url: str,
        cache: LocalStore,
        endpoint_url: str | None = None,
        stale_upload_s: float = STALE_UPLOAD_S,
    ):
        self.bucket, self.prefix = parse_s3_url(url)
        self.location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.cache = cache
        self.stale_upload_s = stale_upload_s
        config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10)
        # endpoint_url=None lets boto3 read AWS_ENDPOINT_URL / the AWS config, like region and keys
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint = self.client.meta.endpoint_url
        with self._errors("open the bucket"):
            self.client.head_bucket(Bucket=self.bucket)

    @property
    def local_root(self) -> Path:
        return self.cache.root

    # -- S3 plumbing -------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn boto3's exceptions into StoreErrors that say what to check."""
        where = f"{self.location} at {self.endpoint}"
        try:
            yield
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StoreError(
                f"no usable AWS credentials to {doing} in {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ) from exc
        except ConnectionError as exc:
            raise StoreError(
                f"cannot reach the S3 endpoint {self.endpoint} to {doing}: check AWS_ENDPOINT_URL "
                f"(or the recipe's store.endpoint_url) and that the server is up ({exc})"
            ) from exc
        except ClientError as exc:
            raise self._refused(exc, doing) from exc
        except S3UploadFailedError as exc:
            # NOTE: boto3 puts the server's answer (an access denial, say) only into the message
            # of its upload error; the ClientError itself is the implicit __context__
            if isinstance(exc.__context__, ClientError):
                raise self._refused(exc.__context__, doing) from exc
            raise StoreError(f"upload failed while trying to {doing} in {where}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"S3 failed to {doing} in {where}: {exc}") from exc

    def _refused(self, exc: ClientError, doing: str) -> StoreError:
        """The StoreError for a request the server answered with an error."""
        where = f"{self.location} at {self.endpoint}"
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ACCESS_CODES or status == 403:
            return StoreError(
                f"access denied to {where} when trying to {doing} ({code}) — check "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and that this "
                "identity may read and write the bucket"
            )
        if code == "NoSuchBucket" or (code == "404" and doing == "open the bucket"):
            return StoreError(
                f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}: create it "
                f"(aws s3 mb s3://{self.bucket}) or fix the store location"
            )
        return StoreError(
            f"S3 refused to {doing} in {where}: {code} {error.get('Message', '')}".rstrip()
        )

    def _get(self, name: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        with self._errors(f"read {name}"):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

    def _put(self, name: str, data: bytes) -> None:
        with self._errors(f"write {name}"):
            self.client.put_object(Bucket=self.bucket, Key=name, Body=data)

    def _put_new(self, name: str, data: bytes, doing: str) -> bool:
        """Put `name` only if it does not exist yet (If-None-Match: *); False if it did. Where the
        server ignores conditional puts it is check, then put: a race can still overwrite."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=name, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in PRECONDITION_CODES:
                return False
            if code not in UNCONDITIONAL_CODES:
                raise self._refused(exc, doing) from exc
            if self._get(name) is not None:
                return False
            self._put(name, data)
        except BotoCoreError:
            with self._errors(doing):
                raise
        return True

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        with self._errors(f"list {prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                yield from page.get("Contents", [])

    def _delete_prefix(self, prefix: str) -> None:
        names = [obj["Key"] for obj in self._list(prefix)]
        with self._errors(f"delete {prefix}"):
            for start in range(0, len(names), 1000):
                batch = [{"Key": name} for name in names[start : start + 1000]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})

    @contextmanager
    def _progress(self, verb: str, total: int) -> Iterator[Callable[[str], Callable[[int], None]]]:
        """A byte-counting rich progress bar; yields `callback_for(file_name)` for boto3."""
        progress = Progress(
            TextColumn(f"{verb} {{task.description}}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
            disable=total < PROGRESS_MIN_BYTES,
        )
        task = progress.add_task("", total=total)

        def callback_for(name: str) -> Callable[[int], None]:
            progress.update(task, description=name)
            return lambda done: progress.update(task, advance=done)

        with progress:
            yield callback_for

    # -- entries -----------------------------------------------------------------------------

    def lookup(self, key: str) -> S3Marker | None:
        data = self._get(self._path("entries", f"{key}.json"))
        if data is None:
            return None
        try:
            return S3Marker.model_validate_json(data)
        except (ValidationError, ValueError):
            return None

    def _require(self, key: str) -> S3Marker:
        meta = self.lookup(key)
        if meta is None:
            raise KeyError(key)
        return meta

    def local_copy(self, key: str) -> Path | None:
        return self.cache.local_copy(key)

    def open(self, key: str, verify: bool = True) -> Path:
        if self.cache.lookup(key) is not None:
            try:
                return self.cache.open(key, verify)
            except CorruptEntry as exc:
                self.cache.quarantine(key, f"download cache copy: {exc.problem}")
        meta = self._require(key)
        with self.cache.writer(key, meta.stage) as tmp:
            self._download(meta, meta.files, "", tmp)
            verify_files(tmp, meta)  # always: a download is exactly what checksums are for
            self.cache.adopt(EntryMeta.model_validate(meta.model_dump()), tmp)
        return self.cache.open(key, verify=False)

    def verify(self, key: str) -> None:
        """Downloads the bucket's files into a temp dir (removed after), not the download cache:
        the cache's copy can be intact while the bucket's, which every other machine gets, is
        not."""
        with self.cache.writer(key, "verify") as tmp:
            self.fetch(key, tmp)

    def fetch(self, key: str, dest: Path, prefix: str = "") -> EntryMeta:
        meta = self._require(key)
        selected = select_files(meta, prefix)
        self._download(meta, selected, prefix.strip("/"), dest)
        verify_files(dest, meta.model_copy(update={"files": selected}))
        return meta

    def _download(
        self, meta: S3Marker, files: dict[str, FileRecord], prefix: str, dest: Path
    ) -> None:
        total = sum(record.size for record in files.values())
        with self._progress("download", total) as callback_for:
            for rel, record in files.items():
                source = self._path("blobs", meta.key, meta.upload, f"{prefix}/{rel}".lstrip("/"))
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                config = TransferConfig(
                    multipart_threshold=_part_size(record.size),
                    multipart_chunksize=_part_size(record.size),
                )
                with self._errors(f"download {source}"):
                    self.client.download_file(
                        self.bucket, source, str(target), Config=config, Callback=callback_for(rel)
                    )

    @contextmanager
    def writer(self, key: str, stage: str) -> Iterator[Path]:
        with self.cache.writer(key, stage) as tmp:
            yield tmp

    def commit(
        self,
        key: str,
        stage: str,
        built: Path,
        metrics: dict[str, Any],
        gate: dict[str, Any] | None,
        key_inputs: dict[str, Any],
        replace: bool = False,
    ) -> EntryMeta:
        """With `replace`, the new marker overwrites the old one in a single PUT once the new files
        are uploaded: readers see the old entry or the new, never neither. The old upload's files
        stay until gc drops them as an upload no marker points to, and other machines' download
        caches keep the old copy they hold (same key: built from the same inputs)."""
        meta = EntryMeta.of_built(key, stage, built, metrics, gate, key_inputs)
        published = self.import_entry(meta, built, replace)
        if published.files == meta.files:  # ours won (or an identical build): keep it, no download
            self.cache.adopt(meta, built, replace)
        return published

    def import_entry(self, meta: EntryMeta, files: Path, replace: bool = False) -> EntryMeta:
        """`replace` overwrites an entry already under the key (see commit)."""
        existing = None if replace else self.lookup(meta.key)
        if existing is not None:
            return existing
        upload = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        base = self._path("blobs", meta.key, upload)
        total = sum(record.size for record in meta.files.values())
        with self._progress("upload", total) as callback_for:
            for rel, record in meta.files.items():
                config = TransferConfig(
                    multipart_threshold=_part_size(record.size),
                    multipart_chunksize=_part_size(record.size),
                )
                with self._errors(f"upload {rel} of {meta.key[:12]}"):
                    self.client.upload_file(
                        str(files / rel),
                        self.bucket,
                        f"{base}/{rel}",
                        Config=config,
                        Callback=callback_for(rel),
                    )
        uploaded = {obj["Key"][len(base) + 1 :]: obj["Size"] for obj in self._list(base + "/")}
        for rel, record in meta.files.items():
            if uploaded.get(rel) != record.size:
                raise StoreError(
                    f"upload of {meta.key[:12]} is incomplete: {rel} has "
                    f"{uploaded.get(rel)} bytes in {self.location}, expected {record.size}"
                )
        marker = S3Marker.model_validate({**meta.model_dump(), "upload": upload})
        return self._put_marker(marker, replace)

    def _put_marker(self, marker: S3Marker, replace: bool = False) -> S3Marker:
        """The commit point: first marker wins; a loser removes its upload and reuses the winner.
        `replace` puts it unconditionally: the last forced rebuild wins."""
        name = self._path("entries", f"{marker.key}.json")
        body = marker.model_dump_json(indent=2).encode()
        if replace:
            self._put(name, body)
            return marker
        if self._put_new(name, body, f"commit {marker.key[:12]}"):
            return self._winner(marker)
        self._delete_prefix(self._path("blobs", marker.key, marker.upload) + "/")
        winner = self.lookup(marker.key)
        if winner is None:
            raise StoreError(
                f"{self.location} refused the marker of {marker.key[:12]} as already present, "
                "but it cannot be read: retry the run"
            )
        return winner

    def _winner(self, marker: S3Marker) -> S3Marker:
        """The marker now in the bucket. NOTE: where conditional puts are not enforced, the last
        marker stays; both uploads are complete, so either is valid, and gc() drops the other."""
        return self.lookup(marker.key) or marker

    def quarantine(self, key: str, reason: str) -> None:
        self.cache.quarantine(key, reason)
        meta = self.lookup(key)
        if meta is None:
            return
        record = {"reason": reason, "marker": meta.model_dump()}
        self._put(
            self._path("corrupt", f"{key}.{int(time.time())}.json"), json.dumps(record).encode()
        )
        with self._errors(f"quarantine {key[:12]}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._path("entries", f"{key}.json"))

    def entries(self) -> Iterator[EntryMeta]:
        for obj in self._list(self._path("entries") + "/"):
            key = obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
            meta = self.lookup(key)
            if meta is not None:
                yield meta

    def remove(self, key: str) -> None:
        with self._errors(f"remove {key[:12]}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._path("entries", f"{key}.json"))
        self._delete_prefix(self._path("blobs", key) + "/")
        self.cache.remove(key)

    def gc(self, keep: set[str] | None = None) -> list[str]:
        return self.gc_remote(keep) + self.cache.gc(keep)

    def gc_remote(self, keep: set[str] | None = None) -> list[str]:
        """Quarantined entries, uploads no marker points to (older than stale_upload_s), abandoned
        multipart uploads, (with `keep`) entries not in it, and then aliases whose entry is gone:
        those are garbage for every machine sharing the bucket, so even a gc without `keep` (the
        two-tier store's) drops them."""
        removed = []
        for obj in self._list(self._path("corrupt") + "/"):
            record = json.loads(self._get(obj["Key"]) or b"{}")
            marker = record.get("marker", {})
            if marker.get("key") and marker.get("upload"):
                self._delete_prefix(self._path("blobs", marker["key"], marker["upload"]) + "/")
            self._delete_prefix(obj["Key"])
            removed.append(obj["Key"])
        if keep is not None:
            for meta in list(self.entries()):
                if meta.key not in keep:
                    self.remove(meta.key)
                    removed.append(f"entries/{meta.key}")
        cutoff = time.time() - self.stale_upload_s
        live: dict[str, str | None] = {}
        blobs = self._path("blobs") + "/"
        for obj in self._list(blobs):
            key, upload = obj["Key"][len(blobs) :].split("/", 2)[:2]
            if key not in live:
                marker = self.lookup(key)
                live[key] = marker.upload if marker else None
            started = int(upload.split("-", 1)[0]) if upload.split("-", 1)[0].isdigit() else 0
            if upload != live[key] and started < cutoff:
                self._delete_prefix(f"{blobs}{key}/{upload}/")
                removed.append(f"blobs/{key}/{upload}")
        with self._errors("list abandoned multipart uploads"):
            pending = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=blobs)
            for upload in pending.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff:
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    removed.append(f"multipart/{upload['Key']}")
        return sorted(set(removed)) + self._drop_dangling_aliases()

    def _drop_dangling_aliases(self) -> list[str]:
        """Delete aliases whose marker is gone (after gc or quarantine), so `cache ls` and `cache
        push` never meet them. A run puts its marker before the alias, so only an alias moved in
        the instant between check and delete is lost."""
        removed = []
        for obj in list(self._list(self._path("aliases") + "/")):
            alias = obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
            try:
                record, why = self._alias_record(alias), ""
            except MalformedAlias:
                record, why = None, " (unreadable record)"
            if not why and (record is None or self.lookup(record["key"]) is not None):
                continue
            with self._errors(f"remove alias {alias}"):
                self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])
            removed.append(f"aliases/{alias}{why}")
        return removed

    # -- aliases and documents ---------------------------------------------------------------

    def set_alias(self, alias: str, key: str, info: dict[str, Any]) -> None:
        self._put(self._path("aliases", f"{alias}.json"), json.dumps({"key": key, **info}).encode())

    def resolve_alias(self, alias: str) -> dict[str, Any] | None:
        return self._checked_alias(alias, self._alias_record(alias))

    def _alias_record(self, alias: str) -> dict[str, Any] | None:
        """The stored record, whether or not its entry exists (resolve_alias checks that)."""
        name = self._path("aliases", f"{alias}.json")
        data = self._get(name)
        return parse_alias_record(f"s3://{self.bucket}/{name}", data) if data is not None else None

    def aliases(self) -> dict[str, dict[str, Any]]:
        names = (
            obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
            for obj in self._list(self._path("aliases") + "/")
        )
        return readable_aliases(names, self._alias_record)

    def write_document(self, name: str, data: bytes) -> None:
        self._put(self._doc(name), data)

    def create_document(self, name: str, data: bytes) -> None:
        if not self._put_new(self._doc(name), data, f"create {name}"):
            raise DocumentExists(name, self.location)

    def read_document(self, name: str) -> bytes | None:
        return self._get(self._doc(name))

    def list_documents(self, prefix: str) -> list[str]:
        base = self._path("docs") + "/"
        return sorted(obj["Key"][len(base) :] for obj in self._list(base + prefix))

    def _doc(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise StoreError(f"document name {name!r} leaves the store")
        return self._path("docs", name)
