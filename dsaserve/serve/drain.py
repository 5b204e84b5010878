"""Graceful shutdown: on SIGTERM (or SIGINT) the server drains instead of dropping its requests.

    signal ──► draining: new requests and /health get 503 (load balancers stop sending),
               requests in flight run on
           ──► all finished, or --shutdown-timeout elapsed: the engine is shut down (streams still
               open end with an error event, then [DONE]), uvicorn closes its connections, exit 0
    a second signal ──► exit now

The listening socket stays open while draining, so a client that connects then gets a 503 it can
retry elsewhere rather than a refused connection it cannot tell from a crash.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from dsaserve.serve.middleware import send_error

logger = logging.getLogger(__name__)

# Scrapers may watch the drain; everything else is refused once it starts.
OPEN_WHILE_DRAINING = frozenset({"/metrics"})


@dataclass
class DrainState:
    """Shared by the middleware (counts and refuses requests) and the server (starts the drain and
    waits for it). Touched only on the event loop."""

    draining: bool = False
    num_in_flight: int = 0
    num_refused: int = 0


class DrainMiddleware:
    """Counts requests in flight (a streaming one until its last byte) and refuses new ones with
    503 once the drain has begun."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_WHILE_DRAINING:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            self.state.num_refused += 1
            await send_error(send, 503, "ServiceUnavailable", "the server is shutting down")
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown (which then finds little to wait for).

    `on_timeout` runs when the grace period ends with requests still in flight: it must make them
    end (the CLI shuts the engine down, which fails every open stream with an error event).
    """

    def __init__(self, config: uvicorn.Config, state: DrainState, shutdown_timeout_s: float,
                 on_timeout: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self._on_timeout = on_timeout
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded for uvicorn to re-raise after serving: that would kill the process with the
        # signal's default action before the CLI could stop the engine and exit 0.
        if self._deadline is not None:  # a second signal: no more waiting
            self.should_exit = self.force_exit = True
            return
        logger.warning("%s: draining %d request(s), at most %.0f s (a second signal exits now)",
                       signal.Signals(sig).name, self.drain.num_in_flight,
                       self.shutdown_timeout_s)
        self.drain.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            if self.drain.num_in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                logger.warning("shutdown timeout: ending %d request(s) in flight",
                               self.drain.num_in_flight)
                self._on_timeout()
                self.should_exit = True
        return await super().on_tick(counter)
