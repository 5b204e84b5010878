"""API-key authentication (vLLM's `--api-key`): every route but /health needs
`Authorization: Bearer <key>`, checked before the body is read.

/health stays open for load balancers and orchestrators; /metrics, /kv_info and /openapi.json need
the key, since they reveal load, cache contents and configuration.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from dsaserve.serve.middleware import send_error

OPEN_PATHS = frozenset({"/health"})
# Read when --api-key is not given: ours first, then vLLM's, so vLLM deployments carry over.
API_KEY_ENV_VARS = ("DSASERVE_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> str | None:
    return next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)


def _digest(secret: bytes) -> bytes:
    # Equal-length digests: compare_digest then reveals nothing, not even the key's length.
    return hashlib.sha256(secret).digest()


class APIKeyMiddleware:
    """401 with OpenAI's error body for a request without the key (constant-time comparison)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = _digest(api_key.encode())

    def authorized(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        ok = hmac.compare_digest(_digest(token.strip()), self._expected)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not self.authorized(given):
                await send_error(send, 401, "AuthenticationError",
                                 "invalid or missing API key: send 'Authorization: Bearer <key>'")
                return
        await self.app(scope, receive, send)
