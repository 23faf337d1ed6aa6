"""The runner's rules with small stand-in stages: keys, skipping, resuming, corruption, failures."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel

from qpipe.cli import _exit_for, _note, _open_store
from qpipe.hashing import HashCache
from qpipe.pipeline import STAGE_ORDER, Pipeline, PlannedStage, gate_failures
from qpipe.recipe import Recipe, parse_recipe
from qpipe.stages.base import GateVerdict, Stage, StageContext, StageError, StageResult
from qpipe.stages.evaluate import EvaluateStage
from qpipe.store.local import LocalStore

RUNS: Counter[str] = Counter()


class FakeStage(Stage):
    """Writes its name plus the content of everything it reads; counts its runs."""

    fail_with: str | None = None

    def __init__(self, name: str, needs: tuple[str, ...]):
        self.name = name  # type: ignore[misc]
        self.needs = needs  # type: ignore[misc]

    def section(self, recipe: Recipe) -> BaseModel | None:
        return {"convert": recipe.model, "calibrate": recipe.calibration,
                "quantize": recipe.quantization, "build": recipe.build,
                "evaluate": recipe.evaluate}.get(self.name)  # fmt: skip

    def input_files(self, recipe: Recipe, recipe_dir: Path) -> dict[str, Path]:
        if self.name == "calibrate" and recipe.calibration is not None:
            return {"calibration.dataset": recipe_dir / recipe.calibration.dataset}
        return {}

    def run(self, ctx: StageContext) -> StageResult:
        RUNS[self.name] += 1
        if self.fail_with:
            (ctx.out_dir / "partial.bin").write_bytes(b"half")
            raise StageError(self.fail_with)
        text = self.name + "".join((p / "out.txt").read_text() for p in ctx.inputs.values())
        (ctx.out_dir / "out.txt").write_text(text)
        gate = None
        if self.name == "evaluate":
            gate = GateVerdict(passed=False, failures=("kld_mean 0.2 > allowed 0.05",))
        return StageResult(metrics={"chars": len(text)}, gate=gate)


NEEDS = {"convert": (), "calibrate": ("convert",), "quantize": ("convert", "calibrate"),
         "build": ("quantize",), "evaluate": ("convert", "quantize")}  # fmt: skip


def make_loader(stages: dict[str, FakeStage]):  # type: ignore[no-untyped-def]
    return lambda name: stages.get(name)


@pytest.fixture
def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    RUNS.clear()
    (tmp_path / "calib.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    recipe = parse_recipe(textwrap.dedent("""\
        name: fake
        model: {source: gguf:m.gguf, dtype: float32}
        calibration: {dataset: calib.jsonl, num_samples: 2}
        quantization: {method: int8-sq}
        """))  # fmt: skip
    stages = {name: FakeStage(name, needs) for name, needs in NEEDS.items()}
    store = LocalStore(tmp_path / "store")

    def pipeline(recipe: Recipe = recipe) -> Pipeline:
        return Pipeline(recipe, tmp_path, store, HashCache(tmp_path / "hashes.db"),
                        make_loader(stages))  # fmt: skip

    return pipeline, stages, store, tmp_path


def keys(planned: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {p.name: p.key for p in planned if p.key}


def test_keys_are_stable_and_follow_content(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, _, root = setup
    first = keys(pipeline().plan())
    assert first == keys(pipeline().plan())
    assert set(first) == {"convert", "calibrate", "quantize", "build"}
    (root / "calib.jsonl").write_text('{"text": "one"}\n{"text": "TWO"}\n')
    second = keys(pipeline().plan())
    assert second["convert"] == first["convert"]
    for name in ("calibrate", "quantize", "build"):
        assert second[name] != first[name], name


def test_recipe_section_change_rekeys_downstream_only(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, _, _ = setup
    base = pipeline()
    first = keys(base.plan())
    changed = base.recipe.model_copy(
        update={
            "quantization": base.recipe.quantization.model_copy(update={"smoothquant_alpha": 0.8})
        }
    )
    second = keys(pipeline(changed).plan())
    assert second["convert"] == first["convert"] and second["calibrate"] == first["calibrate"]
    assert second["quantize"] != first["quantize"] and second["build"] != first["build"]


def test_run_then_rerun_does_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, store, _ = setup
    planned = pipeline().run()
    assert [p.status for p in planned if p.key] == ["ran"] * 4
    assert (Path(planned[3].path) / "out.txt").read_text() == "buildquantizeconvertcalibrateconvert"
    again = pipeline().run()
    assert [p.status for p in again if p.key] == ["hit"] * 4
    assert sum(RUNS.values()) == 4
    assert not list((store.root / "tmp").iterdir())


def test_until_and_force(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, _, _ = setup
    planned = pipeline().run(until="calibrate")
    assert [p.name for p in planned] == ["convert", "calibrate"]
    pipeline().run(force=("calibrate",))
    assert RUNS == {"convert": 1, "calibrate": 2, "quantize": 1, "build": 1}


class RebuildingStage(FakeStage):
    """A forced rebuild: writes other bytes than the first build, or is interrupted (Ctrl-C)."""

    interrupt = False

    def run(self, ctx: StageContext) -> StageResult:
        RUNS[self.name] += 1
        (ctx.out_dir / "out.txt").write_text("rebuilt")
        if self.interrupt:
            raise KeyboardInterrupt
        return StageResult(metrics={"rebuilt": True})


def test_forced_rebuild_replaces_the_entry_only_when_it_succeeds(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, stages, store, _ = setup
    first = pipeline().run(until="calibrate")
    key = first[1].key
    store.set_alias("fake-calibration", key, {"stage": "calibrate"})
    stages["calibrate"] = RebuildingStage("calibrate", NEEDS["calibrate"])
    stages["calibrate"].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        pipeline().run(until="calibrate", force=("calibrate",))
    assert (store.open(key, verify=True) / "out.txt").read_text() == "calibrateconvert"
    assert store.resolve_alias("fake-calibration")["key"] == key
    assert not list((store.root / "tmp").iterdir())

    stages["calibrate"].interrupt = False
    again = pipeline().run(until="calibrate", force=("calibrate",))
    assert again[1].status == "ran" and again[1].key == key
    assert (store.open(key, verify=True) / "out.txt").read_text() == "rebuilt"
    assert store.lookup(key).metrics == {"rebuilt": True}
    assert store.resolve_alias("fake-calibration")["key"] == key
    assert not list((store.root / "tmp").iterdir())
    assert RUNS == {"convert": 1, "calibrate": 3}


class ExternalEffectStage(RebuildingStage):
    """A stage whose effect lives outside its entry (as publish's in the registry)."""

    effect_gone = False

    def stale(self, recipe: Recipe, entry: Path, store: LocalStore) -> str | None:
        return "its effect is gone" if self.effect_gone else None


def test_a_stale_entry_runs_again_and_replaces_itself(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, stages, store, _ = setup
    stages["calibrate"] = ExternalEffectStage("calibrate", NEEDS["calibrate"])
    first = pipeline().run(until="calibrate")
    assert [p.status for p in pipeline().plan(until="calibrate")] == ["hit", "hit"]
    stages["calibrate"].effect_gone = True
    planned = pipeline().plan(until="calibrate")
    assert planned[1].status == "stale" and planned[1].reason == "its effect is gone"
    again = pipeline().run(until="calibrate")
    assert [p.status for p in again] == ["hit", "ran"] and again[1].key == first[1].key
    assert store.lookup(first[1].key).metrics == {"rebuilt": True}
    assert RUNS == {"convert": 1, "calibrate": 2}


def test_unavailable_stage_stops_the_run_after_what_can_run(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, stages, _, _ = setup
    del stages["build"]
    planned = pipeline().run()
    status = {p.name: p.status for p in planned}
    assert status["quantize"] == "ran"
    assert status["build"] == "failed"
    assert planned[3].reason == "not available yet: build"


def test_failed_stage_leaves_nothing_visible(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, stages, store, _ = setup
    stages["quantize"].fail_with = "calibration set too small"
    planned = pipeline().run()
    failed = next(p for p in planned if p.status == "failed")
    assert failed.name == "quantize" and "too small" in failed.reason
    assert store.lookup(failed.key) is None
    assert not list((store.root / "tmp").iterdir())
    stages["quantize"].fail_with = None
    resumed = pipeline().run()
    assert {p.name: p.status for p in resumed if p.key} == {
        "convert": "hit", "calibrate": "hit", "quantize": "ran", "build": "ran"}  # fmt: skip


def test_corrupt_entry_is_reported_and_rebuilt(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, store, _ = setup
    planned = pipeline().run(until="calibrate")
    out = Path(planned[0].path) / "out.txt"
    out.write_text("CONVERT")  # same size, other bytes: only the checksum can tell
    events = []
    resumed = pipeline().run(on_event=lambda p, e: events.append((p.name, e)))
    assert ("convert", "corrupt") in events
    assert {p.name: p.status for p in resumed if p.key}["convert"] == "ran"
    assert (Path(resumed[0].path) / "out.txt").read_text() == "convert"
    assert RUNS["convert"] == 2
    assert len(list((store.root / "corrupt").iterdir())) == 1


def test_truncated_entry_shows_as_corrupt_in_plan(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, _, _ = setup
    planned = pipeline().run(until="convert")
    (Path(planned[0].path) / "out.txt").write_text("x")
    again = pipeline().plan()
    assert again[0].status == "corrupt" and "bytes" in again[0].reason


def test_failed_gate_is_cached_and_still_fails(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, _, _ = setup
    recipe = parse_recipe(textwrap.dedent("""\
        name: fake
        model: {source: gguf:m.gguf, dtype: float32}
        calibration: {dataset: calib.jsonl, num_samples: 2}
        quantization: {method: int8-sq}
        evaluate: {max_drop: {kld_mean: 0.05}}
        """))  # fmt: skip
    planned = pipeline(recipe).run()
    assert gate_failures(planned) == ["evaluate: kld_mean 0.2 > allowed 0.05"]
    again = pipeline(recipe).run()
    assert gate_failures(again) == ["evaluate: kld_mean 0.2 > allowed 0.05"]
    assert RUNS["evaluate"] == 1


def test_stage_order_is_the_documented_one() -> None:
    assert STAGE_ORDER == ("convert", "calibrate", "quantize", "build", "evaluate", "bench",
                           "publish")  # fmt: skip


def test_aliases_a_stage_returns_point_at_its_entry(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, stages, store, _ = setup

    class AliasingBuild(FakeStage):
        def run(self, ctx: StageContext) -> StageResult:
            result = super().run(ctx)
            return StageResult(result.metrics, aliases={"fake-sm90-int8-tp1": {"arch": "sm90"}})

    stages["build"] = AliasingBuild("build", NEEDS["build"])
    planned = pipeline().run()
    record = store.resolve_alias("fake-sm90-int8-tp1")
    assert record == {"key": planned[3].key, "stage": "build", "arch": "sm90"}


def test_inputs_are_keyed_by_role_and_content(tmp_path: Path) -> None:
    """Two inputs that share a file name both count (an edit to either re-keys), and the same
    bytes under another name or folder keep the key."""
    hashes = HashCache(tmp_path / "hashes.db")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test.jsonl").write_text(f'{{"q": "{folder}"}}\n')
    inputs = {"first": tmp_path / "a" / "test.jsonl", "second": tmp_path / "b" / "test.jsonl"}
    before = hashes.files_hash(inputs)
    assert len(set(before.values())) == 2
    for role in inputs:
        inputs[role].write_text('{"q": "edited"}\n')
        assert hashes.files_hash(inputs)[role] != before[role], role
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(inputs["first"].read_bytes())
    assert hashes.files_hash({**inputs, "first": moved}) == hashes.files_hash(inputs)


def test_evaluate_inputs_name_their_place_in_the_recipe(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "test.jsonl").write_text("{}\n")
    recipe = parse_recipe(textwrap.dedent("""\
        name: fake
        model: {source: gguf:m.gguf, dtype: float32}
        quantization: {method: int8-wo}
        evaluate:
          tasks:
            - {name: arc_easy, data_files: {test: a/test.jsonl}}
            - {name: hellaswag, data_files: {test: b/test.jsonl}}
        """))  # fmt: skip
    with pytest.raises(StageError, match=r"evaluate.tasks\[1\].data_files.test: .*b/test.jsonl"):
        EvaluateStage().input_files(recipe, tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "test.jsonl").write_text("{}\n")
    assert EvaluateStage().input_files(recipe, tmp_path) == {
        "evaluate.tasks[0].data_files.test": tmp_path / "a" / "test.jsonl",
        "evaluate.tasks[1].data_files.test": tmp_path / "b" / "test.jsonl",
    }


def _stage(name: str, status: str = "ran", reason: str = "", failures: tuple = ()) -> PlannedStage:
    gate = {"passed": False, "failures": list(failures)} if failures else None
    return PlannedStage(name, status, reason=reason, gate=gate)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("planned", "allowed", "code", "says"),
    [
        # publish refused because evaluate's gate failed: the gate's code, not a stage failure
        ([_stage("evaluate", failures=("kld_mean: 0.02 > allowed 0.0001",)),
          _stage("publish", "failed", "publish: refusing to publish x: its gates failed")],
         False, 3, "gates failed:\n  evaluate: kld_mean"),
        ([_stage("evaluate", failures=("kld_mean: 0.02",)), _stage("publish")], True, 3,
         "gates failed"),
        # an engine that could not be built is a missing target, not a quality verdict
        ([_stage("build", failures=("trtllm-engine: TensorRT-LLM is not installed",)),
          _stage("publish", "failed", "publish: refusing to publish x: its gates failed")],
         False, 1, "targets not built:\n  build: trtllm-engine"),
        # a stage that failed on its own; its message is not prefixed twice
        ([_stage("publish", "failed", "publish: the registry is unreachable")], False, 1,
         "error: publish: the registry is unreachable"),
    ],
)  # fmt: skip
def test_run_exit_codes(
    planned: list[PlannedStage], allowed: bool, code: int, says: str, capsys
) -> None:  # noqa: ANN001
    with pytest.raises(typer.Exit) as exit_info:
        _exit_for(planned, allowed)
    assert exit_info.value.exit_code == code
    assert says in capsys.readouterr().err


def test_a_clean_run_exits_zero() -> None:
    _exit_for([_stage("evaluate"), _stage("publish")], gates_allowed=False)


def test_recipe_store_paths_are_relative_to_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like every path in a recipe, a local store.location is read from the recipe's directory,
    not from where qpipe runs; an s3:// location is passed as written."""
    opened: list[tuple[str | None, ...]] = []
    monkeypatch.setattr("qpipe.store.factory.open_store", lambda *args, **_: opened.append(args))
    monkeypatch.chdir(tmp_path)
    recipes = tmp_path / "recipes"
    for store in ("{location: relstore}", "{location: s3://bucket/ci, local_cache: .qpipe}"):
        recipe = parse_recipe(f"name: r\nmodel: {{source: gguf:m.gguf}}\nstore: {store}\n")
        _open_store(None, recipe, recipes)
    assert opened == [
        (str(recipes / "relstore"), None, None),
        ("s3://bucket/ci", None, str(recipes / ".qpipe")),
    ]
    # an unsupported scheme is refused, not made a directory under the recipe's
    recipe = parse_recipe("name: r\nmodel: {source: gguf:m.gguf}\nstore: {location: gs://b/p}\n")
    with pytest.raises(typer.Exit):
        _open_store(None, recipe, recipes)
    assert len(opened) == 2 and not (recipes / "gs:").exists()


def test_a_failure_is_reported_without_its_stage_name_twice() -> None:
    failed = PlannedStage("evaluate", "failed", reason="evaluate: wikitext-2 is missing")
    assert _note(failed) == "wikitext-2 is missing"
    other = PlannedStage("bench", "failed", reason="evaluate: a reason naming another stage")
    assert _note(other) == "evaluate: a reason naming another stage"


def test_a_bench_regression_shows_in_the_run_table() -> None:
    """A regression against the accepted baseline is information (exit 0) but not a silent one."""
    metrics = {"regressions": "c=8: output_throughput 41.7% worse"}
    bench = PlannedStage("bench", "ran", metrics=metrics, gate={"passed": True})
    assert _note(bench) == "gates passed; regressed: c=8: output_throughput 41.7% worse"
    assert _note(PlannedStage("bench", "ran", metrics={}, gate={"passed": True})) == "gates passed"


def test_a_stale_check_runs_on_a_runner_without_a_local_copy(
    setup,
    s3_env,  # type: ignore[no-untyped-def]
) -> None:
    """A CI runner with an empty download cache sees a remote entry as a hit; publish's check of
    the registry (its effect outside the store) must still run there, or a lost or moved
    registry is repaired only on machines that happen to hold a copy."""
    from qpipe.store.s3 import S3Store

    pipeline, stages, _, root = setup
    stages["calibrate"] = ExternalEffectStage("calibrate", NEEDS["calibrate"])
    location = f"s3://{s3_env.bucket()}/cache"
    first = S3Store(location, LocalStore(root / "runner-a"))
    ran = Pipeline(pipeline().recipe, root, first, HashCache(root / "a.db"),
                   make_loader(stages)).run(until="calibrate")  # fmt: skip
    assert [p.status for p in ran] == ["ran", "ran"]
    stages["calibrate"].effect_gone = True
    fresh = S3Store(location, LocalStore(root / "runner-b"))
    planned = Pipeline(pipeline().recipe, root, fresh, HashCache(root / "b.db"),
                       make_loader(stages)).plan(until="calibrate")  # fmt: skip
    assert [p.status for p in planned] == ["hit", "stale"]
    assert planned[0].reason == "in the remote store; downloaded when a stage reads it"
