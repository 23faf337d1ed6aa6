"""OpenAI-style error objects: what a client gets for every failure, with the status it implies."""

from __future__ import annotations

from qpipe.serve.async_engine import EngineUnavailableError
from qpipe.serve.openai_protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the client caused (or must wait out), rendered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.error_type, param=self.param, code=self.status
            )
        )


def as_api_error(exc: BaseException) -> APIError:
    """Any failure while serving a request, as the error its client sees: bad input the engine
    rejected is the client's (400); a request the shutdown ended is 503 (retry on another
    replica); anything else is the server's (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), error_type="service_unavailable")
    return APIError(500, f"engine error: {exc}", error_type="internal_error")
