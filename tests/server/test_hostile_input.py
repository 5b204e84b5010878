"""Hostile and careless input, in process (the ASGI app in front of a real engine on the tiny
model): each case is a precise 4xx naming the field, never a 5xx, and the engine keeps serving.
Regression tests for what the fuzzer (test_fuzz.py) and the probes behind it found."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from server_harness import MODEL_NAME

from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import make_generator, sample
from dsaserve.serve.api import ServerConfig, create_app, error_body
from dsaserve.serve.limits import find_lone_surrogate

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ServerConfig(served_model_name=MODEL_NAME))) as c:
        yield c


def post_raw(client: TestClient, path: str, text: str):
    """Send JSON text as written: json.dumps cannot produce a lone surrogate escape."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


# Each was a 500 (the tokenizer raised TypeError) or an unencodable error body before.
@pytest.mark.parametrize("path, body, where", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": "x\\udc00y"}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\ud83d"]}', "prompt[0]"),
    ("/v1/completions", '{"prompt": "ok", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["a", "\\ud800"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "ok", "cache_salt": "\\ud800"}', "cache_salt"),
])
def test_lone_surrogates_are_400_naming_the_field(client, path, body, where) -> None:
    r = post_raw(client, path, body)
    assert r.status_code == 400, r.text
    assert f"{where}: a lone UTF-16 surrogate" in r.json()["error"]["message"]


def test_find_lone_surrogate_paths() -> None:
    assert find_lone_surrogate({"a": ["ok", {"b": "\ud800"}]}) == "a[1].b"
    assert find_lone_surrogate({"k\udc00": 1}) == "a key in body"
    assert find_lone_surrogate({"a": "emoji 🙂 and ümlaut", "b": [1, 2.5, None]}) is None
    assert find_lone_surrogate("\ud83d\ude42".encode("utf-16", "surrogatepass")
                               .decode("utf-16")) is None  # a proper pair is one character


def test_error_body_survives_surrogates_in_its_message() -> None:
    body = error_body(404, "The model '\ud800' does not exist")
    assert "\\ud800" in body.model_dump_json()


# Each failed the engine step (NaN probabilities), killing the engine for every request: 503 after.
@pytest.mark.parametrize("params", [{"temperature": 1e-38}, {"temperature": 5e-324},
                                    {"top_p": 1e-300}, {"temperature": 1e-30, "top_p": 1e-50}])
def test_extreme_sampling_values_do_not_kill_the_engine(client, engine, params) -> None:
    r = client.post("/v1/completions", json={"prompt": "The harbour", "max_tokens": 4,
                                             "ignore_eos": True, "seed": 3} | params)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert engine.is_alive


def test_near_zero_temperature_and_top_p_sample_the_argmax() -> None:
    """Below the thresholds sampling is argmax (what it is in exact arithmetic); above them the
    fp32 maths is finite and sampling proceeds as before."""
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)) * 4
    argmax = logits.argmax(-1).tolist()
    for kw in ({"temperature": 1e-38}, {"top_p": 1e-300}, {"top_p": 1e-7}):
        p = SamplingParams(**kw)
        assert p.greedy
        gens = [make_generator(p, torch.device("cpu"), i) for i in range(3)]
        assert sample(logits, [p] * 3, gens)[0] == argmax
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams(top_p=1e-5).greedy
