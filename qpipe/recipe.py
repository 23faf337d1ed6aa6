"""The recipe: one YAML file describing a whole qpipe run, loaded into typed models.

Errors point at the file and line of the offending value and, for unknown keys, suggest the closest
valid key, because a recipe is edited by hand and a CI log is often all the user sees.
"""

from __future__ import annotations

import difflib
import io
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from qpipe.bench.config import BenchConfig
from qpipe.calibration.seq_len import SeqLenError, check_seq_len
from qpipe.config_base import Section, field_error
from qpipe.evaluate.config import EvaluateConfig
from qpipe.export.config import BuildConfig
from qpipe.quant.config import CalibrationConfig, QuantizationConfig
from qpipe.registry.config import PublishConfig

Dtype = Literal["float32", "bfloat16", "float16"]
SOURCE_SCHEMES = ("gguf:", "package:", "hf:", "dir:")


class ModelConfig(Section):
    source: str = Field(description="gguf:PATH | package:DIST/FILE | hf:ORG/NAME | a local HF dir")
    name: str | None = Field(
        default=None, description="Short model name used in engine aliases (e.g. llama3-8b)."
    )
    dtype: Dtype = "bfloat16"
    allow_pickle: bool = Field(
        default=False, description="Allow loading pickle .bin weights (runs code from the file)."
    )
    verify_prompts: list[str] = Field(
        default_factory=lambda: ["The capital of France is", "def fibonacci(n):"]
    )

    @field_validator("source")
    @classmethod
    def _source_form(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if ":" in value.split("/")[0] and not value.startswith(SOURCE_SCHEMES):
            scheme = value.split(":")[0]
            raise ValueError(
                f"unknown source scheme {scheme!r}; use one of "
                + ", ".join(s.rstrip(":") for s in SOURCE_SCHEMES)
            )
        return value


class StoreConfig(Section):
    location: str | None = Field(default=None, description="Directory or s3://bucket/prefix.")
    endpoint_url: str | None = None
    local_cache: str | None = Field(
        default=None, description="With an s3 location: a local store in front of it (two-tier)."
    )


class Recipe(Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    model: ModelConfig
    calibration: CalibrationConfig | None = None
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    build: BuildConfig = Field(default_factory=BuildConfig)
    evaluate: EvaluateConfig | None = None
    bench: BenchConfig | None = None
    publish: PublishConfig | None = None
    store: StoreConfig = Field(default_factory=StoreConfig)

    @field_validator("calibration", "evaluate", "bench", "publish", mode="before")
    @classmethod
    def _not_left_empty(cls, value: Any) -> Any:
        """`publish:` with nothing under it is YAML's null, which reads as "no such stage": a
        recipe that meant the stage's defaults would silently skip it. (Only a key that is
        there is checked; an absent one is the stage turned off.)"""
        if value is None:
            raise ValueError(
                "this section is empty, which turns its stage off: write `{}` after the colon "
                "for its defaults, or remove the line"
            )
        return value

    @model_validator(mode="after")
    def _calibration_when_needed(self) -> Recipe:
        if self.quantization.needs_calibration and self.calibration is None:
            raise ValueError(
                f"quantization {self.quantization.label} needs a calibration section "
                "(calibration.dataset: your domain data)"
            )
        return self

    @model_validator(mode="after")
    def _seq_len_any_model_reads(self) -> Recipe:
        """The bound that holds whatever the model; `qpipe recipe validate` and the calibrate
        stage also check it against the model's own context."""
        if self.calibration is not None:
            try:
                check_seq_len(self.calibration.seq_len)
            except SeqLenError as exc:
                loc = ("calibration", "seq_len")
                raise field_error(Recipe, loc, self.calibration.seq_len, str(exc)) from exc
        return self

    @property
    def model_name(self) -> str:
        return self.model.name or self.name.split("-int")[0]


class RecipeError(Exception):
    """A recipe that cannot be used, with every problem located as `file:line path: message`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _node_at(root: yaml.Node | None, loc: tuple[str | int, ...]) -> yaml.Node | None:
    """The deepest YAML node along `loc` (its line is where the error points)."""
    node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == part), None)
            if match is None:
                key = next((k for k, _ in node.value if k.value == part), None)
                return key or node
            node = match
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return node
            node = node.value[part]
        else:
            return node
    return node


def _key_node(root: yaml.Node | None, loc: tuple[str | int, ...]) -> yaml.Node | None:
    parent = _node_at(root, loc[:-1])
    if isinstance(parent, yaml.MappingNode):
        return next((k for k, _ in parent.value if k.value == loc[-1]), parent)
    return parent


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `loc` (to suggest valid keys)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _unwrap_model(field.annotation)
        if model is None:
            return None
    return model


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


_TYPE_WORDS = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}


def _describe(error: dict[str, Any], root: yaml.Node | None) -> tuple[int | None, str, str]:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        node = _key_node(root, loc)
        model = _model_at(loc[:-1])
        valid = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        where = ".".join(str(p) for p in loc[:-1]) or "the recipe"
        message = f"unknown key {loc[-1]!r} in {where}{hint} (valid keys: {', '.join(valid)})"
    elif kind == "missing":
        node = _node_at(root, loc[:-1])
        message = "required key is missing"
    elif kind in _TYPE_WORDS:
        node = _node_at(root, loc)
        message = f"expected {_TYPE_WORDS[kind]}, got {error.get('input')!r}"
    else:
        node = _node_at(root, loc)
        message = re.sub(r"^(Value error|Assertion failed), ", "", error["msg"])
        if kind == "literal_error":
            message += f", got {error.get('input')!r}"
    line = node.start_mark.line + 1 if node is not None else None
    return line, path, message


def _duplicate_keys(node: yaml.Node | None, source: str, path: str = "") -> list[str]:
    """YAML keeps the last of two equal keys silently; in a hand-edited recipe that hides a bug."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            where = f"{path}.{key.value}" if path else str(key.value)
            if key.value in seen:
                problems.append(
                    f"{source}:{key.start_mark.line + 1} {where}: duplicate key; "
                    "YAML would silently keep only the last one — merge the two"
                )
            seen.add(key.value)
            problems += _duplicate_keys(value, source, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, source, f"{path}.{i}")
    return problems


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    """Validate recipe YAML text; raise RecipeError with every problem located."""
    try:
        stream = io.StringIO(text)
        stream.name = source  # PyYAML's messages then say `in "r.yaml"`, not "<unicode string>"
        loader = yaml.SafeLoader(stream)
        try:  # one parse: the node tree locates problems, the data is built from it
            root = loader.get_single_node()
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError([f"{source}{line}: not valid YAML: {exc}"]) from exc
    duplicates = _duplicate_keys(root, source)
    if duplicates:
        raise RecipeError(duplicates)
    if not isinstance(data, dict):
        raise RecipeError([f"{source}: a recipe is a YAML mapping (name:, model:, ...)"])
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            line, path, message = _describe(error, root)
            where = f"{source}:{line}" if line else source
            problems.append(f"{where} {path}: {message}")
        raise RecipeError(problems) from exc


def load_recipe(path: Path) -> Recipe:
    """Read and validate a recipe file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError([f"{path}: cannot read the recipe: {exc.strerror}"]) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError([f"{path}: not UTF-8 text (byte {exc.start})"]) from exc
    return parse_recipe(text, str(path))


def locate(path: Path, loc: tuple[str | int, ...]) -> str:
    """`file:line` of the value at `loc` in a recipe file (the nearest enclosing one where the key
    is left to its default), for problems found after parsing, against the model's shape."""
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return str(path)
    node = _node_at(root, loc)
    return f"{path}:{node.start_mark.line + 1}" if node is not None else str(path)


def recipe_schema() -> dict[str, Any]:
    return Recipe.model_json_schema()
