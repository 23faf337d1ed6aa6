"""The bench stage and the client against qpipe's own server on the tiny random Llama."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qpipe.bench.client import LoadResult, RequestResult, Target
from qpipe.bench.config import LoadProfile
from qpipe.bench.dataset import load_tokenizer
from qpipe.bench.history import History, history_path
from qpipe.bench.metrics import compute_metrics
from qpipe.bench.runner import WARMUP_OUTPUT_LEN, BenchOptions, LevelResult, run_benchmark
from qpipe.bench.server_process import BuiltinServer
from qpipe.recipe import parse_recipe
from qpipe.stages.base import StageContext, StageError
from qpipe.stages.bench import BenchStage, scaled_for_cpu
from qpipe.store.local import LocalStore


def test_cpu_scaling_rule() -> None:
    seed = scaled_for_cpu(LoadProfile())
    assert (seed.input_len, seed.output_len, seed.concurrency, seed.num_prompts) == (128, 64, 8, 16)
    small = LoadProfile(input_len=20, output_len=10, concurrency=2, num_prompts=50, request_rate=4)
    assert scaled_for_cpu(small) == small.model_copy(update={"num_prompts": 4})


def test_goodput_gate_without_slos_is_a_recipe_error(tmp_path: Path) -> None:
    recipe = parse_recipe("name: x\nmodel: {source: /m}\nbench: {min_goodput: 1.0}")
    ctx = StageContext(recipe, tmp_path, tmp_path, {"build": tmp_path}, LocalStore(tmp_path / "s"))
    with pytest.raises(StageError, match="set bench.goodput"):
        BenchStage().run(ctx)


PROFILE = LoadProfile(input_len=16, output_len=8, concurrency=4, num_prompts=12)
LABEL = "random:in16:out8:c4:rateinf:n12"


def _level(duration_s: float, failed: int = 0) -> LevelResult:
    """12 requests of 8 tokens each; a longer duration is a slower server."""
    ok = RequestResult(16, success=True, output_len=8, ttft=0.05, itl=[0.01] * 7, latency=0.12)
    results = [ok] * (12 - failed) + [RequestResult(16, error="HTTP 500: boom")] * failed
    return LevelResult(PROFILE, compute_metrics(LoadResult(results, duration_s)), "20250101-0000")


def _report(tmp_path: Path, level: LevelResult, bench: str = "{}"):  # noqa: ANN202 - StageResult
    """The bench stage's report of one measured level, its history in tmp_path/store."""
    recipe = parse_recipe(f"name: x\nmodel: {{source: /m}}\nbench: {bench}")
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    ctx = StageContext(recipe, tmp_path, out, {"build": tmp_path}, LocalStore(tmp_path / "store"))
    target = Target("http://127.0.0.1:1", "m")
    return BenchStage()._report(ctx, recipe.bench, target, BenchOptions(), [level], scaled=False)


