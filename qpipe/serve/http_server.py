"""The HTTP server around the app: uvicorn, with one drain deadline for the whole shutdown."""

from __future__ import annotations

import asyncio
import logging
import math
import socket

import uvicorn

from qpipe.serve.async_engine import AsyncLLMEngine

log = logging.getLogger(__name__)
# Past the drain deadline: how long the aborted requests' clients get for their last bytes.
FLUSH_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown starts the engine's drain when it starts its own. New
    requests get a 503 at once, and uvicorn's wait for open connections and the engine's wait for
    its requests share one `--drain-timeout`: run one after the other, each with the full timeout,
    a shutdown could take twice as long as asked."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """At the drain deadline the engine aborts what is unfinished and each client is told (a
        503, or an error event and [DONE] in its stream); uvicorn cancels the handlers only
        FLUSH_S later, when those replies are out. Cancelled at the deadline itself, the streams
        ended mid-body and the waiting requests got a bare 500."""
        timeout = self.config.timeout_graceful_shutdown
        self.engine.begin_drain(math.inf if timeout is None else timeout)
        if timeout is not None:
            self.config.timeout_graceful_shutdown = timeout + FLUSH_S
        ending = asyncio.create_task(self.engine.shutdown())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def on_tick(self, counter: int) -> bool:
        """Also ends the server when the engine thread has died. Its requests already have their
        error; a process that answers every later one with a 503 waits for someone to notice,
        where an exit lets a supervisor (systemd, Kubernetes) restart it at once, as vLLM's
        server does when its engine dies."""
        if self.engine.error is not None and not self.should_exit:
            log.error("the engine failed (%s): shutting the server down", self.engine.error)
            self.should_exit = True
        return await super().on_tick(counter)
