"""--api-key: every route but /health needs `Authorization: Bearer <key>` (401 with OpenAI's error
body otherwise), on a real server; the key may also come from the environment, as in vLLM."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
from server_harness import MODEL_NAME, serve

from dsaserve.serve import cli as serve_cli
from dsaserve.serve.auth import APIKeyMiddleware

pytestmark = pytest.mark.server

KEY = "s3cret-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_every_route_but_health_needs_the_key(engine) -> None:
    with serve(engine, api_key=KEY) as s:
        routes = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/kv_info"),
                  ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"),
                  ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]
        bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                       {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                       {"Authorization": "Bearer"}, {"X-API-Key": KEY}]
        with httpx.Client(base_url=s.url, timeout=30) as c:
            for method, path in routes:
                for headers in bad_headers:
                    r = c.request(method, path, headers=headers, json=CHAT)
                    assert r.status_code == 401, (method, path, headers, r.text)
                    error = r.json()["error"]
                    assert error["code"] == 401 and "API key" in error["message"]
            assert c.get("/health").status_code == 200  # open: load balancers probe it
            good = {"Authorization": f"Bearer {KEY}"}
            for path in ("/v1/models", "/metrics", "/kv_info", "/openapi.json"):
                assert c.get(path, headers=good).status_code == 200, path
            assert c.get("/no/such/route", headers=good).status_code == 404
            r = c.post("/v1/chat/completions", headers={"authorization": f"bearer {KEY}"},
                       json=CHAT)
            assert r.status_code == 200, r.text
        # The official client sends the key as a bearer token.
        r2 = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0).completions.create(
            model=MODEL_NAME, prompt="The harbour", max_tokens=2)
        assert r2.usage.completion_tokens <= 2


def test_unauthorized_bodies_are_not_read(engine) -> None:
    """A client without the key gets its 401 before the 413 check reads anything."""
    with serve(engine, api_key=KEY, max_request_body_bytes=100) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x" * 1000}, timeout=30)
        assert r.status_code == 401


def test_key_comparison() -> None:
    m = APIKeyMiddleware(app=None, api_key=KEY)
    assert m.authorized(f"Bearer {KEY}".encode())
    assert m.authorized(f"bearer {KEY}".encode())  # the scheme is case-insensitive (RFC 7235)
    for given in (b"", b"Bearer", f"Bearer {KEY[:-1]}".encode(), KEY.encode(),
                  f"Token {KEY}".encode(), f"Bearer {KEY.upper()}".encode()):
        assert not m.authorized(given), given


@pytest.mark.parametrize("env, flag, expected", [
    ({}, None, None),
    ({"VLLM_API_KEY": "v"}, None, "v"),
    ({"DSASERVE_API_KEY": "d", "VLLM_API_KEY": "v"}, None, "d"),
    ({"DSASERVE_API_KEY": "d"}, "f", "f"),  # the flag wins
])
def test_api_key_from_flag_or_environment(monkeypatch, env, flag, expected) -> None:
    for name in ("DSASERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = serve_cli._configure(argparse.ArgumentParser())
    args = parser.parse_args(["--api-key", flag] if flag else [])
    assert serve_cli.server_config_from_args(args, "m").api_key == expected
