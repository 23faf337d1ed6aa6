"""The HTTP server around the app: uvicorn, with one drain deadline for the whole shutdown."""

from __future__ import annotations

import math
import socket

import uvicorn

from qpipe.serve.async_engine import AsyncLLMEngine


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown starts the engine's drain when it starts its own. New
    requests get a 503 at once, and uvicorn's wait for open connections and the engine's wait for
    its requests share one `--drain-timeout`: run one after the other, each with the full timeout,
    a shutdown could take twice as long as asked."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        self.engine.begin_drain(math.inf if timeout is None else timeout)
        await super().shutdown(sockets)
