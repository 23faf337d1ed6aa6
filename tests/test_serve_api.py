"""The built-in server's HTTP layer, over real HTTP against a real uvicorn and the real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from qpipe.serve.api import ServerSettings, build_app
from qpipe.serve.async_engine import (
    KEEP_ALIVE,
    AsyncLLMEngine,
    EngineUnavailableError,
    GenerationChunk,
    LoopMailbox,
    PendingChunks,
    QueueFullError,
)
from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.http_server import DrainingServer
from qpipe.serve.metrics import ServerMetrics
from qpipe.serve.prompt_encoder import PromptEncoder
from qpipe.serve.sampling_params import SamplingParams

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"


@dataclass
class RunningServer:
    url: str
    engine: LLMEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not shut down"

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        """Waits until the engine holds no request and every KV block is free."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if (
                stats.num_running == stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_total_blocks
            ):
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {self.engine.stats()}")


def start_server(
    checkpoint: Path,
    name: str = MODEL,
    api_key: str | None = API_KEY,
    max_queue: int | None = None,
    keepalive_interval_s: float = 15.0,
    drain_timeout_s: float | None = None,
    **engine_kwargs: object,
) -> RunningServer:
    engine_kwargs = {
        "dtype": "float32", "kv_cache_memory_gib": 0.05, "max_model_len": 256, **engine_kwargs
    }  # fmt: skip
    config = EngineConfig(model=str(checkpoint), **engine_kwargs)  # type: ignore[arg-type]
    async_engine = AsyncLLMEngine(
        lambda: LLMEngine(config), ServerMetrics(name), max_queue=max_queue
    )
    engine = async_engine.engine
    settings = ServerSettings(
        served_model_name=name,
        model_path=str(checkpoint),
        api_key=api_key,
        keepalive_interval_s=keepalive_interval_s,
    )
    server = DrainingServer(
        uvicorn.Config(
            build_app(async_engine, settings),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=drain_timeout_s,
        ),  # fmt: skip
        async_engine,
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_checkpoint, max_num_seqs=64)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_leaked_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on the shared server leaves it holding no request and no KV block."""
    yield
    if "tiny_server" in request.fixturenames:
        request.getfixturevalue("tiny_server").assert_idle()


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value}."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted({"model_name": MODEL, **labels}.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)


def sse_events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# ---- the engine thread's hand-over -------------------------------------------------------------


def test_chunks_a_slow_consumer_has_not_taken_arrive_as_one() -> None:
    """A stream whose reader lags gets every token since its last read in one chunk; a failure
    replaces what is pending and is not overwritten; a keep-alive waits only in an empty slot."""

    def chunk(text: str, token: int, **kw: object) -> GenerationChunk:
        fields: dict = {"logprobs": [{token: -0.5}], "finished": False, "finish_reason": None}
        fields |= {"num_prompt_tokens": 5, "num_cached_tokens": 0} | kw
        return GenerationChunk(text, [token], **fields)

    async def run() -> None:
        pending = PendingChunks()
        pending.put(chunk("Gr", 1, prompt_logprobs=[None, {9: -1.0}]))
        pending.put(chunk("ü", 2))
        pending.put(chunk("ße", 3, finished=True, finish_reason="length", num_cached_tokens=16))
        assert await pending.get() == GenerationChunk(
            "Grüße", [1, 2, 3], [{1: -0.5}, {2: -0.5}, {3: -0.5}], True, "length", 5, 16,
            prompt_logprobs=[None, {9: -1.0}],
        )  # fmt: skip
        failure = EngineUnavailableError("the engine failed")
        pending.put(chunk("a", 4))
        pending.put(failure)
        pending.put(chunk("b", 5))
        assert await pending.get() is failure

        quiet = PendingChunks()
        quiet.keep_alive()
        assert await quiet.get() is KEEP_ALIVE
        quiet.keep_alive()
        quiet.put(chunk("c", 6))  # a chunk replaces a keep-alive nobody took yet
        assert await quiet.get() == chunk("c", 6)
        quiet.put(chunk("d", 7))
        quiet.keep_alive()  # and a keep-alive never replaces a chunk
        assert await quiet.get() == chunk("d", 7)

    asyncio.run(run())


def test_chunks_posted_while_a_wake_up_is_on_its_way_ride_with_it() -> None:
    """The engine thread wakes a loop once for all the steps it posts before the loop takes them."""

    class CountingLoop(asyncio.SelectorEventLoop):
        wake_ups = 0

        def call_soon_threadsafe(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.wake_ups += 1
            return super().call_soon_threadsafe(*args, **kwargs)

    def chunk(text: str, token: int) -> GenerationChunk:
        return GenerationChunk(text, [token], None, False, None, 5, 0)

    loop = CountingLoop()
    try:
        pending, mailbox = PendingChunks(), LoopMailbox()
        mailbox.post(loop, [(pending, chunk("a", 1))])
        mailbox.post(loop, [(pending, chunk("b", 2))])  # the loop has not run since the first
        assert loop.wake_ups == 1
        assert loop.run_until_complete(pending.get()) == GenerationChunk(
            "ab", [1, 2], None, False, None, 5, 0
        )
        mailbox.post(loop, [(pending, chunk("c", 3))])  # all taken: this one wakes it again
        assert loop.wake_ups == 2
        assert loop.run_until_complete(pending.get()) == chunk("c", 3)
    finally:
        loop.close()


# ---- OpenAI API over HTTP ------------------------------------------------------------------------


def test_openai_client_completions_chat_and_streaming(tiny_server: RunningServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL

    prompt = "The quick brown fox jumps over the lazy dog and"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(tiny_server.engine.tokenizer.encode(prompt))
    assert full.choices[0].finish_reason == "length"

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "user", "content": "Hello there!"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 10
    chat_prompt = tiny_server.engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert chat.usage.prompt_tokens == len(chat_prompt["input_ids"])
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in chat_stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content
    tiny_server.assert_idle()


def test_sse_headers_and_done(tiny_server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = sse_events(lines)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_echo_logprobs_and_batch_prompts(tiny_server: RunningServer) -> None:
    url = f"{tiny_server.url}/v1/completions"
    base = {"model": MODEL, "prompt": "Numbers: one two three", "max_tokens": 24, "temperature": 0}
    full = httpx.post(url, json=base, headers=AUTH, timeout=30).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"greedy text too uniform to pick a stop string: {text!r}"
    cut = httpx.post(url, json={**base, "stop": [stop]}, headers=AUTH, timeout=30).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < 24

    kept = {**base, "stop": [stop], "include_stop_str_in_output": True}
    kept_text = httpx.post(url, json=kept, headers=AUTH, timeout=30).json()["choices"][0]["text"]
    assert kept_text == text[: text.index(stop) + len(stop)]
    # A token that stops the request (here: any token) leaves its text out, as in vLLM
    every = list(range(tiny_server.engine.vocab_size))
    first = httpx.post(url, json={**base, "max_tokens": 1}, headers=AUTH, timeout=30).json()
    for include, expected in ((False, ""), (True, first["choices"][0]["text"])):
        body = {**base, "stop_token_ids": every, "include_stop_str_in_output": include}
        reply = httpx.post(url, json=body, headers=AUTH, timeout=30).json()
        assert reply["choices"][0]["text"] == expected and expected == text[: len(expected)]
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == 1

    echo = httpx.post(url, json={**base, "echo": True}, headers=AUTH, timeout=30).json()
    assert echo["choices"][0]["text"] == base["prompt"] + text

    lp = httpx.post(url, json={**base, "logprobs": 3}, headers=AUTH, timeout=30).json()
    logprobs = lp["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == text
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values())), "greedy picks the most likely token"

    encode = tiny_server.engine.tokenizer.encode
    scored = {**base, "echo": True, "logprobs": 2}  # what lm-eval's loglikelihood requests send
    echoed = httpx.post(url, json=scored, headers=AUTH, timeout=30).json()["choices"][0]
    n = len(encode(base["prompt"]))
    lps = echoed["logprobs"]
    assert echoed["text"] == base["prompt"] + text and len(lps["tokens"]) == n + 24
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(v <= 0 and len(top) in (2, 3) for v, top in
               zip(lps["token_logprobs"][1:n], lps["top_logprobs"][1:n], strict=True))  # fmt: skip
    assert "".join(lps["tokens"][n:]) == text
    assert lps["token_logprobs"][n:] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    assert lps["text_offset"] == [sum(len(t) for t in lps["tokens"][:i]) for i in range(n + 24)]
    with httpx.stream("POST", url, json={**scored, "stream": True}, headers=AUTH) as response:
        events = sse_events([line for line in response.iter_lines() if line])
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum((e["tokens"] for e in streamed), []) == lps["tokens"]
    assert sum((e["token_logprobs"] for e in streamed), []) == pytest.approx(lps["token_logprobs"])
    assert sum((e["text_offset"] for e in streamed), []) == lps["text_offset"]

    batch = {**base, "prompt": [encode(base["prompt"]), encode("Another prompt")]}
    both = httpx.post(url, json=batch, headers=AUTH, timeout=30).json()
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == text, "token-id prompt == string prompt"
    assert both["usage"]["completion_tokens"] == 48
    tiny_server.assert_idle()


def test_logprobs_list_the_chosen_token_and_its_bytes(tiny_server: RunningServer) -> None:
    """Completions' top_logprobs hold the k most likely tokens and the chosen one (OpenAI's
    legacy API: up to k + 1 entries, the chosen alone for k = 0); chat's entries carry each
    token's UTF-8 bytes, and top_logprobs without logprobs is refused, not ignored."""
    url = f"{tiny_server.url}/v1/completions"
    # hot sampling over a random model: most picks are not the most likely token
    sampled = {"model": MODEL, "prompt": "Numbers: one two", "max_tokens": 16, "temperature": 5.0,
               "seed": 7, "ignore_eos": True}  # fmt: skip
    for k in (0, 1):
        body = {**sampled, "logprobs": k}
        lps = httpx.post(url, json=body, headers=AUTH, timeout=30).json()["choices"][0]["logprobs"]
        entries = list(zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"], strict=True))
        assert len(entries) == 16
        for token, chosen, top in entries:
            assert top[token] == pytest.approx(chosen)
            assert len(top) == 1 if k == 0 else len(top) in (1, 2)
        if k == 1:
            assert any(len(top) == 2 for _, _, top in entries), "the chosen token was never second"

    chat = f"{tiny_server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Count: 1 2 3"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}  # fmt: skip
    content = httpx.post(chat, json=body, headers=AUTH, timeout=30).json()["choices"][0]
    entries = content["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == content["message"]["content"]
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])  # greedy
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])


