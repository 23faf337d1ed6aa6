"""bench: the built `qpipe` artifact (or `bench.endpoint`) under the recipe's load profiles.

Starts the built-in server on the artifact, waits for /health, runs every profile, stops the server,
and leaves results.jsonl (vLLM `bench serve` keys, one object per profile), summary.json, the server
log and PNG plots in the output. Every profile's figures go into the store's bench history and are
compared with the last accepted baseline of the same alias, hardware and profile.

On CPU the seed's GPU-sized profile (512 in / 256 out at concurrency 32) would take an hour, so
when our own server runs on CPU each profile is capped: at most 128 input and 64 output tokens,
concurrency 8, and 2 × that concurrency prompts. The seed case becomes 128 in / 64 out at
concurrency 8 with 16 prompts (the shipped CPU recipe's shape); a remote endpoint is never scaled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from qpipe.bench.config import BenchConfig, LoadProfile
from qpipe.recipe import Recipe
from qpipe.stages.base import GateVerdict, MetricValue, Stage, StageContext, StageError, StageResult

if TYPE_CHECKING:
    from qpipe.bench.client import Target
    from qpipe.bench.runner import BenchOptions, LevelResult

STAGE_METRICS = (
    "output_throughput", "request_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "completed", "failed",
)  # fmt: skip
CPU_CAPS = LoadProfile(input_len=128, output_len=64, concurrency=8)


def scaled_for_cpu(profile: LoadProfile) -> LoadProfile:
    concurrency = min(profile.concurrency, CPU_CAPS.concurrency)
    return LoadProfile(
        input_len=min(profile.input_len, CPU_CAPS.input_len),
        output_len=min(profile.output_len, CPU_CAPS.output_len),
        concurrency=concurrency,
        num_prompts=min(profile.num_prompts, 2 * concurrency),
        request_rate=profile.request_rate,
    )


def find_artifact(build_dir: Path) -> Path:
    """The `qpipe` target inside the build stage's output (its own subdirectory, or the root)."""
    from qpipe.serve.artifact import ARTIFACT_MARKER

    for candidate in (build_dir / "qpipe", build_dir):
        if (candidate / ARTIFACT_MARKER).is_file():
            return candidate
    raise StageError(
        f"bench: the build output {build_dir} holds no qpipe artifact ({ARTIFACT_MARKER}); add "
        "'qpipe' to build.targets, or set bench.endpoint to benchmark another server"
    )


def evaluate_gates(config: BenchConfig, summaries: dict[str, dict]) -> GateVerdict:
    """Every profile must meet every threshold the recipe sets; failed requests always fail."""
    failures: list[str] = []
    checked: dict[str, MetricValue] = {}
    limits = (
        ("output_throughput", config.min_output_throughput, +1, "tok/s"),
        ("p99_ttft_ms", config.max_ttft_p99_ms, -1, "ms"),
        ("p99_tpot_ms", config.max_tpot_p99_ms, -1, "ms"),
        ("request_goodput", config.min_goodput, +1, "req/s"),
    )
    for label, summary in summaries.items():
        if summary["failed"]:
            failures.append(
                f"{label}: {summary['failed']} requests failed ({summary['failed_reasons']})"
            )
        for metric, limit, direction, unit in limits:
            if limit is None:
                continue
            value = float(summary[metric] or 0.0)
            checked[f"{label}.{metric}"] = value
            if (value < limit) if direction > 0 else (value > limit):
                word = "below the minimum" if direction > 0 else "above the maximum"
                failures.append(f"{label}: {metric} {value:.2f} {unit} is {word} {limit:g} {unit}")
    return GateVerdict(passed=not failures, failures=tuple(failures), checked=checked)


