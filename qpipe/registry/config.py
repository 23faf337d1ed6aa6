"""Recipe section for the publish stage."""

from __future__ import annotations

from pydantic import Field

from qpipe.config_base import Section

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]*$"


class PublishConfig(Section):
    registry: str | None = Field(
        default=None,
        description="Registry location (dir or s3://bucket/prefix); default: the run's store. "
        "A separate registry receives copies of the published entries.",
    )
    name: str | None = Field(
        default=None, pattern=NAME_PATTERN, description="Artifact name; default: the recipe name."
    )
    version: str | None = Field(
        default=None,
        pattern=VERSION_PATTERN,
        description="Default: the next integer version (republishing the same content reuses it).",
    )
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint of an s3:// registry (default: AWS_ENDPOINT_URL)."
    )
    allow_failed_gates: bool = Field(
        default=False,
        description="Publish even if the evaluate/bench gates failed (recorded in the manifest).",
    )