def test_explicit_nulls_ask_for_defaults(tiny_server: RunningServer) -> None:
    """OpenAI's schema makes most fields nullable and clients send nulls: the same output as
    leaving them out; a null max_tokens on chat still means 'to the end of the context'."""
    url = f"{tiny_server.url}/v1/completions"
    base = {"model": MODEL, "prompt": "Numbers: one two", "max_tokens": 12, "seed": 3}
    nulls = dict.fromkeys(
        ("temperature", "top_p", "top_k", "n", "stream", "echo", "logprobs", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stop"),
    )  # fmt: skip
    plain = httpx.post(url, json=base, headers=AUTH, timeout=30).json()
    nulled = httpx.post(url, json={**base, **nulls}, headers=AUTH, timeout=30)
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain["choices"]


def test_continue_final_message(tiny_server: RunningServer) -> None:
    """vLLM's continue_final_message leaves the last (assistant) message open: the prompt is the
    closed conversation's prefix, ending in the message's own text."""
    messages = [{"role": "user", "content": "Greet me"},
                {"role": "assistant", "content": "Bonjour, mon"}]  # fmt: skip
    tokenize = f"{tiny_server.url}/tokenize"
    flags = {"add_generation_prompt": False}
    open_ids = httpx.post(
        tokenize, json={"messages": messages, **flags, "continue_final_message": True},
        headers=AUTH,
    ).json()["tokens"]  # fmt: skip
    closed_ids = httpx.post(tokenize, json={"messages": messages, **flags}, headers=AUTH).json()
    decode = tiny_server.engine.tokenizer.decode
    assert decode(open_ids).endswith("Bonjour, mon")
    assert closed_ids["tokens"][: len(open_ids)] == open_ids
    assert len(closed_ids["tokens"]) > len(open_ids)  # the template's end of turn
    body = {"model": MODEL, "messages": messages, **flags, "continue_final_message": True,
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH).json()
    assert reply["usage"]["prompt_tokens"] == len(open_ids)


def test_validation_errors_quote_little_of_the_request(tiny_server: RunningServer) -> None:
    """A missing field's error does not quote the whole body (its 'input'), and a long wrong
    value is cut short."""
    url = f"{tiny_server.url}/v1/completions"
    missing = httpx.post(url, json={"max_tokens": 4, "user": "x" * 500}, headers=AUTH).json()
    assert missing["error"]["message"] == "prompt: Field required"
    long = httpx.post(url, json={"prompt": "hi", "max_tokens": "9" * 500 + "x"}, headers=AUTH)
    message = long.json()["error"]["message"]
    assert message.startswith("max_tokens: ") and message.endswith("...)") and len(message) < 200


def test_n_choices_penalties_and_logit_bias(tiny_server: RunningServer) -> None:
    url = f"{tiny_server.url}/v1/completions"
    encode = tiny_server.engine.tokenizer.encode
    base = {"model": MODEL, "prompt": "Numbers: one two three", "max_tokens": 10,
            "temperature": 1.0, "seed": 11, "ignore_eos": True}  # fmt: skip

    def post(body: dict, path: str = url) -> dict:
        response = httpx.post(path, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    three = post({**base, "n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    for j, choice in enumerate(three["choices"]):  # choice j is the request seeded seed + j
        assert choice["text"] == post({**base, "seed": 11 + j})["choices"][0]["text"]
    assert len({c["text"] for c in three["choices"]}) == 3
    assert three["usage"]["prompt_tokens"] == len(encode(base["prompt"])), "counted once"
    assert three["usage"]["completion_tokens"] == 30

    greedy = {**base, "temperature": 0, "max_tokens": 4, "echo": True}
    two = post({**greedy, "prompt": ["Alpha beta", "Gamma delta"], "n": 2})
    texts = [c["text"] for c in two["choices"]]  # prompt-major, as OpenAI numbers choices
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert texts[0].startswith("Alpha beta") and texts[2].startswith("Gamma delta")
    assert two["usage"]["prompt_tokens"] == len(encode("Alpha beta")) + len(encode("Gamma delta"))
    streamed = {**greedy, "prompt": ["Alpha beta", "Gamma delta"], "n": 2, "stream": True}
    with httpx.stream("POST", url, json=streamed, headers=AUTH, timeout=60) as response:
        events = sse_events([line for line in response.iter_lines() if line])
    pieces = [c for e in events for c in e["choices"]]
    assert ["".join(c["text"] for c in pieces if c["index"] == i) for i in range(4)] == texts

    plain = {**base, "temperature": 0, "logprobs": 0}
    unbiased = post(plain)["choices"][0]["logprobs"]["tokens"]
    forced_id = encode(" seven", add_special_tokens=False)[0]
    forced = post({**plain, "logit_bias": {str(forced_id): 100}})["choices"][0]["logprobs"]
    assert forced["tokens"] == [tiny_server.engine.tokenizer.decode([forced_id])] * 10
    assert forced["tokens"] != unbiased
    repeated = post({**plain, "frequency_penalty": 2.0})["choices"][0]["logprobs"]["tokens"]
    assert max(map(repeated.count, repeated)) < max(map(unbiased.count, unbiased))

    chat_url = f"{tiny_server.url}/v1/chat/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "n": 2,
            "seed": 5, "max_tokens": 8, "ignore_eos": True}  # fmt: skip
    full = post(chat, chat_url)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["choices"][0]["message"] != full["choices"][1]["message"]
    stream_body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", chat_url, json=stream_body, headers=AUTH, timeout=60) as response:
        events = sse_events([line for line in response.iter_lines() if line])
    for index, choice in enumerate(full["choices"]):
        deltas = [c for e in events for c in e["choices"] if c["index"] == index]
        assert deltas[0]["delta"]["role"] == "assistant"
        assert (
            "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
        )
        assert deltas[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 16

    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY)
    reply = client.chat.completions.create(
        model=MODEL, messages=chat["messages"], n=2, seed=5, max_tokens=8,
        presence_penalty=0.0, logit_bias={}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.message.content for c in reply.choices] == [
        c["message"]["content"] for c in full["choices"]
    ]
    tiny_server.assert_idle()


def test_lm_eval_loglikelihood_through_the_server(
    tiny_server: RunningServer, tiny_llama_checkpoint: Path
) -> None:
    """lm-eval's `local-completions` model, unchanged, scores multiple-choice style requests
    (echo + logprobs, max_tokens 1) through the server: the sums equal transformers' own."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM

    lm = LocalCompletionsAPI(
        base_url=f"{tiny_server.url}/v1/completions", model=MODEL,
        tokenizer_backend="huggingface", tokenizer=str(tiny_llama_checkpoint),
        tokenized_requests=True, num_concurrent=2, max_retries=1, header=AUTH,
    )  # fmt: skip
    pairs = [("The capital of France is", " Paris"), ("Numbers: one two", " three four five")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    for (context, continuation), (total, greedy) in zip(pairs, got, strict=True):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        ids = torch.tensor([context_ids + continuation_ids])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).logits[0, len(context_ids) - 1 : -1], -1)
        picked = logprobs.gather(1, torch.tensor(continuation_ids)[:, None]).squeeze(1)
        assert total == pytest.approx(picked.sum().item(), abs=1e-3)
        assert greedy == bool((logprobs.argmax(-1) == torch.tensor(continuation_ids)).all())


def test_structured_outputs_over_http(tiny_server: RunningServer) -> None:
    """vLLM's `structured_outputs` and OpenAI's `response_format` hold the random model's output
    to the constraint, on completions and chat, streamed or not, for every sampled choice."""
    url = f"{tiny_server.url}/v1/completions"
    base = {"model": MODEL, "prompt": "The answer is", "max_tokens": 24, "temperature": 1.0}

    def post(body: dict, path: str = url) -> dict:
        response = httpx.post(path, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    choices = ["alpha", "beta gamma", 'a "quoted" one']
    picked = post({**base, "n": 6, "seed": 3, "structured_outputs": {"choice": choices}})
    assert all(c["text"] in choices and c["finish_reason"] == "stop" for c in picked["choices"])
    assert len({c["text"] for c in picked["choices"]}) > 1, "sampled, not forced to one"
    free = post({**base, "n": 6, "seed": 3})["choices"]
    assert not any(c["text"] in choices for c in free), "the random model never says them alone"

    regex = r"[a-c]{2}-\d{3}"
    body = {**base, "temperature": 0, "structured_outputs": {"regex": regex}}
    text = post(body)["choices"][0]["text"]
    assert re.fullmatch(regex, text), text
    legacy = {**base, "temperature": 0, "guided_regex": regex}  # vLLM's older name
    assert post(legacy)["choices"][0]["text"] == text
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        events = sse_events([line for line in r.iter_lines() if line])
    assert "".join(c["text"] for e in events for c in e["choices"]) == text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64,
            "temperature": 0, "response_format": {"type": "json_schema",
            "json_schema": {"name": "flag", "schema": schema}}}  # fmt: skip
    chat_url = f"{tiny_server.url}/v1/chat/completions"
    reply = post(chat, chat_url)["choices"][0]
    assert list(json.loads(reply["message"]["content"])) == ["ok"], reply
    assert reply["finish_reason"] == "stop"
    declined = post({**chat, "tools": [TOOL], "tool_choice": "none"}, chat_url)["choices"][0]
    assert declined["message"] == reply["message"], "tools that are declined change nothing"
    tiny_server.assert_idle()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "the time now"}}


def test_forced_tool_calls_over_http(tiny_server: RunningServer) -> None:
    """A named tool_choice and "required" come back as OpenAI tool calls whose arguments fit the
    function's schema, streamed as the same calls; the official client reads them; an earlier
    call and its result in the history are accepted."""
    url = f"{tiny_server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    named = {"model": MODEL, "messages": messages, "max_tokens": 64, "temperature": 0,
             "tools": [WEATHER, CLOCK],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip

    def post(body: dict) -> dict:
        response = httpx.post(url, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def streamed_calls(body: dict) -> tuple[list[dict], str]:
        with httpx.stream(
            "POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60
        ) as r:
            events = sse_events([line for line in r.iter_lines() if line])
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert not any(d.get("content") for d in deltas), "calls, not text"
        calls: dict[int, dict] = {}
        for part in (p for d in deltas for p in d.get("tool_calls") or []):
            call = calls.setdefault(part["index"], {"arguments": ""})
            for key in ("id", "type"):
                if part.get(key):
                    assert key not in call, f"{key} comes once"
                    call[key] = part[key]
            if part["function"].get("name"):
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"].get("arguments") or ""
        return [calls[i] for i in sorted(calls)], events[-1]["choices"][0]["finish_reason"]

    choice = post(named)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    (streamed,), finish = streamed_calls(named)
    assert finish == "stop" and streamed["name"] == "get_weather"
    assert streamed["arguments"] == call["function"]["arguments"]
    assert streamed["id"].startswith("call") and streamed["type"] == "function"

    required = {**named, "tool_choice": "required", "max_tokens": 200}
    choice = post(required)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} <= {"get_weather", "get_time"}
    for c in calls:
        arguments = json.loads(c["function"]["arguments"])
        assert c["function"]["name"] == "get_time" or arguments["city"] in ("Paris", "Rome")
    streamed, finish = streamed_calls(required)
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for s in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]

    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY)
    history = [*messages, choice["message"],
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]  # fmt: skip
    reply = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=64, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments)["city"]
    tiny_server.assert_idle()


def test_tokenize_health_and_models(tiny_server: RunningServer) -> None:
    tokens = httpx.post(
        f"{tiny_server.url}/tokenize", json={"prompt": "hello world"}, headers=AUTH
    ).json()
    assert tokens["tokens"] == tiny_server.engine.tokenizer.encode("hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(
        f"{tiny_server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH
    ).json()
    assert text == {"prompt": tiny_server.engine.tokenizer.decode(tokens["tokens"])}
    assert text["prompt"].endswith("hello world")
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    models = httpx.get(f"{tiny_server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == 256


def test_model_lookup_method_errors_and_unexpected_failures(
    tiny_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    unknown = httpx.get(f"{tiny_server.url}/v1/models/gpt-9", headers=AUTH)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    # a 405 says which methods the route takes
    wrong_method = httpx.get(f"{tiny_server.url}/v1/chat/completions", headers=AUTH)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["code"] == 405

    def broken(*_: object, **__: object) -> list[int]:
        raise RuntimeError("a bug in the tokenizer")

    # a bug's 500 comes as an OpenAI error object too, and the server goes on
    monkeypatch.setattr(PromptEncoder, "encode", broken)
    response = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "hi"}, headers=AUTH)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error"
    assert "a bug in the tokenizer" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_a_chat_template_that_refuses_the_messages_is_a_400(
    tiny_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Templates raise on histories they do not take (Mistral's and Llama 2's: roles must
    alternate); that is the client's error, not a 500."""
    refusing = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    )
    monkeypatch.setattr(tiny_server.engine.tokenizer, "chat_template", refusing)
    response = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "system", "content": "be brief"}]},
        headers=AUTH,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "no system role" in error["message"]


