"""`qpipe run` / `plan` / `cache` as a user runs them, on the real SmolLM2, in real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2-135m-int8.yaml"

pytestmark = pytest.mark.slow


def qpipe(*args: str, store: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "qpipe", *args, "--store", str(store)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"qpipe {args} failed ({result.returncode}):\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("store")
    qpipe("run", str(RECIPE), "--until", "convert", store=store)
    return store


def _stages(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads(result.stdout)["stages"]}


def test_convert_writes_a_verified_checkpoint(converted: Path) -> None:
    stage = _stages(qpipe("plan", str(RECIPE), "--until", "convert", "--json", store=converted))
    convert = stage["convert"]
    assert convert["status"] == "hit"
    out = Path(convert["path"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "convert.json", "meta.json"} <= {p.name for p in out.iterdir()}  # fmt: skip
    assert convert["metrics"]["max_abs_logit_diff"] <= convert["metrics"]["logit_tolerance"]
    assert convert["metrics"]["num_parameters"] == 134_515_008
    plan_text = qpipe("plan", str(RECIPE), "--until", "convert", store=converted).stdout
    assert "verified: max |Δlogit|" in plan_text


def test_noop_rerun_is_fast_and_runs_nothing(converted: Path) -> None:
    started = time.perf_counter()
    result = qpipe("run", str(RECIPE), "--until", "convert", "--json", store=converted)
    elapsed = time.perf_counter() - started
    stages = _stages(result)
    assert stages["convert"]["status"] == "hit"
    assert elapsed < 3.0, f"no-op re-run took {elapsed:.2f}s"
    manifest = json.loads(result.stdout)
    assert manifest["recipe"]["name"] == "smollm2-135m-int8"
    assert manifest["environment"]["tools"]["torch"].startswith("2.13")


def test_fit_counts_the_recipes_kv_cache_dtype(converted: Path) -> None:
    """The fp8-KV recipe shares the default recipe's converted checkpoint; fit reads the KV
    dtype from each recipe: 2 bytes per value (bf16, fit's default), 1 with `kv_cache: fp8`."""
    per_token = {}
    for name in ("smollm2-135m-int8", "smollm2-135m-int8-fp8kv"):
        recipe = REPO / "recipes" / f"{name}.yaml"
        report = json.loads(
            qpipe("fit", str(recipe), "--gpu", "L4", "--json", store=converted).stdout
        )
        per_token[name] = report["kv_bytes_per_token"]
    values = 2 * 30 * 3 * 64  # K and V, 30 layers, 3 KV heads of 64
    assert per_token == {"smollm2-135m-int8": 2 * values, "smollm2-135m-int8-fp8kv": values}


def test_kill_during_convert_then_resume(tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qpipe", "run", str(RECIPE), "--until", "convert", "--store",
         str(store)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 300
    partial: list[Path] = []
    while time.time() < deadline and not partial:  # wait until the stage is writing its output
        partial = [p for p in (store / "tmp").glob("convert-*/*") if p.stat().st_size > 0]
        time.sleep(0.05)
    assert partial, "convert never started writing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list((store / "objects").glob("*/*")), "a killed stage left a visible entry"
    plan = _stages(qpipe("plan", str(RECIPE), "--until", "convert", "--json", store=store))
    assert plan["convert"]["status"] == "miss"
    resumed = _stages(qpipe("run", str(RECIPE), "--until", "convert", "--json", store=store))
    assert resumed["convert"]["status"] == "ran"
    gc = qpipe("cache", "gc", store=store)
    assert "removed tmp/convert-" in gc.stderr
    assert not list((store / "tmp").iterdir())


def test_corrupted_checkpoint_is_detected_and_rebuilt(converted: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    subprocess.run(["cp", "-a", str(converted), str(store)], check=True)
    convert = _stages(qpipe("plan", str(RECIPE), "--until", "convert", "--json", store=store))
    weights = (
        Path(convert["convert"]["path"].replace(str(converted), str(store))) / "model.safetensors"
    )
    with weights.open("r+b") as handle:  # flip bytes inside the tensor data, size unchanged
        handle.seek(weights.stat().st_size // 2)
        handle.write(b"\x00\x01\x02\x03")
    verify = qpipe("cache", "verify", store=store, check=False)
    assert verify.returncode == 1
    assert "model.safetensors does not match its checksum" in verify.stderr
    verify = qpipe("cache", "verify", "--quarantine", store=store, check=False)
    plan = _stages(qpipe("plan", str(RECIPE), "--until", "convert", "--json", store=store))
    assert plan["convert"]["status"] == "miss"


def test_a_manifest_path_that_cannot_take_a_file_is_refused_before_any_stage(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    (tmp_path / "afile").write_text("")
    for path, expected in (
        (tmp_path, "is a directory; name a file"),
        (tmp_path / "afile" / "x.json", "afile is a file, not a directory"),
    ):
        result = qpipe("run", str(RECIPE), "--until", "convert", "--manifest", str(path),
                       store=store, check=False)  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
    assert not list((store / "objects").glob("*/*")), "a stage ran before the path was checked"


def test_a_manifest_that_cannot_be_written_after_the_run_says_where_the_store_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from qpipe.cli import app
    from qpipe.pipeline import Pipeline

    target = tmp_path / "ci" / "manifest.json"

    def run_that_takes_the_path(self: Pipeline, **kwargs: object) -> list:
        target.mkdir(parents=True)  # something else took the path while the stages ran
        return []

    monkeypatch.setattr(Pipeline, "run", run_that_takes_the_path)
    result = CliRunner().invoke(app, ["run", str(RECIPE), "--until", "convert", "--manifest",
                                      str(target), "--store", str(tmp_path / "store")])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert f"--manifest {target}: cannot write it" in result.output
    assert "docs/runs/smollm2-135m-int8/" in result.output


def test_sigterm_unwinds_the_run_and_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (a CI job or container stopped) unwinds like Ctrl-C, so the running stage cleans
    up, but exits 128 + 15 as a terminated process does, not Ctrl-C's 130."""
    import time

    from typer.testing import CliRunner

    from qpipe.cli import app
    from qpipe.pipeline import Pipeline

    unwound = []

    def run_until_terminated(self: Pipeline, **kwargs: object) -> list:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises here
        except KeyboardInterrupt:
            unwound.append(True)
            raise
        return []

    monkeypatch.setattr(Pipeline, "run", run_until_terminated)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(
        app, ["run", str(RECIPE), "--until", "convert", "--store", str(tmp_path / "store")]
    )
    assert result.exit_code == 143, result.output
    assert unwound == [True]
    assert signal.getsignal(signal.SIGTERM) == before  # the run's handler was put back
