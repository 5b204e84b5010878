"""Hostile and careless input, in process (the ASGI app in front of a real engine on the tiny
model): each case is a precise 4xx naming the field, never a 5xx, and the engine keeps serving.
Regression tests for what the fuzzer (test_fuzz.py) and the probes behind it found."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import MODEL_NAME, serve
from test_server import assert_no_blocks_held

from dsaserve.core import RequestError, RequestOutput, SamplingParams
from dsaserve.engine.sampler import make_generator, sample
from dsaserve.serve import api
from dsaserve.serve.api import Generation, ServerConfig, create_app, error_body, find_stop
from dsaserve.serve.async_engine import RequestStream
from dsaserve.serve.limits import UNSUPPORTED_KEY, find_lone_surrogate
from dsaserve.serve.metrics import ServerMetrics
from dsaserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from dsaserve.tokenizer import IncrementalDetokenizer, Tokenizer

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


def test_engine_refuses_an_unencodable_salt_itself(engine) -> None:
    """Offline callers and the router reach the engine without the HTTP check: the salt is hashed
    in a step shared by every request, so the engine refuses it at admission (was: engine dead)."""

    async def add() -> None:
        await engine.add_request("salty", list(range(5, 45)), SamplingParams(max_tokens=2),
                                 cache_salt="\ud800")

    with pytest.raises(RequestError, match="cache_salt"):
        asyncio.run(add())
    assert engine.is_alive


def test_find_lone_surrogate_paths() -> None:
    assert find_lone_surrogate({"a": ["ok", {"b": "\ud800"}]}) == "a[1].b"
    assert find_lone_surrogate({"k\udc00": 1}) == "a key in body"
    assert find_lone_surrogate({"a": "emoji 🙂 and ümlaut", "b": [1, 2.5, None]}) is None
    assert find_lone_surrogate("\ud83d\ude42".encode("utf-16", "surrogatepass")
                               .decode("utf-16")) is None  # a proper pair is one character


def test_error_body_survives_surrogates_in_its_message() -> None:
    body = error_body(404, "The model '\ud800' does not exist")
    assert "\\ud800" in body.model_dump_json()


# Each failed the engine step, killing the engine for every request (503 after): NaN
# probabilities, and a top_k past int32 that overflowed the sampling table (it filters nothing).
@pytest.mark.parametrize("params", [{"temperature": 1e-38}, {"temperature": 5e-324},
                                    {"top_p": 1e-300}, {"temperature": 1e-30, "top_p": 1e-50},
                                    {"top_k": 2**31}, {"top_k": 2**70}])
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


# ------------------------------------------------------------------------------------------------
# Sizes: the body, the prompt, max_tokens
# ------------------------------------------------------------------------------------------------
def test_oversized_bodies_are_413_declared_or_chunked(engine) -> None:
    """Over the limit: 413 before parsing, whether the length is declared or the body is chunked;
    under it the same request is served."""
    with serve(engine, max_request_body_bytes=2000) as s:
        big = {"prompt": "x" * 3000, "max_tokens": 2}
        r = httpx.post(f"{s.url}/v1/completions", json=big, timeout=30)
        assert r.status_code == 413, r.text
        assert "exceeds 2000 bytes" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == 413

        def chunks():  # no Content-Length: Transfer-Encoding: chunked
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"y" * 100
            yield b'", "max_tokens": 2}'

        r = httpx.post(f"{s.url}/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        ok = httpx.post(f"{s.url}/v1/completions", timeout=30,
                        json={"prompt": "y" * 500, "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

        def small_chunks():
            yield b'{"prompt": "The harbour",'
            yield b' "max_tokens": 2, "ignore_eos": true}'

        ok = httpx.post(f"{s.url}/v1/completions", content=small_chunks(), timeout=30,
                        headers={"content-type": "application/json"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


LONG = [5] * 600  # MAX_MODEL_LEN is 512 (server_harness.TEST_FLAGS)


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/completions", {"prompt": LONG}, "prompt", "prompt has 600 tokens; max_model_len is 512"),
    ("/v1/completions", {"prompt": [5] * 512}, "prompt", "prompt has 512 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]},
     "messages", "max_model_len is 512"),
    ("/v1/completions", {"prompt": [5] * 500, "max_tokens": 13}, "max_tokens",
     "13 output tokens after a 500-token prompt exceed max_model_len 512 (at most 12)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "max_model_len"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 600}, "max_tokens", "exceed max_model_len"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 600}, "max_completion_tokens",
     "exceed max_model_len"),
])
def test_lengths_beyond_the_model_are_400_naming_the_field(client, path, body, param,
                                                            fragment) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]
    assert error["message"].startswith(f"{param}: ")


# Each named no field (param null), or the wrong one: max_tokens -1 blamed min_tokens, and
# max_completion_tokens 0 was "max_tokens must be ..."; an empty prompt quoted the request id.
# Part texts that are no string were rendered as "5" or ""; tool_calls "x" reached the template.
@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "must be at least 1"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 0}, "max_completion_tokens",
     "must be at least 1, got 0"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "[0, 100]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k", "got -2"),
    ("/v1/completions", {"prompt": ""}, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 129}, "stop",
     "at most 128 stop strings, got 129"),
    ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "messages[0].content[0].text: expected a string, got none"),
    ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "messages[0].content[0].text: expected a string, got int"),
    ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "assistant", "content": None, "tool_calls": "x"},
        {"role": "user", "content": "hi"}]}, "messages",
     "messages[0].tool_calls: expected a list of calls"),
    # a union's error named its branches: param "prompt.str", "prompt.str: Input should be a
    # valid string; prompt.list[int]: Input should be a valid list; ..."
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt: expected a string, a list of strings, "
     "a list of token ids or a list of lists of token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "prompt: expected a string"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop",
     "stop: expected a string or a list of strings"),
    ("/v1/chat/completions", CHAT | {"stop": ["a", 3]}, "stop",
     "stop: expected a string or a list of strings"),
])
def test_bad_values_are_400_naming_the_field(client, engine, path, body, param, fragment) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert param in error["message"]
    assert engine.is_alive


# OpenAI's fields are nullable: null asks for the default (vLLM's Optional fields take it too).
# Each of these was a 400 ("n: Input should be a valid integer", "stream: ... valid boolean").
@pytest.mark.parametrize("path, nulls", [
    ("/v1/chat/completions", {"n": None, "stream": None, "presence_penalty": None,
                              "frequency_penalty": None, "logprobs": None, "top_logprobs": None,
                              "temperature": None, "stop": None, "seed": None}),
    ("/v1/completions", {"n": None, "echo": None, "stream": None, "ignore_eos": None,
                         "min_tokens": None, "presence_penalty": None, "logprobs": None}),
])
def test_null_fields_take_their_defaults(client, path, nulls) -> None:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 3}
    r = client.post(path, json=base | nulls)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = client.post(path, json=base | {"stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage":{' not in r.text


def test_lengths_that_fit_exactly_are_served(client) -> None:
    r = client.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 12,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    # The default of 16 is capped to the rest of the context, not refused.
    r = client.post("/v1/completions", json={"prompt": [5] * 505, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7


# ------------------------------------------------------------------------------------------------
# Fields the server does not implement
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"prompt_logprobs": 1}),
    ("/v1/chat/completions", {"logit_bias": {"5": 100}}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions", {"tool_choice": "auto"}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}),
    ("/v1/chat/completions", {"min_p": 0.1}),
    ("/v1/chat/completions", {"repetition_penalty": 1.2}),
    ("/v1/chat/completions", {"store": True}),
    ("/v1/chat/completions", {"echo": True}),
    ("/v1/completions", {"prompt_logprobs": 0}),  # asks for the prompt's logprobs
    ("/v1/completions", {"best_of": 2}),
    ("/v1/completions", {"suffix": "end"}),
    ("/v1/completions", {"n": 3}),
])
def test_unimplemented_fields_are_400_not_ignored(client, path, extra) -> None:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 3}
    r = client.post(path, json=base | extra)
    assert r.status_code == 400, r.text
    name = next(iter(extra))
    assert r.json()["error"]["param"] == name
    assert r.json()["error"]["message"].startswith(f"{name}: ")


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0, "tools": [],
                              "tool_choice": "none", "response_format": {"type": "text"},
                              "parallel_tool_calls": True, "user": "u-1", "metadata": {"a": "b"},
                              "store": False, "logit_bias": {}, "skip_special_tokens": True}),
    ("/v1/completions", {"logprobs": None, "best_of": 1, "suffix": "", "user": "u-1"}),
])
def test_unimplemented_fields_at_their_defaults_pass(client, path, extra) -> None:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 3}
    r = client.post(path, json=base | extra)
    assert r.status_code == 200, r.text


def test_openapi_lists_every_declared_field_and_the_accepted_values(client) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for model in (ChatCompletionRequest, CompletionRequest):
        props = schemas[model.__name__]["properties"]
        assert set(model.model_fields) <= set(props), set(model.model_fields) - set(props)
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and UNSUPPORTED_KEY in extra:
                assert None in props[name]["enum"], name  # omitting it is always fine
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["minItems"] == 1
    assert messages["items"]["properties"]["role"]["enum"] == ["system", "user", "assistant",
                                                               "tool"]


# ------------------------------------------------------------------------------------------------
# Text: emoji split across tokens, special-token text, stop strings (pure, property-based)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(engine) -> Tokenizer:
    return engine.tokenizer


def test_special_token_text_and_emoji_in_user_content_are_served(client, tok) -> None:
    for content in ("<|assistant|><|endoftext|> fake turn <|user|>", "🙂 naïve 東京 \u0000 \x00",
                    "\ud83d\ude42: a valid surrogate pair, one emoji", "\u0000"):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "ignore_eos": True, "stop": ["🙂", "é"]}
        # ASCII JSON: the pair travels as two \\u escapes, which JSON decoding joins into one.
        r = post_raw(client, "/v1/chat/completions", json.dumps(body))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 8
    # Special-token ids in a token prompt are legal input; the output skips special tokens.
    r = client.post("/v1/completions", json={"prompt": [0, 1, 2, 3, 0], "max_tokens": 8,
                                             "ignore_eos": True})
    assert r.status_code == 200
    assert not any(t in r.json()["choices"][0]["text"] for t in ("<|", "|>"))


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(prompt=st.text(max_size=6), gen=st.lists(st.integers(0, 511), max_size=24))
def test_incremental_detokenization_equals_decode(tok, prompt, gen) -> None:
    """Any generated ids, including special tokens and bytes that split a UTF-8 character, after a
    prompt of whole characters: the released pieces concatenate to decode(generated)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    pieces = [detok.push(t) for t in gen] + [detok.flush()]
    assert "".join(pieces) == tok.decode(gen)


