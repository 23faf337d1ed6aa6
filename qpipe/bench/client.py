"""The async streaming client: sends prompts to an OpenAI-compatible server at a request rate
under a concurrency cap, and times every streamed chunk.

Timing follows `vllm bench serve`: TTFT is the time to the first chunk that carries `choices` (even
with empty text: servers send the first token's chunk before detokenizing it to anything), ITL the
gaps between later `choices` chunks, latency the time to the end of the stream. Token counts come
from the server's `usage` (asked for with `stream_options.include_usage`) or, when it sends none,
from the tokenizer — never from the number of chunks, which servers are free to batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from qpipe.bench.dataset import BenchPrompt, Tokenizer, count_tokens


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    chat: bool = False
    ignore_eos: bool = True
    read_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return self.base_url.rstrip("/") + path


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    output_len: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""


@dataclass(frozen=True)
class LoadResult:
    results: list[RequestResult]
    duration_s: float


class StreamError(Exception):
    """A stream that ended wrongly; the message is the failure reason recorded for the request."""


def request_body(target: Target, prompt: BenchPrompt) -> dict[str, object]:
    body: dict[str, object] = {
        "model": target.model,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    return body


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    prompt: BenchPrompt,
    tokenizer: Tokenizer | None = None,
) -> RequestResult:
    """One streamed request; never raises: a failure is a result with its reason."""
    result = RequestResult(prompt_len=prompt.prompt_len)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(target.request_timeout_s):
            await _stream(client, target, prompt, result, start)
    except StreamError as exc:
        result.error = str(exc)
    except TimeoutError:
        result.error = f"request timeout: no complete answer within {target.request_timeout_s:g}s"
    except httpx.ReadTimeout:
        result.error = f"read timeout: no data for {target.read_timeout_s:g}s"
    except httpx.ConnectError as exc:
        result.error = f"connect error: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        result.error = f"connection dropped mid-stream: {str(exc) or type(exc).__name__}"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    else:
        result.success = True
        if result.output_len is None and tokenizer is not None:
            result.output_len = count_tokens(tokenizer, result.generated_text)
    return result


async def _stream(
    client: httpx.AsyncClient,
    target: Target,
    prompt: BenchPrompt,
    result: RequestResult,
    start: float,
) -> None:
    body = request_body(target, prompt)
    async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise StreamError(f"HTTP {response.status_code}: {detail}")
        last = start
        first_chunk = True
        done = False
        async for payload in _sse_data(response.aiter_lines()):
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError as exc:
                raise StreamError(f"malformed event: {payload[:80]!r} ({exc.msg})") from exc
            if not isinstance(chunk, dict):
                raise StreamError(f"malformed event: {payload[:80]!r} (not a JSON object)")
            if "error" in chunk:
                raise StreamError(f"server error mid-stream: {chunk['error']}")
            usage = chunk.get("usage")
            if usage:
                result.output_len = usage.get("completion_tokens", result.output_len)
                result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
            choices = chunk.get("choices")
            if choices:
                now = time.perf_counter()
                if first_chunk:
                    result.ttft = now - start
                    first_chunk = False
                else:
                    result.itl.append(now - last)
                last = now
                result.generated_text += _choice_text(choices[0], target.chat)
        if not done:
            raise StreamError("stream ended without [DONE] (cut by a proxy or the server)")
        if first_chunk:
            raise StreamError("never received a chunk to time TTFT (no event carried `choices`)")
        result.latency = time.perf_counter() - start


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream (comments and blank lines skipped)."""
    async for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def _choice_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def arrival_gaps(num: int, request_rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: all at once for an infinite rate, else the first at
    once and gamma-distributed gaps with mean 1/rate between the others (burstiness 1 is a Poisson
    process; lower is burstier), as vLLM's benchmark_serving sends them. A wait before the first
    one would count in the duration with no request in flight, lowering every throughput."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [0.0, *(rng.gammavariate(burstiness, scale) for _ in range(num - 1))][:num]


async def run_load(
    target: Target,
    prompts: list[BenchPrompt],
    concurrency: int,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> LoadResult:
    """Send every prompt, at most `concurrency` in flight; the duration spans first send to last
    answer, which is what the throughputs divide by."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(connect=10.0, read=target.read_timeout_s, write=30.0, pool=None)
    slots = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(prompt: BenchPrompt) -> RequestResult:
            async with slots:
                result = await send_request(client, target, prompt, tokenizer)
            if on_done is not None:
                on_done(result)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(
            prompts, arrival_gaps(len(prompts), request_rate, burstiness, seed), strict=True
        ):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)
        return LoadResult(list(results), time.perf_counter() - start)


@dataclass(frozen=True)
class ServedModel:
    id: str
    root: str | None  # where the server loaded it from (vLLM and qpipe fill this in)


async def served_model(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> ServedModel:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model NAME")
    return ServedModel(str(models[0]["id"]), models[0].get("root"))
