"""What the OpenAI endpoints share: request checks, sampling parameters, and running engine
requests to the end (streamed or collected) with keep-alives and abort on disconnect.

Everything a client can get wrong is checked before the engine sees the request, and raised as an
`APIError` that the app renders as an OpenAI error object.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2

from qpipe.serve.api_errors import APIError, as_api_error
from qpipe.serve.async_engine import (
    KEEP_ALIVE,
    AsyncLLMEngine,
    EngineUnavailableError,
    GenerationChunk,
    QueueFullError,
    RequestStream,
)
from qpipe.serve.openai_protocol import ChatMessage, SamplingRequest, UsageInfo
from qpipe.serve.prompt_encoder import PromptEncoder
from qpipe.serve.sampling_params import SamplingParams, StructuredOutput
from qpipe.serve.structured_output import choice_grammar

Disconnected = Callable[[], Awaitable[None]]  # returns once the client has gone away


@dataclass(frozen=True)
class ServingSettings:
    served_model_name: str
    keepalive_interval_s: float = 15.0
    retry_after_s: int = 1


@dataclass
class ChoiceOutput:
    """One choice's output so far, for non-streaming responses and the final usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        self.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs


def usage_info(choices: list[ChoiceOutput], prompt_lens: list[int], n: int = 1) -> UsageInfo:
    """A prompt counts once however many choices (`n`, prompt-major) it has, as in OpenAI's and
    vLLM's usage; so do its cached tokens, read from its first choice."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices[::n])
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


def sse_event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


class SilenceTimer:
    """Calls `on_silence` each time `interval_s` passes without a `reset`: one timer per stream,
    re-armed when it fires. A timer armed and cancelled around every chunk (`asyncio.timeout`) was
    over a quarter of the streaming loop's own time at 256 streams, and ~9 % of the event loop's
    CPU still where only streams with nothing waiting armed one (py-spy, tests' tiny model)."""

    def __init__(self, interval_s: float, on_silence: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval_s = interval_s
        self._on_silence = on_silence
        self._last = self._loop.time()
        self._handle = self._loop.call_at(self._last + interval_s, self._fire)

    def reset(self) -> None:
        self._last = self._loop.time()

    def cancel(self) -> None:
        self._handle.cancel()

    def _fire(self) -> None:
        now = self._loop.time()
        if now - self._last >= self._interval_s:
            self._on_silence()
            self._last = now
        self._handle = self._loop.call_at(self._last + self._interval_s, self._fire)


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLMEngine, settings: ServingSettings, encoder: PromptEncoder
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.engine.tokenizer
        self.encoder = encoder
        self.max_model_len: int = engine.engine.max_model_len
        self.vocab_size: int = engine.engine.vocab_size

    # ---- request checks -------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(
                400,
                f"model {model!r} is not served here; this server serves "
                f"{self.settings.served_model_name!r} (see GET /v1/models)",
                param="model",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Token ids a client sends to be decoded must be the tokenizer's (a model's vocabulary
        may be padded past it)."""
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)

    def check_fields(self, body: SamplingRequest) -> None:
        """Fields that contradict each other, or that qpipe cannot honour: a 400, not a guess."""
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only for streamed requests (stream: true)",
                param="stream_options",
            )  # fmt: skip
        if body.best_of not in (None, body.n):
            raise APIError(
                400,
                f"best_of={body.best_of} is not supported by qpipe's server (as in vLLM's V1 "
                f"engine); ask for n={body.best_of} choices and rank them on the client",
                param="best_of",
            )

    def logit_bias(self, body: SamplingRequest) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} map as (id, bias) pairs, every id checked."""
        pairs = []
        for key, value in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size:
                raise APIError(
                    400,
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                    param="logit_bias",
                )
            pairs.append((token, value))
        return tuple(pairs)

    def structured_output(self, body: SamplingRequest) -> StructuredOutput | None:
        """The request's constraint on its output: OpenAI's `response_format`, vLLM's
        `structured_outputs` or its older `guided_` fields (one constraint in all)."""
        specs = self._constraints(body)
        if len(specs) > 1:
            raise APIError(
                400,
                "give one structured output constraint: response_format, or one of "
                "structured_outputs' json, regex, choice, grammar and json_object (or vLLM's "
                f"older guided_ fields); got {', '.join(param for param, _ in specs)}",
                param=specs[-1][0],
            )
        return specs[0][1] if specs else None

    def _constraints(self, body: SamplingRequest) -> list[tuple[str, StructuredOutput]]:
        """(request field, constraint) for every constraint the request sends."""
        fmt = body.response_format
        specs: list[tuple[str, StructuredOutput]] = []
        if fmt is not None and fmt.type == "json_object":
            specs.append(("response_format", StructuredOutput("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(
                    400,
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format",
                )
            schema = json.dumps(fmt.json_schema.json_schema)
            specs.append(("response_format", StructuredOutput("json_schema", schema)))
        for param, extra in body.structured_outputs_given():
            if extra.json_ is not None:
                schema = extra.json_ if isinstance(extra.json_, str) else json.dumps(extra.json_)
                specs.append((param, StructuredOutput("json_schema", schema)))
            if extra.regex is not None:
                specs.append((param, StructuredOutput("regex", extra.regex)))
            if extra.choice is not None:
                try:
                    specs.append((param, StructuredOutput("grammar", choice_grammar(extra.choice))))
                except ValueError as exc:
                    raise APIError(400, f"{param}: {exc}", param=param) from exc
            if extra.grammar is not None:
                specs.append((param, StructuredOutput("grammar", extra.grammar)))
            if extra.json_object:
                specs.append((param, StructuredOutput("json_object")))
        return specs

    def sampling_params(
        self,
        body: SamplingRequest,
        max_tokens: int | None,
        prompt_len: int,
        logprobs: int | None,
        max_tokens_field: str = "max_tokens",
        prompt_logprobs: int | None = None,
        structured_output: StructuredOutput | None = None,
        prompt_field: str = "prompt",
    ) -> SamplingParams:
        """`max_tokens_field` and `prompt_field` name the request fields the limit and the prompt
        came from, for the errors; `structured_output` stands for the request's own (a forced tool
        call's)."""
        room = self.max_model_len - prompt_len
        if prompt_len >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens but this model's maximum context length is "
                f"{self.max_model_len} tokens (--max-model-len); shorten the prompt",
                param=prompt_field,
            )
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(
                400, f"{max_tokens_field} must be >= 1, got {max_tokens}", param=max_tokens_field
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len}, so {max_tokens_field} can be at most {room} (got {max_tokens})",
                param=max_tokens_field,
            )
        try:
            return SamplingParams(
                max_tokens=room if max_tokens is None else max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=self.logit_bias(body),
                structured_output=structured_output or self.structured_output(body),
            )
        except ValueError as exc:
            message = str(exc).removeprefix("SamplingParams.")  # which starts with the field
            raise APIError(400, message, param=message.partition(" ")[0]) from exc

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt's token ids through the checkpoint's chat template. With
        `continue_final_message` the last message, an assistant's, is left open for the model to
        go on writing (vLLM's field; a prefilled answer), instead of closed by the template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "this checkpoint has no chat template (chat_template.jinja or "
                "tokenizer_config.json); use /v1/completions with a formatted prompt",
                param="messages",
            )
        if continue_final_message and add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message extends the last message, add_generation_prompt starts a "
                "new one: set add_generation_prompt to false",
                param="continue_final_message",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise APIError(
                400,
                f"continue_final_message needs an assistant message last, got "
                f"{messages[-1].role!r}",
                param="continue_final_message",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
            )
        except jinja2.TemplateError as exc:  # a template's raise_exception: roles must alternate
            raise APIError(
                400, f"the checkpoint's chat template refused the messages: {exc}", param="messages"
            ) from exc
        return await self.encoder.encode(text, add_special_tokens=False)

    # ---- generation -----------------------------------------------------------------------------

    async def compile_structured_output(
        self, body: SamplingRequest, params: SamplingParams
    ) -> None:
        """Compiles the request's structured output, if any, in a worker thread: a schema can
        take a while, and the first one imports xgrammar (~2 s), which would stall every stream
        on the event loop. The engine thread then finds it in the compiler's cache. One that
        does not compile is a 400."""
        spec = params.structured_output
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.grammars.compile, spec)
        except ValueError as exc:
            # the one constraint the request sent; none: a forced tool call's parameters
            sources = [param for param, _ in self._constraints(body)]
            raise APIError(400, str(exc), param=sources[0] if sources else "tools") from exc

    def start(
        self,
        prompts: list[list[int]],
        params: Sequence[SamplingParams],
        stop: list[str],
        n: int = 1,
        include_stop: bool = False,
    ) -> list[RequestStream]:
        """One engine request per choice: `n` per prompt (`params[i]` for prompt i),
        prompt-major, as OpenAI numbers the choices. With a seed, choice j draws with seed + j (as
        vLLM does), so the n choices differ and each one can be repeated alone."""
        needed, limit = len(prompts) * n, self.engine.max_queue
        if limit is not None and needed > limit:
            raise APIError(
                400,
                f"this request needs {needed} engine requests ({len(prompts)} prompt(s) x n={n}) "
                f"but the server queues at most {limit} (--max-queue); send fewer choices",
                param="n",
            )
        base = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for i, (ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                for j in range(n):
                    choice = prompt_params
                    if prompt_params.seed is not None:
                        choice = replace(prompt_params, seed=prompt_params.seed + j)
                    request_id = f"{base}-{i * n + j}"
                    streams.append(
                        self.engine.add_request(request_id, ids, choice, stop, include_stop)
                    )
        except QueueFullError as exc:
            for stream in streams:
                stream.abort()
            raise APIError(
                503,
                f"the server's waiting queue is full ({exc}); retry later",
                error_type="server_overloaded",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            ) from exc
        except EngineUnavailableError as exc:
            raise as_api_error(exc) from exc
        return streams

    async def merged(
        self, streams: list[RequestStream]
    ) -> AsyncIterator[tuple[int, GenerationChunk] | None]:
        """Chunks of all streams as (choice index, chunk); None once a keep-alive interval passed
        with nothing sent. Leaving early aborts every unfinished stream. One stream (n = 1, the
        common case) is read directly: no task and no shared queue per chunk."""
        interval_s = self.settings.keepalive_interval_s
        if len(streams) == 1:
            (stream,) = streams
            silence = SilenceTimer(interval_s, stream.keep_alive)
            try:
                while not stream.finished:
                    chunk = await stream.next()
                    if chunk is KEEP_ALIVE:
                        yield None
                        continue
                    silence.reset()
                    yield 0, chunk
            finally:
                silence.cancel()
                stream.abort()
            return
        queue: asyncio.Queue[tuple[int, GenerationChunk] | BaseException | None] = asyncio.Queue()

        def keep_alive() -> None:
            if queue.empty():
                queue.put_nowait(None)

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                while not stream.finished:
                    chunk = await stream.next()  # never KEEP_ALIVE: the timer is the queue's
                    assert chunk is not KEEP_ALIVE
                    queue.put_nowait((index, chunk))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)

        silence = SilenceTimer(interval_s, keep_alive)
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        unfinished = len(streams)
        try:
            while unfinished:
                item = await queue.get()
                if item is None:
                    yield None
                    continue
                if isinstance(item, BaseException):
                    raise item
                silence.reset()
                unfinished -= item[1].finished
                yield item
        finally:
            silence.cancel()
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.abort()

    async def collect(
        self, streams: list[RequestStream], disconnected: Disconnected
    ) -> list[ChoiceOutput]:
        """Runs the streams to the end; a client that disconnects first aborts them."""
        results = [ChoiceOutput() for _ in streams]

        async def run() -> None:
            async for item in self.merged(streams):
                if item is not None:
                    results[item[0]].add(item[1])

        gen_task = asyncio.create_task(run())
        watch_task = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({gen_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_task.cancel()
            if not gen_task.done():
                gen_task.cancel()
            (outcome,) = await asyncio.gather(gen_task, return_exceptions=True)
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise as_api_error(outcome) from outcome
        return results