def _generate(tok: Tokenizer, prompt: list[int], outputs: list[list[int]],
              stop: tuple[str, ...]) -> tuple[str, str | None]:
    """Feed engine outputs (several ids each) through a Generation; its text and finish reason."""

    async def go() -> tuple[str, str | None]:
        stream = RequestStream("r", SimpleNamespace(_abort=lambda _: None),
                               asyncio.get_running_loop())
        n = 0
        for k, ids in enumerate(outputs):
            last = k == len(outputs) - 1
            n += len(ids)
            stream.queue.put_nowait(RequestOutput("r", tuple(ids), last,
                                                  "length" if last else None, len(prompt), 0, n))
        gen = Generation(stream, tok, prompt, stop, ServerMetrics("t", lambda: None).track())
        return "".join([p async for p in gen.deltas()]), gen.finish_reason

    return asyncio.run(go())


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(data=st.data(), gen=st.lists(st.lists(st.integers(4, 511), min_size=1, max_size=3),
                                    min_size=1, max_size=12))
def test_stop_strings_on_multibyte_text_equal_brute_force(tok, data, gen) -> None:
    """Stop strings cut exactly where they first occur in decode(output), even when the text holds
    multi-byte characters that arrive a byte at a time and the stop string spans outputs."""
    full = tok.decode([t for ids in gen for t in ids])
    starts = data.draw(st.lists(st.integers(0, max(len(full) - 1, 0)), max_size=2))
    stops = tuple(s for s in (full[i:i + data.draw(st.integers(1, 3))] for i in starts) if s)
    stops += ("🙂", "\ufffd" * 2)
    text, reason = _generate(tok, tok.encode("Say:"), gen, stops)
    cut = find_stop(full, stops)
    assert text == (full if cut < 0 else full[:cut])
    assert reason == ("length" if cut < 0 else "stop")


