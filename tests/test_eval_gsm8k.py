"""GSM8K through lm-eval, offline, from the copy qpipe ships; scores checked by hand."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qpipe.data import GSM8K_EVAL, GSM8K_FEWSHOT
from qpipe.evaluate.config import EvaluateConfig, TaskConfig
from qpipe.evaluate.evaluation import evaluate
from qpipe.evaluate.models import ModelRef
from qpipe.evaluate.tasks import lm_eval_model, run_task, task_yaml

STRICT = "exact_match,strict-match"
FLEXIBLE = "exact_match,flexible-extract"


def _number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".").strip()


def hand_extract(generation: str) -> tuple[str, str]:
    """GSM8K's two readings of a generation, written here independently of lm-eval.

    strict: the number after the first `#### `; flexible: the last number-looking token anywhere.
    """
    strict = re.search(r"#### (-?[\d.,]+)", generation)
    numbers = re.findall(r"-?[$\d.,]{2,}|-?\d+", generation)
    return (strict.group(1) if strict else "[invalid]"), (numbers[-1] if numbers else "[invalid]")


def test_shipped_gsm8k_keeps_fewshot_items_apart() -> None:
    evaluated = {json.loads(line)["question"] for line in GSM8K_EVAL.open()}
    fewshot = {json.loads(line)["question"] for line in GSM8K_FEWSHOT.open()}
    assert (len(evaluated), len(fewshot)) == (1269, 50)
    assert not evaluated & fewshot


@pytest.mark.slow
def test_gsm8k_scores_equal_a_hand_check(smollm2_checkpoint: Path, tmp_path: Path) -> None:
    task = TaskConfig(name="gsm8k", limit=4)
    spec = task_yaml(task, lambda p: Path(p), tmp_path)
    model = lm_eval_model(ModelRef(str(smollm2_checkpoint)), "float32", batch_size=4)
    scores = run_task(model, task, spec, tmp_path / "samples.jsonl", seed=0)
    assert set(scores.metrics) == {STRICT, FLEXIBLE}
    assert scores.doc_ids == (0, 1, 2, 3)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").open()]
    by_filter = {s["filter"]: s for s in samples if s["doc_id"] == 0}
    prompt = by_filter["strict-match"]["arguments"][0][0]
    assert prompt.count("Question:") == 6  # 5-shot, as lm-eval defines gsm8k
    shown = re.findall(r"Question: (.*?)\nAnswer:", prompt, flags=re.S)[:5]
    fewshot = {json.loads(line)["question"] for line in GSM8K_FEWSHOT.open()}
    assert set(shown) <= fewshot
    expected: dict[str, list[float]] = {STRICT: [], FLEXIBLE: []}
    for doc_id in scores.doc_ids:
        logged = {s["filter"]: s for s in samples if s["doc_id"] == doc_id}
        strict, flexible = hand_extract(logged["strict-match"]["resps"][0][0])
        assert logged["strict-match"]["filtered_resps"] == [strict]
        assert logged["flexible-extract"]["filtered_resps"] == [flexible]
        target = _number(logged["strict-match"]["doc"]["answer"].split("####")[-1])
        expected[STRICT].append(float(_number(strict) == target))
        expected[FLEXIBLE].append(float(_number(flexible) == target))
    for metric, values in expected.items():
        assert scores.items[metric].tolist() == values
        assert scores.metrics[metric] == pytest.approx(np.mean(values))


@pytest.mark.slow
def test_task_metrics_are_compared_and_gated(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    ref = ModelRef(str(tiny_llama_checkpoint))
    config = EvaluateConfig(
        max_tokens=256, window=128, tasks=[{"name": "gsm8k", "limit": 2}], max_drop={"gsm8k": 0.0}
    )
    report = evaluate(ref, ref, config, tmp_path)
    rows = {c.name: c for c in report.comparisons}
    assert {f"gsm8k/{STRICT}", f"gsm8k/{FLEXIBLE}"} <= set(rows)
    assert rows[f"gsm8k/{STRICT}"].p_value == 1.0  # same model, same items: no discordant pair
    assert report.gate.passed
    assert (tmp_path / "samples" / "candidate-gsm8k.jsonl").is_file()
    assert "include" in (tmp_path / "tasks" / "gsm8k.yaml").read_text()


@pytest.fixture()
def tiny_endpoint(tiny_llama_checkpoint: Path, tmp_path: Path) -> Iterator[str]:
    """`qpipe serve` on the tiny model, as a separate process on a free port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = "import typer; from qpipe.serve.cli import serve; typer.run(serve)"
    args = [str(tiny_llama_checkpoint), "--port", str(port), "--max-model-len", "2048"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", command, *args], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "qpipe serve did not start"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.slow
def test_endpoint_candidate_runs_tasks_only(
    tiny_llama_checkpoint: Path, tiny_endpoint: str, tmp_path: Path
) -> None:
    config = EvaluateConfig(
        tasks=[{"name": "gsm8k", "limit": 2}], max_drop={"gsm8k": 100.0, "kld_mean": 0.05}
    )
    report = evaluate(
        ModelRef(str(tiny_llama_checkpoint)), ModelRef(tiny_endpoint), config, tmp_path
    )
    assert report.distribution is None
    assert "distribution checks" in report.notes[0] and "skipped" in report.notes[0]
    rows = {c.name for c in report.comparisons}
    assert rows == {f"gsm8k/{STRICT}", f"gsm8k/{FLEXIBLE}"}
    served = [json.loads(line) for line in (tmp_path / "samples" / "candidate-gsm8k.jsonl").open()]
    assert {s["doc_id"] for s in served} == {0, 1}
    assert all(isinstance(s["resps"][0][0], str) for s in served)
    assert report.gate.failures == (
        "kld_mean: not measured (limit 0.05); was it skipped for an endpoint?",
    )


@pytest.mark.slow
def test_any_lm_eval_task_runs_on_local_files(tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    """arc_easy's own lm-eval config (prompt, choices, acc/acc_norm) on three local items."""
    items = [
        ("What do plants need to make food?", ["sunlight", "sand", "noise"], "A"),
        ("Which is a liquid at room temperature?", ["iron", "water", "salt"], "B"),
        ("What melts ice fastest?", ["cold", "shade", "heat"], "C"),
    ]
    data = tmp_path / "arc.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": question,
                    "choices": {"text": choices, "label": ["A", "B", "C"]},
                    "answerKey": key,
                }
            )
            + "\n"
            for i, (question, choices, key) in enumerate(items)
        )
    )
    task = TaskConfig(name="arc_easy", data_files={"test": str(data)})
    spec = task_yaml(task, lambda p: Path(p), tmp_path)
    model = lm_eval_model(ModelRef(str(tiny_llama_checkpoint)), "float32", batch_size=3)
    scores = run_task(model, task, spec, tmp_path / "samples.jsonl", seed=0)
    assert set(scores.metrics) == {"acc,none", "acc_norm,none"}
    assert scores.doc_ids == (0, 1, 2)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").open()]
    for sample in samples:  # acc = the highest-loglikelihood choice is the answer
        loglikelihoods = [float(resp[0][0]) for resp in sample["resps"]]
        assert sample["acc"] == float(int(np.argmax(loglikelihoods)) == sample["target"])
    assert scores.metrics["acc,none"] == pytest.approx(scores.items["acc,none"].mean())
