"""Recipe section for the evaluate stage: what to measure and how much drop is allowed.

Gate names (keys of `max_drop`) and what each compares, so a recipe reads unambiguously:

- `<task>` (an lm-eval task listed in `tasks`): every metric of the task, e.g. both
  `exact_match,strict-match` and `exact_match,flexible-extract` of gsm8k, may drop by at most this
  many accuracy points (baseline% - candidate%). `<task>/<filter>` gates one metric only.
- `top1_agreement`: at most this many points of tokens whose top-1 prediction differs
  (100 - agreement%).
- `kld_mean`, `kld_p99`, `kld_max`: the candidate's KL divergence from the baseline, nats per token.
- `ppl_ratio`: candidate perplexity / baseline perplexity.

Gates compare point estimates; the report adds each drop's interval and says noise or significant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from qpipe.config_base import Section, field_error

DISTRIBUTION_GATES = ("kld_mean", "kld_p99", "kld_max", "ppl_ratio", "top1_agreement")


class TaskConfig(Section):
    """One lm-eval task, run offline on local data.

    `gsm8k` uses the copy shipped with qpipe. Any other lm-eval task needs either `data_files`
    (its own config, with the dataset swapped for these local files: split name -> file) or `config`
    (a task YAML of your own whose `dataset_path` points at local files).
    """

    name: str = Field(min_length=1)
    limit: int | None = Field(default=None, gt=0, description="Evaluate only the first N items.")
    num_fewshot: int | None = Field(default=None, ge=0)
    data_files: dict[str, str] | None = Field(
        default=None, description="Split name -> local .json/.jsonl/.csv/.parquet file."
    )
    config: str | None = Field(default=None, description="A custom lm-eval task YAML file.")

    @model_validator(mode="after")
    def _one_data_source(self) -> TaskConfig:
        if self.data_files is not None and self.config is not None:
            raise ValueError(f"task {self.name!r}: give data_files or config, not both")
        if self.name != "gsm8k" and self.data_files is None and self.config is None:
            raise ValueError(
                f"task {self.name!r}: qpipe ships data only for gsm8k; give data_files (split -> "
                "local file) or config (your lm-eval task YAML) so nothing is downloaded"
            )
        for split, path in (self.data_files or {}).items():
            if Path(path).suffix not in (".json", ".jsonl", ".csv", ".parquet"):
                raise ValueError(
                    f"task {self.name!r}: data_files.{split} must be a .json, .jsonl, .csv or "
                    f".parquet file, got {path!r}"
                )
        return self


class EvaluateConfig(Section):
    text: str | None = Field(
        default=None,
        description="Held-out domain text for KLD/perplexity (default: shipped wikitext-2 test).",
    )
    max_tokens: int = Field(
        default=16384, ge=0, description="Tokens of held-out text to score (0: skip these checks)."
    )
    window: int = Field(default=512, ge=16, description="Tokens per scored window.")
    batch_size: int = Field(default=4, gt=0, description="Windows (or lm-eval requests) per batch.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="Compute dtype of both models (auto: the checkpoint's own; bf16 is slow on "
        "CPUs without native bf16).",
    )
    tasks: list[TaskConfig] = Field(default_factory=list)
    max_drop: dict[str, float] = Field(default_factory=dict)
    bootstrap_iterations: int = Field(default=10000, ge=100)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    seed: int = 0

    @field_validator("tasks", mode="before")
    @classmethod
    def _task_names(cls, value: Any) -> Any:
        """`tasks: [gsm8k]` is shorthand for `tasks: [{name: gsm8k}]`."""
        if isinstance(value, list):
            return [{"name": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _known_gates(self) -> EvaluateConfig:
        names = [task.name for task in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks lists a task twice: {names}")
        valid = gate_names(names)
        for gate, limit in self.max_drop.items():
            task = gate.split("/", 1)[0]
            if gate not in valid and not ("/" in gate and task in names):
                raise ValueError(
                    f"unknown gate {gate!r} in max_drop; valid gates: {', '.join(valid)} "
                    "(a task name gates that task's metrics; add the task to evaluate.tasks)"
                )
            if gate == "ppl_ratio" and limit < 1:
                raise ValueError(f"max_drop.ppl_ratio is candidate/baseline, >= 1; got {limit}")
            if limit < 0:
                raise ValueError(f"max_drop.{gate} must be >= 0, got {limit}")
        return self

    @model_validator(mode="after")
    def _one_window_at_least(self) -> EvaluateConfig:
        """A budget under one window scores nothing: refused here, not after quantize has run."""
        if 0 < self.max_tokens < self.window:
            raise field_error(
                EvaluateConfig,
                ("max_tokens",),
                self.max_tokens,
                f"max_tokens ({self.max_tokens}) is less than one window (window: {self.window} "
                f"tokens), so no window would be scored; use max_tokens {self.window} or more, "
                "a smaller window, or max_tokens 0 to skip the perplexity/KLD checks",
            )
        return self


def gate_names(task_names: list[str]) -> list[str]:
    return [*DISTRIBUTION_GATES, *task_names, *(f"{name}/<filter>" for name in task_names)]