def test_extreme_sampling_values_answer_and_leave_the_server_up(
    tiny_server: RunningServer,
) -> None:
    """One request with a temperature or top_p that rounds to 0 in fp32 used to make the
    batch's draw raise on the engine thread, which failed every other request."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6}
    url = f"{tiny_server.url}/v1/completions"
    greedy = httpx.post(url, json={**body, "temperature": 0}, headers=AUTH).json()
    for extreme in ({"temperature": 1e-50}, {"temperature": 1.0, "top_p": 1e-50, "seed": 1}):
        response = httpx.post(url, json={**body, **extreme}, headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == greedy["choices"][0]["text"], extreme
    assert httpx.post(url, json={**body, "repetition_penalty": 1e-37}, headers=AUTH).is_success
    huge_k = {**body, "temperature": 1.0, "top_k": 2**63, "seed": 1}  # past int64: top-k is off
    assert httpx.post(url, json=huge_k, headers=AUTH).is_success
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_max_tokens_null_lets_each_prompt_fill_its_own_room(tiny_server: RunningServer) -> None:
    """As in vLLM; the room used to be the longest prompt's for every prompt of the request."""
    body = {"model": MODEL, "prompt": [[5] * 3, [5] * 40], "max_tokens": None, "ignore_eos": True}
    response = httpx.post(
        f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=120
    ).json()
    assert [c["finish_reason"] for c in response["choices"]] == ["length", "length"]
    assert response["usage"]["completion_tokens"] == (256 - 3) + (256 - 40)


