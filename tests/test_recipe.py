"""Shipped recipes validate; malformed ones fail with located, actionable errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpipe.cli import app
from qpipe.recipe import RecipeError, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

VALID = """\
name: ok-recipe
model:
  source: gguf:model.gguf
  dtype: float32
calibration:
  dataset: data.jsonl
  num_samples: 8
quantization:
  method: int8-sq
  smoothquant_alpha: 0.5
build:
  targets: [compressed-tensors]
"""


def test_shipped_recipes_are_all_there_and_valid() -> None:
    names = {p.stem for p in RECIPES}
    expected = {
        "smollm2-135m-int8", "smollm2-135m-fp8", "smollm2-135m-awq", "smollm2-135m-gptq",
        "llama3-8b-int8", "llama3-8b-fp8", "llama3-8b-awq", "llama3-70b-awq-tp4",
    }  # fmt: skip
    assert expected <= names
    for path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.name == path.stem
        if recipe.calibration is not None:
            assert (path.parent / recipe.calibration.dataset).exists(), path


def test_smollm2_group_wise_recipes_use_a_group_that_divides_576() -> None:
    for path in RECIPES:
        recipe = load_recipe(path)
        if recipe.name.startswith("smollm2") and recipe.quantization.group_size:
            assert 576 % recipe.quantization.group_size == 0


def _error(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(textwrap.dedent(text), "recipes/x.yaml")
    return str(info.value)


def _replace(old: str, new: str) -> str:
    assert old in VALID
    return VALID.replace(old, new)


MALFORMED = [
    # (recipe text, substrings the message must contain)
    (VALID + "publish:\n", ["recipes/x.yaml:13 publish:", "this section is empty", "`{}`"]),
    (
        _replace("  smoothquant_alpha: 0.5", "  smoothquant_alpha: .nan"),
        ["recipes/x.yaml:10 quantization.smoothquant_alpha:", "finite"],
    ),
    (_replace("name: ok-recipe\n", "name: ok-recipe\nmodel: [\n"), ['in "recipes/x.yaml"']),
    (
        _replace("  num_samples: 8", "  num_samples: x"),
        ["recipes/x.yaml:7 calibration.num_samples: expected an integer, got 'x'"],
    ),
    (
        _replace("  smoothquant_alpha: 0.5", "  smoothquant_alpa: 0.5"),
        ["recipes/x.yaml:10", "unknown key 'smoothquant_alpa'", "did you mean 'smoothquant_alpha'"],
    ),
    (
        _replace("quantization:", "quantisation:"),
        ["recipes/x.yaml:8", "unknown key 'quantisation'", "did you mean 'quantization'"],
    ),
    (
        _replace("  method: int8-sq", "  method: int3"),
        ["recipes/x.yaml:9 quantization.method:", "'int8-sq'", "got 'int3'"],
    ),
    (
        _replace("  dtype: float32", "  dtype: float64"),
        ["recipes/x.yaml:4 model.dtype:", "'bfloat16'", "got 'float64'"],
    ),
    (VALID.replace("name: ok-recipe\n", ""), ["name: required key is missing"]),
    (_replace("name: ok-recipe", "name: Bad Name!"), ["recipes/x.yaml:1 name:", "pattern"]),
    (
        _replace("  source: gguf:model.gguf", "  source: s4://bucket/model"),
        ["recipes/x.yaml:3 model.source:", "unknown source scheme 's4'"],
    ),
    (_replace("  source: gguf:model.gguf", "  source: ''"), ["model.source:", "must not be empty"]),
    (
        _replace("  targets: [compressed-tensors]", "  targets: [tensorrt]"),
        ["recipes/x.yaml:12 build.targets.0:", "'trtllm-checkpoint'", "got 'tensorrt'"],
    ),
    (
        _replace("  targets: [compressed-tensors]", "  targets: compressed-tensors"),
        ["build.targets: expected a list"],
    ),
    (
        _replace("  num_samples: 8", "  num_samples: -3"),
        ["recipes/x.yaml:7 calibration.num_samples:", "greater than 0"],
    ),
    ("name: a\nmodel: [1, 2]\n", ["recipes/x.yaml:2 model: expected a mapping"]),
    ("- just\n- a list\n", ["a recipe is a YAML mapping"]),
    ("name: a\nmodel: {source: x\n", ["recipes/x.yaml:", "not valid YAML"]),
    (
        VALID.replace("calibration:\n  dataset: data.jsonl\n  num_samples: 8\n", ""),
        ["needs a calibration section"],
    ),
    (
        _replace("  smoothquant_alpha: 0.5", "  group_size: 64"),
        ["quantization", "group_size", "int8-sq"],
    ),
    (
        _replace("  dtype: float32", "  dtype: float32\n  allow_pickle: maybe"),
        ["recipes/x.yaml:5 model.allow_pickle: expected true or false, got 'maybe'"],
    ),
    (VALID + "build:\n  tp: 2\n", ["recipes/x.yaml:", "duplicate", "build"]),
    (
        _replace("  num_samples: 8", "  num_samples: 8\n  seq_len: 100000000"),
        ["recipes/x.yaml:8 calibration.seq_len: 100000000 is longer than any model's context"],
    ),
    (
        _replace("  num_samples: 8", "  num_samples: 8\n  seq_len: 1"),
        ["recipes/x.yaml:8 calibration.seq_len:", "greater than or equal to 2"],
    ),
    (
        _replace("  smoothquant_alpha: 0.5", "  auto_keep_16bit: {max_kld: 0.1, seq_len: 1}"),
        ["recipes/x.yaml:10 quantization.auto_keep_16bit.seq_len:", "greater than or equal to 2"],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), MALFORMED, ids=[str(i) for i in range(len(MALFORMED))]
)
def test_malformed_recipe_message(text: str, expected: list[str]) -> None:
    message = _error(text)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_every_problem_is_reported_at_once() -> None:
    text = _replace("  num_samples: 8", "  num_samples: x").replace("dtype: float32", "dtype: fp64")
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "r.yaml")
    assert len(info.value.problems) == 2


def test_yaml_is_loaded_safely() -> None:
    message = _error("name: !!python/object/apply:os.system ['echo pwned']\n")
    assert "not valid YAML" in message


def test_cli_validate_and_schema(tmp_path: Path) -> None:
    runner = CliRunner()
    good = runner.invoke(app, ["recipe", "validate", *map(str, RECIPES)])
    assert good.exit_code == 0, good.output
    assert good.output.count("ok ") == len(RECIPES)
    bad = tmp_path / "bad.yaml"
    bad.write_text(_replace("  num_samples: 8", "  num_samples: x"))
    result = runner.invoke(app, ["recipe", "validate", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:7 calibration.num_samples: expected an integer" in result.output
    schema = runner.invoke(app, ["recipe", "schema"])
    assert schema.exit_code == 0
    parsed = json.loads(schema.stdout)
    assert {"name", "model", "quantization", "build"} <= set(parsed["properties"])


def test_group_size_that_does_not_divide_the_model_fails_validation(tmp_path: Path) -> None:
    """SmolLM2's hidden size is 576: group 128 must be refused before anything runs."""
    text = (REPO / "recipes" / "smollm2-135m-gptq.yaml").read_text()
    bad = tmp_path / "recipes" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_text(text.replace("group_size: 64", "group_size: 128"))
    (tmp_path / "calibration").symlink_to(REPO / "calibration")
    result = CliRunner().invoke(app, ["recipe", "validate", str(bad)])
    assert result.exit_code == 2
    assert (
        "quantization.group_size: 128 does not divide hidden_size 576 of "
        "model.layers.*.self_attn.q_proj" in result.output
    )
    assert "use 64 or 32" in result.output
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if "group_size" in text)
    assert f"{bad}:{line} quantization.group_size: 128" in result.output

    # `qpipe run` refuses it the same way, before convert and calibrate spend minutes on it
    store = tmp_path / "store"
    run = CliRunner().invoke(app, ["run", str(bad), "--store", str(store)])
    assert run.exit_code == 2, run.output
    assert f"{bad}:{line} quantization.group_size: 128 does not divide" in run.output
    assert not (store / "objects").exists() or not any((store / "objects").iterdir())


