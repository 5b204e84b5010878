"""ASGI middleware that acts before FastAPI parses a request: the body-size limit (413) and the
drain on shutdown (503). Each answers with OpenAI's error body, like every other error."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsaserve.serve.protocol import ErrorInfo, ErrorResponse


async def send_error(send: Send, status: int, kind: str, message: str) -> None:
    """A complete JSON error response, written straight to the ASGI `send`."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)).model_dump_json()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body.encode()})


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`, without reading it when Content-Length says so.

    A declared length is enforced by the HTTP parser (uvicorn reads no further), so it is checked
    up front; a chunked body is counted while it arrives and buffered, then replayed to the app
    (FastAPI buffers it whole anyway), after which `receive` is the server's again, so disconnect
    detection keeps working.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            try:
                length = int(declared[0])
            except ValueError:
                await send_error(send, 400, "BadRequestError", "malformed Content-Length header")
                return
            if length > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break  # the client left; the app sees that too
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        replay: Iterator[Message] = iter(buffered)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, "RequestTooLarge",
                         f"request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)")
