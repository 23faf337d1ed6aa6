"""/v1/chat/completions: messages through the checkpoint's chat template, logprobs, stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from qpipe.serve.api_errors import APIError, as_api_error
from qpipe.serve.async_engine import GenerationChunk, RequestStream
from qpipe.serve.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    UsageInfo,
    tool_call_id,
)
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.serving_engine import (
    ChoiceOutput,
    Disconnected,
    OpenAIServing,
    sse_event,
    usage_info,
)
from qpipe.serve.tool_calls import ForcedToolCall


class OpenAIServingChat(OpenAIServing):
    async def _prepare(
        self, body: ChatCompletionRequest
    ) -> tuple[list[int], SamplingParams, ForcedToolCall | None]:
        self.check_model(body.model)
        self.check_fields(body)
        try:
            forced = ForcedToolCall.of(body.tools, body.tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from exc
        if forced is not None and self.structured_output(body) is not None:
            raise APIError(
                400,
                "a forced tool call is a structured output itself: drop response_format or "
                "structured_outputs, or set tool_choice to 'none'",
                param="tool_choice",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true (as in OpenAI's API)", param="top_logprobs"
            )
        tools = None if forced is None else [t.model_dump(exclude_none=True) for t in forced.tools]
        prompt = await self.chat_prompt(
            body.messages, body.add_generation_prompt, body.continue_final_message, tools
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        field, max_tokens = "max_tokens", body.max_tokens
        if body.max_completion_tokens is not None:  # OpenAI's newer name wins, 0 included
            field, max_tokens = "max_completion_tokens", body.max_completion_tokens
        params = self.sampling_params(
            body, max_tokens, len(prompt), logprobs, field,
            structured_output=None if forced is None else forced.structured_output(),
            prompt_field="messages",
        )  # fmt: skip
        return prompt, params, forced

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], k: int
    ) -> ChatLogprobs:
        content = []
        for token_id, candidates in zip(token_ids, logprobs, strict=False):
            top = sorted(candidates.items(), key=lambda kv: -kv[1])[:k]
            chosen = self._top_logprob(token_id, candidates.get(token_id, float("-inf")))
            content.append(
                ChatTokenLogprob(
                    **chosen.model_dump(), top_logprobs=[self._top_logprob(*kv) for kv in top]
                )
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> ChatTopLogprob:
        """A token as OpenAI lists it: its text and that text's UTF-8 bytes (a token that ends
        inside a character decodes to U+FFFD here, as in vLLM)."""
        token = self.tokenizer.decode([token_id])
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    async def create(
        self, body: ChatCompletionRequest, disconnected: Disconnected
    ) -> ChatCompletionResponse | AsyncIterator[bytes]:
        prompt, params, forced = await self._prepare(body)
        await self.compile_structured_output(body, params)
        streams = self.start(
            [prompt], [params], body.stop_strings(), body.n, body.include_stop_str_in_output
        )
        if body.stream:
            return self._stream(body, streams, len(prompt), forced)
        results = await self.collect(streams, disconnected)
        choices = []
        for index, result in enumerate(results):
            logprobs = None
            if body.logprobs:
                logprobs = self._logprobs(result.token_ids, result.logprobs, body.top_logprobs or 0)
            message = ChatResponseMessage(content=result.text)
            finish_reason = result.finish_reason
            if forced is not None and (calls := forced.calls(result.text)) is not None:
                message = ChatResponseMessage(content=None, tool_calls=calls)
                finish_reason = forced.finish_reason
            choices.append(
                ChatChoice(
                    index=index, message=message, logprobs=logprobs, finish_reason=finish_reason
                )
            )
        return ChatCompletionResponse(
            model=self.settings.served_model_name,
            choices=choices,
            usage=usage_info(results, [len(prompt)], body.n),
        )

    async def _stream(
        self,
        body: ChatCompletionRequest,
        streams: list[RequestStream],
        prompt_len: int,
        forced: ForcedToolCall | None,
    ) -> AsyncIterator[bytes]:
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = self.settings.served_model_name
        results = [ChoiceOutput() for _ in streams]

        def event(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
            chunk = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            )
            return sse_event(chunk.model_dump_json())

        call_ids = [tool_call_id() for _ in streams]  # a named call's id, per choice
        for index in range(len(streams)):
            role = ChatDelta(role="assistant", content="")
            yield event([ChatStreamChoice(index=index, delta=role)])
        try:
            async for item in self.merged(streams):
                if item is None:
                    yield b": keep-alive\n\n"
                    continue
                index, chunk = item
                results[index].add(chunk)
                logprobs = None
                if body.logprobs:
                    logprobs = self._logprobs(
                        chunk.token_ids, chunk.logprobs or [], body.top_logprobs or 0
                    )
                delta: ChatDelta | None = ChatDelta(content=chunk.text or None)
                finish_reason = chunk.finish_reason
                if forced is not None:
                    delta, finish_reason = forced_delta(
                        forced, chunk, results[index], call_ids[index]
                    )
                if delta is None and logprobs is None and not chunk.finished:
                    continue
                choice = ChatStreamChoice(
                    index=index,
                    delta=delta or ChatDelta(),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                )
                yield event([choice])
            if body.stream_options is not None and body.stream_options.include_usage:
                yield event([], usage_info(results, [prompt_len], body.n))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse_event(as_api_error(exc).body().model_dump_json())
        yield sse_event("[DONE]")


def forced_delta(
    forced: ForcedToolCall, chunk: GenerationChunk, result: ChoiceOutput, call_id: str
) -> tuple[ChatDelta | None, str | None]:
    """A forced tool call's stream (`result` already holds `chunk`): a named call's arguments as
    they come, with its id, type and name on the first delta; "required" calls all at once when
    the output is complete, as they can only be read then (partial JSON is not parsed here).
    Output that does not read as calls (cut by max_tokens) ends as text."""
    if forced.name is not None and chunk.text:
        first = result.text == chunk.text
        call = DeltaToolCall(
            index=0, id=call_id if first else None, type="function" if first else None,
            function=DeltaFunctionCall(name=forced.name if first else None, arguments=chunk.text),
        )  # fmt: skip
        return ChatDelta(tool_calls=[call]), chunk.finish_reason  # "stop", as OpenAI's
    if not chunk.finished or forced.name is not None:
        return None, chunk.finish_reason
    calls = forced.calls(result.text)
    if calls is None:
        return ChatDelta(content=result.text or None), chunk.finish_reason
    deltas = [
        DeltaToolCall(
            index=k,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )
        for k, call in enumerate(calls)
    ]
    return ChatDelta(tool_calls=deltas), forced.finish_reason
