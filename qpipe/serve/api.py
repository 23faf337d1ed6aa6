"""The FastAPI app: OpenAI routes, health, metrics, (de)tokenize; errors as OpenAI error objects.

FastAPI answers bad bodies with 422 and its own shape; OpenAI clients expect 400 and
`{"error": {...}}`, so validation errors and HTTP errors are re-rendered here.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from qpipe.serve.api_errors import APIError, as_api_error
from qpipe.serve.async_engine import AsyncLLMEngine
from qpipe.serve.metrics import CONTENT_TYPE
from qpipe.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from qpipe.serve.prompt_encoder import PromptEncoder
from qpipe.serve.serving_chat import OpenAIServingChat
from qpipe.serve.serving_completion import OpenAIServingCompletion
from qpipe.serve.serving_engine import ServingSettings

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_ECHOED = 80  # characters of a rejected value quoted back in a validation error
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # /health and /metrics stay open to probes


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None = None
    keepalive_interval_s: float = 15.0
    drain_timeout_s: float = 30.0


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message and the offending field. A field with a union type (like `prompt`) fails once
    per member, at locations below the field: the field is their common prefix."""
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {errors[0].get('msg')}", None
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    common = os.path.commonprefix(locs)  # NOTE: works on lists of path parts, not just strings
    param = ".".join(common) or None
    reasons = "; ".join(dict.fromkeys(str(e.get("msg")) for e in errors))
    if len(errors) > 1:
        reasons = f"no accepted form matches ({reasons})"
    where = f"{param}: " if param else ""
    if errors[0].get("type") == "missing":  # its input is the object around it: the whole body
        return f"{where}{reasons}", param
    got = repr(errors[0].get("input"))
    if len(got) > MAX_ECHOED:
        got = got[:MAX_ECHOED] + "..."
    return f"{where}{reasons} (got {got})", param


class ApiKeyMiddleware:
    """`--api-key`, checked before anything reads the request: FastAPI parses a body before a
    route's dependencies run, so a check there answered a keyless request with a malformed body
    400, not 401. The key is compared as bytes: `secrets.compare_digest` refuses str with
    non-ASCII characters, which turned such a header into a 500."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(KEYED_PATHS)
            and not self._authorized(scope)
        ):
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                "server was started with (--api-key)",
                error_type="authentication_error",
            )
            await _error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(token, self.api_key)
        return False


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    serving_settings = ServingSettings(
        served_model_name=settings.served_model_name,
        keepalive_interval_s=settings.keepalive_interval_s,
    )
    encoder = PromptEncoder(
        engine.engine.tokenizer, in_worker=engine.engine.model_runner.device.type != "cpu"
    )
    completion = OpenAIServingCompletion(engine, serving_settings, encoder)
    chat = OpenAIServingChat(engine, serving_settings, encoder)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(settings.drain_timeout_s)

    app = FastAPI(title="qpipe server", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # with its headers: a 405 must say which methods the route takes (`Allow`)
        headers = dict(exc.headers or {})
        return _error_response(
            APIError(exc.status_code, str(exc.detail), error_type="http_error", headers=headers)
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # a bug's 500 in OpenAI's shape too, not starlette's plain text (the traceback is logged)
        return _error_response(as_api_error(exc))

    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    def disconnect_watcher(request: Request):  # noqa: ANN202 - a coroutine factory
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        return disconnected

    def respond(result: object) -> Response:
        if isinstance(result, AsyncIterator):
            return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(result.model_dump())  # type: ignore[attr-defined]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return respond(await completion.create(body, disconnect_watcher(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return respond(await chat.create(body, disconnect_watcher(request)))

    card = ModelCard(
        id=settings.served_model_name, root=settings.model_path, max_model_len=chat.max_model_len
    )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model:path}")  # the openai client's models.retrieve; ids may hold '/'
    async def model(model: str) -> ModelCard:
        if model != card.id:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {card.id!r}",
                param="model",
            )
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            ids = await chat.chat_prompt(
                body.messages, body.add_generation_prompt, body.continue_final_message
            )
        else:
            ids = await encoder.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=chat.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(body.model)
        chat.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=chat.tokenizer.decode(body.tokens))

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            raise APIError(503, "the engine is not running", error_type="service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app
