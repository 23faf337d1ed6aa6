"""The one interface every pipeline stage implements.

A stage is a pure function of declared inputs to a directory: the pipeline computes its key from
what it declares here, skips it when the store has that key, and otherwise runs it into an empty
temporary directory that the store commits atomically. Stages never write to the store themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel

from qpipe.recipe import Recipe
from qpipe.store.base import Store

MetricValue = float | int | str | bool | None


class NotAvailable(Exception):
    """A stage or method qpipe does not implement (yet): the run stops, never skips silently."""

    def __init__(self, what: str, hint: str = ""):
        self.what = what
        super().__init__(f"not available yet: {what}" + (f" ({hint})" if hint else ""))


class StageError(Exception):
    """A stage failed for a reason the user can act on (bad data, missing tool, ...)."""


def recipe_path(value: str, recipe_dir: Path) -> Path:
    """A path a recipe names: a relative one is read from the recipe's directory."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (recipe_dir / path).resolve()


def input_path(field: str, value: str, recipe_dir: Path, file_only: bool = False) -> Path:
    """`recipe_path` of a stage's input, or a StageError that names the recipe field when nothing
    (or, with `file_only`, no file) is there."""
    path = recipe_path(value, recipe_dir)
    if not (path.is_file() if file_only else path.exists()):
        raise StageError(
            f"{field}: {path} {'is not a file' if file_only else 'does not exist'} (a relative "
            f"path is resolved from the recipe's directory, {recipe_dir}); fix the path"
        )
    return path


@dataclass(frozen=True)
class GateVerdict:
    """The outcome of a stage's accuracy/throughput gates: failures are human-readable lines."""

    passed: bool
    failures: tuple[str, ...] = ()
    checked: Mapping[str, MetricValue] = field(default_factory=dict)


@dataclass(frozen=True)
class StageResult:
    metrics: Mapping[str, MetricValue] = field(default_factory=dict)
    gate: GateVerdict | None = None
    # Human names for the committed entry (e.g. engine aliases), with what each record says.
    aliases: Mapping[str, Mapping[str, MetricValue]] = field(default_factory=dict)


@dataclass(frozen=True)
class StageContext:
    recipe: Recipe
    recipe_dir: Path
    out_dir: Path
    inputs: Mapping[str, Path]
    store: Store
    keys: Mapping[str, str] = field(default_factory=dict)

    def resolve(self, path: str) -> Path:
        """A path from the recipe, relative to the recipe file's directory."""
        return recipe_path(path, self.recipe_dir)


class Stage(ABC):
    name: ClassVar[str]
    version: ClassVar[int] = 1
    needs: ClassVar[tuple[str, ...]] = ()

    def enabled(self, recipe: Recipe) -> bool:
        return True

    def section(self, recipe: Recipe) -> BaseModel | None:
        """The recipe part that shapes this stage's output; it goes into the key."""
        return None

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        """Files whose content goes into the key (hashed, with a stat-keyed cache), by the role
        each plays, the recipe field that names it ("calibration.dataset",
        "evaluate.tasks[0].data_files.test"): content and role decide the key, not where the file
        lies or what it is called. Raises StageError for a file that is not there."""
        return {}

    def tools(self, recipe: Recipe) -> tuple[str, ...]:
        """Python distributions whose versions shape the output (their versions go into the key)."""
        return ()

    def key_extras(self, recipe: Recipe) -> Mapping[str, str]:
        """Anything else the output depends on (e.g. GPU arch for engines)."""
        return {}

    def check_available(self, recipe: Recipe) -> None:  # noqa: B027 - optional hook
        """Raise NotAvailable before anything runs if this recipe asks for what is not built."""

    def stale(self, recipe: Recipe, entry: Path, store: Store) -> str | None:
        """Why a cached entry (`entry`, its directory) no longer stands for what its stage did
        outside the store, or None. Only a stage with effects elsewhere (publish: the registry)
        has any; a stale entry runs again and replaces itself."""
        return None

    @abstractmethod
    def run(self, ctx: StageContext) -> StageResult: ...
