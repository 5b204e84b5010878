"""The router's HTTP front: OpenAI-compatible, it forwards each completion to one backend.

A request's life here:
    1. read the body; malformed JSON → 400 (as `serve`); anything else is the backend's to judge;
    2. admission: at most max_concurrent_requests forwarded, max_queued_requests waiting, the rest
       429 at once (bounded memory under a flood);
    3. render + tokenize exactly as `serve` does (dsaserve.serve.prompt), hash per block size;
    4. pick a backend (policy.py), forward; a failure before the first byte reaches the client
       (connect error, 5xx, a dead stream) marks the backend and retries another, up to
       max_retries; after that the client gets a clear error (502/503 JSON, or an SSE error frame);
    5. stream the backend's bytes through; a client that leaves closes the upstream stream, which
       makes `serve` abort the request and free its KV blocks.

P/D (`--prefill ... --decode ...`), vLLM's two-step protocol, so that the engines behind could be
vLLM's as well as ours: step 4 becomes
    4a. prefill: pick a prefill engine (prefix + load scores over the prefill engines), send it the
        request as a one-token, non-streaming completion with `kv_transfer_params:
        {"do_remote_decode": true}`; its answer carries the params that locate the KV;
    4b. decode: pick a decode engine (the same scores over the decode engines: one that still
        holds the session's prefix pulls only the new blocks), send it the client's request with
        those params, and stream its answer as in 5.
A 4xx from the prefill engine is the client's answer; a prefill engine that answers without
params is a 502 naming it (started without a KV connector).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import TypeAdapter
from starlette.background import BackgroundTask

from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.router.backends import Backend, BackendPool
from dsaserve.router.config import Role, RouterConfig
from dsaserve.router.events import KVEventSubscriber
from dsaserve.router.metrics import RouterMetrics
from dsaserve.router.policy import Decision, Picker
from dsaserve.serve.api import error_body, error_response, unless_disconnected
from dsaserve.serve.prompt import (
    ChatFormat,
    PromptError,
    chat_format_for,
    completion_prompt,
    render_chat,
)
from dsaserve.serve.protocol import ChatTool, template_tools
from dsaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "content-type", "accept")
BACKEND_HEADER = "x-dsaserve-backend"  # which backend served the response (debugging, tests)
PREFIX_HEADER = "x-dsaserve-prefix-match"  # "matched/total" blocks the choice was scored with
PREFILL_HEADER = "x-dsaserve-prefill-backend"  # P/D: which prefill engine made the KV

# What a prefill request asks for (vLLM's field names): compute the prompt's KV, keep it for a
# decode engine to pull, return where it is. The remote_* fields are the producer's to fill.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as its P/D prefill step: one token, no stream, the KV kept."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class RouterError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Admission:
    """A counting semaphore with a bounded waiting room: `enter` raises RouterError(429) when
    both the slots and the waiting room are full."""

    def __init__(self, max_concurrent: int, max_queued: int, metrics: RouterMetrics) -> None:
        self._sem = asyncio.Semaphore(max_concurrent)
        self._max_queued = max_queued
        self._max_concurrent = max_concurrent
        self._waiting = 0
        self._metrics = metrics

    async def enter(self) -> None:
        if self._sem.locked() and self._waiting >= self._max_queued:
            self._metrics.rejected.labels("queue_full").inc()
            raise RouterError(429, f"router overloaded: {self._max_concurrent} requests in flight "
                              f"and {self._waiting} queued; retry later")
        self._waiting += 1
        self._metrics.queued.set(self._waiting)
        try:
            await self._sem.acquire()
        finally:
            self._waiting -= 1
            self._metrics.queued.set(self._waiting)

    def leave(self) -> None:
        self._sem.release()


class _InFlight:
    """One request counted in flight on a backend until `finish` (idempotent) is called."""

    def __init__(self, backend: Backend) -> None:
        self._backend: Backend | None = backend
        backend.num_active += 1

    def finish(self) -> None:
        if self._backend is not None:
            self._backend.num_active -= 1
            self._backend = None


class Router:
    """State shared by the handlers: backends, indexes, tokenizer, upstream client."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.picker = Picker(config)
        self.pool = BackendPool(config, on_recovered=self.picker.forget, on_info=self._on_info)
        self.metrics = RouterMetrics(lambda: self.pool.backends)
        self.admission = _Admission(config.max_concurrent_requests, config.max_queued_requests,
                                    self.metrics)
        self.tokenizer: Tokenizer | None = None
        self.chat_format = ChatFormat()  # resolved with the tokenizer
        self._tokenizer_failed = False
        self.subscriber: KVEventSubscriber | None = None
        limits = httpx.Limits(max_connections=config.max_concurrent_requests + 16,
                              max_keepalive_connections=64)
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    # ---- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.config.prefix_index == "precise":
            self.subscriber = KVEventSubscriber(
                self.picker.precise,
                on_batch=lambda b: self.metrics.kv_event_batches.labels(b).inc())
        await self.pool.start()
        if self.config.policy == "prefix":
            await self.ensure_tokenizer()

    async def stop(self) -> None:
        await self.pool.stop()
        if self.subscriber is not None:
            await self.subscriber.close()
        await self.client.aclose()

    def _on_info(self, backend: Backend) -> None:
        if self.subscriber is not None:  # precise index; the approximate one needs no events
            self.subscriber.follow(backend.url, backend.kv_events_endpoints)

    async def ensure_tokenizer(self) -> Tokenizer | None:
        """The tokenizer (--tokenizer, else the model directory a healthy backend reports as its
        /v1/models root); None while no backend has answered."""
        if self.tokenizer is not None or self._tokenizer_failed:
            return self.tokenizer
        path = self.config.tokenizer or await self.pool.model_root()
        if path is None:
            return None  # no backend answered yet: try again on the next request
        try:
            tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, path)
            self.chat_format = chat_format_for(path, tokenizer, self.config.tokenizer_mode,
                                               self.config.chat_template)
            self.tokenizer = tokenizer
        except (OSError, ValueError) as e:
            self._tokenizer_failed = True  # do not retry per request
            logger.warning("router: no tokenizer at %s (%s): routing by load only", path, e)
        return self.tokenizer

    # ---- hashing --------------------------------------------------------------------------------
    async def block_hashes(self, path: str, body: dict[str, Any]) -> dict[int, list[bytes]]:
        """The request's block hashes per backend block size, exactly as the engine will compute
        them; {} when the prompt cannot be rendered (the backend will say why) or routing needs
        no prefix."""
        if self.config.policy != "prefix":
            return {}
        tokenizer = await self.ensure_tokenizer()
        if tokenizer is None:
            return {}
        try:
            if path == "/v1/chat/completions":
                tools = body.get("tools")
                tools = None if tools is None else template_tools(
                    TypeAdapter(list[ChatTool]).validate_python(tools))
                ids = await asyncio.to_thread(render_chat, tokenizer, body.get("messages"),
                                              body.get("chat_template_kwargs"), tools,
                                              self.chat_format)
            else:
                # Ids outside the vocabulary are the backend's to reject: no bound here.
                ids = await asyncio.to_thread(completion_prompt, tokenizer, body.get("prompt"),
                                              2**63)
        except (PromptError, TypeError, ValueError, AttributeError) as e:
            logger.debug("router: prompt not hashed (%s); routing by load", e)
            return {}
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        sizes = {b.block_size for b in self.pool.backends if b.block_size}
        # Every full block: the engine computes and caches them all (the one ending at the last
        # token is never a hit for this request, but it is for the next turn, which extends it).
        return {size: request_block_hashes(ids, size, salt) for size in sizes}

    # ---- forwarding -----------------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            return error_response(400, "body: expected a JSON object")
        await self.admission.enter()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admission.leave()

        try:
            hashes = await self.block_hashes(path, body)
            stream = bool(body.get("stream"))
            headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
            if self.config.disaggregated:
                response = await self._send_pd(request, path, body, headers, hashes, stream,
                                               release)
            else:
                response = await self._send(request, path, raw, headers, hashes, stream,
                                            release)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()  # a streaming response releases its slot when it ends
        return response

    async def _send_pd(self, request: Request, path: str, body: dict[str, Any],
                       headers: dict[str, str], hashes: dict[int, list[bytes]], stream: bool,
                       release: Callable[[], None]) -> Response:
        """Steps 4a and 4b: prefill on one engine, decode on another with its kv_transfer_params."""
        t0 = time.monotonic()
        prefill = await self._send(request, path, json.dumps(prefill_body(body)).encode(),
                                   headers, hashes, False, lambda: None, role="prefill")
        self.metrics.pd_prefill_seconds.observe(time.monotonic() - t0)
        if prefill.status_code != 200:
            return prefill  # the client's mistake (4xx) or no prefill engine could do it (5xx)
        prefill_url = prefill.headers.get(BACKEND_HEADER, "?")
        try:
            params = json.loads(bytes(prefill.body))["kv_transfer_params"]
            if not isinstance(params, dict):
                raise TypeError(type(params).__name__)
        except (ValueError, KeyError, TypeError) as e:
            self.metrics.proxy_errors.labels(prefill_url, "no_kv_transfer_params").inc()
            return error_response(502, f"router: prefill backend {prefill_url} answered without "
                                  f"kv_transfer_params ({type(e).__name__}); is it started with "
                                  f"--kv-transfer-config and a KV connector?")
        decode_raw = json.dumps({**body, "kv_transfer_params": params}).encode()
        response = await self._send(request, path, decode_raw, headers, hashes, stream, release,
                                    role="decode")
        response.headers[PREFILL_HEADER] = prefill_url
        return response

    async def _send(self, request: Request, path: str, raw: bytes, headers: dict[str, str],
                    hashes: dict[int, list[bytes]], stream: bool,
                    release: Callable[[], None], role: Role = "both") -> Response:
        """Forward to one backend of `role`, retrying others before anything was streamed."""
        tried: list[str] = []
        last_error = "no healthy backend"
        candidates = self.pool.with_role(role)
        for attempt in range(self.config.max_retries + 1):
            decision = self.picker.choose(candidates, hashes, exclude=tried)
            if decision is None:
                break
            b = decision.backend
            tried.append(b.url)
            if attempt > 0:
                self.metrics.retries.inc()
            finish = _InFlight(b).finish  # idempotent: every exit path may call it
            try:
                result = await self._attempt(request, decision, path, raw, headers, stream,
                                             finish, release)
            except BaseException:
                finish()
                raise
            if isinstance(result, Response):
                if not isinstance(result, StreamingResponse):
                    finish()  # a streaming response finishes when its stream closes
                self.picker.record(decision, hashes)
                self._count(decision)
                return result
            finish()
            last_error = f"{b.url}: {result}"
        if not tried:
            self.metrics.rejected.labels("no_backend").inc()
            kind = "" if role == "both" else f"{role} "
            return error_response(503, f"router: no healthy {kind}backend (all are down or "
                                  "being retried); retry later")
        return JSONResponse(error_body(502, f"router: every backend tried failed "
                                       f"({len(tried)} tried); last: {last_error}")
                            .model_dump(), status_code=502)

    def _count(self, d: Decision) -> None:
        d.backend.num_routed += 1
        self.metrics.routed.labels(d.backend.url).inc()
        if d.total_blocks:
            self.metrics.prefix_match_ratio.observe(d.matched_blocks / d.total_blocks)
        self.metrics.prefix_match_tokens.observe(d.matched_blocks * (d.block_size or 0))

    async def _attempt(self, request: Request, d: Decision, path: str, raw: bytes,
                       headers: dict[str, str], stream: bool, finish: Callable[[], None],
                       release: Callable[[], None]) -> Response | str:
        """One try on d.backend: a Response to return, or a reason string to retry elsewhere."""
        b = d.backend
        url = f"{b.url}{path}"
        route_headers = {BACKEND_HEADER: b.url,
                         PREFIX_HEADER: f"{d.matched_blocks}/{d.total_blocks}"}
        upstream: httpx.Response | None = None
        peeked = False
        try:
            req = self.client.build_request("POST", url, content=raw, headers=headers)
            if not stream:
                r = await unless_disconnected(request, self.client.send(req))
                if r is None:
                    return Response(status_code=499)  # the client left; the upstream is closed
                if r.status_code >= 500:
                    self.metrics.proxy_errors.labels(b.url, "status_5xx").inc()
                    return f"HTTP {r.status_code}: {r.text[:200]}"
                finish()
                return Response(r.content, status_code=r.status_code, headers=route_headers,
                                media_type=r.headers.get("content-type"))
            upstream = await self.client.send(req, stream=True)
            if upstream.status_code >= 500:
                text = (await upstream.aread())[:200]
                self.metrics.proxy_errors.labels(b.url, "status_5xx").inc()
                return f"HTTP {upstream.status_code}: {text!r}"
            chunks = upstream.aiter_raw()
            # Peek the first bytes: a backend that dies before them is retried elsewhere.
            first = await anext(chunks, b"")
            peeked = True
        except httpx.ConnectError as e:
            self.metrics.proxy_errors.labels(b.url, "connect").inc()
            self.pool.mark_down(b, f"connect: {e}")
            return f"cannot connect: {e}"
        except httpx.TimeoutException as e:
            self.metrics.proxy_errors.labels(b.url, "timeout").inc()
            return f"timed out: {type(e).__name__}"
        except httpx.HTTPError as e:
            self.metrics.proxy_errors.labels(b.url, "stream").inc()
            self.pool.mark_down(b, f"{type(e).__name__}: {e}")
            return f"{type(e).__name__}: {e}"
        finally:
            if upstream is not None and not peeked:  # failed or cancelled before the peek
                await upstream.aclose()
        if upstream.status_code != 200 or not first:
            # A 4xx (the client's mistake) is the answer; an empty 200 stream failed before
            # anything was sent and can be retried.
            if upstream.status_code == 200:
                await upstream.aclose()
                self.metrics.proxy_errors.labels(b.url, "stream").inc()
                return "the stream ended before its first byte"
            rest = first + await upstream.aread()
            await upstream.aclose()
            finish()
            return Response(rest, status_code=upstream.status_code, headers=route_headers,
                            media_type=upstream.headers.get("content-type"))

        async def body() -> AsyncIterator[bytes]:
            yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as e:  # mid-stream: too late to retry, fail fast and say so
                self.metrics.proxy_errors.labels(b.url, "stream").inc()
                err = error_body(502, f"router: backend {b.url} failed mid-stream: "
                                 f"{type(e).__name__}: {e}")
                yield f"data: {err.model_dump_json()}\n\ndata: [DONE]\n\n".encode()

        async def close() -> None:  # runs however the response ends, client gone included
            await upstream.aclose()  # an unfinished stream's connection closes → serve aborts
            finish()
            release()

        return StreamingResponse(body(), status_code=200, headers=route_headers,
                                 media_type=upstream.headers.get("content-type"),
                                 background=BackgroundTask(close))


