"""Evaluation time on this machine: KLD over held-out text, GSM8K items through HF and an endpoint.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/evaluate/run.py --tokens 16384 --gsm8k-items 8

Baseline is SmolLM2-135M (fp32 checkpoint, run in bf16), candidate its int8 per-channel
compressed-tensors copy (the test cache builds both). The endpoint run starts `qpipe serve` on the
candidate and points lm-eval's `local-completions` adapter at it. Writes results.json (merged with
earlier runs, so `--runs endpoint` re-measures one part) and each run's report under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from qpipe.evaluate.config import EvaluateConfig  # noqa: E402
from qpipe.evaluate.evaluation import EvalReport, evaluate  # noqa: E402
from qpipe.evaluate.models import ModelRef  # noqa: E402
from qpipe.evaluate.report import write_report  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(checkpoint: Path, port: int, log: Path) -> subprocess.Popen:
    command = "import typer; from qpipe.serve.cli import serve; typer.run(serve)"
    args = [str(checkpoint), "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16"]
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", command, *args], stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"qpipe serve exited; see {log}") from None
            time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"qpipe serve did not come up in 300 s; see {log}")


def timed_eval(
    label: str, run: Callable[[], EvalReport], config: EvaluateConfig, out: Path
) -> tuple[EvalReport, dict[str, float]]:
    cpu, wall = time.process_time(), time.perf_counter()
    report = run()
    seconds = {
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
    }
    write_report(report, config, out)
    print(f"{label}: {seconds['wall_s']} s wall", flush=True)
    return report, seconds


def run_kld(base: ModelRef, cand: ModelRef, tokens: int, out: Path) -> dict[str, Any]:
    config = EvaluateConfig(max_tokens=tokens, window=512, batch_size=4)
    report, seconds = timed_eval(
        f"KLD over {tokens} tokens", lambda: evaluate(base, cand, config, out), config, out
    )
    assert report.distribution is not None
    return {
        "tokens": tokens,
        "scoring_s": round(report.distribution.seconds, 1),
        "loading_s": round(report.distribution.load_seconds, 1),
        "total": seconds,
        "metrics": {c.name: c.as_dict() for c in report.comparisons},
    }


def run_gsm8k(base: ModelRef, cand: ModelRef, items: int, out: Path) -> dict[str, Any]:
    config = EvaluateConfig(
        max_tokens=0, batch_size=items, tasks=[{"name": "gsm8k", "limit": items}]
    )
    report, seconds = timed_eval(
        f"GSM8K x{items}: {base.spec} vs {cand.spec}",
        lambda: evaluate(base, cand, config, out),
        config,
        out,
    )
    return {
        "items": items,
        "total_both_models": seconds,
        "seconds_per_model": {
            name: {"baseline": round(base.seconds, 1), "candidate": round(cand.seconds, 1)}
            for name, (base, cand) in report.tasks.items()
        },
        "notes": report.notes,
        "metrics": {c.name: c.as_dict() for c in report.comparisons},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--gsm8k-items", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "evaluate" / "results")
    parser.add_argument("--runs", default="kld,hf,endpoint", help="Any of kld,hf,endpoint.")
    args = parser.parse_args()

    from tests.model_cache import converted_smollm2
    from tests.test_eval_distribution import int8_checkpoint

    cache = Path(os.environ.get("QPIPE_TEST_CACHE", REPO / ".cache" / "test"))
    baseline = converted_smollm2(cache)
    candidate = int8_checkpoint(baseline)
    base, cand = ModelRef(str(baseline)), ModelRef(str(candidate))
    runs = set(args.runs.split(","))
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results |= {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "baseline": str(baseline),
        "candidate": str(candidate),
    }
    context = {"load_average_at_start": os.getloadavg(), "omp": os.environ.get("OMP_WAIT_POLICY")}
    if "kld" in runs:
        results["kld"] = context | run_kld(base, cand, args.tokens, args.out / "kld")
    if "hf" in runs:
        results["gsm8k_hf"] = context | run_gsm8k(base, cand, args.gsm8k_items, args.out / "hf")
    if "endpoint" in runs:
        port = free_port()
        server = start_server(candidate, port, args.out / "serve.log")
        try:
            endpoint = ModelRef(f"http://127.0.0.1:{port}")
            results["gsm8k_endpoint"] = context | run_gsm8k(
                base, endpoint, args.gsm8k_items, args.out / "endpoint"
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