def test_a_dead_engine_takes_the_server_down(
    tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's server exits when its engine dies, so that a supervisor restarts it; one that
    stays up answers every request with a 503 until someone notices."""
    running = start_server(tiny_llama_checkpoint)

    def failing_step(*_: object) -> None:
        raise RuntimeError("an injected step failure")

    monkeypatch.setattr(running.engine, "execute", failing_step)
    response = httpx.post(
        f"{running.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers=AUTH,
    )
    assert response.status_code == 500
    assert "an injected step failure" in response.json()["error"]["message"]
    running.thread.join(timeout=15)
    assert not running.thread.is_alive(), "the server kept running without its engine"


LONG_PROMPT = "word " * 300
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_INPUTS = [
    # (name, path, body (dict, or raw str), headers, status, param)
    ("malformed json", "/v1/completions", '{"prompt": "hi", ', AUTH, 400, None),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, AUTH,
     400, "max_tokens"),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, AUTH, 400, "prompt"),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, AUTH, 400, "prompt"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, AUTH, 400,
     "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, AUTH, 400, "max_tokens"),
    ("max_completion_tokens zero", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, AUTH, 400,
     "max_completion_tokens"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_PROMPT}, AUTH, 400, "prompt"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "hi", "max_tokens": 1000},
     AUTH, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, AUTH, 400, "model"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, AUTH, 400, "n"),
    ("best_of", "/v1/completions", {"prompt": "hi", "best_of": 3}, AUTH, 400, "best_of"),
    ("penalty out of range", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, AUTH,
     400, "presence_penalty"),
    ("repetition_penalty zero", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, AUTH, 400,
     "repetition_penalty"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"a": 1}},
     AUTH, 400, "logit_bias"),
    ("logit_bias key outside the vocabulary", "/v1/completions",
     {"prompt": "hi", "logit_bias": {str(10**6): 1}}, AUTH, 400, "logit_bias"),
    ("logit_bias value out of range", "/v1/completions",
     {"prompt": "hi", "logit_bias": {"5": 150}}, AUTH, 400, "logit_bias"),
    ("min_p out of range", "/v1/completions", {"prompt": "hi", "min_p": -0.1}, AUTH, 400,
     "min_p"),
    ("detokenize id outside the vocabulary", "/detokenize", {"tokens": [1, 10**6]}, AUTH, 400,
     "tokens"),
    ("detokenize without tokens", "/detokenize", {}, AUTH, 400, "tokens"),
    ("min_tokens over max_tokens", "/v1/completions",
     {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, AUTH, 400, "min_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, AUTH, 400,
     None),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10**9]}, AUTH, 400, "prompt"),
    ("regex that does not compile", "/v1/completions",
     {"prompt": "hi", "structured_outputs": {"regex": "(ab"}}, AUTH, 400, "structured_outputs"),
    ("json schema that does not compile", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
      "json_schema": {"name": "x", "schema": {"type": "thing"}}}}, AUTH, 400, "response_format"),
    ("json_schema format without a schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     AUTH, 400, "response_format"),
    ("two structured output constraints", "/v1/completions",
     {"prompt": "hi", "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, AUTH, 400, "structured_outputs"),
    ("guided_ field beside structured_outputs", "/v1/completions",
     {"prompt": "hi", "structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, AUTH, 400,
     "guided_choice"),
    ("tool parameters that do not compile", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
      {"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}]}, AUTH,
     400, "tools"),
    ("empty choice list", "/v1/completions",
     {"prompt": "hi", "structured_outputs": {"choice": []}}, AUTH, 400, "structured_outputs"),
    ("unknown response_format type", "/v1/completions",
     {"prompt": "hi", "response_format": {"type": "xml"}}, AUTH, 400, "response_format.type"),
    ("min_tokens with a structured output", "/v1/completions",
     {"prompt": "hi", "min_tokens": 2, "response_format": {"type": "json_object"}}, AUTH, 400,
     "min_tokens"),
    ("tools with tool_choice auto (the default)", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, AUTH, 400,
     "tool_choice"),
    ("tool_choice naming an undeclared function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, AUTH, 400, "tool_choice"),
    ("tool_choice required without tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, AUTH, 400,
     "tool_choice"),
    ("a forced tool call and a response_format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, AUTH, 400, "tool_choice"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, AUTH, 400,
     "top_logprobs"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, AUTH, 400, "stream_options"),
    ("seed beyond int64", "/v1/completions", {"prompt": "hi", "seed": 2**64}, AUTH, 400, "seed"),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
      "continue_final_message": True}, AUTH, 400, "continue_final_message"),
    ("continue_final_message after a user message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
      "add_generation_prompt": False}, AUTH, 400, "continue_final_message"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, AUTH, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "hi"}]}, AUTH,
     400, "messages.0.role"),
    ("NaN temperature", "/v1/completions", '{"prompt": "hi", "temperature": NaN}', AUTH, 400,
     "temperature"),
    ("infinite temperature", "/v1/completions", '{"prompt": "hi", "temperature": Infinity}', AUTH,
     400, "temperature"),
    ("negative stop token id", "/v1/completions",
     {"prompt": "hi", "min_tokens": 2, "max_tokens": 3, "stop_token_ids": [-100000]}, AUTH, 400,
     "stop_token_ids"),
    ("stop token id outside the vocabulary", "/v1/completions",
     {"prompt": "hi", "stop_token_ids": [10**6]}, AUTH, 400, None),
    ("repetition_penalty below fp32's range", "/v1/completions",
     {"prompt": "hi", "repetition_penalty": 1e-300}, AUTH, 400, "repetition_penalty"),
    ("lone surrogate in a prompt", "/v1/completions", '{"prompt": "\\ud800 x"}', AUTH, 400, None),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x\\udfff"}]}', AUTH, 400, None),
    ("lone surrogate to tokenize", "/tokenize", '{"prompt": "\\ud800"}', AUTH, 400, None),
    ("chat prompt too long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG_PROMPT}]}, AUTH, 400, "messages"),
    ("no api key", "/v1/completions", {"prompt": "hi"}, {}, 401, None),
    ("no api key and a malformed body", "/v1/completions", '{"prompt": ', {}, 401, None),
    ("non-ASCII api key", "/v1/completions", {"prompt": "hi"},
     {"Authorization": "Bearer secr\u00e9".encode()}, 401, None),
    ("wrong api key", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     {"Authorization": "Bearer nope"}, 401, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_inputs_get_openai_errors(
    tiny_server: RunningServer,
    path: str,
    body: dict | str,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    url = f"{tiny_server.url}{path}"
    if isinstance(body, str):
        headers = {**headers, "Content-Type": "application/json"}
        response = httpx.post(url, content=body, headers=headers)
    else:
        response = httpx.post(url, json={"model": MODEL, **body}, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


DISCONNECTING_MAX_TOKENS = 240


async def _stream_client(url: str, index: int, disconnect_after: int | None) -> dict:
    """One streaming client; returns what it saw. Disconnects after `disconnect_after` events,
    from a request long enough that the server cannot finish it first: the tiny model decodes a
    few tokens per millisecond, and 16 did run out once before a close was noticed."""
    body = {
        "model": MODEL,
        "prompt": f"Client {index} says hello to the server and then",
        "max_tokens": 16 + index % 8 if disconnect_after is None else DISCONNECTING_MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as response,
    ):
        assert response.status_code == 200
        events: list[dict] = []
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if disconnect_after is not None and len(events) >= disconnect_after:
                    return {"disconnected": True, "events": events}
            elif line == "data: [DONE]":
                break
    return {"disconnected": False, "events": events, "max_tokens": body["max_tokens"]}


def test_64_concurrent_streams_with_disconnects_free_all_blocks(
    tiny_server: RunningServer,
) -> None:
    before = scrape(tiny_server.url)

    async def run_all() -> list[dict]:
        clients = [
            _stream_client(tiny_server.url, i, disconnect_after=3 if i % 4 == 0 else None)
            for i in range(64)
        ]
        return await asyncio.gather(*clients)

    results = asyncio.run(run_all())
    completed = [r for r in results if not r["disconnected"]]
    assert len(completed) == 48
    completion_tokens = 0
    for result in completed:
        usage = result["events"][-1]["usage"]
        assert usage["completion_tokens"] == result["max_tokens"], "ignore_eos runs to max_tokens"
        assert result["events"][-2]["choices"][0]["finish_reason"] == "length"
        completion_tokens += usage["completion_tokens"]

    tiny_server.assert_idle()
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    after = scrape(tiny_server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("qpipe:request_success_total", finished_reason="length") == 48
    assert delta("qpipe:request_success_total", finished_reason="abort") == 16
    # the aborted clients stopped early: their 16 requests produced fewer than their max tokens
    aborted_tokens = delta("qpipe:generation_tokens_total") - completion_tokens
    assert 0 < aborted_tokens < 16 * DISCONNECTING_MAX_TOKENS


def test_non_streaming_client_disconnect_aborts(tiny_server: RunningServer) -> None:
    before = scrape(tiny_server.url)
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    # on a loaded machine the request may still be on its way to the engine when the client gives
    # up, so wait for the abort to be counted rather than for the engine to look idle
    deadline = time.monotonic() + 10
    while True:
        after = scrape(tiny_server.url)
        aborted = metric(after, "qpipe:request_success_total", finished_reason="abort") - metric(
            before, "qpipe:request_success_total", finished_reason="abort"
        )
        if aborted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    tiny_server.assert_idle()
    after = scrape(tiny_server.url)
    generated = metric(after, "qpipe:generation_tokens_total") - metric(
        before, "qpipe:generation_tokens_total"
    )
    assert metric(after, "qpipe:request_success_total", finished_reason="length") == metric(
        before, "qpipe:request_success_total", finished_reason="length"
    ), "the request ran to max_tokens although its client had gone"
    assert aborted == 1 and generated < 240


def test_metrics_after_traffic(tiny_server: RunningServer) -> None:
    before = scrape(tiny_server.url)
    prompt = "A shared system prompt that is long enough to fill a block or two of the cache. " * 2
    usages = []
    for i in range(4):
        body = {"model": MODEL, "prompt": prompt + str(i), "max_tokens": 5 + i, "ignore_eos": True}
        response = httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=AUTH)
        usages.append(response.json()["usage"])
    tiny_server.assert_idle()
    after = scrape(tiny_server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("qpipe:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("qpipe:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("qpipe:request_success_total", finished_reason="length") == 4
    assert delta("qpipe:time_to_first_token_seconds_count") == 4
    assert delta("qpipe:e2e_request_latency_seconds_count") == 4
    assert delta("qpipe:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages
    )
    assert 0 < delta("qpipe:e2e_request_latency_seconds_sum") < 60
    assert delta("qpipe:prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usages)
    assert delta("qpipe:prefix_cache_hits_total") > 0, "later prompts reuse the shared prefix"
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) > 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"qpipe:{gauge}") == 0
    assert metric(after, "qpipe:num_preemptions_total") >= 0
    assert f"qpipe:num_preemptions_total{{model_name={MODEL}}}" in after
    blocks = tiny_server.engine.model_runner.num_kv_blocks
    config = {"block_size": "16", "cache_dtype": "float32", "num_gpu_blocks": str(blocks)}
    assert metric(after, "qpipe:cache_config_info", enable_prefix_caching="True", **config) == 1


def test_queue_full_gets_503_with_retry_after(tiny_llama_checkpoint: Path) -> None:
    running = start_server(tiny_llama_checkpoint, max_queue=1, max_num_seqs=1)
    try:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 64, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                posts = [
                    client.post(f"{running.url}/v1/completions", json=body, headers=AUTH)
                    for _ in range(6)
                ]
                return await asyncio.gather(*posts)

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 503 in statuses, statuses
        rejected = next(r for r in responses if r.status_code == 503)
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["code"] == 503
        # more choices than the queue can ever hold: a 400, not a 503 to retry forever
        too_many = httpx.post(
            f"{running.url}/v1/completions", json={**body, "n": 2}, headers=AUTH, timeout=30
        )
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert "--max-queue" in too_many.json()["error"]["message"]
        running.assert_idle()
    finally:
        running.stop()


def test_max_queue_counts_requests_taken_in_since_the_last_step(
    tiny_llama_checkpoint: Path,
) -> None:
    """Requests the engine thread moved into the engine's waiting queue count against
    --max-queue at once, not only when the next step's stats arrive (a step can take 0.4 s)."""
    config = EngineConfig(
        model=str(tiny_llama_checkpoint), dtype="float32", kv_cache_memory_gib=0.01
    )
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), ServerMetrics("tiny"), max_queue=2)
    params = SamplingParams(max_tokens=4)

    async def fill() -> None:
        async_engine.add_request("a", [100, 101], params)
        async_engine.add_request("b", [102, 103], params)
        # not started, so the engine thread waits: apply its commands here, as a step would
        async_engine._apply_commands()
        assert async_engine.engine.stats().num_waiting == 2
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            async_engine.add_request("c", [104, 105], params)
        await async_engine.shutdown(drain_timeout_s=0)

    asyncio.run(fill())
    stats = async_engine.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_max_queue_does_not_count_requests_the_running_step_admitted(
    tiny_llama_checkpoint: Path,
) -> None:
    """A request the step now computing has admitted (its prefill) is running, not waiting: the
    queue is read when the step is formed, not when it ends. The step here waits until the test
    has sent what it checks."""
    config = EngineConfig(
        model=str(tiny_llama_checkpoint), dtype="float32", kv_cache_memory_gib=0.01
    )
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), ServerMetrics("tiny"), max_queue=2)
    engine = async_engine.engine
    running, release = threading.Event(), threading.Event()
    execute = engine.execute

    def held_execute(batch):  # noqa: ANN001, ANN202 - LLMEngine.execute, held open
        if batch.items:
            running.set()
            release.wait(30)
        return execute(batch)

    engine.execute = held_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=2)

    async def send() -> None:
        async_engine.start()
        async_engine.add_request("a", [100, 101], params)
        async_engine.add_request("b", [102, 103], params)
        assert await asyncio.to_thread(running.wait, 30), "the first step did not start"
        # a and b are in the held step: the queue has room for two more, then it is full
        async_engine.add_request("c", [104, 105], params)
        async_engine.add_request("d", [106, 107], params)
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            async_engine.add_request("e", [108, 109], params)
        release.set()
        await async_engine.shutdown(drain_timeout_s=30)

    asyncio.run(send())
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_the_server_and_the_engine_drain_against_one_deadline(
    tiny_llama_checkpoint: Path,
) -> None:
    """A drain begun when uvicorn starts shutting down bounds the engine's own wait too: by the
    time the lifespan shutdown runs, the time is spent and unfinished requests are aborted at
    once, not given a second full timeout. New requests are refused from the start."""
    config = EngineConfig(
        model=str(tiny_llama_checkpoint), dtype="float32", kv_cache_memory_gib=0.01
    )
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), ServerMetrics("tiny"))
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)

    async def drain() -> float:
        async_engine.start()
        stream = async_engine.add_request("long", [100, 101], long)
        await stream.next()  # running, with blocks: ~2,000 tokens to go (seconds of steps)
        async_engine.begin_drain(0.2)  # what DrainingServer.shutdown does first
        with pytest.raises(EngineUnavailableError):
            async_engine.add_request("late", [102], long)
        await asyncio.sleep(0.3)  # uvicorn's own wait for connections spends the drain time
        started = time.monotonic()
        await async_engine.shutdown(drain_timeout_s=30)
        elapsed = time.monotonic() - started
        with pytest.raises(EngineUnavailableError, match="shut down before"):
            while not stream.finished:
                await stream.next()
        return elapsed

    assert asyncio.run(drain()) < 5
    stats = async_engine.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_keepalives_and_graceful_shutdown_drain(tiny_llama_checkpoint: Path) -> None:
    # NOTE: a 1 ms keep-alive interval is shorter than any engine step, so comments must appear
    running = start_server(tiny_llama_checkpoint, keepalive_interval_s=0.001)
    two = {"model": MODEL, "prompt": "two of me", "max_tokens": 16, "n": 2, "stream": True}
    with httpx.stream(
        "POST", f"{running.url}/v1/completions", json=two, headers=AUTH, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert ": keep-alive" in lines, "n > 1 reads its streams through a queue, with its own timer"
    assert {c["index"] for e in sse_events(lines) for c in e["choices"]} == {0, 1}
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": 64, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream(
        "POST", f"{running.url}/v1/completions", json=body, headers=AUTH, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
            if len(sse_events(lines)) == 1:  # the first event is in: ask the server to stop
                running.server.should_exit = True
    assert lines[-1] == "data: [DONE]"
    assert ": keep-alive" in lines
    assert sse_events(lines)[-1]["usage"]["completion_tokens"] == 64
    running.thread.join(timeout=30)
    assert not running.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health")


def test_what_the_drain_deadline_cuts_off_is_told_so(tiny_llama_checkpoint: Path) -> None:
    """Requests still running at the drain deadline were cut off by uvicorn's cancel: streams
    ended mid-body (no error, no [DONE]) and a waiting non-streaming request got a plain-text
    500. Now each gets a 503 in OpenAI's shape, in-band for the stream, and its blocks are free."""
    running = start_server(tiny_llama_checkpoint, drain_timeout_s=0.5, max_model_len=2048)
    long = {"model": MODEL, "prompt": "never done", "max_tokens": 2000, "ignore_eos": True}
    replies: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: replies.append(
            httpx.post(f"{running.url}/v1/completions", json=long, headers=AUTH, timeout=60)
        )
    )
    lines: list[str] = []
    with httpx.stream("POST", f"{running.url}/v1/completions", json={**long, "stream": True},
                      headers=AUTH, timeout=60) as response:  # fmt: skip
        for line in response.iter_lines():
            if line:
                lines.append(line)
            if len(sse_events(lines)) == 1 and not waiting.is_alive() and not replies:
                waiting.start()
                time.sleep(0.3)  # the second request is in the engine
                running.server.should_exit = True
    waiting.join(timeout=30)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = sse_events(lines)[-1]["error"]
    assert (error["code"], error["type"]) == (503, "service_unavailable")
    assert "shut down before the request finished" in error["message"]
    (reply,) = replies
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["type"] == "service_unavailable"
    running.thread.join(timeout=30)
    assert not running.thread.is_alive()
    stats = running.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
