"""One place that turns a store location (recipe `store:` or `--store`) into a Store."""

from __future__ import annotations

import re
from pathlib import Path

from qpipe.store.base import Store, StoreError
from qpipe.store.local import LocalStore, default_home

# `name:` at the start, as in a URL; a local directory whose name has a colon is written `./a:b`
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def check_location(location: str) -> None:
    """StoreError for a location that looks like a URL but is not `s3://...`: a mistyped or
    unsupported scheme (`S3://`, `s3:/`, `gs://`) would otherwise become a local directory named
    after it. Schemes are case-sensitive, as boto3 and the AWS CLI read them: `S3://` is a typo.
    A caller that rewrites a location (a recipe's relative path) checks it first."""
    match = SCHEME.match(location)
    if match is None or location.startswith("s3://"):
        return
    scheme = match.group(1)
    if scheme.lower() == "s3":
        problem = f"did you mean s3://{location[len(scheme) + 1 :].lstrip('/')}?"
    else:
        problem = f"the scheme {scheme}: is not supported."
    raise StoreError(
        f"store location {location!r}: {problem} A store is a local directory or "
        f"s3://bucket/prefix (lower-case s3, two slashes); write ./{location} for a local "
        "directory whose name has a colon"
    )


def open_store(
    location: str | None,
    endpoint_url: str | None = None,
    local_cache: str | None = None,
    create: bool = True,
) -> Store:
    """None -> the default local store; a path -> LocalStore; `s3://bucket/prefix` -> S3Store
    (downloads cached under $QPIPE_HOME/s3-cache), or TieredStore when `local_cache` is given.

    `endpoint_url` and `local_cache` only apply to s3:// locations, so `--store DIR` can override
    a recipe's S3 store without editing the recipe. `create=False` refuses a local directory that
    is not a store yet (a bucket must always exist already)."""
    if location is not None:
        check_location(location)
    if location is None or not location.startswith("s3://"):
        return LocalStore(Path(location) if location else default_home(), create=create)

    # boto3 is imported only for S3 locations: `qpipe plan` on a local store stays fast
    from qpipe.store.s3 import S3Store, parse_s3_url
    from qpipe.store.tiered import TieredStore

    bucket, prefix = parse_s3_url(location)
    if local_cache is None:
        cache = LocalStore(default_home() / "s3-cache" / bucket / (prefix or "_"))
        return S3Store(location, cache, endpoint_url=endpoint_url)
    return TieredStore(S3Store(location, LocalStore(Path(local_cache)), endpoint_url=endpoint_url))
