"""The bench client and CLI against a small OpenAI-compatible server with scripted delays and
faults.

The server streams two tokens per chunk and reports `usage`, so a client that counted chunks would
report half the tokens: the token totals below would catch it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from typer.testing import CliRunner

from qpipe.bench.cli import bench_app
from qpipe.bench.client import RequestResult, Target, arrival_gaps, run_load, send_request
from qpipe.bench.config import LoadProfile
from qpipe.bench.dataset import BenchPrompt, prompt_sets, random_prompts
from qpipe.bench.history import History, history_path
from qpipe.bench.metrics import compute_metrics, parse_goodput
from qpipe.bench.runner import BenchError, BenchOptions, run_benchmark

# The decode time (7 chunk gaps, 560 ms) is well above the scheduling delays a loaded 2-core CI
# machine adds (up to ~140 ms seen), so a TTFT timed at the end of the stream cannot pass for one
# timed at the first chunk.
TTFT_S = 0.2
STEP_S = 0.04  # per token; two tokens per chunk
TOKENS_PER_CHUNK = 2
GAPS_MS = 7 * TOKENS_PER_CHUNK * STEP_S * 1000  # between the first and the last of 8 chunks
EMPTY_FIRST_PAUSE_S = 0.4


class WordTokenizer:
    """Whitespace tokenizer: enough for prompt lengths and counting `tok` words."""

    vocab_size = 1000
    all_special_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % self.vocab_size for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class ScriptedServer:
    """`/{mode}/v1/...`: `ok`, `nousage`, `flaky` (every 4 requests: ok, HTTP 500, dropped
    mid-stream, cut without [DONE]), `stall` (one chunk, then silence), `keepalive` (comments),
    `emptyfirst` (a first chunk with empty text, the text after a pause, as qpipe's server streams
    a special first token), `nochoices` (only a usage event, then [DONE])."""

    def __init__(self) -> None:
        self.counter = itertools.count()
        self.received: dict[str, list[str]] = {}  # the prompts each mode was sent
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{mode}/v1/models", self.models)
        app.router.add_post("/{mode}/v1/completions", self.complete)
        app.router.add_post("/{mode}/v1/chat/completions", self.complete)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(app), self.loop).result(10)

    async def _serve(self, app: web.Application) -> None:
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    def stop(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted-model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        self.received.setdefault(mode, []).append(prompt)
        turn = next(self.counter) % 4 if mode == "flaky" else 0
        if turn == 1:
            return web.json_response({"error": {"message": "engine overloaded"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "garbage":
            await response.write(b"data: {oops\n\n")
            return response
        if mode == "keepalive":
            while True:
                await response.write(b": keep-alive\n\n")
                await asyncio.sleep(0.1)
        await asyncio.sleep(TTFT_S)
        if mode == "nochoices":
            usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
            await response.write(b"data: [DONE]\n\n")
            return response
        if mode == "emptyfirst":
            await response.write(f"data: {json.dumps({'choices': [{'text': ''}]})}\n\n".encode())
            await asyncio.sleep(EMPTY_FIRST_PAUSE_S)
        for index in range(body["max_tokens"] // TOKENS_PER_CHUNK):
            if index > 0:
                await asyncio.sleep(STEP_S * TOKENS_PER_CHUNK)
            text = "tok " * TOKENS_PER_CHUNK
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if mode == "stall":
                await asyncio.sleep(30)
            if turn == 2 and index == 2:
                request.transport.close()  # the connection dies mid-stream
                return response
        if turn == 3:
            await response.write_eof()  # a proxy ends the stream early but cleanly
            return response
        if mode != "nousage":
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": body["max_tokens"],
                "total_tokens": len(prompt.split()) + body["max_tokens"],
            }
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    scripted.start()
    yield scripted
    scripted.stop()


def _prompts(num: int, output_len: int = 16) -> list[BenchPrompt]:
    return random_prompts(WordTokenizer(), num, 32, output_len)


def test_figures_are_consistent_with_the_scripted_server(server: ScriptedServer) -> None:
    target = Target(server.url("ok"), "scripted-model")
    start = time.perf_counter()
    load = asyncio.run(run_load(target, _prompts(16), concurrency=4))
    wall = time.perf_counter() - start
    m = compute_metrics(load, parse_goodput("ttft:5000,tpot:1000"))  # SLOs every request meets
    s = m.summary()
    assert (m.completed, m.failed) == (16, 0)
    assert m.total_output_tokens == 16 * 16  # from usage, not the 8 chunks per request
    assert m.total_input_tokens == 16 * 32
    assert s["output_throughput"] == pytest.approx(m.total_output_tokens / m.duration)
    assert m.total_output_tokens / wall == pytest.approx(s["output_throughput"], rel=0.15)
    assert s["request_throughput"] == pytest.approx(16 / m.duration)
    assert TTFT_S * 1000 <= s["mean_ttft_ms"] < TTFT_S * 1000 + GAPS_MS / 2
    assert s["p99_ttft_ms"] >= s["median_ttft_ms"]
    # 7 chunk gaps of 2 tokens each spread over 15 tokens after the first chunk
    expected_tpot = GAPS_MS / 15
    assert s["median_tpot_ms"] == pytest.approx(expected_tpot, rel=0.5)
    assert s["median_itl_ms"] == pytest.approx(TOKENS_PER_CHUNK * STEP_S * 1000, rel=0.5)
    assert s["mean_e2el_ms"] == pytest.approx(s["mean_ttft_ms"] + GAPS_MS, rel=0.3)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert parse_goodput("ttft:1")  # an SLO nobody meets gives goodput 0
    assert compute_metrics(load, parse_goodput("ttft:1")).request_goodput == 0.0


def test_chat_and_tokenizer_counts_when_the_server_sends_no_usage(server: ScriptedServer) -> None:
    target = Target(server.url("nousage"), "scripted-model", chat=True)
    load = asyncio.run(run_load(target, _prompts(4, 8), concurrency=2, tokenizer=WordTokenizer()))
    assert compute_metrics(load).total_output_tokens == 4 * 8
    bare = asyncio.run(run_load(target, _prompts(2, 8), concurrency=2))
    with pytest.raises(ValueError, match="--tokenizer"):
        compute_metrics(bare)


def test_errors_and_dropped_streams_are_counted_with_reasons(server: ScriptedServer) -> None:
    target = Target(server.url("flaky"), "scripted-model", read_timeout_s=5)
    load = asyncio.run(run_load(target, _prompts(8), concurrency=2))
    m = compute_metrics(load)
    assert m.completed + m.failed == 8
    assert m.failed_reasons == {
        "HTTP 500": 2,
        "connection dropped mid-stream": 2,
        "stream ended without [DONE] (cut by a proxy or the server)": 2,
    }
    assert any("engine overloaded" in e for e in m.errors)
    assert m.total_output_tokens == 2 * 16  # failed requests add no tokens
    garbage = asyncio.run(run_load(Target(server.url("garbage"), "m"), _prompts(2), 2))
    assert compute_metrics(garbage).failed_reasons == {"malformed event": 2}


def test_ttft_is_the_first_chunk_with_choices_even_with_empty_text(server: ScriptedServer) -> None:
    load = asyncio.run(run_load(Target(server.url("emptyfirst"), "m"), _prompts(2), 2))
    m = compute_metrics(load)
    assert (m.completed, m.failed) == (2, 0)
    for r in load.results:
        assert TTFT_S <= r.ttft < TTFT_S + EMPTY_FIRST_PAUSE_S / 2  # not at the first text
        assert len(r.itl) == 8  # every chunk after the empty first one, the pause included
        assert r.itl[0] >= EMPTY_FIRST_PAUSE_S
        assert r.ttft + sum(r.itl) == pytest.approx(r.latency, abs=0.05)


def test_a_stream_without_choices_fails_instead_of_timing_ttft_zero(
    server: ScriptedServer,
) -> None:
    load = asyncio.run(run_load(Target(server.url("nochoices"), "m"), _prompts(2), 2))
    m = compute_metrics(load, parse_goodput("ttft:1"))
    assert (m.completed, m.failed, m.request_goodput) == (0, 2, 0.0)
    assert m.errors == ["never received a chunk to time TTFT (no event carried `choices`)"] * 2


def test_a_dropped_stream_without_a_message_names_the_exception() -> None:
    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("")

    async def send() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(drop)) as client:
            return await send_request(client, Target("http://x", "m"), _prompts(1)[0])

    assert asyncio.run(send()).error == "connection dropped mid-stream: ReadError"


def test_stalled_and_trickling_servers_fail_in_bounded_time(server: ScriptedServer) -> None:
    start = time.perf_counter()
    stalled = asyncio.run(
        run_load(Target(server.url("stall"), "m", read_timeout_s=0.5), _prompts(3), concurrency=3)
    )
    trickle = asyncio.run(
        run_load(
            Target(server.url("keepalive"), "m", read_timeout_s=5, request_timeout_s=0.8),
            _prompts(2),
            concurrency=2,
        )
    )
    refused = asyncio.run(run_load(Target("http://127.0.0.1:9", "m"), _prompts(2), concurrency=2))
    assert time.perf_counter() - start < 8
    assert compute_metrics(stalled).failed_reasons == {"read timeout": 3}
    assert compute_metrics(trickle).failed_reasons == {"request timeout": 2}
    assert compute_metrics(refused).failed_reasons == {"connect error": 2}


def test_request_rate_spaces_arrivals(server: ScriptedServer) -> None:
    gaps = arrival_gaps(4000, request_rate=10.0, burstiness=1.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    bursty = arrival_gaps(4000, request_rate=10.0, burstiness=0.25, seed=1)
    assert _cv(bursty) == pytest.approx(2.0, rel=0.2) and _cv(gaps) == pytest.approx(1.0, rel=0.1)
    assert arrival_gaps(3, None, 1.0, 0) == [0.0, 0.0, 0.0]
    # the first request goes at once: a wait before it would be a duration with nothing to measure
    assert (
        gaps[0] == 0.0 and all(gap > 0 for gap in gaps[1:]) and arrival_gaps(0, 8.0, 1.0, 0) == []
    )
    load = asyncio.run(
        run_load(Target(server.url("ok"), "m"), _prompts(8, 2), 8, request_rate=8.0, seed=3)
    )
    expected = sum(arrival_gaps(8, 8.0, 1.0, 3))
    assert load.duration_s >= expected


def test_warm_up_failure_names_the_endpoint(server: ScriptedServer) -> None:
    target = Target("http://127.0.0.1:9", "m", read_timeout_s=2)
    profile = LoadProfile(input_len=8, output_len=4, concurrency=1, num_prompts=1)
    with pytest.raises(BenchError, match="warm-up request to http://127.0.0.1:9"):
        run_benchmark(target, [profile], BenchOptions(), WordTokenizer(), show_progress=False)


def test_levels_repeats_and_the_warm_up_send_their_own_dataset_prompts(
    server: ScriptedServer, tmp_path: Path
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(20)))
    profiles = [
        LoadProfile(input_len=8, output_len=4, concurrency=c, num_prompts=4) for c in (1, 2)
    ] * 2  # two repeats
    options = BenchOptions(dataset=str(dataset), seed=5)
    target = Target(server.url("dataset"), "m")
    run_benchmark(target, profiles, options, WordTokenizer(), show_progress=False)
    sent = server.received["dataset"]
    assert len(sent) == 1 + 4 * 4 and len(set(sent)) == len(sent)  # the warm-up's is sent first


def test_dataset_prompts_move_with_the_seed_and_a_small_dataset_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(6)))
    pair = [LoadProfile(num_prompts=3)] * 2

    def texts(profiles: list[LoadProfile], seed: int) -> list[list[str]]:
        return [[p.prompt for p in s] for s in prompt_sets(str(dataset), None, profiles, seed)]

    first, second = texts(pair, seed=0)
    assert not set(first) & set(second) and not caplog.records
    assert texts(pair, seed=1) != [first, second]
    assert [len(s) for s in texts(pair * 2, seed=0)] == [3] * 4  # dealt again from the start...
    assert "holds 6 prompts but this run sends 12" in caplog.text  # ...and said so


def test_cli_writes_results_plots_and_history(server: ScriptedServer, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": f"question {i} " * 5}) for i in range(3)))
    args = [
        "--endpoint", server.url("ok"), "--concurrency", "1,4", "--output-len", "8",
        "--dataset", str(dataset), "--num-prompts", "4", "--goodput", "ttft:1000",
        "--result-file", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path / "plots"),
        "--store", str(tmp_path / "store"), "--alias", "scripted", "--hardware", "test-box",
    ]  # fmt: skip
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    levels = [json.loads(line) for line in (tmp_path / "r.json").read_text().splitlines()]
    assert [lv["max_concurrency"] for lv in levels] == [1, 4]
    for level in levels:
        assert level["model_id"] == "scripted-model"  # from /v1/models
        assert level["completed"] == 4 and level["failed"] == 0
        assert level["total_output_tokens"] == 4 * 8
        assert level["request_goodput"] == pytest.approx(level["request_throughput"])
        for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "std_ttft_ms"):
            assert level[key] > 0
    assert levels[1]["request_throughput"] > levels[0]["request_throughput"] * 2
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == [
        "throughput_vs_concurrency.png",
        "tpot_distribution.png",
        "ttft_distribution.png",
    ]
    assert all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in plots)
    rows = History(history_path(tmp_path / "store")).runs("scripted")
    assert {r.profile for r in rows} == {
        "prompts.jsonl:out8:c1:rateinf:n4",
        "prompts.jsonl:out8:c4:rateinf:n4",
    }
    assert all(r.hardware == "test-box" and not r.accepted for r in rows)
    listing = CliRunner().invoke(
        bench_app, ["history", "scripted", "--store", str(tmp_path / "store")]
    )
    assert listing.exit_code == 0 and listing.output.count("test-box") == 2


def _cv(values: list[float]) -> float:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return var**0.5 / mean


def test_cli_names_a_tokenizer_path_that_holds_no_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path, expected in (
        (tmp_path / "nope", "not a directory"),
        (tmp_path / "empty", "no tokenizer could be loaded from it"),
    ):
        args = ["--endpoint", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(path)]
        result = CliRunner().invoke(bench_app, [*args, "--store", str(tmp_path / "store")])
        assert result.exit_code == 2, result.output
        assert f"tokenizer {path}: {expected}" in result.output
        assert "--tokenizer DIR" in result.output


def test_cli_names_the_option_of_a_load_value_out_of_range(tmp_path: Path) -> None:
    for option, value in (("--request-rate", "-1"), ("--input-len", "0"), ("--num-prompts", "0")):
        args = ["--endpoint", "http://127.0.0.1:9", "--model", "m", option, value]
        result = CliRunner().invoke(bench_app, [*args, "--store", str(tmp_path / "store")])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert f"{option} {value}" in text and "greater than 0" in text
        assert "errors.pydantic.dev" not in text


def test_cli_refuses_options_that_would_run_nothing_or_fail_later(tmp_path: Path) -> None:
    cases = [
        (["--repeats", "0"], "--repeats 0: run every level at least once (>= 1)"),
        (["--concurrency", ","], "--concurrency ',': give at least one level"),
        (["--timeout", "0"], "--timeout 0: give the seconds to wait for data, > 0"),
        (["--timeout", "-1"], "--timeout -1: give the seconds to wait for data, > 0"),
    ]
    for index, value in enumerate((0, "12", 1.5)):
        dataset = tmp_path / f"prompts{index}.jsonl"
        dataset.write_text(
            f'{{"prompt": "hi"}}\n{{"prompt": "q", "output_len": {json.dumps(value)}}}'
        )
        cases.append(
            (["--dataset", str(dataset)], f'{dataset}:2: "output_len" is {value!r}; give a whole')
        )
    for extra, expected in cases:
        args = ["--endpoint", "http://127.0.0.1:9", "--model", "m", *extra]
        result = CliRunner().invoke(bench_app, [*args, "--store", str(tmp_path / "store")])
        assert result.exit_code == 2, result.output
        assert expected in " ".join(result.output.split()), result.output