def test_serve_command_binds_localhost_and_exits_cleanly(tiny_llama_checkpoint: Path) -> None:
    """The typer command the CLI wires as `qpipe serve`, as a real process stopped by SIGTERM."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = "import typer; from qpipe.serve.cli import serve; typer.run(serve)"
    args = [str(tiny_llama_checkpoint), "--port", str(port), "--served-model-name", "cli-tiny"]
    args += ["--kv-cache-memory", "0.05", "--max-model-len", "128", "--kv-cache-dtype", "fp8"]
    env = {**os.environ, "QPIPE_API_KEY": API_KEY, "COLUMNS": "400"}  # log lines unwrapped
    proc = subprocess.Popen([sys.executable, "-c", command, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "qpipe serve did not come up"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
        assert models["data"][0]["id"] == "cli-tiny"
        assert models["data"][0]["max_model_len"] == 128
        completion = {"prompt": "Hello , world", "max_tokens": 4, "echo": True}
        reply = httpx.post(f"{url}/v1/completions", json=completion, headers=AUTH, timeout=30)
        assert reply.json()["choices"][0]["text"].startswith("Hello , world"), reply.text
        outside = _non_loopback_address()
        if outside is not None:  # bound to 127.0.0.1 only: the host's own address is refused
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{outside}:{port}/health", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    # NOTE: uvicorn re-raises the signal it caught once its graceful shutdown is done
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert "clean_up_tokenization_spaces" not in output, "no transformers warning on decode"
    logged = re.search(
        r"KV cache: (\d+) blocks of 16 tokens in float8_e4m3fn \(([\d.]+) GiB\); "
        r"max concurrency at max_model_len 128: ([\d.]+)",
        output,
    )
    assert logged, f"the KV-cache size is logged: {output}"
    blocks, gib = int(logged[1]), float(logged[2])
    assert blocks > 0 and 0 < gib <= 0.05 + 0.005  # --kv-cache-memory 0.05, plus the scratch block
    assert logged[3] == str(blocks // (128 // 16))  # whole max_model_len requests


def _non_loopback_address() -> str | None:
    """This host's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