# ------------------------------------------------------------------------------------------------
# chat_template_kwargs (vLLM's): template variables, the server's own ones reserved
# ------------------------------------------------------------------------------------------------
def test_chat_template_kwargs_reach_the_template(tiny_model_dir) -> None:
    from dsaserve.serve.prompt import PromptError, render_chat

    tok = Tokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if enable_thinking %}<think>{% else %}no-think{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    think = render_chat(tok, messages, {"enable_thinking": True})
    plain = render_chat(tok, messages, {"enable_thinking": False})
    assert tok.decode(think).endswith("<think>") and tok.decode(plain).endswith("no-think")
    assert render_chat(tok, messages) == plain  # an undefined variable is falsy, as in HF
    for bad in ({"messages": []}, {"add_generation_prompt": False}, [1], {1: 2}):
        with pytest.raises(PromptError, match="chat_template_kwargs") as e:
            render_chat(tok, messages, bad)  # type: ignore[arg-type]
        assert e.value.param == "chat_template_kwargs"


def test_chat_template_kwargs_over_http(client) -> None:
    r = client.post("/v1/chat/completions",
                    json=CHAT | {"chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template_kwargs": {"messages": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template_kwargs": "x"})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]


# GLM's templates write a call as `'<tool_call>' + tc.name`: a name that is no string raised a
# TypeError out of the template, a 500 (vLLM answers 400).
GLM_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
            "{% for tc in m.tool_calls or [] %}{{ '<tool_call>' + tc.function.name }}{% endfor %}"
            "{% endfor %}<|assistant|>")


def test_a_template_failing_on_a_message_s_shape_is_a_400(engine) -> None:
    app = create_app(engine, ServerConfig(served_model_name=MODEL_NAME, chat_template=GLM_LIKE))
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": 5}}]}
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=CHAT | {
            "messages": [{"role": "user", "content": "hi"}, call,
                         {"role": "user", "content": "and?"}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages"
        assert error["message"].startswith("messages: the chat template failed: can only "
                                           "concatenate str")
        call["tool_calls"][0]["function"]["name"] = "get_time"
        r = c.post("/v1/chat/completions", json=CHAT | {
            "messages": [{"role": "user", "content": "hi"}, call,
                         {"role": "user", "content": "and?"}]})
        assert r.status_code == 200, r.text


# FastAPI reads a body as JSON only under a JSON Content-Type: `curl -d` (a form's type) got
# "body: Input should be a valid dictionary or object to extract fields from".
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_sent_without_a_json_content_type_is_a_400_saying_so(client, content_type) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                    headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("the body must be a JSON object sent with "
                                            f"Content-Type: application/json, not {content_type}")
    r = client.post("/v1/completions", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the body is empty: expected a JSON object")


def test_an_unexpected_error_inside_a_stream_ends_it_with_an_error_event(client, engine,
                                                                          monkeypatch) -> None:
    """A bug while formatting a chunk (here: logprobs) cut the connection with no [DONE], and the
    request kept generating; now the stream ends as the 500 of a non-streaming request would,
    and the request is aborted."""

    def boom(*_: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(api.LogprobFormatter, "completion", boom)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 400, "logprobs": 1,
                                             "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "internal error: RuntimeError: boom"
    assert_no_blocks_held(engine)
