"""logprobs over HTTP: /v1/completions' legacy format and /v1/chat/completions' content list,
whole and streamed (the streamed chunks' entries joined equal the whole response's), parsed by
the openai client's types; the entries equal the engine's own; bad values are a 400 naming the
field; prompt_logprobs stays a 400 that says what is supported instead."""

from __future__ import annotations

import json
from os.path import commonprefix

import openai.types
import openai.types.chat
import pytest
from fastapi.testclient import TestClient
from server_harness import MODEL_NAME

from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.api import ServerConfig, create_app

PROMPT = [5, 17, 99, 203, 41, 7, 300, 12]
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6,
        "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ServerConfig(served_model_name=MODEL_NAME))) as c:
        yield c


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


def _events(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines()
                 if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _engine_entries(engine, n: int):
    """The same request through the engine offline: its TokenLogprob entries."""
    llm = LLMEngine.from_config(engine.config)  # its own: the server's runs on its thread
    return llm.generate_with_logprobs(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                 logprobs=n))[0].logprobs


def test_completions_legacy_format(client, engine, tok) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    parsed = openai.types.Completion.model_validate(r.json())
    choice = parsed.choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == 6 == len(lp.token_logprobs)
    want = _engine_entries(engine, 3)
    assert lp.tokens == [tok.decode([e.token_id], skip_special_tokens=False) for e in want]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want], abs=1e-5)
    # where each token's text starts in the returned text: the characters the tokens before
    # it decode to (tests/server/test_logprob_text.py has special tokens and byte pieces)
    ids = [e.token_id for e in want]
    assert lp.text_offset == [len(commonprefix([tok.decode(ids[:i]), choice.text]))
                              for i in range(len(ids))]
    for top, e, text in zip(lp.top_logprobs, want, lp.tokens, strict=True):
        # the 3 most likely (distinct texts) and the chosen token's
        assert text in top and top[text] == pytest.approx(e.logprob, abs=1e-5)
        assert len(top) <= 4
        assert max(top.values()) == pytest.approx(e.top[0][1], abs=1e-5)
    # streamed: the chunks' entries, joined, are the whole response's
    chunks = [c["choices"][0]["logprobs"] for c in _events(client, "/v1/completions", body)
              if c["choices"] and c["choices"][0]["logprobs"]]
    joined = {k: sum((c[k] for c in chunks), []) for k in ("tokens", "token_logprobs",
                                                           "top_logprobs", "text_offset")}
    assert joined == r.json()["choices"][0]["logprobs"]


def test_completions_logprobs_zero_and_absent(client) -> None:
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    r = client.post("/v1/completions", json=base | {"logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4
    assert all(len(top) == 1 and t in top for t, top in zip(lp["tokens"], lp["top_logprobs"],
                                                             strict=True))
    r = client.post("/v1/completions", json=base)
    assert r.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_content(client) -> None:
    body = CHAT | {"logprobs": True, "top_logprobs": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    parsed = openai.types.chat.ChatCompletion.model_validate(r.json())
    content = parsed.choices[0].logprobs.content
    assert len(content) == 6 == r.json()["usage"]["completion_tokens"]
    for e in content:
        assert len(e.top_logprobs) == 4
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.bytes == list(e.token.encode())
        # greedy: the chosen token is the most likely
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    chunks = _events(client, "/v1/chat/completions", body)
    streamed = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for x in c["choices"][0]["logprobs"]["content"]]
    for c in chunks:
        openai.types.chat.ChatCompletionChunk.model_validate(c)
    assert streamed == r.json()["choices"][0]["logprobs"]["content"]
    # logprobs alone: the chosen tokens', no top list
    r = client.post("/v1/chat/completions", json=CHAT | {"logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(e["top_logprobs"] == [] for e in content)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),  # above --max-logprobs 20
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "many"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {"logprobs": "perhaps"}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_values_are_400_naming_the_field(client, path, extra, param) -> None:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 3}
    r = client.post(path, json=base | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    if param == "prompt_logprobs":
        assert "logprobs, top_logprobs" in error["message"]
    if extra.get("logprobs") == 21 or extra.get("top_logprobs") == 21:
        assert "--max-logprobs" in error["message"]
