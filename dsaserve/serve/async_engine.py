"""The engine core on a thread of its own, reached from the HTTP event loop through typed messages.

The engine is not thread-safe and `step()` blocks while the model runs, so exactly one thread (the
engine core) owns it. The event loop never touches the engine; it sends messages and receives each
step's outputs on per-request asyncio queues:

    event loop(s)                                        engine-core thread
    ─────────────                                        ──────────────────
    add_request ──► AddRequest ─┐                        loop:
    stream.abort ─► Abort ──────┼──► inbox (queue.Queue)    wait for messages while idle
    shutdown ─────► Shutdown ───┤                           handle them (add / abort / call)
    call_in_core ─► CallInCore ─┘                           engine.step() while work remains
                                                            publish engine.stats()
    RequestStream.queue ◄── loop.call_soon_threadsafe(one batch per loop per step)

Continuous batching falls out of the loop: requests that arrive during a step join the next one.
If the engine raises, the core marks itself dead: every request in flight receives EngineDeadError,
later requests are refused at once, and `is_alive` turns false (so /health fails). Nothing waits
forever, because the death and every new registration are serialised by one lock.

A stream holds at most `max_stream_buffer` outputs its consumer has not taken: a client that stops
reading blocks its HTTP writer, not the engine, and once its backlog passes the bound the request
is aborted (freeing its KV blocks) and its buffer dropped; the consumer, if it ever reads again,
gets StreamOverflowError. Memory per stream is bounded whatever the client does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from dsaserve.core import (
    EngineDeadError,
    EngineStats,
    KVTransferParams,
    RequestError,
    RequestOutput,
    SamplingParams,
)

if TYPE_CHECKING:
    from dsaserve.config import EngineConfig
    from dsaserve.engine.engine import LLMEngine
    from dsaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------
# Messages: event loop → engine core
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    kv_remote: dict | None = None  # P/D: the prefill engine's side channel, read beforehand
    # where its outputs go: the stream registered for this request, not whichever holds its id
    # when an output is posted (an aborted request's last outputs and its retry's differ)
    stream: RequestStream | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class CallInCore:
    """Run `fn(engine)` on the core thread: the only safe way to read engine state from outside
    (accounting checks in tests, debugging)."""

    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


EngineCoreMessage = AddRequest | Abort | Shutdown | CallInCore


# ------------------------------------------------------------------------------------------------
# Items: engine core → one request's stream
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    """The engine accepted the request (sent before any output, so errors can still be a 400)."""


class StreamOverflowError(RuntimeError):
    """The consumer fell more than `max_stream_buffer` outputs behind; the request was aborted."""


StreamItem = Admitted | RequestOutput | RequestError | EngineDeadError | StreamOverflowError
# Outputs (engine steps) one stream may hold unread: seconds of a client's stall at any step time.
DEFAULT_MAX_STREAM_BUFFER = 1024


class RequestStream:
    """The outputs of one request, consumed on the event loop that added it.

    Iterate it for RequestOutputs until one is finished. Leaving early (a client disconnect, a stop
    string) must call `abort()`, which frees the request's KV blocks in the engine.
    """

    def __init__(
        self, request_id: str, owner: AsyncEngine, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()  # bounded by _put
        self.finished = False
        self.overflowed = False
        self._owner = owner

    def _put(self, item: StreamItem) -> None:
        """On the stream's loop: enqueue, or abort the request once its consumer is too far
        behind. Items that end the stream are always taken, so the consumer always sees an end."""
        if self.overflowed:
            return  # aborted: late outputs of the request are dropped
        if (isinstance(item, RequestOutput) and not item.finished
                and self.queue.qsize() >= self._owner.max_stream_buffer):
            self.overflowed = True
            while not self.queue.empty():  # free the backlog now, not when the client returns
                self.queue.get_nowait()
            self.queue.put_nowait(StreamOverflowError(
                f"the client fell {self._owner.max_stream_buffer} outputs behind; "
                "the request was aborted"))
            self._owner.num_stream_overflows += 1
            self._owner._abort(self.request_id)  # not abort(): the consumer must still see why
            return
        self.queue.put_nowait(item)

    async def _next(self) -> StreamItem:
        item = await self.queue.get()
        if isinstance(item, RequestError | EngineDeadError | StreamOverflowError):
            self.finished = True
            raise item
        if isinstance(item, RequestOutput) and item.finished:
            self.finished = True
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._next()
            if isinstance(item, RequestOutput):
                yield item

    def abort(self) -> None:
        """Stop the request if it is still running (idempotent; safe after it finished)."""
        if not self.finished:
            self.finished = True
            self._owner._abort(self.request_id)


# ------------------------------------------------------------------------------------------------
# The engine-core thread and its asyncio front
# ------------------------------------------------------------------------------------------------
class AsyncEngine:
    """Owns an LLMEngine on a dedicated thread; every public method is safe from any other thread.

    Started on construction; `shutdown()` stops the thread (requests in flight get EngineDeadError).
    """

    def __init__(self, engine: LLMEngine,
                 max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER) -> None:
        self._engine = engine
        self.max_stream_buffer = max_stream_buffer
        self.num_stream_overflows = 0  # requests aborted for a slow consumer (event-loop side)
        self._inbox: queue.Queue[EngineCoreMessage] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # registered by loops, popped by either side
        # ids the engine holds → the stream their outputs go to; touched by the core thread only
        self._live: dict[str, RequestStream] = {}
        # ids aborted by their clients whose "abort" answer the engine has yet to give: nobody
        # waits for it, and a retry under the same id (allowed at once) must not receive it
        self._unanswered: Counter[str] = Counter()
        self._lock = threading.Lock()  # serialises death against registration
        self._dead_reason: str | None = None
        self._stats = engine.stats()  # republished by the core thread after every iteration
        self._thread = threading.Thread(target=self._core_loop, name="engine-core", daemon=True)
        self._thread.start()

    # ---- read-only views ----------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._engine.config  # frozen: safe to share

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._engine.tokenizer  # never used by the core thread

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def stats(self) -> EngineStats:
        """The snapshot taken after the core's latest iteration (never blocks on a step)."""
        return self._stats

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> RequestStream:
        """Hand a request to the core and wait until it is admitted.

        Raises RequestError when the engine rejects it (→ HTTP 400) and EngineDeadError when the
        core is gone (→ 503); either way nothing is left allocated.
        """
        kv_remote = None
        disagg = self.config.disagg
        if (kv_transfer_params is not None and kv_transfer_params.do_remote_prefill
                and disagg is not None and disagg.is_consumer):
            # Network I/O here, on a worker thread: a slow or unreachable prefill host stalls
            # this request only, never the engine core's steps. An id in use is refused first,
            # so that its fetch does not claim the held request for nothing (a claim refused
            # later in the core is given back there).
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            from dsaserve.disagg.connector import fetch_remote

            kv_remote = await asyncio.to_thread(fetch_remote, kv_transfer_params,
                                                disagg.transfer_timeout_s, request_id)
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._inbox.put(AddRequest(request_id, list(prompt_token_ids), params, cache_salt,
                                       kv_transfer_params, kv_remote, stream))
        try:
            item = await stream._next()
        except BaseException:
            # Rejected, the core died, or the caller was cancelled while waiting for admission.
            self._streams.pop(request_id, None)
            stream.abort()
            raise
        assert isinstance(item, Admitted), f"first stream item must be Admitted, got {item!r}"
        return stream

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._inbox.put(Abort(request_id))

    def call_in_core(self, fn: Callable[[LLMEngine], T], timeout: float | None = 30.0) -> T:
        """Run `fn(engine)` between two steps and return its result (blocks the calling thread:
        never call it from the core thread or from an event loop serving requests)."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            self._inbox.put(CallInCore(fn, result))
        return result.result(timeout)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core after its current step; requests still in flight get EngineDeadError."""
        self._inbox.put(Shutdown())
        self._thread.join(timeout)

    # ---- the core thread -----------------------------------------------------------------------
    def _core_loop(self) -> None:
        from dsaserve.engine.engine import POLL_INTERVAL_S  # (the engine's module is loaded)

        try:
            while True:
                idle = not self._engine.has_unfinished_requests()
                # only transfers in flight: a short wait, not a spinning core
                wait = POLL_INTERVAL_S if not idle and self._engine.only_polling else None
                for message in self._receive(block=idle, timeout=wait):
                    if isinstance(message, Shutdown):
                        self._die("the engine was shut down")
                        self._engine.shutdown()  # no worker process outlives the server
                        return
                    self._handle(message)
                # 1. One scheduling step over everything running (continuous batching).
                outputs = self._engine.step() if self._engine.has_unfinished_requests() else []
                # 2. Publish the accounting (a reference swap: readers never lock) before the
                #    outputs, so whoever has seen an output sees stats that include it.
                self._stats = self._engine.stats()
                # 3. Route the outputs to their streams.
                self._dispatch(outputs)
        except Exception as e:
            logger.exception("engine core failed; every request in flight is failed with it")
            self._die(f"engine core failed: {type(e).__name__}: {e}")
            self._engine.shutdown()

    def _receive(self, block: bool, timeout: float | None = None) -> list[EngineCoreMessage]:
        """All queued messages; waits for the first one when `block` (the engine is idle), or
        up to `timeout` seconds for it."""
        messages = []
        if block or timeout is not None:
            try:
                messages.append(self._inbox.get(timeout=None if block else timeout))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, message: EngineCoreMessage) -> None:
        if isinstance(message, AddRequest):
            stream = message.stream
            assert stream is not None, "AddRequest without its stream"
            try:
                self._engine.add_request(
                    message.request_id, message.prompt_token_ids, message.params,
                    cache_salt=message.cache_salt, kv_transfer_params=message.kv_transfer_params,
                    kv_remote=message.kv_remote,
                )
            except RequestError as e:
                self._post([(stream, e)])
                return
            except Exception as e:  # a bug met by this request alone: fail it, keep the engine
                logger.exception("engine core: adding request %s failed", message.request_id)
                self._engine.check_integrity()  # torn state raises: the core dies (run())
                failed = RequestOutput(
                    request_id=message.request_id, new_token_ids=(), finished=True,
                    finish_reason="abort", num_prompt_tokens=len(message.prompt_token_ids),
                    num_cached_tokens=0, num_output_tokens=0,
                    error=f"internal error while adding the request: {type(e).__name__}: {e}")
                self._post([(stream, Admitted()), (stream, failed)])
                return
            self._live[message.request_id] = stream
            self._post([(stream, Admitted())])
        elif isinstance(message, Abort):
            # A request may finish in the same step its client leaves: abort only what is live.
            if message.request_id in self._live:
                del self._live[message.request_id]
                self._unanswered[message.request_id] += 1
                self._engine.abort_request(message.request_id)
        elif isinstance(message, CallInCore):
            try:
                message.result.set_result(message.fn(self._engine))
            except Exception as e:  # the caller's function failed, not the engine
                message.result.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            if out.finished and out.finish_reason == "abort" and self._unanswered[out.request_id]:
                self._unanswered[out.request_id] -= 1  # the aborted one's, not a retry's
                if not self._unanswered[out.request_id]:
                    del self._unanswered[out.request_id]
                continue
            stream = (self._live.pop(out.request_id, None) if out.finished
                      else self._live.get(out.request_id))
            if stream is not None:
                items.append((stream, out))
        self._post(items)

    def _post(self, items: list[tuple[RequestStream, StreamItem]]) -> None:
        """Deliver items to their streams: one wake-up per event loop, however many requests."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = {}
        for stream, item in items:
            # aborted by its consumer (nobody is listening), maybe already retried under its id
            if self._streams.get(stream.request_id) is not stream:
                continue
            if isinstance(item, RequestOutput) and item.finished:
                self._streams.pop(stream.request_id, None)
            batches.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: its server is gone
                pass

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead_reason = reason
            streams = list(self._streams.values())
            self._streams.clear()
            pending = self._receive(block=False)
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(_deliver, [(stream, EngineDeadError(reason))])
            except RuntimeError:
                pass
        for message in pending:
            if isinstance(message, CallInCore):
                message.result.set_exception(EngineDeadError(reason))


def _deliver(batch: list[tuple[RequestStream, StreamItem]]) -> None:
    for stream, item in batch:
        stream._put(item)
