"""Recipe section for the evaluate stage: what to measure and how much drop is allowed."""

from __future__ import annotations

from pydantic import Field

from qpipe.config_base import Section


class TaskConfig(Section):
    """One lm-eval task, run offline on local data."""

    name: str
    limit: int | None = Field(default=None, gt=0)
    num_fewshot: int | None = Field(default=None, ge=0)
    data_files: str | None = Field(
        default=None, description="Local data for tasks other than the shipped gsm8k."
    )


class EvaluateConfig(Section):
    text: str | None = Field(
        default=None, description="Held-out domain text for KLD/perplexity (default: wikitext-2)."
    )
    max_tokens: int = Field(default=16384, gt=0)
    window: int = Field(default=512, gt=0)
    tasks: list[TaskConfig] = Field(default_factory=list)
    max_drop: dict[str, float] = Field(default_factory=dict)
    batch_size: int = Field(default=8, gt=0)
