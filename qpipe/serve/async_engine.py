"""Runs the synchronous `LLMEngine` on a background thread and feeds asyncio request streams.

The engine is single-threaded by design, so only the engine thread touches it: HTTP handlers post
"add" and "abort" commands to a deque and wake the thread; the thread applies them between steps,
detokenizes each step's tokens and hands the chunks to each request's stream. Detokenizing on
the engine thread lets a stop string abort its request before the next step, so its blocks are freed
at once and no token is computed past it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from qpipe.serve.detokenizer import IncrementalDetokenizer
from qpipe.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qpipe.serve.engine import LLMEngine, RequestOutput
    from qpipe.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queue` requests: the client should retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or died: no new requests are taken."""


class GenerationChunk(NamedTuple):
    """What a request gained since its last chunk. `text` is safe to show: no partial UTF-8
    character, no partial stop string, nothing past a stop string. A tuple, as the engine's
    `RequestOutput`: the engine thread builds one per running request per step."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first chunk

    def then(self, later: GenerationChunk) -> GenerationChunk:
        """This chunk and the one after it, as one."""
        return GenerationChunk(
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=None if self.logprobs is None else self.logprobs + (later.logprobs or []),
            finished=later.finished,
            finish_reason=later.finish_reason,
            num_prompt_tokens=later.num_prompt_tokens,
            num_cached_tokens=later.num_cached_tokens,
            prompt_logprobs=(
                self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
            ),
        )


class KeepAlive(enum.Enum):
    """What a silent stream yields when its keep-alive interval passes."""

    KEEP_ALIVE = enum.auto()


KEEP_ALIVE = KeepAlive.KEEP_ALIVE


class PendingChunks:
    """What a request's consumer has not taken yet, as one chunk: a chunk that arrives before the
    last was taken is merged into it. When the engine steps faster than the event loop serves
    every stream (an H200 at concurrency 256: 10,961 output tok/s offline, 3,706 over HTTP), a
    stream's next wake-up then carries every token since its last, one event and one write,
    instead of a backlog of one event per token (vLLM's output collector does the same). A
    failure replaces what is pending and stays. A keep-alive is pending only while nothing else
    is, and a chunk replaces it."""

    def __init__(self) -> None:
        self._item: GenerationChunk | BaseException | KeepAlive | None = None
        self._ready = asyncio.Event()

    def put(self, item: GenerationChunk | BaseException) -> None:
        pending = self._item
        if isinstance(pending, BaseException):
            return
        if isinstance(pending, GenerationChunk) and isinstance(item, GenerationChunk):
            item = pending.then(item)
        self._item = item
        self._ready.set()

    def keep_alive(self) -> None:
        if self._item is None:
            self._item = KEEP_ALIVE
            self._ready.set()

    async def get(self) -> GenerationChunk | BaseException | KeepAlive:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        assert item is not None
        return item


@dataclass
class _RequestState:
    loop: asyncio.AbstractEventLoop
    pending: PendingChunks
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None


class RequestStream:
    """The consumer side of one request. Aborting it before it finished is how a client
    disconnect frees the request's KV blocks."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._pending = state.pending

    async def next(self) -> GenerationChunk | KeepAlive:
        """Every token since the last call, as one chunk; or `KEEP_ALIVE` when `keep_alive` was
        called with nothing pending."""
        item = await self._pending.get()
        if item is KEEP_ALIVE:
            return item
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def keep_alive(self) -> None:
        self._pending.keep_alive()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """`make_engine` runs on the engine thread, so that the model is loaded, warmed up and run by
    one OS thread. torch's OpenMP runtime (libgomp) gives each thread that runs a parallel op its
    own worker team; once two teams exist on a machine with as many cores as one team has
    threads, libgomp stops spin-waiting between parallel regions and puts its workers to sleep on
    a futex after each one. Measured here with SmolLM2 in bf16 at concurrency 32: a decode step
    took 82 ms with the model loaded on the main thread and stepped on another, 57 ms with both
    on the same thread. The constructor waits for the engine and re-raises its load error."""

    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        metrics: ServerMetrics,
        max_queue: int | None = None,
        idle_poll_s: float = 1.0,
    ) -> None:
        self.engine: LLMEngine
        self.metrics = metrics
        self.max_queue = max_queue
        self._idle_poll_s = idle_poll_s
        self._commands: deque[tuple[str, str, object]] = deque()
        self._states: dict[str, _RequestState] = {}
        self._lock = threading.Lock()  # guards _states between handlers and the engine thread
        # the engine thread's own; weak, so that a closed loop (tests run several) can go
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self._drain_deadline: float | None = None
        self.error: BaseException | None = None
        self._num_waiting = 0
        self._serving = threading.Event()
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(make_engine, built), name="qpipe-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if self.error is not None:
            raise self.error

    # ---- called from the event loop -------------------------------------------------------------

    def start(self) -> None:
        self._serving.set()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._states)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> RequestStream:
        if not self._accepting or not self.healthy:
            raise EngineUnavailableError("the server is shutting down or its engine failed")
        detokenizer = IncrementalDetokenizer(
            self.engine.tokenizer, prompt_token_ids, stop, params.min_tokens, include_stop
        )
        state = _RequestState(asyncio.get_running_loop(), PendingChunks(), detokenizer)
        with self._lock:
            pending_adds = sum(1 for kind, *_ in self._commands if kind == "add")
            if self.max_queue is not None and self._num_waiting + pending_adds >= self.max_queue:
                raise QueueFullError(f"{self._num_waiting + pending_adds} requests are waiting")
            self._states[request_id] = state
            self._commands.append(("add", request_id, (list(prompt_token_ids), params)))
        self._wake.set()
        return RequestStream(self, request_id, state)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", request_id, None))
        self._wake.set()

    def begin_drain(self, drain_timeout_s: float) -> None:
        """Stops taking requests and starts the clock on the unfinished ones: they get until
        `drain_timeout_s` from now, however late `shutdown` comes."""
        self._accepting = False
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + drain_timeout_s

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stops taking requests, lets the unfinished ones finish (until the deadline of a drain
        already begun, else for `drain_timeout_s`), then stops the engine thread."""
        self.begin_drain(drain_timeout_s)
        deadline = self._drain_deadline
        while self.num_unfinished and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        if self.num_unfinished:
            log.warning("shutdown: aborting %d unfinished requests", self.num_unfinished)
        self._stop = True
        self._wake.set()
        self._serving.set()
        await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineUnavailableError("the server shut down before the request finished"))

    # ---- the engine thread ----------------------------------------------------------------------

    def _main(self, make_engine: Callable[[], LLMEngine], built: threading.Event) -> None:
        try:
            self.engine = make_engine()
            runner = self.engine.model_runner
            self.metrics.describe_cache(
                runner.block_size,
                runner.kv_cache_dtype_name,
                runner.num_kv_blocks,
                runner.config.enable_prefix_caching,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self.error = exc
            return
        finally:
            built.set()
        self._serving.wait()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                self._apply_commands()
                if self.engine.has_unfinished():
                    batch = self.engine.scheduler.schedule()
                    # the queue as this step leaves it, before it runs: a request it admits
                    # (a long prefill) no longer counts against --max-queue while it computes
                    self._observe_stats()
                    self._hand_over(self._deliver_step(self.engine.execute(batch)))
                else:
                    self._observe_stats()
                    self._wake.wait(self._idle_poll_s)
            self._abort_unfinished()
        except BaseException as exc:  # noqa: BLE001 - every waiting client must hear about it
            log.exception("engine thread failed")
            self.error = exc
            self._fail_all(exc)

    def _apply_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, request_id, payload = self._commands.popleft()
            if kind == "add":
                prompt_token_ids, params = payload  # type: ignore[misc]
                try:
                    self.engine.add_request(request_id, prompt_token_ids, params)
                except ValueError as exc:
                    self._finish_with(request_id, exc)
                else:  # waiting from now on, not only from the next step's stats: --max-queue
                    with self._lock:
                        self._num_waiting += 1
            else:
                # counted before the blocks are freed, so an idle engine has every abort on record
                with self._lock:
                    dropped = self._states.pop(request_id, None)
                if dropped is not None:
                    self.metrics.request_finished("abort")
                self.engine.abort_request(request_id)

    def _abort_unfinished(self) -> None:
        """At shutdown, what the drain did not finish leaves the engine with its blocks freed;
        `shutdown` then tells the clients."""
        with self._lock:
            unfinished = list(self._states)
        for request_id in unfinished:
            self.engine.abort_request(request_id)
            self.metrics.request_finished("abort")

    def _hand_over(self, deliveries: list[tuple[_RequestState, GenerationChunk] | None]) -> None:
        """At most one wake-up of each event loop per step, not one per request: with 64 streams
        the per-chunk wake-ups (a pipe write each) cost the GIL more than the step's own Python."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[PendingChunks, GenerationChunk]]] = {}
        for delivery in deliveries:
            if delivery is not None:
                state, chunk = delivery
                by_loop.setdefault(state.loop, []).append((state.pending, chunk))
        for loop, items in by_loop.items():
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox()
            mailbox.post(loop, items)

    def _deliver_step(
        self, outputs: list[RequestOutput]
    ) -> list[tuple[_RequestState, GenerationChunk] | None]:
        """One clock reading, one token count and one inter-token-latency update per step: every
        output of a step arrives at once, and at a GPU's step rate each per-token call here is a
        share of the step."""
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(sum(len(out.new_token_ids) for out in outputs))
        gaps: list[float] = []
        deliveries = [self._deliver(output, now, gaps) for output in outputs]
        self.metrics.inter_token_latency.observe_many(gaps)
        return deliveries

    def _deliver(
        self, output: RequestOutput, now: float, gaps: list[float]
    ) -> tuple[_RequestState, GenerationChunk] | None:
        """The chunk for one request's output; its inter-token gap goes into `gaps`."""
        with self._lock:
            state = self._states.get(output.request_id)
        if state is None:  # aborted while this step ran
            return None
        metrics = self.metrics
        if state.last_token_time is None:
            metrics.time_to_first_token.observe(now - state.arrival)
            metrics.prompt_tokens.inc(output.num_prompt_tokens)
        else:
            gaps.append(now - state.last_token_time)
        state.last_token_time = now

        detokenizer = state.detokenizer
        stop_token = output.finished and output.finish_reason == "stop"  # EOS or a stop id
        text = detokenizer.add_tokens(output.new_token_ids, stop_terminated=stop_token)
        finished, finish_reason = output.finished, output.finish_reason
        if detokenizer.stopped:
            if not finished:
                self.engine.abort_request(output.request_id)
            finished, finish_reason = True, "stop"
        if finished:
            text += detokenizer.flush()
            metrics.e2e_request_latency.observe(now - state.arrival)
            metrics.request_finished(finish_reason or "stop")
            with self._lock:
                self._states.pop(output.request_id, None)
        chunk = GenerationChunk(
            text=text,
            token_ids=list(output.new_token_ids),
            logprobs=output.new_logprobs,
            finished=finished,
            finish_reason=finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs=output.prompt_logprobs,
        )
        return state, chunk

    def _observe_stats(self) -> None:
        stats = self.engine.stats()
        self._num_waiting = stats.num_waiting
        self.metrics.observe_engine(stats)

    def _finish_with(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            state = self._states.pop(request_id, None)
        if state is not None:
            state.loop.call_soon_threadsafe(state.pending.put, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            states, self._states = self._states, {}
        for state in states.values():
            state.loop.call_soon_threadsafe(state.pending.put, exc)


class LoopMailbox:
    """Chunks on their way to one event loop. While a wake-up is on its way, a later step's chunks
    join it rather than send another: a wake-up is a socket write, which gives up the GIL, and the
    engine thread must then win it back from a loop that is busy streaming, the case where the
    loop runs behind the engine and the next wake-up was not needed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[PendingChunks, GenerationChunk]] = []
        self._woken = False

    def post(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[PendingChunks, GenerationChunk]]
    ) -> None:
        with self._lock:
            self._items += items
            if self._woken:
                return
            self._woken = True
        loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
        for pending, chunk in items:
            pending.put(chunk)
