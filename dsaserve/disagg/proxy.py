"""A minimal P/D proxy: each completion goes to the prefill server, then to the decode server.

    client ──► proxy ──(1) body + kv_transfer_params {do_remote_decode}, max_tokens 1, no stream──►
                                                                           prefill server
                     ◄── its response's kv_transfer_params (do_remote_prefill, remote_*) ──────
                     ──(2) the client's body + those kv_transfer_params ──► decode server
    client ◄──────── the decode server's response (streamed through when the client streams) ──

This is the two-step protocol of vLLM's disaggregation proxy example, for one prefill and one
decode server; choosing among several of each is the router's job. An error from either server
is passed back to the client with its status.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

_ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server gets: one token, not streamed, its KV kept for the decode side."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def create_proxy(prefill_url: str, decode_url: str, *, timeout_s: float = 600.0) -> FastAPI:
    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="dsaserve P/D proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(f"{url}/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(f"{decode_url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def two_step(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        # 1. prefill: one token; its response says where the KV is
        try:
            first = await client.post(f"{prefill_url}{path}", json=prefill_body(body),
                                      headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"prefill server: {e}")
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code,
                            media_type="application/json")
        params = first.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return _error(502, "prefill server returned no kv_transfer_params (is it started "
                               "with a NixlConnector --kv-transfer-config?)")
        # 2. decode: the client's request, with the remote KV's whereabouts
        decode = dict(body, kv_transfer_params=params)
        if not body.get("stream"):
            try:
                r = await client.post(f"{decode_url}{path}", json=decode, headers=headers)
            except httpx.HTTPError as e:
                return _error(502, f"decode server: {e}")
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{decode_url}{path}", json=decode,
                                        headers=headers)
        try:
            r = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"decode server: {e}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(relay(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type", "text/event-stream"))

    for path in _ROUTES:
        async def route(request: Request, _path: str = path) -> Response:
            return await two_step(request, _path)

        app.add_api_route(path, route, methods=["POST"])

    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "proxy_error", "code": status}},
                        status_code=status)