# ---- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_openai_client_end_to_end(smollm2_checkpoint: Path) -> None:
    """The official client against SmolLM2: greedy text equals transformers' greedy text."""
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    running = start_server(smollm2_checkpoint, name="smollm2", api_key=None, max_model_len=1024)
    try:
        client = OpenAI(base_url=f"{running.url}/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=20, temperature=0
        )
        answer = chat.choices[0].message.content
        assert "Paris" in answer

        stream = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=20, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == answer

        tokenizer = running.engine.tokenizer
        prompt_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32)
        with torch.inference_mode():
            out = model.generate(prompt_ids, max_new_tokens=20, do_sample=False)
        expected = tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        assert answer == expected

        # a prefilled answer, continued (vLLM's continue_final_message): as transformers goes on
        prefilled = [*messages, {"role": "assistant", "content": "The capital of France is"}]
        going_on = client.chat.completions.create(
            model="smollm2", messages=prefilled, max_tokens=8, temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )  # fmt: skip
        open_ids = tokenizer.apply_chat_template(
            prefilled, continue_final_message=True, return_tensors="pt"
        )["input_ids"]
        with torch.inference_mode():
            out = model.generate(open_ids, max_new_tokens=8, do_sample=False)
        continued = going_on.choices[0].message.content
        assert continued == tokenizer.decode(out[0, open_ids.shape[1] :], skip_special_tokens=True)
        assert "Paris" in continued and going_on.usage.prompt_tokens == open_ids.shape[1]

        samples = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=20, n=3, seed=0, temperature=0.8,
            frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2},
        )  # fmt: skip
        assert [c.index for c in samples.choices] == [0, 1, 2]
        assert len({c.message.content for c in samples.choices}) > 1
        assert samples.usage.prompt_tokens == prompt_ids.shape[1]

        class City(BaseModel):  # the client sends it as a strict json_schema response_format
            name: str
            country: str

        parsed = client.chat.completions.parse(
            model="smollm2", messages=messages, max_tokens=40, temperature=0, response_format=City
        )
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City), parsed.choices[0].message.content  # pydantic-validated
        assert parsed.choices[0].finish_reason == "stop"
        ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
        json_mode = client.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=40, temperature=0,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert isinstance(json.loads(json_mode.choices[0].message.content), dict)
        assert json_mode.choices[0].finish_reason == "stop"
        tool_reply = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=40, temperature=0, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        (call,) = tool_reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        running.assert_idle()
    finally:
        running.stop()


def test_the_engine_is_built_on_its_own_thread_and_load_errors_reach_the_caller(
    tiny_llama_checkpoint: Path,
) -> None:
    """One OS thread loads and steps the model (see AsyncLLMEngine: two OpenMP teams make every
    parallel op sleep and wake its workers); a load error is raised by the constructor."""
    built_on: list[threading.Thread] = []

    def make() -> LLMEngine:
        built_on.append(threading.current_thread())
        config = EngineConfig(
            model=str(tiny_llama_checkpoint), dtype="float32", kv_cache_memory_gib=0.01
        )
        return LLMEngine(config)

    async_engine = AsyncLLMEngine(make, ServerMetrics("tiny"))
    assert built_on == [async_engine._thread] and built_on[0] is not threading.current_thread()
    assert async_engine.engine.model_runner.num_kv_blocks > 0

    def broken() -> LLMEngine:
        raise ValueError("EngineConfig.max_model_len=9999999 exceeds the checkpoint's limit")

    with pytest.raises(ValueError, match="exceeds the checkpoint"):
        AsyncLLMEngine(broken, ServerMetrics("broken"))