def create_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="dsaserve router", version="0.1.0", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, e: RouterError) -> JSONResponse:
        return error_response(e.status, e.message)

    @app.get("/health")
    async def health() -> Response:
        # Serving needs a healthy backend of every role the deployment has.
        roles = {b.role for b in router.pool.backends}
        missing = [r for r in roles if not any(b.healthy for b in router.pool.with_role(r))]
        if not missing:
            return Response(status_code=200)
        down = "; ".join(f"{b.url}: {b.last_error}" for b in router.pool.backends
                         if b.role in missing)
        kind = "" if missing == ["both"] else "/".join(sorted(missing)) + " "
        return error_response(503, f"router: no healthy {kind}backend ({down})")

    @app.get("/metrics")
    async def metrics() -> Response:
        await router.pool.scrape_all()
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        for b in router.pool.healthy():
            try:
                r = await router.client.get(f"{b.url}/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return error_response(503, "router: no healthy backend")

    @app.get("/router/state")
    async def state() -> dict[str, Any]:
        """The router's view of its backends (for operators and tests)."""
        return {"policy": config.policy, "prefix_index": config.prefix_index, "backends": [
            {"url": b.url, "role": b.role, "healthy": b.healthy, "last_error": b.last_error,
             "block_size": b.block_size, "kv_events_endpoints": list(b.kv_events_endpoints),
             "num_active": b.num_active, "num_routed": b.num_routed,
             "num_waiting": b.load.num_waiting, "kv_usage": b.load.kv_usage,
             "approximate_blocks": router.picker.approximate.num_blocks(b.url),
             "precise_blocks": router.picker.precise.num_blocks(b.url)}
            for b in router.pool.backends]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    return app
