"""`dsaserve router --prefill ... --decode ...`: vLLM's two-step P/D protocol, driven against
fake engines that speak it (what each step sends, what comes back, stickiness of both steps,
errors of each step). The real engines' connector is tested end to end in test_pd_*.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from server_harness import LiveServer

from dsaserve.config import ConfigError
from dsaserve.router.app import BACKEND_HEADER, PREFILL_HEADER, create_router_app
from dsaserve.router.config import RouterConfig

pytestmark = pytest.mark.server

BLOCK_SIZE = 16
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


@dataclass
class FakeEngine:
    """A `serve` with a KV connector, as the router sees it: a prefill engine answers one token
    and the params of its held KV; a decode engine insists on such params."""

    role: str
    mode: str = "ok"  # prefill: "ok" | "no-params" | "503"
    bodies: list[dict] = field(default_factory=list)
    server: LiveServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self) -> FakeEngine:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/kv_info")
        async def kv_info() -> dict:
            return {"model": "tiny-test", "block_size": BLOCK_SIZE, "enable_prefix_caching": True,
                    "data_parallel_size": 1, "kv_events_endpoints": []}

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if body.get("prompt") == "bad":
                return JSONResponse({"error": {"message": "prompt: bad", "code": 400}}, 400)
            params = body.get("kv_transfer_params") or {}
            if self.role == "prefill":
                if self.mode == "503":
                    return JSONResponse({"error": {"message": "engine is not running"}}, 503)
                answer: dict = {"choices": [{"index": 0, "text": "p"}]}
                if self.mode == "ok":
                    answer["kv_transfer_params"] = {
                        "do_remote_prefill": True, "do_remote_decode": False,
                        "remote_engine_id": f"engine-{self.server.port}",
                        "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
                        "remote_port": 5555}
                return JSONResponse(answer)
            if not params.get("do_remote_prefill"):
                return JSONResponse({"error": {"message": "no remote KV"}}, 400)
            if body.get("stream"):
                async def frames() -> Iterator[bytes]:
                    for text in ("de", "coded"):
                        yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(frames(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"index": 0, "text": "decoded"}],
                                 "kv_transfer_params": None})

        app.post("/v1/completions", response_model=None)(complete)
        app.post("/v1/chat/completions", response_model=None)(complete)
        self.server = LiveServer(app)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
def engines() -> Iterator[dict[str, list[FakeEngine]]]:
    made = {"prefill": [FakeEngine("prefill").start() for _ in range(2)],
            "decode": [FakeEngine("decode").start() for _ in range(2)]}
    try:
        yield made
    finally:
        for e in made["prefill"] + made["decode"]:
            e.close()


def start_pd_router(prefill: list[FakeEngine], decode: list[FakeEngine],
                    **config: object) -> LiveServer:
    return LiveServer(create_router_app(RouterConfig(
        prefill_backends=tuple(e.url for e in prefill),
        decode_backends=tuple(e.url for e in decode), **config)))


def test_each_request_is_prefilled_then_decoded_with_the_prefill_params(engines) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    router = start_pd_router(prefill, decode, policy="round-robin")
    try:
        body = {"prompt": "def f(x):", "max_tokens": 7, "temperature": 0}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        stream = {**body, "stream": True, "stream_options": {"include_usage": True},
                  "max_completion_tokens": 7, "min_tokens": 2}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=stream,
                          timeout=TIMEOUT) as s:
            assert s.status_code == 200
            frames = [line for line in s.iter_lines() if line.startswith("data: ")]
            headers = s.headers
        assert frames[-1] == "data: [DONE]" and "coded" in frames[1]
        assert headers[PREFILL_HEADER] in {e.url for e in prefill}
        assert headers[BACKEND_HEADER] in {e.url for e in decode}
        sent_p = [b for e in prefill for b in e.bodies]
        sent_d = [b for e in decode for b in e.bodies]
        assert len(sent_p) == len(sent_d) == 2
        for p, d, client in zip(sent_p, sent_d, (body, stream), strict=True):
            # The prefill step: one token, no stream, the KV kept for a remote decode.
            assert p["max_tokens"] == 1 and p["stream"] is False
            assert p["kv_transfer_params"]["do_remote_decode"] is True
            assert "stream_options" not in p and "min_tokens" not in p
            assert p.get("max_completion_tokens", 1) == 1 and p["prompt"] == client["prompt"]
            # The decode step: the client's own request plus the prefill engine's answer.
            params = d.pop("kv_transfer_params")
            assert d == client
            assert params["do_remote_prefill"] is True and params["remote_block_ids"] == [3, 4]
        state = httpx.get(f"{router.url}/router/state", timeout=5).json()
        assert sorted(b["role"] for b in state["backends"]) == ["decode"] * 2 + ["prefill"] * 2
    finally:
        router.close()


def test_a_session_keeps_its_prefill_and_decode_engines(engines, tiny_model_dir: Path) -> None:
    """Prefix scoring on both sides: the prefill engine that holds the session's prefix, and the
    decode engine that does (it then pulls only the new blocks)."""
    prefill, decode = engines["prefill"], engines["decode"]
    router = start_pd_router(prefill, decode, tokenizer=str(tiny_model_dir))
    try:
        sessions = [" ".join(f"session {s} line {i}: def f{i}(x): return x" for i in range(12))
                    for s in range(4)]
        seen: dict[int, set[tuple[str, str]]] = {s: set() for s in range(4)}
        for turn in range(3):
            for s, prompt in enumerate(sessions):
                text = prompt + "".join(f" turn {t} ok" for t in range(turn + 1))
                r = httpx.post(f"{router.url}/v1/completions", timeout=TIMEOUT,
                               json={"prompt": text, "max_tokens": 2})
                assert r.status_code == 200
                seen[s].add((r.headers[PREFILL_HEADER], r.headers[BACKEND_HEADER]))
        assert all(len(pairs) == 1 for pairs in seen.values()), seen
        used = {pair for pairs in seen.values() for pair in pairs}
        assert len({p for p, _ in used}) == 2 and len({d for _, d in used}) == 2  # balanced
    finally:
        router.close()


def test_prefill_errors_reach_the_client_and_decode_is_not_called(engines) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    router = start_pd_router(prefill[:1], decode[:1])
    try:
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "bad"}, timeout=TIMEOUT)
        assert r.status_code == 400 and "prompt: bad" in r.json()["error"]["message"]
        prefill[0].mode = "no-params"
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert prefill[0].url in message and "kv_transfer_params" in message
        assert decode[0].bodies == []
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
        assert 'kind="no_kv_transfer_params"' in metrics and "pd_prefill_seconds" in metrics
    finally:
        router.close()


def test_a_failed_prefill_engine_is_retried_and_a_missing_role_is_a_503(engines) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    prefill[0].mode = "503"
    router = start_pd_router(prefill, decode[:1], policy="round-robin", max_retries=1,
                             health_check_interval_s=60)
    try:
        for _ in range(2):
            r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
            assert r.status_code == 200 and r.headers[PREFILL_HEADER] == prefill[1].url
        decode[0].close()  # nothing listens there now
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code in (502, 503)
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 503 and "no healthy decode backend" in r.json()["error"]["message"]
        h = httpx.get(f"{router.url}/health", timeout=5)
        assert h.status_code == 503 and "decode" in h.json()["error"]["message"]
    finally:
        router.close()


@pytest.mark.parametrize("config, flag", [
    ({"prefill_backends": ("http://127.0.0.1:1",)}, "--decode"),
    ({"decode_backends": ("http://127.0.0.1:1",)}, "--prefill"),
    ({"backends": ("http://127.0.0.1:1",), "prefill_backends": ("http://127.0.0.1:2",),
      "decode_backends": ("http://127.0.0.1:3",)}, "--backend"),
    ({"prefill_backends": ("127.0.0.1:2",), "decode_backends": ("http://127.0.0.1:3",)},
     "--prefill"),
    ({"prefill_backends": ("http://127.0.0.1:2",), "decode_backends": ("http://127.0.0.1:2",)},
     "twice"),
    ({}, "--backend"),
])
def test_pd_flags_are_validated(config: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        RouterConfig(**config)
