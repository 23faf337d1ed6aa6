"""`qpipe bench`: throughput check of any OpenAI-compatible server, its history and regressions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from qpipe.bench.config import LoadProfile
from qpipe.console import error, out

if TYPE_CHECKING:
    from qpipe.bench.client import Target
    from qpipe.bench.history import HistoryRow
    from qpipe.bench.runner import BenchOptions, LevelResult

bench_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Benchmark an OpenAI-compatible endpoint (vLLM `bench serve` figures); history; compare.",
)

StoreOption = Annotated[
    Path | None,
    typer.Option(
        "--store",
        help="Store holding bench/history.sqlite (default: $QPIPE_HOME or ~/.cache/qpipe).",
    ),
]


@bench_app.callback()
def bench(
    ctx: typer.Context,
    endpoint: Annotated[
        str | None, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8000")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model name to request (default: the first of /v1/models)")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="Comma-separated max concurrencies")] = "1,8,32",
    request_rate: Annotated[str, typer.Option(help="Requests/s, or inf (all at once)")] = "inf",
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrivals; 1 = Poisson")] = 1.0,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (random dataset)")] = 512,
    output_len: Annotated[int, typer.Option(help="Output tokens per request")] = 256,
    dataset: Annotated[str, typer.Option(help="random | FILE.jsonl | sharegpt.json")] = "random",
    num_prompts: Annotated[
        int | None, typer.Option(help="Prompts per level (default: 4 x concurrency, at least 8)")
    ] = None,
    goodput: Annotated[str | None, typer.Option(help="SLOs in ms, e.g. ttft:500,tpot:50")] = None,
    chat: Annotated[bool, typer.Option(help="Use /v1/chat/completions")] = False,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Tokenizer directory (default: the served model's directory)"),
    ] = None,
    result_file: Annotated[
        Path | None, typer.Option(help="Write one JSON object per level (JSON lines)")
    ] = None,
    plot_dir: Annotated[Path | None, typer.Option(help="Write PNG plots here")] = None,
    alias: Annotated[
        str | None, typer.Option(help="History name of what is benched (default: the model name)")
    ] = None,
    hardware: Annotated[
        str | None, typer.Option(help="History hardware label (default: this machine's CPU/GPU)")
    ] = None,
    store: StoreOption = None,
    record: Annotated[bool, typer.Option(help="Record the results in the history")] = True,
    accept: Annotated[bool, typer.Option(help="Record them as an accepted baseline")] = False,
    repeats: Annotated[int, typer.Option(help="Run every level this many times (noise band)")] = 1,
    ignore_eos: Annotated[bool, typer.Option(help="Ask for exactly the output length")] = True,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up requests")] = 1,
    timeout: Annotated[
        float, typer.Option(help="Seconds without data before a request fails")
    ] = 60.0,
    seed: int = 0,
    api_key: Annotated[
        str | None, typer.Option(envvar="QPIPE_API_KEY", help="Send 'Authorization: Bearer KEY'")
    ] = None,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if endpoint is None:
        out.print(ctx.get_help())
        raise typer.Exit(2)
    import asyncio

    from qpipe.bench.client import Target, served_model
    from qpipe.bench.dataset import load_tokenizer
    from qpipe.bench.metrics import parse_goodput
    from qpipe.bench.runner import BenchError, BenchOptions, run_benchmark

    try:
        levels = [_int(c, "--concurrency") for c in concurrency.split(",") if c.strip()]
        if not levels:
            raise ValueError(f"--concurrency {concurrency!r}: give at least one level, e.g. 1,8,32")
        if repeats < 1:
            raise ValueError(f"--repeats {repeats}: run every level at least once (>= 1)")
        if timeout <= 0:
            raise ValueError(f"--timeout {timeout:g}: give the seconds to wait for data, > 0")
        rate = None if request_rate.strip().lower() == "inf" else float(request_rate)
        options = BenchOptions(dataset, burstiness, parse_goodput(goodput), seed, warmup)
        profiles = [
            LoadProfile(
                input_len=input_len,
                output_len=output_len,
                concurrency=c,
                num_prompts=max(8, 4 * c) if num_prompts is None else num_prompts,
                request_rate=rate,
            )
            for c in levels
        ] * repeats
    except ValidationError as exc:  # a LoadProfile field is the option of the same name
        raise typer.BadParameter(
            "; ".join(
                f"--{str(e['loc'][0]).replace('_', '-')} {e['input']}: {e['msg'].lower()}"
                for e in exc.errors()
            )
        ) from exc
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if model is None:
        try:
            served = asyncio.run(served_model(endpoint, api_key))
        except Exception as exc:
            raise error(
                f"cannot list models at {endpoint}/v1/models ({exc}); is it up? or pass --model",
                code=2,
            ) from exc
        model = served.id
        # NOTE: a server on this machine names the directory it loaded; its tokenizer is there.
        if tokenizer is None and served.root and Path(served.root).is_dir():
            tokenizer = Path(served.root)
    if tokenizer is None and Path(model).is_dir():
        tokenizer = Path(model)
    try:
        loaded_tokenizer = load_tokenizer(tokenizer) if tokenizer else None
    except ValueError as exc:
        raise error(str(exc), code=2) from exc
    target = Target(
        endpoint, model, chat=chat, ignore_eos=ignore_eos, read_timeout_s=timeout, api_key=api_key
    )
    try:
        results = run_benchmark(target, profiles, options, loaded_tokenizer)
    except BenchError as exc:
        raise error(str(exc), code=2) from exc
    for level in results:
        print_level(level)
    if result_file is not None:
        write_results(result_file, results, target, options, tokenizer)
        out.print(f"results: {result_file}")
    if plot_dir is not None:
        from qpipe.bench.plots import write_plots

        for path in write_plots(results, plot_dir):
            out.print(f"plot: {path}")
    if record:
        _record(results, store, alias or model, hardware, dataset, accept)


def _record(
    results: list[LevelResult],
    store: Path | None,
    alias: str,
    hardware: str | None,
    dataset: str,
    accept: bool,
) -> None:
    """Every level into the history; with `accept`, as baselines unless `baseline_refusal` says
    otherwise, and then exit 1 naming them: a refused --accept must not pass as a good CI run."""
    from qpipe.bench.history import History, hardware_string, history_path
    from qpipe.bench.regression import baseline_refusal

    history = History(history_path(store or default_store_dir()))
    hw = hardware or hardware_string()
    accepted: list[int] = []
    recorded: list[int] = []
    refused: list[str] = []
    for lv in results:
        summary, label = lv.metrics.summary(), lv.profile_label(dataset)
        refusal = baseline_refusal(summary) if accept else None
        run_id = history.record(alias, hw, label, summary, accept and refusal is None)
        (accepted if accept and refusal is None else recorded).append(run_id)
        if refusal is not None:
            refused.append(f"run {run_id} [{label}]: {refusal}")
    for state, ids in (("accepted baseline", accepted), ("recorded", recorded)):
        if ids:
            out.print(f"{state}: runs {', '.join(map(str, ids))} in {history.path}", markup=False)
    if refused:
        raise error(
            "not accepted as a baseline (a baseline needs every request to complete):\n  "
            + "\n  ".join(refused)
            + "\nthe failures are listed above; fix the server or lower the load, then run again"
        )


def write_results(
    path: Path,
    results: list[LevelResult],
    target: Target,
    options: BenchOptions,
    tokenizer: Path | None,
) -> None:
    """One JSON object per level, one per line (a single level makes a plain JSON file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_id = str(tokenizer) if tokenizer else None
    with path.open("w") as f:
        for level in results:
            f.write(json.dumps(level.to_json(target, options, tokenizer_id)) + "\n")


def default_store_dir() -> Path:
    """The pipeline's default local store ($QPIPE_HOME or ~/.cache/qpipe)."""
    from qpipe.store.local import default_home

    return default_home()


def print_level(level: LevelResult) -> None:
    """The figures of one level, laid out like `vllm bench serve` prints them."""
    s = level.metrics.summary()
    table = Table(title=f"Serving benchmark: concurrency {level.profile.concurrency}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration"]),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Request goodput (req/s)", s["request_goodput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", s[f"{stat}_{name}_ms"]))
    for name, value in rows:
        if value is not None:
            table.add_row(name, f"{value:.2f}" if isinstance(value, float) else str(value))
    for reason, count in level.metrics.failed_reasons.items():
        table.add_row(f"[red]failed: {reason}", str(count))
    out.print(table)


