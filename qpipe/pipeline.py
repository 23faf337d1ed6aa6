"""The pipeline: the ordered list of stages and the rule for skipping them.

A stage's key is the hash of everything that shapes its output (see Stage). A stage whose key is in
the store is a hit and is skipped; a miss runs into a temp dir that the store commits atomically.
Cached entries that a running stage reads are checksum-verified first; a corrupt one is quarantined
and rebuilt, never used.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from qpipe.hashing import HashCache, digest_json
from qpipe.recipe import Recipe
from qpipe.stages.base import NotAvailable, Stage, StageContext, StageError
from qpipe.store.base import Store
from qpipe.store.entry import CorruptEntry, EntryMeta

STAGE_ORDER = ("convert", "calibrate", "quantize", "build", "evaluate", "bench", "publish")
OPTIONAL_SECTIONS = {"calibrate": "calibration", "evaluate": "evaluate", "bench": "bench",
                     "publish": "publish"}  # fmt: skip

Status = Literal["hit", "miss", "stale", "ran", "failed", "corrupt", "disabled", "unavailable"]


def load_stage(name: str) -> Stage | None:
    """The stage implementation, or None while qpipe has none for it."""
    try:
        module = importlib.import_module(f"qpipe.stages.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"qpipe.stages.{name}":
            return None
        raise
    return getattr(module, f"{name.capitalize()}Stage")()


def tool_versions(names: tuple[str, ...]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = "absent"
    return versions


@dataclass
class PlannedStage:
    name: str
    status: Status
    key: str | None = None
    path: str | None = None
    reason: str = ""
    seconds: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] | None = None
    key_inputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "status": self.status,
            "path": self.path,
            "reason": self.reason or None,
            "seconds": self.seconds,
            "metrics": self.metrics,
            "gate": self.gate,
        }


def stage_enabled(name: str, stage: Stage | None, recipe: Recipe) -> bool:
    section = OPTIONAL_SECTIONS.get(name)
    if section is not None and getattr(recipe, section) is None:
        return False
    return stage.enabled(recipe) if stage is not None else True


def missing_inputs(recipe: Recipe, recipe_dir: Path) -> list[str]:
    """The data files the recipe names that are not there (calibration, evaluation, held-out
    text), as the run would report them, without hashing anything. The model source is left
    out: it may live on the machine that runs the recipe (a GPU box's Hugging Face cache)."""
    problems = []
    for name in STAGE_ORDER:
        stage = load_stage(name)
        if name == "convert" or stage is None or not stage_enabled(name, stage, recipe):
            continue
        try:
            stage.input_files(recipe, recipe_dir)
        except StageError as exc:
            problems.append(str(exc))
    return problems


@dataclass
class Pipeline:
    recipe: Recipe
    recipe_dir: Path
    store: Store
    hash_cache: HashCache
    loader: Callable[[str], Stage | None] = load_stage

    def _stages(self) -> list[tuple[str, Stage | None]]:
        return [(name, self.loader(name)) for name in STAGE_ORDER]

    def plan(self, until: str | None = None) -> list[PlannedStage]:
        """Each stage's key and whether the store has it, without running anything."""
        planned: list[PlannedStage] = []
        keys: dict[str, str] = {}
        for name, stage in self._stages():
            if stage is None:
                planned.append(
                    PlannedStage(name, "unavailable", reason=f"not available yet: {name}")
                )
                if self._reached(name, until):
                    break
                continue
            if not stage_enabled(name, stage, self.recipe):
                planned.append(PlannedStage(name, "disabled", reason="not in the recipe"))
            else:
                planned.append(self._plan_one(name, stage, keys))
            if self._reached(name, until):
                break
        return planned

    @staticmethod
    def _reached(name: str, until: str | None) -> bool:
        return until is not None and name == until

    def _plan_one(self, name: str, stage: Stage, keys: dict[str, str]) -> PlannedStage:
        try:
            stage.check_available(self.recipe)
        except NotAvailable as exc:
            return PlannedStage(name, "unavailable", reason=str(exc))
        missing = [n for n in stage.needs if n in STAGE_ORDER and n not in keys and
                   self._needed_upstream(n)]  # fmt: skip
        if missing:
            return PlannedStage(name, "unavailable", reason=f"needs {', '.join(missing)}")
        section = stage.section(self.recipe)
        key_inputs = {
            "stage": name,
            "version": stage.version,
            "section": section.model_dump(mode="json") if section is not None else None,
            "upstream": {n: keys[n] for n in stage.needs if n in keys},
            "files": self.hash_cache.files_hash(stage.input_files(self.recipe, self.recipe_dir)),
            "tools": tool_versions(stage.tools(self.recipe)),
            "extras": dict(stage.key_extras(self.recipe)),
        }
        key = digest_json(key_inputs)
        keys[name] = key
        meta = self.store.lookup(key)
        if meta is None:
            return PlannedStage(name, "miss", key=key, key_inputs=key_inputs)
        planned = PlannedStage(name, "hit", key=key, key_inputs=key_inputs,
                               metrics=meta.metrics, gate=meta.gate)  # fmt: skip
        if self.store.local_copy(key) is None and type(stage).stale is Stage.stale:
            # NOTE: a stage with a stale check (publish: a few KB) is read now, so every runner
            # sees what its effects outside the store have become, with or without a local copy
            planned.reason = "in the remote store; downloaded when a stage reads it"
            return planned
        try:
            planned.path = str(self.store.open(key, verify=False))
        except CorruptEntry as exc:
            planned.status, planned.reason = "corrupt", exc.problem
            return planned
        stale = stage.stale(self.recipe, Path(planned.path), self.store)
        if stale is not None:
            planned.status, planned.reason = "stale", stale
        return planned

    def _needed_upstream(self, name: str) -> bool:
        return stage_enabled(name, self.loader(name), self.recipe)

    def run(
        self,
        until: str | None = None,
        force: tuple[str, ...] = (),
        on_event: Callable[[PlannedStage, str], None] = lambda stage, event: None,
    ) -> list[PlannedStage]:
        """Run every stage that is not in the store, in order; return the final table.

        A stage that cannot run (not available, bad input) ends the run with status "failed" and
        its reason; stages after it are left as planned. A forced stage's cached entry is replaced
        only once its rebuild is committed: a failed or interrupted one leaves it as it was.
        """
        planned = self.plan(until)
        active = [p for p in planned if p.status != "disabled"]
        blocked = next((p for p in active if p.status == "unavailable"), None)
        if blocked is not None:
            active = active[: active.index(blocked)]
        to_run = {
            p.name for p in active if p.status in ("miss", "stale", "corrupt") or p.name in force
        }
        inputs = self._verify_inputs(active, to_run, on_event)
        keys = {p.name: p.key for p in active if p.key}
        for p in active:
            if p.name not in to_run:
                continue
            stage = self.loader(p.name)
            assert stage is not None and p.key is not None
            if p.status == "corrupt":
                self.store.quarantine(p.key, p.reason)
            on_event(p, "start")
            started = time.perf_counter()
            try:
                meta = self._run_one(stage, p, inputs, keys)
            except (StageError, NotAvailable) as exc:
                p.status, p.reason = "failed", str(exc)
                p.seconds = time.perf_counter() - started
                on_event(p, "failed")
                return planned
            except BaseException as exc:
                p.status = "failed"
                p.reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else repr(exc)
                p.seconds = time.perf_counter() - started
                on_event(p, "failed")
                raise
            p.seconds = time.perf_counter() - started
            p.status, p.metrics, p.gate = "ran", meta.metrics, meta.gate
            p.path = str(self.store.open(p.key, verify=False))
            inputs[p.name] = Path(p.path)
            on_event(p, "done")
        if blocked is not None:
            blocked.status = "failed"
            on_event(blocked, "failed")
        return planned

    def _verify_inputs(
        self,
        active: list[PlannedStage],
        to_run: set[str],
        on_event: Callable[[PlannedStage, str], None],
    ) -> dict[str, Path]:
        """Checksum the cached entries that stages about to run will read; rebuild corrupt ones."""
        by_name = {p.name: p for p in active}
        inputs: dict[str, Path] = {}
        changed = True
        while changed:
            changed = False
            for p in active:
                if p.name not in to_run:
                    continue
                stage = self.loader(p.name)
                assert stage is not None
                for need in stage.needs:
                    up = by_name.get(need)
                    if up is None or need in to_run or need in inputs or up.key is None:
                        continue
                    try:
                        inputs[need] = self.store.open(up.key, verify=True)
                    except CorruptEntry as exc:
                        up.status, up.reason = "corrupt", exc.problem
                        on_event(up, "corrupt")
                        to_run.add(need)
                        changed = True
        return inputs

    def _run_one(
        self,
        stage: Stage,
        planned: PlannedStage,
        inputs: dict[str, Path],
        keys: dict[str, str],
    ) -> EntryMeta:
        """Run one stage into a temp dir and commit it; a forced or stale stage (planned as a
        hit, or found stale) replaces its cached entry."""
        assert planned.key is not None
        with self.store.writer(planned.key, stage.name) as out_dir:
            ctx = StageContext(
                recipe=self.recipe,
                recipe_dir=self.recipe_dir,
                out_dir=out_dir,
                inputs={n: inputs[n] for n in stage.needs if n in inputs},
                store=self.store,
                keys=dict(keys),
            )
            result = stage.run(ctx)
            gate = None
            if result.gate is not None:
                gate = {
                    "passed": result.gate.passed,
                    "failures": list(result.gate.failures),
                    "checked": dict(result.gate.checked),
                }
            meta = self.store.commit(
                planned.key,
                stage.name,
                out_dir,
                dict(result.metrics),
                gate,
                planned.key_inputs,
                replace=planned.status in ("hit", "stale"),
            )
        for alias, info in result.aliases.items():
            self.store.set_alias(alias, planned.key, {"stage": stage.name, **info})
        return meta


def gate_failures(planned: list[PlannedStage]) -> list[str]:
    failures = []
    for p in planned:
        if p.gate is not None and not p.gate.get("passed", True):
            failures += [f"{p.name}: {line}" for line in p.gate.get("failures", [])]
    return failures


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "tools": tool_versions(
            (
                "qpipe",
                "torch",
                "transformers",
                "llmcompressor",
                "compressed-tensors",
                "lm-eval",
                "tensorrt_llm",
            )  # fmt: skip
        ),
    }


def manifest(recipe: Recipe, recipe_path: Path, planned: list[PlannedStage],
             store: Store) -> dict[str, Any]:  # fmt: skip
    return {
        "recipe": recipe.model_dump(mode="json"),
        "recipe_path": str(recipe_path),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "store": store.location,
        "stages": [p.to_json() for p in planned],
        "gates_failed": gate_failures(planned),
        "environment": environment(),
    }
