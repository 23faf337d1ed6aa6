"""/v1/completions: prompts as text or token ids, several per request, echo, logprobs, stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from qpipe.serve.api_errors import APIError, as_api_error
from qpipe.serve.async_engine import RequestStream
from qpipe.serve.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]  # type: ignore[list-item]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        texts = [p for p in prompts if isinstance(p, str)]  # encoded together, in one batch
        encoded = iter(await asyncio.gather(*(self.encoder.encode(text) for text in texts)))
        token_lists = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt is empty: it encodes to no tokens", param="prompt")
            self.check_token_ids(ids, "prompt")
            token_lists.append(ids)
        return token_lists

    async def _prepare(self, body: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
        self.check_model(body.model)
        self.check_fields(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported by qpipe's server", param="suffix")
        prompts = await self._prompts(body)
        longest = max(len(p) for p in prompts)
        # echo with logprobs scores the prompt too, as lm-eval's loglikelihood requests need
        prompt_logprobs = body.logprobs if body.echo else None
        params = self.sampling_params(
            body, body.max_tokens, longest, body.logprobs, prompt_logprobs=prompt_logprobs
        )
        return prompts, params

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float]],
        k: int,
        offset: int,
        echoed: tuple[list[int], list[dict[int, float] | None]] | None = None,
    ) -> CompletionLogprobs:
        """OpenAI's logprobs object, listing first the `echoed` prompt's token ids and logprobs
        when given; a None entry (the first prompt token) scores nothing."""
        scored: list[dict[int, float] | None] = list(logprobs)
        if echoed is not None:
            token_ids, scored = echoed[0] + token_ids, echoed[1] + scored
        out = CompletionLogprobs()
        for token_id, candidates in zip(token_ids, scored, strict=False):
            token = self.tokenizer.decode([token_id])
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if candidates is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(candidates.get(token_id))
            # the k most likely and the chosen token, as OpenAI's legacy API and vLLM list them
            top = dict(sorted(candidates.items(), key=lambda kv: -kv[1])[:k])
            if token_id in candidates:
                top[token_id] = candidates[token_id]
            out.top_logprobs.append({self.tokenizer.decode([t]): lp for t, lp in top.items()})
        return out

    async def create(
        self, body: CompletionRequest, disconnected: Disconnected
    ) -> CompletionResponse | AsyncIterator[bytes]:
        prompts, params = await self._prepare(body)
        await self.compile_structured_output(body, params)
        n = body.n
        # without max_tokens each prompt may fill its own room, as in vLLM (validated above on
        # the longest, whose room is the smallest)
        per_prompt = [
            params if body.max_tokens is not None else replace(params, max_tokens=room)
            for room in (self.max_model_len - len(p) for p in prompts)
        ]
        streams = self.start(
            prompts, per_prompt, body.stop_strings(), n, body.include_stop_str_in_output
        )
        echoes = [self.tokenizer.decode(p) if body.echo else "" for p in prompts]
        if body.stream:
            return self._stream(body, streams, prompts, echoes)
        results = await self.collect(streams, disconnected)
        choices = []
        for i, result in enumerate(results):
            logprobs = None
            if body.logprobs is not None:
                echoed = None
                if body.echo and result.prompt_logprobs is not None:
                    echoed = (prompts[i // n], result.prompt_logprobs)
                logprobs = self._logprobs(
                    result.token_ids, result.logprobs, body.logprobs, 0, echoed
                )
            choices.append(
                CompletionChoice(
                    index=i,
                    text=echoes[i // n] + result.text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                )
            )
        return CompletionResponse(
            model=self.settings.served_model_name,
            choices=choices,
            usage=usage_info(results, [len(p) for p in prompts], n),
        )

    async def _stream(
        self,
        body: CompletionRequest,
        streams: list[RequestStream],
        prompts: list[list[int]],
        echoes: list[str],
    ) -> AsyncIterator[bytes]:
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = self.settings.served_model_name
        n = body.n
        results = [ChoiceOutput() for _ in streams]
        offsets = [len(echoes[i // n]) for i in range(len(streams))]
        pending_echo = [bool(echoes[i // n]) for i in range(len(streams))]

        def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
            response = CompletionResponse(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            )
            return sse_event(response.model_dump_json())

        try:
            async for item in self.merged(streams):
                if item is None:
                    yield b": keep-alive\n\n"
                    continue
                index, chunk = item
                results[index].add(chunk)
                logprobs = None
                if body.logprobs is not None:
                    echoed = None
                    if chunk.prompt_logprobs is not None and pending_echo[index]:
                        echoed, offsets[index] = (prompts[index // n], chunk.prompt_logprobs), 0
                    logprobs = self._logprobs(
                        chunk.token_ids, chunk.logprobs or [], body.logprobs, offsets[index], echoed
                    )
                    offsets[index] += sum(len(t) for t in logprobs.tokens)
                text = chunk.text
                if pending_echo[index]:
                    text, pending_echo[index] = echoes[index // n] + text, False
                if not text and logprobs is None and not chunk.finished:
                    continue
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=chunk.finish_reason
                )
                yield event([choice])
            if body.stream_options is not None and body.stream_options.include_usage:
                yield event([], usage_info(results, [len(p) for p in prompts], n))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse_event(as_api_error(exc).body().model_dump_json())
        yield sse_event("[DONE]")
