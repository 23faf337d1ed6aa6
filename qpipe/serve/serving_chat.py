"""/v1/chat/completions: messages through the checkpoint's chat template, logprobs, stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from qpipe.serve.api_errors import APIError, as_api_error
from qpipe.serve.async_engine import RequestStream
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
    UsageInfo,
)
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.serving_engine import (
    ChoiceOutput,
    Disconnected,
    OpenAIServing,
    sse_event,
    usage_info,
)


class OpenAIServingChat(OpenAIServing):
    def _prepare(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        self.check_model(body.model)
        self.check_unsupported(body)
        if body.tools and body.tool_choice != "none":
            raise APIError(
                400,
                "tool calling is not supported by qpipe's server: send tool_choice='none' for a "
                "text answer, or ask for the call's JSON as a structured output (response_format "
                "of type json_schema)",
                param="tools",
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = self.chat_prompt(messages, body.add_generation_prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        field, max_tokens = "max_tokens", body.max_tokens
        if body.max_completion_tokens is not None:  # OpenAI's newer name wins, 0 included
            field, max_tokens = "max_completion_tokens", body.max_completion_tokens
        return prompt, self.sampling_params(body, max_tokens, len(prompt), logprobs, field)

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], k: int
    ) -> ChatLogprobs:
        content = []
        for token_id, candidates in zip(token_ids, logprobs, strict=False):
            top = sorted(candidates.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                ChatTokenLogprob(
                    token=self.tokenizer.decode([token_id]),
                    logprob=candidates.get(token_id, float("-inf")),
                    top_logprobs=[
                        ChatTopLogprob(token=self.tokenizer.decode([t]), logprob=lp)
                        for t, lp in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    async def create(
        self, body: ChatCompletionRequest, disconnected: Disconnected
    ) -> ChatCompletionResponse | AsyncIterator[bytes]:
        prompt, params = self._prepare(body)
        await self.compile_structured_output(body, params)
        streams = self.start([prompt], params, body.stop_strings(), body.n)
        if body.stream:
            return self._stream(body, streams, len(prompt))
        results = await self.collect(streams, disconnected)
        choices = []
        for index, result in enumerate(results):
            logprobs = None
            if body.logprobs:
                logprobs = self._logprobs(result.token_ids, result.logprobs, body.top_logprobs or 0)
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=result.text),
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                )
            )
        return ChatCompletionResponse(
            model=self.settings.served_model_name,
            choices=choices,
            usage=usage_info(results, [len(prompt)], body.n),
        )

    async def _stream(
        self, body: ChatCompletionRequest, streams: list[RequestStream], prompt_len: int
    ) -> AsyncIterator[bytes]:
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = self.settings.served_model_name
        results = [ChoiceOutput() for _ in streams]

        def event(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
            chunk = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            )
            return sse_event(chunk.model_dump_json())

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
                if not chunk.text and logprobs is None and not chunk.finished:
                    continue
                choice = ChatStreamChoice(
                    index=index,
                    delta=ChatDelta(content=chunk.text or None),
                    logprobs=logprobs,
                    finish_reason=chunk.finish_reason,
                )
                yield event([choice])
            if body.stream_options is not None and body.stream_options.include_usage:
                yield event([], usage_info(results, [prompt_len], body.n))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse_event(as_api_error(exc).body().model_dump_json())
        yield sse_event("[DONE]")
