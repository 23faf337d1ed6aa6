"""One place that turns a store location (recipe `store:` or `--store`) into a Store."""

from __future__ import annotations

from pathlib import Path

from qpipe.store.base import Store
from qpipe.store.local import LocalStore, default_home


def open_store(
    location: str | None,
    endpoint_url: str | None = None,
    local_cache: str | None = None,
) -> Store:
    """None -> the default local store; a path -> LocalStore; `s3://bucket/prefix` -> S3Store
    (downloads cached under $QPIPE_HOME/s3-cache), or TieredStore when `local_cache` is given.

    `endpoint_url` and `local_cache` only apply to s3:// locations, so `--store DIR` can override
    a recipe's S3 store without editing the recipe."""
    if location is None or not location.startswith("s3://"):
        return LocalStore(Path(location) if location else default_home())

    # boto3 is imported only for S3 locations: `qpipe plan` on a local store stays fast
    from qpipe.store.s3 import S3Store, parse_s3_url
    from qpipe.store.tiered import TieredStore

    bucket, prefix = parse_s3_url(location)
    if local_cache is None:
        cache = LocalStore(default_home() / "s3-cache" / bucket / (prefix or "_"))
        return S3Store(location, cache, endpoint_url=endpoint_url)
    return TieredStore(S3Store(location, LocalStore(Path(local_cache)), endpoint_url=endpoint_url))