def test_stage_warns_of_regressions_without_failing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _report(tmp_path, _level(1.0)).gate.passed  # the first clean run is the baseline
    result = _report(tmp_path, _level(2.0))  # half the throughput
    assert result.gate is not None and result.gate.passed
    assert f"{LABEL}: output_throughput: 48 vs baseline 96" in result.metrics["regressions"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 2 and all(LABEL in line for line in warnings)  # output, request tput
    assert [r.accepted for r in History(history_path(tmp_path / "store")).runs("x")] == [
        False, True,
    ]  # fmt: skip


def test_fail_on_regression_makes_it_a_gate(tmp_path: Path) -> None:
    _report(tmp_path, _level(1.0))
    result = _report(tmp_path, _level(2.0), "{fail_on_regression: true}")
    assert result.gate is not None and not result.gate.passed
    assert result.gate.failures[0].startswith(f"regressed: {LABEL}: output_throughput: 48")


def test_stage_flags_failed_requests_against_the_baseline_and_keeps_them_out(
    tmp_path: Path,
) -> None:
    _report(tmp_path, _level(1.0))
    result = _report(tmp_path, _level(2 / 3, failed=4))  # the same throughput from 8 requests
    assert result.gate is not None and not result.gate.passed
    assert result.metrics["regressions"] == f"{LABEL}: requests: 4 of 12 requests failed"
    assert [r.accepted for r in History(history_path(tmp_path / "store")).runs("x")] == [
        False, True,
    ]  # fmt: skip


def test_bench_accept_refuses_failed_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from qpipe.bench import runner
    from qpipe.bench.cli import bench_app

    levels = [_level(1.0), _level(1.0, failed=12)]
    monkeypatch.setattr(runner, "run_benchmark", lambda *args, **kwargs: levels)
    args = ["--endpoint", "http://127.0.0.1:1", "--model", "m", "--store", str(tmp_path)]
    result = CliRunner().invoke(bench_app, [*args, "--accept"])
    assert result.exit_code == 1, result.output
    assert "accepted baseline: runs 1 in" in result.output
    assert "not accepted as a baseline" in result.output
    assert f"run 2 [{LABEL}]: 12 of 12 requests failed" in result.output
    assert [r.accepted for r in History(history_path(tmp_path)).runs()] == [False, True]


@pytest.mark.slow
def test_stage_serves_the_artifact_gates_and_records(
    tiny_llama_checkpoint: Path, tmp_path: Path
) -> None:
    from qpipe.serve.artifact import write_artifact

    build = tmp_path / "build"
    write_artifact(tiny_llama_checkpoint, build / "qpipe")
    (build / "build.json").write_text(json.dumps({"alias": "tiny-cpu-fp32-tp1"}))
    recipe = parse_recipe(
        f"""
name: tiny-bench
model: {{source: {tiny_llama_checkpoint}}}
bench:
  profiles: [{{input_len: 256, output_len: 32, concurrency: 16, num_prompts: 8}}]
  min_output_throughput: 1
  max_ttft_p99_ms: 0.001
  goodput: {{ttft: 60000}}
  min_goodput: 0.01
  server_args: {{device: cpu, max_num_seqs: 4}}
"""
    )
    store = LocalStore(tmp_path / "store")
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(recipe, tmp_path, out, {"build": build}, store)
    result = BenchStage().run(ctx)

    label = "random:in128:out32:c8:rateinf:n8"  # scaled for CPU
    assert result.metrics["scaled_for_cpu"] is True
    assert result.metrics[f"{label}.completed"] == 8
    assert result.metrics[f"{label}.failed"] == 0
    assert result.gate is not None and not result.gate.passed
    assert len(result.gate.failures) == 1 and "p99_ttft_ms" in result.gate.failures[0]
    assert result.gate.checked[f"{label}.output_throughput"] > 1
    assert result.gate.checked[f"{label}.request_goodput"] > 0.01
    (level,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert level["total_output_tokens"] == 8 * 32 and level["max_concurrency"] == 8
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "throughput_vs_concurrency.png", "tpot_distribution.png", "ttft_distribution.png",
    ]  # fmt: skip
    assert "Application startup complete" in (out / "server.log").read_text()
    (row,) = History(history_path(tmp_path / "store")).runs("tiny-cpu-fp32-tp1")
    assert row.profile == label and not row.accepted  # a failed gate is no baseline
    assert row.metrics["output_throughput"] == pytest.approx(level["output_throughput"])


@pytest.fixture(scope="module")
def tiny_server(
    tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BuiltinServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = {"device": "cpu", "served_model_name": "tiny", "max_num_seqs": 8}
    with BuiltinServer(tiny_llama_checkpoint, log, args, startup_timeout_s=180) as server:
        yield server


@pytest.mark.parametrize("chat", [False, True])
def test_client_against_the_builtin_server(
    tiny_server: BuiltinServer, tiny_llama_checkpoint: Path, chat: bool
) -> None:
    tokenizer = load_tokenizer(tiny_llama_checkpoint)
    profile = LoadProfile(input_len=48, output_len=24, concurrency=4, num_prompts=8)
    target = Target(tiny_server.base_url, "tiny", chat=chat)
    generated_before = _generated_tokens(tiny_server)
    (level,) = run_benchmark(target, [profile], BenchOptions(), tokenizer, show_progress=False)
    s = level.metrics.summary()
    assert (s["completed"], s["failed"]) == (8, 0), level.metrics.errors
    # ignore_eos: every request yields exactly output_len tokens, counted by the server's usage
    assert level.metrics.output_lens == [24] * 8
    if not chat:  # the chat template adds tokens around the prompt
        assert level.metrics.input_lens == [48] * 8
    assert s["output_throughput"] == pytest.approx(8 * 24 / s["duration"])
    assert s["total_token_throughput"] > s["output_throughput"]
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] <= s["p99_e2el_ms"]
    assert 0 < s["mean_tpot_ms"] < s["mean_e2el_ms"]
    # the server's own count agrees: the levels' tokens plus the untimed warm-up request
    assert _generated_tokens(tiny_server) - generated_before == 8 * 24 + WARMUP_OUTPUT_LEN


def _generated_tokens(server: BuiltinServer) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "qpipe:generation_tokens"
    ]
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_cli_takes_the_tokenizer_from_a_local_server(
    tiny_server: BuiltinServer, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from qpipe.bench.cli import bench_app

    args = [
        "--endpoint", tiny_server.base_url, "--concurrency", "2", "--input-len", "32",
        "--output-len", "8", "--num-prompts", "2", "--no-record", "--result-file",
        str(tmp_path / "r.json"),
    ]  # fmt: skip
    result = CliRunner().invoke(bench_app, args)  # random prompts need the tokenizer
    assert result.exit_code == 0, result.output
    level = json.loads((tmp_path / "r.json").read_text())
    assert level["model_id"] == "tiny" and level["input_lens"] == [32, 32]
    assert level["output_lens"] == [8, 8] and level["completed"] == 2