@bench_app.command()
def history(
    alias: Annotated[str | None, typer.Argument(help="Only this artifact alias")] = None,
    store: StoreOption = None,
    limit: int = 50,
) -> None:
    """Recorded benchmark runs, newest first."""
    from qpipe.bench.history import History, history_path

    rows = History(history_path(store or default_store_dir())).runs(alias, limit)
    table = Table(title="bench history")
    for column in (
        "id",
        "time",
        "alias",
        "hardware",
        "profile",
        "out tok/s",
        "p99 TTFT ms",
        "p99 TPOT ms",
        "failed",
        "accepted",
    ):
        table.add_column(column)
    for row in rows:
        m = row.metrics
        table.add_row(
            str(row.id),
            row.created,
            row.alias,
            row.hardware,
            row.profile,
            f"{m.get('output_throughput', 0):.1f}",
            f"{m.get('p99_ttft_ms', 0):.1f}",
            f"{m.get('p99_tpot_ms', 0):.1f}",
            str(m.get("failed", 0)),
            "yes" if row.accepted else "",
        )
    out.print(table)


@bench_app.command()
def compare(
    run: Annotated[
        list[int] | None,
        typer.Option(help="Run id(s) to check (default: the newest of each series)"),
    ] = None,
    alias: Annotated[str | None, typer.Option(help="Only this artifact alias")] = None,
    store: StoreOption = None,
    k: Annotated[float, typer.Option(help="Noise band = k x relative stddev of repeats")] = 3.0,
    floor: Annotated[float, typer.Option(help="Smallest noise band (relative)")] = 0.05,
    window: Annotated[int, typer.Option(help="Accepted runs that measure the noise")] = 5,
    accept: Annotated[bool, typer.Option(help="Accept the runs that do not regress")] = False,
) -> None:
    """Flag regressions against the last accepted baseline of the same alias/hardware/profile.
    Exits 1 when any run regressed, or --accept refused one (failed requests)."""
    from qpipe.bench.history import History, history_path
    from qpipe.bench.regression import NoiseBand
    from qpipe.bench.regression import compare as compare_run

    hist = History(history_path(store or default_store_dir()))
    band = NoiseBand(k, floor, window)
    if run:
        try:
            candidates = [hist.get(run_id) for run_id in run]
        except KeyError as exc:
            raise error(str(exc.args[0]), code=2) from exc
    else:
        newest: dict[tuple[str, str, str], HistoryRow] = {}
        for row in reversed(hist.runs(alias, limit=-1)):
            newest[(row.alias, row.hardware, row.profile)] = row
        candidates = list(newest.values())
    if not candidates:
        raise error(
            f"no benchmark runs in {hist.path}; run `qpipe bench --endpoint URL` first", code=2
        )
    failed = False
    for row in candidates:
        result = compare_run(hist, row, band)
        head = escape(f"run {row.id} [{row.alias} | {row.hardware} | {row.profile}]")
        if result.baseline is None:
            out.print(f"{head}: no accepted baseline yet")
        elif result.regressed:
            failed = True
            out.print(f"[red]{head}: REGRESSION vs run {result.baseline.id}")
            for line in result.describe():
                out.print(f"  {line}", markup=False)
        else:
            out.print(f"[green]{head}: within noise of run {result.baseline.id}")
        if accept and result.acceptable:
            hist.accept(row.id)
            out.print(f"  accepted run {row.id}")
        elif accept and not result.regressed:  # no baseline yet, and unfit to be one
            failed = True
            out.print(
                f"  [red]not accepted: {result.refusal}[/]; a baseline needs every request to "
                "complete: fix the server or lower the load and bench again"
            )
    if failed:
        raise typer.Exit(1)


def _int(text: str, option: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {text!r} is not an integer") from exc
    if value < 1:
        raise ValueError(f"{option}: {value} must be >= 1")
    return value
