"""Recipe section for the bench stage: load profiles and throughput gates."""

from __future__ import annotations

from pydantic import Field

from qpipe.config_base import Section


class LoadProfile(Section):
    input_len: int = Field(default=512, gt=0)
    output_len: int = Field(default=256, gt=0)
    concurrency: int = Field(default=32, gt=0)
    num_prompts: int = Field(default=64, gt=0)
    request_rate: float | None = Field(default=None, gt=0, description="None means infinite.")


class BenchConfig(Section):
    endpoint: str | None = Field(default=None, description="Bench this server instead of ours.")
    profiles: list[LoadProfile] = Field(default_factory=lambda: [LoadProfile()])
    min_output_throughput: float | None = Field(default=None, gt=0)
    max_ttft_p99_ms: float | None = Field(default=None, gt=0)
    max_tpot_p99_ms: float | None = Field(default=None, gt=0)
    min_goodput: float | None = Field(default=None, gt=0)
    goodput: dict[str, float] = Field(default_factory=dict)
    fail_on_regression: bool = Field(
        default=False, description="A regression against the accepted baseline fails the gate."
    )
    server_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