def test_seq_len_longer_than_the_model_context_fails_validation(
    tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    """The tiny model's config.json says max_position_embeddings 2048."""
    recipe = tmp_path / "r.yaml"
    dataset = REPO / "calibration" / "chat-example.jsonl"
    text = _replace("  num_samples: 8", "  num_samples: 8\n  seq_len: 4096")
    text = text.replace("gguf:model.gguf", str(tiny_llama_checkpoint))
    recipe.write_text(text.replace("data.jsonl", str(dataset)))
    result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 2, result.output
    assert (
        f"{recipe}:8 calibration.seq_len: 4096 is longer than the model's context "
        "(max_position_embeddings 2048); use at most 2048" in " ".join(result.output.split())
    )
    recipe.write_text(recipe.read_text().replace("4096", "2048"))
    result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 0, result.output


def test_validate_reports_data_files_that_are_not_there(tmp_path: Path) -> None:
    """A recipe whose calibration or evaluation data is missing is not 'ok': the run would stop
    on it after minutes of convert."""
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    text = (REPO / "recipes" / "smollm2-135m-int8.yaml").read_text()
    recipe.write_text(text.replace("evaluate:\n", "evaluate:\n  text: ../heldout.txt\n"))
    result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "calibration.dataset: " in result.output and "evaluate.text: " in result.output
    (tmp_path / "calibration").symlink_to(REPO / "calibration")
    (tmp_path / "heldout.txt").write_text("Some held-out text.\n")
    result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 0, result.output


def test_recipe_errors_print_brackets_as_text(tmp_path: Path) -> None:
    """A problem quoting a pattern (`^[a-z0-9]...`) is not eaten as rich markup."""
    bad = tmp_path / "upper.yaml"
    bad.write_text(VALID.replace("name: ", "name: SmolLM2_Int8  # ", 1))
    result = CliRunner().invoke(app, ["recipe", "validate", str(bad)])
    assert result.exit_code == 2
    assert "[a-z0-9][a-z0-9._-]*$" in result.output


def test_forcing_a_stage_the_recipe_does_not_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--force evaluate` on a recipe without `evaluate:` used to be ignored silently: a CI job
    asking for a fresh accuracy check got none."""
    monkeypatch.setenv("QPIPE_HOME", str(tmp_path / "home"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(VALID)
    (tmp_path / "data.jsonl").write_text('{"text": "a sample"}\n')
    result = CliRunner().invoke(app, ["run", str(recipe), "--force", "evaluate"])
    assert result.exit_code == 2
    assert "does not run the evaluate stage" in result.output


def test_plan_and_run_refuse_a_missing_data_file_as_validate_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data file the recipe names but that is not there is a bad recipe (2) for every
    command, not a stage failure (1) for plan and run."""
    monkeypatch.setenv("QPIPE_HOME", str(tmp_path / "home"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(VALID)  # calibration.dataset data.jsonl is not in tmp_path
    for command in (["recipe", "validate"], ["plan"], ["run"]):
        result = CliRunner().invoke(app, [*command, str(recipe)])
        assert result.exit_code == 2, (command, result.output)
        assert "data.jsonl does not exist" in " ".join(result.output.split())


def test_model_checks_before_any_stage_runs(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    """keep_16bit entries that match no linear (llm-compressor would skip them silently), and
    models a TensorRT-LLM checkpoint cannot hold, fail `recipe validate` and `run` at file:line
    with the fix, not after convert, calibrate and quantize (tiny model: 4 heads, hidden 64)."""
    (tmp_path / "data.jsonl").write_text('{"text": "a sample"}\n')
    recipe = tmp_path / "r.yaml"

    def problem(quantization: str, build: str) -> str:
        text = VALID.replace("gguf:model.gguf", str(tiny_llama_checkpoint))
        text = text.replace("  method: int8-sq\n  smoothquant_alpha: 0.5\n", quantization)
        recipe.write_text(text.replace("  targets: [compressed-tensors]\n", build))
        result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
        return " ".join(result.output.split()) if result.exit_code else ""

    static = "  method: int8-sq\n"
    trtllm = "  targets: [trtllm-checkpoint]\n"
    typo = static + "  keep_16bit: [lm_head, model.layers.0.self_attn.qproj]\n"
    assert problem(typo, trtllm).startswith(
        f"{recipe}:10 quantization.keep_16bit: 'model.layers.0.self_attn.qproj' matches none of "
        "the model's linear layers; did you mean 'model.layers.0.self_attn.q_proj'?"
    )
    assert not problem(
        static + r"  keep_16bit: [lm_head, 're:model\.layers\.1\..*']" + "\n", trtllm
    )
    assert problem(static, trtllm + "  tp: 3\n").startswith(
        f"{recipe}:12 build.tp: tp=3 does not divide the model's 4 attention heads"
    )
    # int4 groups of 64 over 2 ranks: TensorRT-LLM would pad the 64 hidden features to 128
    awq = "  method: awq\n  group_size: 64\n"
    assert "build.targets: trtllm-checkpoint: transformer.layers.0.attention.qkv" in problem(
        awq, trtllm + "  tp: 2\n"
    )
    assert "use build.tp in {1}" in problem(awq, trtllm + "  tp: 2\n")
    assert not problem(awq, "  targets: [compressed-tensors]\n  tp: 2\n")

    # `qpipe run` refuses the same recipe before convert writes anything
    problem(static, trtllm + "  tp: 3\n")
    store = tmp_path / "store"
    run = CliRunner().invoke(app, ["run", str(recipe), "--store", str(store)])
    assert run.exit_code == 2, run.output
    assert "build.tp: tp=3 does not divide" in " ".join(run.output.split())
    assert not (store / "objects").exists() or not any((store / "objects").iterdir())

    # linear biases (Qwen2-style attention_bias) have no place in the writer's layout
    biased = tmp_path / "biased"
    biased.mkdir()
    for source in tiny_llama_checkpoint.iterdir():
        (biased / source.name).symlink_to(source)
    config = json.loads((tiny_llama_checkpoint / "config.json").read_text())
    (biased / "config.json").unlink()
    (biased / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    text = VALID.replace("gguf:model.gguf", str(biased))
    recipe.write_text(text.replace("  targets: [compressed-tensors]\n", trtllm))
    result = CliRunner().invoke(app, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 2
    assert "linears have biases (attention_bias/mlp_bias)" in " ".join(result.output.split())
