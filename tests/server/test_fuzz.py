"""API fuzzing: schemathesis generates requests from /openapi.json (valid and schema-violating
ones) and sends them to the ASGI app in process, then a smaller run to a real uvicorn server (real
sockets, h11 parsing), in front of a real engine on the tiny model.

Every response must be a 2xx, or a 4xx with OpenAI's error body; never a 5xx, never a stream that
does not end with `[DONE]` in time; and afterwards the engine holds no request and no block and
still serves a normal request. The case count is fixed (and derandomized) to keep CI bounded.
"""

from __future__ import annotations

import json
import time

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.transport import STREAM_CUT_SHORT_ATTRIBUTE
from schemathesis.python import asgi
from server_harness import MODEL_NAME, serve
from test_server import assert_no_blocks_held

from dsaserve.serve.api import ServerConfig, create_app

NUM_CASES = 160  # in process: ~20 s on a 2-core CPU machine; every operation is drawn from
NUM_HTTP_CASES = 80  # over HTTP to uvicorn: ~6 s
STREAM_TIMEOUT_S = 20.0  # a stream still open after this is a hung stream


@pytest.fixture(scope="module")
def fuzz_engine(make_async_engine):
    # A short context bounds each generation (≤ 32 tokens), so the fixed case count stays fast.
    return make_async_engine("--max-model-len", "32")


def check_response(method: str, path: str, response) -> None:
    """The contract every generated request is held to."""
    status = response.status_code
    content_type = (response.headers.get("content-type") or [""])[0]  # name → list of values
    assert status < 500, f"{method} {path} → {status}: {response.text[:500]}"
    assert 200 <= status < 500 and status != 499, f"{method} {path} → {status}"
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["code"] == status
        return
    if content_type.startswith("text/event-stream"):
        assert not getattr(response, STREAM_CUT_SHORT_ATTRIBUTE, False), "the stream hung"
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event  # a failure inside the stream
    elif content_type.startswith("application/json"):
        response.json()


def fuzz(schema, num_cases: int, call) -> dict[str, int]:
    """Run `num_cases` generated cases through `call(case) → response`; the outcomes counted."""
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                      schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[str, int] = {}

    @settings(max_examples=num_cases, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case) -> None:
        response = call(case)
        key = f"{case.method} {case.path} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        check_response(case.method, case.path, response)

    start = time.monotonic()
    one()
    print(f"\nfuzz: {sum(seen.values())} cases in {time.monotonic() - start:.1f} s: "
          + ", ".join(f"{k} ×{v}" for k, v in sorted(seen.items())))
    assert sum(seen.values()) >= num_cases // 2  # hypothesis really generated them
    # Both kinds of outcome happened: generation ran, and bad input was refused.
    assert any(k.endswith(" 200") and "completions" in k for k in seen), seen
    assert any(k.endswith(" 400") for k in seen), seen
    return seen


def test_generated_requests_never_fail_the_server(fuzz_engine) -> None:
    app = create_app(fuzz_engine, ServerConfig(served_model_name=MODEL_NAME))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)

    def call(case):
        with asgi.get_client(app, max_stream_events=10**6) as session:
            return case.call(session=session, timeout=STREAM_TIMEOUT_S)

    fuzz(schema, NUM_CASES, call)

    assert_no_blocks_held(fuzz_engine)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_generated_requests_over_http(fuzz_engine) -> None:
    """The same contract through uvicorn's HTTP parsing and real sockets (a read timeout of
    STREAM_TIMEOUT_S fails the case: a hung stream)."""
    with serve(fuzz_engine) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        fuzz(schema, NUM_HTTP_CASES,
             lambda case: case.call(base_url=server.url, timeout=STREAM_TIMEOUT_S))
        assert_no_blocks_held(fuzz_engine)