class BenchStage(Stage):
    name = "bench"
    version = 1
    needs = ("build",)

    def section(self, recipe: Recipe) -> BaseModel | None:
        return recipe.bench

    def key_extras(self, recipe: Recipe) -> dict[str, str]:
        from qpipe.bench.history import hardware_string

        # NOTE: throughput is a property of the box: another machine is another measurement.
        return {"hardware": hardware_string()}

    def run(self, ctx: StageContext) -> StageResult:
        import asyncio

        import httpx

        from qpipe.bench.client import Target, served_model
        from qpipe.bench.dataset import load_tokenizer
        from qpipe.bench.metrics import validated_slos
        from qpipe.bench.runner import BenchError, BenchOptions, run_benchmark
        from qpipe.bench.server_process import BuiltinServer, ServerStartError

        config = ctx.recipe.bench
        assert config is not None
        if config.min_goodput is not None and not config.goodput:
            raise StageError(
                "bench.min_goodput needs SLOs to count good requests: set bench.goodput "
                "(e.g. {ttft: 500, tpot: 50}, in ms)"
            )
        build_dir = ctx.inputs["build"]
        try:
            tokenizer = load_tokenizer(tokenizer_dir(build_dir))
            options = BenchOptions(goodput=validated_slos(config.goodput))
            if config.endpoint is not None:
                target = Target(config.endpoint, asyncio.run(served_model(config.endpoint)).id)
                levels = run_benchmark(target, list(config.profiles), options, tokenizer)
                return self._report(ctx, config, target, options, levels, scaled=False)
            artifact = find_artifact(build_dir)
            server_args = dict(config.server_args)
            server_args.setdefault("device", _default_device())
            on_cpu = server_args["device"] == "cpu"
            profiles = [scaled_for_cpu(p) if on_cpu else p for p in config.profiles]
            with BuiltinServer(artifact, ctx.out_dir / "server.log", server_args) as server:
                target = Target(server.base_url, asyncio.run(served_model(server.base_url)).id)
                levels = run_benchmark(target, profiles, options, tokenizer)
            return self._report(ctx, config, target, options, levels, scaled=on_cpu)
        except ServerStartError as exc:
            raise StageError(f"bench: the built-in server failed: {exc}") from exc
        except (BenchError, httpx.HTTPError, ValueError) as exc:
            raise StageError(f"bench: {exc}") from exc

    def _report(
        self,
        ctx: StageContext,
        config: BenchConfig,
        target: Target,
        options: BenchOptions,
        levels: list[LevelResult],
        scaled: bool,
    ) -> StageResult:
        from qpipe.bench.history import History, hardware_string, history_path
        from qpipe.bench.plots import write_plots
        from qpipe.bench.regression import compare
        from qpipe.store.local import default_home

        with (ctx.out_dir / "results.jsonl").open("w") as f:
            for level in levels:
                f.write(json.dumps(level.to_json(target, options, None)) + "\n")
        write_plots(levels, ctx.out_dir / "plots")
        summaries = {lv.profile_label(options.dataset): lv.metrics.summary() for lv in levels}
        gate = evaluate_gates(config, summaries)

        history = History(history_path(ctx.store.local_root or default_home()))
        alias = artifact_alias(ctx.inputs["build"], ctx.recipe)
        hardware = hardware_string()
        regressions: list[str] = []
        run_ids = []
        acceptable = True
        for label, summary in summaries.items():
            run_id = history.record(alias, hardware, label, summary)
            comparison = compare(history, history.get(run_id))
            regressions += [f"{label}: {line}" for line in comparison.describe()]
            acceptable &= comparison.acceptable
            run_ids.append(run_id)
        if gate.passed and acceptable:
            for run_id in run_ids:
                history.accept(run_id)
        gate = _with_regressions(config, gate, regressions)

        (ctx.out_dir / "summary.json").write_text(
            json.dumps(
                {
                    "alias": alias,
                    "hardware": hardware,
                    "endpoint": target.base_url if config.endpoint else "built-in server",
                    "scaled_for_cpu": scaled,
                    "profiles": summaries,
                    "regressions": regressions,
                    "history_runs": run_ids,
                },
                indent=2,
            )
        )
        metrics: dict[str, MetricValue] = {
            "scaled_for_cpu": scaled,
            "regressions": "; ".join(regressions),
        }
        for label, summary in summaries.items():
            for name in STAGE_METRICS:
                metrics[f"{label}.{name}"] = summary[name]  # type: ignore[assignment]
        return StageResult(metrics=metrics, gate=gate)


def _with_regressions(
    config: BenchConfig, gate: GateVerdict, regressions: list[str]
) -> GateVerdict:
    """Regressions against the accepted baseline fail the gate only when the recipe asks
    (bench.fail_on_regression); otherwise each is a warning on stderr: a slower run on a shared
    box is information, but it must not pass in silence."""
    from rich.markup import escape

    from qpipe.console import console

    if config.fail_on_regression:
        failures = tuple(f"regressed: {line}" for line in regressions)
        return GateVerdict(gate.passed and not failures, gate.failures + failures, gate.checked)
    for line in regressions:
        console.print(
            f"[yellow]warning: bench regressed against the accepted baseline: {escape(line)} "
            "(set bench.fail_on_regression: true to fail the run on it)[/]",
            highlight=False,
            soft_wrap=True,
        )
    return gate


def artifact_alias(build_dir: Path, recipe: Recipe) -> str:
    """The engine alias the build stage recorded (`{model}-{arch}-{quant}-tp{N}`): history series
    follow it across rebuilds of the same recipe; the recipe name when the build has none."""
    from qpipe.stages.build import BUILD_JSON

    try:
        return str(json.loads((build_dir / BUILD_JSON).read_text())["alias"])
    except (OSError, ValueError, KeyError):
        return recipe.name


def tokenizer_dir(build_dir: Path) -> Path:
    """The build output directory (or target subdirectory) that holds tokenizer files."""
    for candidate in (build_dir / "qpipe", build_dir, *sorted(build_dir.iterdir())):
        if (candidate / "tokenizer_config.json").is_file() or (
            candidate / "tokenizer.json"
        ).is_file():
            return candidate
    raise StageError(f"bench: no tokenizer files in the build output {build_dir}")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
