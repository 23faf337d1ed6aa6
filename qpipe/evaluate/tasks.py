"""lm-eval tasks, offline: GSM8K from the copy qpipe ships, any other task from the user's files.

We do not re-implement tasks: each run gets a small lm-eval task YAML that `include`s lm-eval's own
task config (prompt, 5-shot, filters, metrics stay exactly lm-eval's) and only swaps the dataset
for local files, so nothing is downloaded. The YAML is saved next to the report as the record of
what ran. Models go through lm-eval's own adapters: `hf` for checkpoints, `local-completions` for
an OpenAI-compatible endpoint (the artifact measured the way it is served).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from qpipe.data import GSM8K_EVAL, GSM8K_FEWSHOT
from qpipe.evaluate.config import TaskConfig
from qpipe.evaluate.models import ModelRef

SPLIT_FIELDS = ("test_split", "validation_split", "training_split", "fewshot_split")
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class TaskScores:
    """One model's result on one task: lm-eval's aggregate metrics and per-item scores.

    Metric names are lm-eval's, `metric,filter` (e.g. `exact_match,strict-match`); `items` holds
    each metric's per-item scores ordered by doc_id (the pairing for McNemar / the bootstrap).
    """

    task: str
    metrics: dict[str, float]
    items: dict[str, np.ndarray]
    doc_ids: tuple[int, ...]
    seconds: float


def lm_eval_task_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def builtin_task_yaml(name: str) -> Path:
    """Where lm-eval keeps a task's own YAML (gsm8k's is known; others are looked up)."""
    if name == "gsm8k":
        return lm_eval_task_dir() / "gsm8k" / "gsm8k.yaml"
    # NOTE: a text scan finds a plain `task: NAME` YAML in ~1 s; lm-eval's full index takes ~30 s.
    declares = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    for path in sorted(lm_eval_task_dir().rglob("*.yaml")):
        if declares.search(path.read_text(encoding="utf-8", errors="replace")):
            return path
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    entry = TaskManager().task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise ValueError(
            f"task {name!r}: lm-eval {_lm_eval_version()} has no YAML task of that name; give "
            "`config:` (your own task YAML) instead"
        )
    if entry.kind != Kind.TASK:
        raise ValueError(f"task {name!r} is an lm-eval group or tag; list its tasks one by one")
    return Path(entry.yaml_path)


def task_yaml(task: TaskConfig, resolve: Callable[[str], Path], work_dir: Path) -> Path:
    """The lm-eval task YAML to run `task` offline, written into work_dir."""
    if task.config is not None:
        path = resolve(task.config)
        if not path.is_file():
            raise FileNotFoundError(f"task {task.name!r}: config {path} does not exist")
        return path
    files = (
        {split: resolve(path) for split, path in task.data_files.items()}
        if task.data_files is not None
        else {"train": GSM8K_FEWSHOT, "test": GSM8K_EVAL}
    )
    for split, path in files.items():
        if not path.is_file():
            raise FileNotFoundError(
                f"task {task.name!r}: data_files.{split}: {path} does not exist"
            )
    suffixes = {DATASET_BUILDERS[path.suffix] for path in files.values()}
    if len(suffixes) != 1:
        raise ValueError(f"task {task.name!r}: data_files mix formats; use one of json/csv/parquet")
    base = builtin_task_yaml(task.name)
    from lm_eval.tasks._yaml_loader import load_yaml

    original = load_yaml(base, resolve_func=False)
    config: dict[str, Any] = {
        "include": str(base),
        "task": task.name,
        "dataset_path": suffixes.pop(),
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(path) for split, path in files.items()}},
    }
    for field in SPLIT_FIELDS:
        if original.get(field) is not None and original[field] not in files:
            config[field] = None
    if config.get("test_split", original.get("test_split")) is None and (
        config.get("validation_split", original.get("validation_split")) is None
    ):
        wanted = sorted({original[f] for f in SPLIT_FIELDS if original.get(f)})
        raise ValueError(
            f"task {task.name!r}: data_files has no split to evaluate; its lm-eval config uses "
            f"splits {wanted}, got {sorted(files)}"
        )
    out = work_dir / "tasks" / f"{task.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return out


def lm_eval_model(ref: ModelRef, dtype: str, batch_size: int) -> Any:
    """lm-eval's own adapter for the model: `hf` or `local-completions`."""
    if ref.is_endpoint:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        # NOTE: text prompts (no local tokenizer): the server tokenizes, as it does in production.
        return LocalCompletionsAPI(
            base_url=f"{ref.url}/v1/completions",
            model=ref.served_model_name(),
            tokenizer_backend="none",
            tokenized_requests=False,
            num_concurrent=batch_size,
            max_retries=3,
        )
    import torch
    from lm_eval.models.huggingface import HFLM

    ref.check()
    return HFLM(
        pretrained=str(ref.path),
        dtype=dtype,
        batch_size=batch_size,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )


def run_task(model: Any, task: TaskConfig, spec: Path, samples_file: Path, seed: int) -> TaskScores:
    """Run one task with lm-eval; write its logged samples (JSONL) for auditing the scores."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    start = time.perf_counter()
    output = simple_evaluate(
        model=model,
        tasks=[str(spec)],
        task_manager=TaskManager(include_defaults=False),
        num_fewshot=task.num_fewshot,
        limit=task.limit,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
    )
    seconds = time.perf_counter() - start
    if output is None:
        raise RuntimeError(f"task {task.name!r}: lm-eval returned no results")
    if len(output["results"]) != 1:
        raise ValueError(
            f"task {task.name!r}: expected one task, lm-eval ran {list(output['results'])}"
        )
    name, results = next(iter(output["results"].items()))
    samples = output["samples"][name]
    samples_file.parent.mkdir(parents=True, exist_ok=True)
    with samples_file.open("w", encoding="utf-8") as fh:
        for sample in samples:
            fh.write(json.dumps(sample, default=str) + "\n")
    metrics = {
        key: float(value)
        for key, value in results.items()
        if "," in key and "_stderr" not in key and isinstance(value, int | float)
    }
    doc_ids = sorted({int(s["doc_id"]) for s in samples})
    items = {}
    for key in metrics:
        metric, filter_name = key.split(",", 1)
        by_doc = {int(s["doc_id"]): float(s[metric]) for s in samples if s["filter"] == filter_name}
        items[key] = np.array([by_doc[d] for d in doc_ids])
    return TaskScores(
        task=task.name, metrics=metrics, items=items, doc_ids=tuple(doc_ids), seconds=seconds
    )


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
