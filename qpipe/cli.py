"""qpipe: from checkpoint to a quantized, built, evaluated, benchmarked and published artifact."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from qpipe.console import console, error, out
from qpipe.recipe import Recipe, RecipeError, load_recipe, locate, recipe_schema

if TYPE_CHECKING:
    from collections.abc import Iterator

    from qpipe.pipeline import PlannedStage

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
recipe_app = typer.Typer(no_args_is_help=True, help="Validate recipes and print their schema.")
cache_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain the artifact store.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(cache_app, name="cache")


def _register_area_commands() -> None:
    """Each area keeps its own CLI module; they import only typer/rich at module level."""
    from qpipe.bench.cli import bench_app
    from qpipe.evaluate.cli import eval_command
    from qpipe.quant.cli import sensitivity
    from qpipe.registry.cli import registry_app
    from qpipe.serve.cli import serve

    app.command("serve")(serve)
    app.command("eval")(eval_command)
    app.command("sensitivity")(sensitivity)
    app.add_typer(bench_app, name="bench")
    app.add_typer(registry_app, name="registry")


StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Store directory or s3://bucket/prefix (default: $QPIPE_HOME)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


def _load(path: Path) -> Recipe:
    try:
        return load_recipe(path)
    except RecipeError as exc:
        for problem in exc.problems:
            console.print(f"[red]{escape(problem)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc


def _open_store(
    location: str | None,
    recipe: Recipe | None = None,
    recipe_dir: Path | None = None,
    create: bool = True,
) -> Any:
    from qpipe.stages.base import recipe_path
    from qpipe.store.base import StoreError
    from qpipe.store.factory import check_location, open_store

    config = recipe.store if recipe is not None else None
    try:
        if location is not None or config is None:  # --store replaces the recipe's store
            endpoint = (
                config.endpoint_url if config and (location or "").startswith("s3://") else None
            )
            return open_store(location, endpoint_url=endpoint, create=create)
        location, local_cache = config.location, config.local_cache
        if recipe_dir is not None:  # a recipe's paths are relative to the recipe file
            if location is not None and not location.startswith("s3://"):
                check_location(location)  # before `gs://b` becomes a path under the recipe's dir
                location = str(recipe_path(location, recipe_dir))
            if local_cache is not None:
                local_cache = str(recipe_path(local_cache, recipe_dir))
        return open_store(location, config.endpoint_url, local_cache)
    except StoreError as exc:
        raise error(str(exc)) from exc


def _pipeline(recipe_path: Path, store: str | None, recipe: Recipe | None = None) -> Any:
    from qpipe.hashing import HashCache
    from qpipe.pipeline import Pipeline
    from qpipe.store.local import default_home

    recipe = recipe or _load(recipe_path)
    opened = _open_store(store, recipe, recipe_path.resolve().parent)
    cache_root = opened.local_root or default_home()
    return Pipeline(
        recipe, recipe_path.resolve().parent, opened, HashCache(cache_root / "hashes.db")
    )


def _reason(stage: Any) -> str:
    """The stage's failure, without the stage's own name in front (it is printed beside it)."""
    return str(stage.reason).removeprefix(f"{stage.name}: ")


def _note(stage: Any) -> str:
    if stage.reason:
        return _reason(stage)
    metrics = stage.metrics or {}
    if stage.gate is not None:
        verdict = "gates passed" if stage.gate.get("passed") else "GATES FAILED"
        regressed = metrics.get("regressions")  # bench, against its accepted baseline
        return f"{verdict}; regressed: {regressed}" if regressed else verdict
    if "max_abs_logit_diff" in metrics:
        return (
            f"verified: max |Δlogit| {metrics['max_abs_logit_diff']:.3g} "
            f"≤ {metrics['logit_tolerance']:g}, top-1 {metrics['top1_agreement']:.3f}"
        )
    return ""


def _table(planned: list[Any], title: str) -> Table:
    colors = {"hit": "green", "ran": "cyan", "miss": "yellow", "stale": "yellow", "failed": "red",
              "corrupt": "red"}  # fmt: skip
    table = Table(title=title, title_justify="left")
    for column in ("stage", "status", "seconds", "key", "output", "notes"):
        table.add_column(column, overflow="fold")
    for p in planned:
        color = colors.get(p.status, "dim")
        table.add_row(
            p.name,
            f"[{color}]{p.status}[/]",
            f"{p.seconds:.1f}" if p.seconds is not None else "",
            (p.key or "")[:12],
            p.path or "",
            _note(p),
        )
    return table


def _stage_event(stage: Any, event: str) -> None:
    if event == "start":
        console.print(f"[bold]▶ {stage.name}[/] [dim]{(stage.key or '')[:12]}[/] running…")
    elif event == "done":
        console.print(f"[green]✓ {stage.name}[/] {stage.seconds:.1f}s")
    elif event == "corrupt":
        console.print(
            f"[red]✗ {stage.name}: cached entry {(stage.key or '')[:12]} is corrupt "
            f"({escape(stage.reason)}); rebuilding it[/]"
        )
    elif event == "failed":
        console.print(f"[red]✗ {stage.name}: {escape(_reason(stage))}[/]", highlight=False)


@app.command()
def plan(
    recipe: Path,
    store: StoreOption = None,
    until: Annotated[str | None, typer.Option(help="Plan up to this stage.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Show each stage's key, whether it is cached, and where its output is: runs nothing."""
    from qpipe.stages.base import StageError
    from qpipe.store.base import StoreError

    loaded = _load(recipe)
    _check_inputs(recipe, loaded)
    pipeline = _pipeline(recipe, store, loaded)
    _check_stage_name(until)
    try:
        planned = pipeline.plan(until)
    except (StageError, StoreError) as exc:
        raise error(str(exc)) from exc
    if as_json:
        out.print_json(
            json.dumps({"recipe": str(recipe), "stages": [p.to_json() for p in planned]})
        )
    else:
        out.print(_table(planned, f"plan: {recipe}  (store: {pipeline.store.location})"))


