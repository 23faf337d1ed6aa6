"""The calibrate stage through a StageContext and the pipeline's keys, and the shipped sets."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qpipe.calibration.token_set import TokenSet
from qpipe.hashing import HashCache
from qpipe.pipeline import Pipeline
from qpipe.recipe import parse_recipe
from qpipe.stages.base import StageContext, StageError
from qpipe.stages.calibrate import CalibrateStage
from qpipe.store.local import LocalStore

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "calibration"


def recipe_text(model: Path, dataset: str, extra: str = "") -> str:
    return (
        f"name: cal-test\nmodel:\n  source: {model}\n  dtype: float32\n"
        f"calibration:\n  dataset: {dataset}\n  num_samples: 24\n  seq_len: 128\n{extra}"
    )


def normalised(text: str) -> str:
    return " ".join(text.split()).lower()


def test_stage_writes_the_contract_files_with_consistent_stats(
    smollm2_checkpoint: Path, tmp_path: Path
) -> None:
    text = recipe_text(smollm2_checkpoint, str(SHIPPED / "chat-example.jsonl"), "  seed: 3\n")
    recipe = parse_recipe(text.replace("num_samples: 24", "num_samples: 12"))
    out = tmp_path / "out"
    out.mkdir()
    store = LocalStore(tmp_path / "store")
    inputs = {"convert": smollm2_checkpoint}
    ctx = StageContext(recipe=recipe, recipe_dir=tmp_path, out_dir=out, inputs=inputs, store=store)
    result = CalibrateStage().run(ctx)

    assert sorted(p.name for p in out.iterdir()) == ["calibration.safetensors", "stats.json"]
    tensors = load_file(out / "calibration.safetensors")
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    assert (
        ids.shape == mask.shape == (12, 128) and str(ids.dtype) == str(mask.dtype) == "torch.int64"
    )
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] == stats["kept"] == 12 and stats["samples_read"] == 16
    assert stats["samples_read"] == (stats["dropped"]["duplicate"] + stats["dropped"]["empty"]
                                     + stats["examined"] + stats["unused"])  # fmt: skip
    assert stats["examined"] == (stats["kept"] + stats["dropped"]["too_short"]
                                 + stats["dropped"]["too_long"])  # fmt: skip
    assert stats["tokens"]["in_rows"] == int(mask.sum())
    assert stats["tokens"]["in_rows"] + stats["tokens"]["padding"] == 12 * 128
    assert (stats["tokens"]["in_kept_samples"] - stats["tokens"]["truncated_away"]
            == stats["tokens"]["in_rows"])  # fmt: skip
    assert sum(b["count"] for b in stats["histogram"]) == 12
    assert stats["chat_template_applied"] == 12
    assert (
        stats["content_hash"] == TokenSet.load(out).content_hash == result.metrics["content_hash"]
    )
    assert result.metrics["tokens"] == stats["tokens"]["in_rows"]


def test_a_window_past_the_model_context_fails_before_any_is_built(
    tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    """The tiny model reads 2048 positions: seq_len 4096 is refused with that limit, before a
    MemoryError or a window the model cannot read."""
    text = recipe_text(tiny_llama_checkpoint, str(SHIPPED / "chat-example.jsonl"))
    text = text.replace("num_samples: 24", "num_samples: 12").replace(
        "seq_len: 128", "seq_len: 4096"
    )
    recipe = parse_recipe(text)
    inputs = {"convert": tiny_llama_checkpoint}
    store = LocalStore(tmp_path / "store")
    ctx = StageContext(recipe=recipe, recipe_dir=tmp_path, out_dir=tmp_path, inputs=inputs,
                       store=store)  # fmt: skip
    with pytest.raises(StageError, match=r"calibration.seq_len: 4096 .*\(max_position_embed"):
        CalibrateStage().run(ctx)
    assert not (tmp_path / "calibration.safetensors").exists()


def test_editing_one_sample_rekeys_calibrate_not_convert(
    tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "data"
    dataset.mkdir()
    (dataset / "domain.jsonl").write_text(
        "".join(json.dumps({"text": f"sample {i}"}) + "\n" for i in range(30))
    )
    recipe_path = tmp_path / "r.yaml"

    def keys(extra: str = "") -> dict[str, str | None]:
        recipe_path.write_text(recipe_text(tiny_llama_checkpoint, "data/domain.jsonl", extra))
        recipe = parse_recipe(recipe_path.read_text())
        pipeline = Pipeline(recipe, tmp_path, LocalStore(tmp_path / "store"), HashCache(None))
        return {p.name: p.key for p in pipeline.plan(until="calibrate")}

    before = keys()
    assert before["calibrate"] is not None
    assert keys() == before
    text = (dataset / "domain.jsonl").read_text()
    (dataset / "domain.jsonl").write_text(text.replace("sample 7", "sample seven"))
    edited = keys()
    assert edited["convert"] == before["convert"] and edited["calibrate"] != before["calibrate"]
    # the same bytes under another name: keyed by content, so it hits
    (dataset / "renamed.jsonl").write_bytes((dataset / "domain.jsonl").read_bytes())
    recipe_path.write_text(recipe_text(tiny_llama_checkpoint, "data/renamed.jsonl"))
    renamed = Pipeline(
        parse_recipe(recipe_path.read_text()), tmp_path, LocalStore(tmp_path / "store"),
        HashCache(None),
    ).plan(until="calibrate")  # fmt: skip
    assert {p.name: p.key for p in renamed} == edited
    assert keys("  seed: 1\n")["calibrate"] not in (before["calibrate"], edited["calibrate"])


def test_directory_dataset_is_declared_whole(smollm2_checkpoint: Path, tmp_path: Path) -> None:
    recipe = parse_recipe(recipe_text(smollm2_checkpoint, "saved"))
    (tmp_path / "saved").mkdir()
    assert CalibrateStage().input_files(recipe, tmp_path) == {
        "calibration.dataset": tmp_path / "saved"
    }
    missing = parse_recipe(recipe_text(smollm2_checkpoint, "missing.jsonl"))
    with pytest.raises(StageError, match=r"calibration.dataset: .*missing.jsonl does not exist"):
        CalibrateStage().input_files(missing, tmp_path)


def _make_math() -> object:
    spec = importlib.util.spec_from_file_location("make_math", SHIPPED / "make_math.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_set_is_reproducible_correct_and_disjoint_from_gsm8k_test(shared_data: Path) -> None:
    lines = (SHIPPED / "math-word-problems.jsonl").read_text(encoding="utf-8").splitlines()
    problems = [json.loads(line) for line in lines]
    assert len(problems) >= 600
    assert problems == _make_math().generate()  # type: ignore[attr-defined]
    test_questions = {
        normalised(json.loads(line)["question"])
        for line in (shared_data / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    }
    ours = {normalised(p["question"]) for p in problems}
    assert len(ours) == len(problems) and not ours & test_questions
    for problem in problems:  # every calculator step is right and the final answer is the last one
        steps = re.findall(r"<<([^=>]+)=(-?\d+)>>", problem["answer"])
        assert steps and all(eval(expr) == int(value) for expr, value in steps)  # noqa: S307
        assert problem["answer"].endswith(f"\n#### {steps[-1][1]}")


def test_shipped_sets_calibrate_with_the_real_tokenizer(smollm2_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    from qpipe.calibration.builder import build_calibration_set
    from qpipe.quant.config import CalibrationConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    for name, samples in (("math-word-problems.jsonl", 512), ("wikitext-2.txt", 512),
                          ("chat-example.jsonl", 16)):  # fmt: skip
        config = CalibrationConfig(dataset=name, num_samples=samples, seq_len=256)
        stats = build_calibration_set(config, SHIPPED / name, tokenizer, False).stats
        assert stats.rows == samples
        assert stats.chat_template_applied == (0 if name.endswith(".txt") else samples)
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) < 2 * 1024 * 1024