def _check_inputs(recipe_path: Path, recipe: Recipe) -> None:
    """Data files the recipe names but that are not there: a bad recipe (exit 2), as `qpipe
    recipe validate` says, before any stage is planned or run."""
    from qpipe.pipeline import missing_inputs

    problems = missing_inputs(recipe, recipe_path.resolve().parent)
    if problems:
        raise error("; ".join(f"{recipe_path}: {problem}" for problem in problems), code=2)


def _check_stage_name(name: str | None) -> None:
    from qpipe.pipeline import STAGE_ORDER

    if name is not None and name not in STAGE_ORDER:
        raise error(f"unknown stage {name!r}; stages: {', '.join(STAGE_ORDER)}", code=2)


@app.command()
def run(
    recipe: Path,
    until: Annotated[str | None, typer.Option(help="Stop after this stage.")] = None,
    force: Annotated[
        list[str] | None, typer.Option(help="Re-run this stage even if cached (repeatable).")
    ] = None,
    store: StoreOption = None,
    allow_failed_gates: Annotated[
        bool, typer.Option(help="Publish even when accuracy/throughput gates failed.")
    ] = False,
    manifest_path: Annotated[
        Path | None, typer.Option("--manifest", help="Also write the run manifest here.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Run the recipe's missing stages in order; cached stages are skipped.

    Exit codes: 0 done, 1 a stage failed or is not available or a build target could not be
    built, 2 bad recipe, 3 an accuracy or throughput gate failed.
    """
    from qpipe.pipeline import manifest, stage_enabled
    from qpipe.stages.base import StageError
    from qpipe.store.base import StoreError

    loaded = _load(recipe)
    _check_inputs(recipe, loaded)
    if allow_failed_gates and loaded.publish is not None:
        loaded = loaded.model_copy(
            update={"publish": loaded.publish.model_copy(update={"allow_failed_gates": True})}
        )
    pipeline = _pipeline(recipe, store, loaded)
    _check_stage_name(until)
    for name in force or ():
        _check_stage_name(name)
        if not stage_enabled(name, pipeline.loader(name), loaded):
            raise error(
                f"--force {name}: this recipe does not run the {name} stage (its section is absent "
                "or turns it off), so there is nothing to rebuild",
                code=2,
            )
    if manifest_path is not None:
        _check_manifest_path(manifest_path)
    _check_model_fit(recipe, loaded, pipeline, "quantize" in (force or ()))
    # SIGTERM (`kill PID`, a CI job or container being stopped) unwinds like Ctrl-C: the running
    # stage removes its temp dir and the bench stage stops its server, instead of leaving it
    # serving with no parent
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        # NOTE: stdout is for the result (table or --json); stages' progress and logs go to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            planned = pipeline.run(until=until, force=tuple(force or ()), on_event=_stage_event)
    except (StageError, StoreError) as exc:
        raise error(str(exc)) from exc
    except Terminated as exc:
        raise typer.Exit(128 + signal.SIGTERM) from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    record = manifest(loaded, recipe, planned, pipeline.store)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    name = f"runs/{loaded.name}/{stamp}/manifest.json"
    data = json.dumps(record, indent=2).encode()
    try:
        pipeline.store.write_document(name, data)
        pipeline.store.write_document(f"runs/{loaded.name}/latest.json", data)
    except StoreError as exc:
        raise error(f"the stages are done, but the run's manifest was not written: {exc}") from exc
    if manifest_path is not None:
        try:
            manifest_path.parent.mkdir(parents=True, exist_ok=True)
            manifest_path.write_bytes(data)
        except OSError as exc:
            raise error(
                f"--manifest {manifest_path}: cannot write it ({exc.strerror}); the run's "
                f"manifest is in the store: {pipeline.store.location}/docs/{name}"
            ) from exc
    if as_json:
        out.print_json(json.dumps({**record, "manifest": name}))
    else:
        out.print(_table(planned, f"run: {recipe}  (store: {pipeline.store.location})"))
        console.print(f"manifest: {pipeline.store.location}/docs/{name}", highlight=False)
    _exit_for(planned, loaded.publish is not None and loaded.publish.allow_failed_gates)


def _check_manifest_path(path: Path) -> None:
    """The manifest is written after the last stage: a path that cannot take a file is refused
    before the stages spend minutes, not after."""
    if path.is_dir():
        raise error(
            f"--manifest {path} is a directory; name a file, e.g. {path / 'manifest.json'}", code=2
        )
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        raise error(
            f"--manifest {path}: {existing} is a file, not a directory; name a path under a "
            "directory",
            code=2,
        )


def _exit_for(planned: list[PlannedStage], gates_allowed: bool) -> None:
    """Exit 1 for a stage that failed or a build target that could not be built (an engine's
    missing toolchain is not a quality verdict), 3 for an accuracy or throughput gate. Publish
    refuses before it touches the registry when a gate failed, so its failure then is that
    refusal, and the gate's code is the run's."""
    from qpipe.pipeline import gate_failures

    failures = gate_failures(planned)
    failed = next((p for p in planned if p.status == "failed"), None)
    refused = failed is not None and failed.name == "publish" and failures and not gates_allowed
    if failed is not None and not refused:
        reason = failed.reason.removeprefix(f"{failed.name}: ")
        raise error(f"{failed.name}: {reason}")
    unbuilt = [line for line in failures if line.startswith("build: ")]
    if unbuilt:
        raise error("targets not built:\n  " + "\n  ".join(unbuilt))
    if failures:
        raise error("gates failed:\n  " + "\n  ".join(failures), code=3)


def _check_model_fit(recipe_path: Path, recipe: Recipe, pipeline: Any, forced: bool) -> None:
    """A group size the model cannot take, or a model a TensorRT-LLM checkpoint cannot hold, is
    a recipe error (exit 2, file:line) before convert and calibrate spend minutes on it. A group
    size is checked only when quantize is to run: reading a GGUF header takes seconds, and a
    finished recipe's re-run must stay instant. Without groups `_model_problem` reads at most a
    config.json (it skips a GGUF source), so no second plan is needed to decide."""
    from qpipe.quant.group_size import weight_group
    from qpipe.stages.base import StageError
    from qpipe.store.base import StoreError

    if weight_group(recipe.quantization) is None:
        if not _trtllm(recipe):
            return  # no shape to check
    elif not forced:
        try:
            planned = pipeline.plan(until="quantize")
        except (StageError, StoreError):
            return  # the run itself reports what the plan cannot read
        if all(p.status in ("hit", "disabled") for p in planned if p.name == "quantize"):
            return
    problem = _model_problem(recipe, recipe_path)
    if problem:
        console.print(f"[red]{escape(problem)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2)


@recipe_app.command("validate")
def recipe_validate(files: list[Path]) -> None:
    """Validate recipe files; every problem is printed as file:line path: message."""
    from qpipe.pipeline import missing_inputs

    bad = 0
    for path in files:
        try:
            recipe = load_recipe(path)
        except RecipeError as exc:
            bad += 1
            for problem in exc.problems:
                console.print(f"[red]{escape(problem)}[/]", highlight=False, soft_wrap=True)
            continue
        problems = [f"{path}: {p}" for p in missing_inputs(recipe, path.resolve().parent)]
        problems += filter(None, [_model_problem(recipe, path)])
        if problems:
            bad += 1
            for problem in problems:
                console.print(f"[red]{escape(problem)}[/]", highlight=False, soft_wrap=True)
            continue
        out.print(f"[green]ok[/] {path}: {recipe.name} ({recipe.quantization.method})")
    if bad:
        raise typer.Exit(2)


def _model_problem(recipe: Recipe, recipe_path: Path) -> str | None:
    """The recipe checked against the model's shape when the model is here (group size,
    keep_16bit, calibration window, what a TensorRT-LLM checkpoint can hold), as `file:line
    problem`."""
    from qpipe.calibration.seq_len import SeqLenError, check_seq_len
    from qpipe.convert import SourceError, resolve_source, source_config
    from qpipe.quant.group_size import GroupSizeError, check_group_size, weight_group
    from qpipe.quant.keep_16bit import Keep16BitError, check_keep_16bit

    quant = recipe.quantization
    grouped = weight_group(quant) is not None
    if not (grouped or quant.quantizes or recipe.calibration is not None or _trtllm(recipe)):
        return None  # nothing to check
    try:
        source = resolve_source(
            recipe.model.source, recipe.model.allow_pickle, recipe_path.resolve().parent
        )
    except SourceError:
        return None  # the model lives elsewhere (e.g. a GPU box's HF cache): checked at run time
    if not grouped and source.kind == "gguf":
        return None  # reading a GGUF header takes seconds: the stages check the rest
    config = source_config(source)
    try:
        check_group_size(config, quant)
    except GroupSizeError as exc:
        return f"{locate(recipe_path, ('quantization', 'group_size'))} {exc}"
    if quant.quantizes:
        try:
            check_keep_16bit(config, quant.keep_16bit)
        except Keep16BitError as exc:
            where = locate(recipe_path, ("quantization", "keep_16bit"))
            return f"{where} quantization.keep_16bit: {exc}"
    if recipe.calibration is not None:
        try:
            check_seq_len(recipe.calibration.seq_len, config)
        except SeqLenError as exc:
            return f"{locate(recipe_path, ('calibration', 'seq_len'))} calibration.seq_len: {exc}"
    if _trtllm(recipe) and "architectures" in config:  # a GGUF header names no HF class
        return _trtllm_problem(recipe, recipe_path, config)
    return None


def _trtllm(recipe: Recipe) -> bool:
    return bool({"trtllm-checkpoint", "trtllm-engine"} & set(recipe.build.targets))


def _trtllm_problem(recipe: Recipe, recipe_path: Path, config: dict[str, Any]) -> str | None:
    from qpipe.export.quantized_checkpoint import CheckpointFormatError
    from qpipe.export.trtllm_checkpoint import ParallelismError, check_model_config
    from qpipe.quant.group_size import weight_group

    quant, build = recipe.quantization, recipe.build
    int4_group = weight_group(quant) if quant.weight_bits == 4 else None
    try:
        check_model_config(config, build.tp, build.pp, int4_group, quant.keep_16bit)
    except ParallelismError as exc:
        field = "pp" if str(exc).startswith("pp=") else "tp"
        return f"{locate(recipe_path, ('build', field))} build.{field}: {exc}"
    except CheckpointFormatError as exc:
        return (
            f"{locate(recipe_path, ('build', 'targets'))} build.targets: trtllm-checkpoint: {exc}"
        )
    return None


@recipe_app.command("schema")
def recipe_schema_command() -> None:
    """Print the recipe JSON schema (for editors and CI linting)."""
    sys.stdout.write(json.dumps(recipe_schema(), indent=2) + "\n")


@cache_app.command("ls")
def cache_ls(store: StoreOption = None, as_json: JsonOption = False) -> None:
    """List committed entries (stage, key, size, date) and aliases."""
    opened = _open_store(store)
    with _store_failure(opened, "list"):
        entries = sorted(opened.entries(), key=lambda m: m.created)
        aliases = opened.aliases()
    if as_json:
        rows = [
            {"key": m.key, "stage": m.stage, "size": m.size, "created": m.created} for m in entries
        ]
        out.print_json(json.dumps({"entries": rows, "aliases": aliases}))
        return
    table = Table(title=f"store: {opened.location}", title_justify="left")
    for column in ("stage", "key", "size", "created", "aliases"):
        table.add_column(column)
    named: dict[str, list[str]] = {}
    for alias, record in aliases.items():
        named.setdefault(record["key"], []).append(alias)
    for meta in entries:
        table.add_row(
            meta.stage, meta.key[:12], _size(meta.size), meta.created,
            ", ".join(named.get(meta.key, [])),
        )  # fmt: skip
    out.print(table)


@contextlib.contextmanager
def _store_failure(opened: Any, doing: str) -> Iterator[None]:
    """What fails after the store opened (a bucket this identity may read but not write, a
    directory it cannot change) as an error naming the store, not a traceback."""
    from qpipe.store.base import StoreError

    try:
        yield
    except StoreError as exc:
        raise error(f"cannot {doing} {opened.location}: {exc}") from exc
    except OSError as exc:
        raise error(
            f"cannot {doing} {opened.location}: {exc.strerror}: {exc.filename} (check this "
            "user's permissions on the store's directory)"
        ) from exc


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@cache_app.command("verify")
def cache_verify(
    store: StoreOption = None,
    quarantine: Annotated[bool, typer.Option(help="Move corrupt entries aside.")] = False,
) -> None:
    """Checksum every entry where it lives (an S3 store's in the bucket, not in this machine's
    download cache); corrupt ones are reported (and quarantined with --quarantine)."""
    from rich.progress import track

    from qpipe.store.entry import CorruptEntry

    opened = _open_store(store)
    ok = corrupt = 0
    with _store_failure(opened, "verify"):
        for meta in track(list(opened.entries()), description="verifying", console=console):
            try:
                opened.verify(meta.key)  # where the entry lives: the bucket, not a local copy
            except KeyError:
                continue  # removed since it was listed (a gc meanwhile)
            except CorruptEntry as exc:
                corrupt += 1
                console.print(
                    f"[red]corrupt[/] {meta.stage} {meta.key[:12]}: {escape(exc.problem)}"
                )
                if quarantine:
                    opened.quarantine(meta.key, exc.problem)
                continue
            ok += 1
    out.print(f"{ok} ok, {corrupt} corrupt")
    if corrupt:
        raise typer.Exit(1)


@cache_app.command("gc")
def cache_gc(
    store: StoreOption = None,
    keep_recipe: Annotated[
        list[Path] | None,
        typer.Option("--keep-recipe", help="Also delete entries these recipes do not use."),
    ] = None,
) -> None:
    """Remove abandoned temp dirs and quarantined entries (and, with --keep-recipe, unused ones;
    entries that published registry versions name are always kept)."""
    from qpipe.registry.registry import Registry, RegistryError
    from qpipe.stages.base import StageError
    from qpipe.store.base import StoreError

    opened = _open_store(store)
    keep = None
    if keep_recipe:
        try:
            keep = Registry(opened).referenced_keys()
        except RegistryError as exc:  # an unreadable manifest: deleting would be a guess
            raise error(f"{exc}; gc --keep-recipe keeps what published versions name") from exc
        for path in keep_recipe:
            try:
                keep |= {p.key for p in _pipeline(path, store).plan() if p.key}
            except (StageError, StoreError) as exc:  # what it uses is unknown: delete nothing
                raise error(
                    f"--keep-recipe {path}: gc removed nothing, since what this recipe uses "
                    f"cannot be planned: {exc}"
                ) from exc
    with _store_failure(opened, "gc"):
        removed = opened.gc(keep)
    for item in removed:
        console.print(f"removed {item}")
    out.print(f"{len(removed)} removed")


@cache_app.command("push")
def cache_push(
    to: Annotated[str, typer.Option("--to", help="Target store (s3://bucket/prefix or dir).")],
    refs: Annotated[list[str] | None, typer.Argument(help="Keys, key prefixes or aliases.")] = None,
    store: StoreOption = None,
) -> None:
    """Copy entries (default: all) and their aliases from the store to another, verified."""
    _transfer(store, to, refs or [])


@cache_app.command("pull")
def cache_pull(
    source: Annotated[str, typer.Option("--from", help="Store to copy from.")],
    refs: Annotated[list[str] | None, typer.Argument(help="Keys, key prefixes or aliases.")] = None,
    store: StoreOption = None,
) -> None:
    """Copy entries (default: all) and their aliases from another store into this one, verified."""
    _transfer(source, store, refs or [])


def _transfer(source_location: str | None, target_location: str | None, refs: list[str]) -> None:
    """The source is opened first and never created: a mistyped source path is an error, not a
    new empty store that copies nothing (the target may be new)."""
    from qpipe.store.base import StoreError
    from qpipe.store.transfer import copy_entries

    source = _open_store(source_location, create=False)
    target = _open_store(target_location)
    if source.location == target.location:
        raise error("source and target are the same store; name the other one with --to/--from")
    try:
        report = copy_entries(source, target, refs)
    except StoreError as exc:
        raise error(str(exc)) from exc
    out.print(f"{source.location} → {target.location}: {report.summary()}")


_register_area_commands()


def main() -> None:
    app()


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C (temp dirs removed, servers stopped), but exiting with 143
    (128 + SIGTERM), the code a CI runner or container supervisor expects of a stopped job."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Terminated


RECIPE_QUANT = {"none": None, "int8-sq": "int8", "int8-wo": "int8", "fp8": "fp8", "awq": "int4",
                "int4-wo": "int4"}  # fmt: skip
DTYPE_QUANT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _recipe_shape(path: Path, store: str | None) -> tuple[Any, str, int, str]:
    """The converted checkpoint's shape plus the quant, group size and KV dtype the recipe asks
    for."""
    from qpipe.fit import load_shape

    pipeline = _pipeline(path, store)
    convert = pipeline.plan(until="convert")[0]
    if convert.path is None:
        raise error(
            f"the model of {path} is not converted yet: run `qpipe run {path} --until convert`"
        )
    q = pipeline.recipe.quantization
    quant = RECIPE_QUANT.get(q.method) or DTYPE_QUANT[pipeline.recipe.model.dtype]
    if q.method == "gptq":
        quant = "int8" if q.bits == 8 else "int4"
    kv_dtype = "bf16" if q.kv_cache == "none" else "fp8"
    return load_shape(Path(convert.path)), quant, q.group_size or 128, kv_dtype


@app.command()
def fit(
    model: Annotated[Path, typer.Argument(help="config.json, checkpoint dir, or recipe (.yaml).")],
    gpu: Annotated[
        str, typer.Option(help="A100-40G, A100-80G, H100, H200, L40S, A10, L4, RTX4090, or GiB.")
    ] = "H100",  # fmt: skip
    tp: Annotated[int, typer.Option(help="Tensor-parallel GPUs.")] = 1,
    quant: Annotated[str | None, typer.Option(help="fp32|bf16|fp16|int8|fp8|int4.")] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(help="KV cache dtype: bf16|fp16|fp8|int8 (default: the recipe's, or bf16)."),
    ] = None,
    group_size: Annotated[int | None, typer.Option(help="int4 group size.")] = None,
    max_model_len: Annotated[int, typer.Option(help="Context length per sequence.")] = 8192,
    concurrency: Annotated[int, typer.Option(help="Sequences served at once.")] = 1,
    overhead_gib: Annotated[float, typer.Option(help="Framework overhead per GPU (GiB).")] = 3.0,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Will the model fit? Weights + KV cache + activations + overhead, × 1.2 safety."""
    from qpipe.fit import FitError, FitRequest, gpu_memory, load_shape
    from qpipe.fit import fit as compute_fit

    try:
        if model.suffix in (".yaml", ".yml"):
            shape, recipe_quant, recipe_group, recipe_kv = _recipe_shape(model, store)
        else:
            shape, recipe_quant, recipe_group, recipe_kv = load_shape(model), "bf16", 128, "bf16"
        gpu_name, gpu_gib = gpu_memory(gpu)
        report = compute_fit(
            FitRequest(
                shape=shape, gpu_gib=gpu_gib, gpu_name=gpu_name, quant=quant or recipe_quant,
                kv_dtype=kv_dtype or recipe_kv, tp=tp, max_model_len=max_model_len,
                group_size=recipe_group if group_size is None else group_size,
                concurrency=concurrency, overhead_gib=overhead_gib,
            )
        )  # fmt: skip
    except FitError as exc:
        raise error(str(exc), code=2) from exc
    if as_json:
        out.print_json(report.to_json())
        return
    table = Table(title=f"fit on {report.gpu} ({report.gpu_gib:.1f} GiB) × tp{report.tp}",
                  title_justify="left")  # fmt: skip
    table.add_column("per GPU")
    table.add_column("GiB", justify="right")
    for label, value in (
        ("weights", report.weights_gib),
        (f"KV cache ({report.concurrency} × {report.max_model_len} tokens)", report.kv_cache_gib),
        ("activations (0.2 × weights)", report.activations_gib),
        ("framework overhead", report.overhead_gib),
        ("required (× 1.2 safety)", report.required_gib),
    ):
        table.add_row(label, f"{value:.2f}")
    out.print(table)
    verdict = "[green]fits[/]" if report.fits else "[red]does not fit[/]"
    out.print(
        f"{verdict}; KV cache {report.kv_bytes_per_token:,} bytes/token; "
        f"max concurrency at {report.max_model_len} tokens: {report.max_concurrency_at_len}; "
        f"largest max_model_len at concurrency {report.concurrency}: "
        f"{report.max_model_len_at_concurrency:,}"
    )
    if not report.fits:
        raise typer.Exit(1)
