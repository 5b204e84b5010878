"""The OpenAI-compatible server end to end: a real uvicorn server on 127.0.0.1, the official
`openai` client and raw HTTP, against offline generation by a second engine on one checkpoint."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, LiveServer, serve, server_engine_config

from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine
from dsaserve.tokenizer import Tokenizer

pytestmark = pytest.mark.server

MAX_MODEL_LEN = 512  # conftest.TEST_FLAGS
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLMEngine:
    """The reference: the same checkpoint and flags, driven directly (no server, no threads)."""
    return LLMEngine.from_config(server_engine_config(tiny_model_dir))


@pytest.fixture(scope="module")
def tok(offline: LLMEngine) -> Tokenizer:
    assert offline.tokenizer is not None
    return offline.tokenizer


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def generate(offline: LLMEngine, prompt: list[int], **params) -> list[int]:
    return offline.generate([prompt], SamplingParams(**params))[0]


def sse_events(lines: Iterator[str]) -> list[str]:
    """The data payloads of an SSE stream, in order ('[DONE]' included)."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def wait_until_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Until the engine holds no request: aborts travel through the core's inbox."""
    deadline = time.monotonic() + timeout
    while engine.call_in_core(lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)


def assert_no_blocks_held(engine: AsyncEngine) -> None:
    wait_until_idle(engine)
    engine.call_in_core(lambda e: e.check_integrity())  # no block leaked
    stats = engine.call_in_core(lambda e: e.stats())
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


# ------------------------------------------------------------------------------------------------
# Output equals offline generation
# ------------------------------------------------------------------------------------------------
def test_models_and_health(client: openai.OpenAI, server: LiveServer) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_matches_offline_streaming_and_not(client, offline, tok) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "How does a water clock keep time?"}]
    prompt = chat_ids(tok, messages)
    ref = generate(offline, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    ref_text = tok.decode(ref)
    assert ref_text  # the comparison below must compare something

    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 24)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=24, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_seeded_sampling_matches_offline(client, offline, tok) -> None:
    """temperature / top_p / top_k / seed reach the sampler exactly as offline."""
    messages = [{"role": "user", "content": "Plan a walk in the mountains."}]
    prompt = chat_ids(tok, messages)
    ref = generate(offline, prompt, max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=7,
                   ignore_eos=True)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0.9, top_p=0.9, seed=7,
        extra_body={"top_k": 40, "ignore_eos": True})
    assert r.choices[0].message.content == tok.decode(ref)
    greedy = tok.decode(generate(offline, prompt, max_tokens=20, temperature=0.0, ignore_eos=True))
    assert greedy != tok.decode(ref)  # sampling really happened


def test_completions_match_offline(client, offline, tok) -> None:
    prompt_text = "The harbour town woke early. Before the sun"
    prompt = tok.encode(prompt_text)
    ref_text = tok.decode(generate(offline, prompt, max_tokens=16, temperature=0.0,
                                   ignore_eos=True))
    extra = {"ignore_eos": True}
    r = client.completions.create(model=MODEL_NAME, prompt=prompt_text, max_tokens=16,
                                  temperature=0.0, extra_body=extra)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref_text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                       temperature=0.0, extra_body=extra)
    assert by_ids.choices[0].text == ref_text
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompt_text, max_tokens=16, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == 16


def test_32_concurrent_streams_all_correct(server, offline, tok, engine) -> None:
    prompts = [[{"role": "user", "content": f"Question {i}: what happened in the year {1990 + i}?"}]
               for i in range(32)]
    ids = [chat_ids(tok, m) for m in prompts]
    refs = offline.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))

    async def one(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=12, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
            usage = c.usage or usage
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, m) for m in prompts))

    results = asyncio.run(main())
    assert [text for text, _ in results] == [tok.decode(r) for r in refs]
    assert all(n == 12 for _, n in results)
    assert_no_blocks_held(engine)


# ------------------------------------------------------------------------------------------------
# Prefix caching, stop strings, the AgentX request shape
# ------------------------------------------------------------------------------------------------
def test_cached_tokens_on_repeated_prefix_and_isolated_by_salt(client, server) -> None:
    prompt = [4 + (7 * i) % 300 for i in range(70)]  # token ids: an exact, unique length

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                      temperature=0.0, extra_body=extra)
        assert r.usage.prompt_tokens == len(prompt)  # cached tokens are prompt tokens too
        return r.usage.prompt_tokens_details.cached_tokens

    full_blocks = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    assert cached(None) == 0
    assert cached(None) == full_blocks == 64
    assert cached("tenant-a") == 0  # the salt changes every block's hash
    assert cached("tenant-a") == full_blocks
    assert cached("tenant-b") == 0
    metrics = httpx.get(f"{server.url}/metrics").text
    hits = _sample(metrics, "vllm:prefix_cache_hits_total")
    assert hits >= 2 * full_blocks


def test_stop_strings_cut_the_text_and_free_the_request(client, offline, tok, engine) -> None:
    messages = [{"role": "user", "content": "Describe the library near the station."}]
    full = tok.decode(generate(offline, chat_ids(tok, messages), max_tokens=40, temperature=0.0,
                               ignore_eos=True))
    stop = full[12:15]
    assert len(stop) == 3 and full.index(stop) <= 12
    expected = full[:full.index(stop)]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40,
                                       temperature=0.0, stop=[stop, "\u2603never"],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0.0, stop=stop,
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_no_blocks_held(engine)  # the engine was told to stop generating


def _ask(server: LiveServer, chat: bool, prompt: list[int], stream: bool, **fields
         ) -> tuple[str, str, str | int | None, int]:
    """Raw HTTP (the JSON types as sent): text, finish_reason, stop_reason, completion_tokens;
    streamed, stop_reason on the finishing chunk alone."""
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body |= {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 24, "ignore_eos": True,
             "stream": stream} | fields
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        *chunks, usage = (json.loads(e) for e in events[:-1])
        choices = [c["choices"][0] for c in chunks]
        assert [c["finish_reason"] is None for c in choices] == [True] * (len(choices) - 1) + [
            False]
        assert all(c["stop_reason"] is None for c in choices[:-1])
        text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
        return (text, choices[-1]["finish_reason"], choices[-1]["stop_reason"],
                usage["usage"]["completion_tokens"])
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return text, choice["finish_reason"], choice["stop_reason"], r.json()["usage"][
        "completion_tokens"]


def _reference(offline: LLMEngine, tok: Tokenizer, chat: bool, **params) -> list[int]:
    """_ask's prompt generated offline."""
    prompt = chat_ids(tok, [{"role": "user", "content": "x"}]) if chat else PROMPT_IDS
    return generate(offline, prompt, **({"max_tokens": 24, "temperature": 0.0,
                                        "ignore_eos": True} | params))


PROMPT_IDS = [11, 37, 52, 90, 17, 8, 64]


def _first_new(ids: list[int], start: int) -> int:
    """The first position from `start` on whose token has not come before."""
    return next(j for j in range(start, len(ids)) if ids[j] not in ids[:j])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_reason_names_the_stop_string_or_token_id(server, offline, tok, engine, chat,
                                                        stream) -> None:
    """vLLM's stop_reason: the stop_token_ids entry the engine stopped on (an integer), the stop
    string that cut the text, null on length."""
    ref = _reference(offline, tok, chat)
    full = tok.decode(ref)
    prompt = PROMPT_IDS
    j = _first_new(ref, 3)
    # the stop id counts in usage, but its text is not returned (vLLM's)
    assert _ask(server, chat, prompt, stream, stop_token_ids=[ref[j]]) == (
        tok.decode(ref[:j]), "stop", ref[j], j + 1)
    stop = full[12:15]
    assert len(stop) == 3 and full.index(stop) <= 12
    text, reason, stop_reason, _ = _ask(server, chat, prompt, stream, stop=["\u2603never", stop])
    assert (text, reason, stop_reason) == (full[:full.index(stop)], "stop", stop)
    assert _ask(server, chat, prompt, stream) == (full, "length", None, 24)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_min_tokens_holds_back_stop_token_ids_and_stop_strings(server, offline, tok, engine,
                                                                chat, stream) -> None:
    """A stop id is not sampled within the first min_tokens tokens (masked, as vLLM does), so
    it does not end the output there (offline generation with min_tokens is the reference); a
    stop string that those tokens complete does not count."""
    ref = _reference(offline, tok, chat)
    prompt = PROMPT_IDS
    j = _first_new(ref, 2)
    want = _reference(offline, tok, chat, stop_token_ids=(ref[j],), min_tokens=j + 3)
    # the same tokens up to j, where the stop id is masked: another token, and none up to j + 3
    assert len(want) >= j + 3 and want[:j] == ref[:j] and ref[j] not in want[: j + 3]
    text, reason, stop_reason, n = _ask(server, chat, prompt, stream, stop_token_ids=[ref[j]],
                                        min_tokens=j + 3)
    stopped = len(want) < 24  # on the stop id, whose text is not returned
    assert (text, n) == (tok.decode(want[:-1] if stopped else want), len(want))
    assert (reason, stop_reason) == (("stop", ref[j]) if stopped else ("length", None))
    # a piece of the text found once: completed within min_tokens, it cuts nothing
    full = tok.decode(ref)
    stop = next(full[i:i + 3] for i in range(len(full) - 3) if full.count(full[i:i + 3]) == 1
                and full[i:i + 3].strip() == full[i:i + 3])
    m = next(n for n in range(len(ref) + 1) if stop in tok.decode(ref[:n]))
    assert _ask(server, chat, prompt, stream, stop=[stop], min_tokens=m - 1)[:3] == (
        full[:full.index(stop)], "stop", stop)
    assert _ask(server, chat, prompt, stream, stop=[stop], min_tokens=m) == (
        full, "length", None, 24)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("fields", [{"min_tokens": 9, "max_tokens": 8}, {"min_tokens": -1},
                                    {"min_tokens": 17}])
def test_min_tokens_out_of_range_is_400_naming_it(server, chat, fields) -> None:
    """0 <= min_tokens <= max_tokens, an absent max_tokens being the one it defaults to (16 for
    completions, the rest of the context for chat)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = (CHAT if chat else {"model": MODEL_NAME, "prompt": "x"}) | fields
    if chat and fields == {"min_tokens": 17}:
        body["min_tokens"] = MAX_MODEL_LEN
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens"
    assert "min_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_min_tokens_with_too_many_stop_ids_is_400(server, chat) -> None:
    """min_tokens masks the stop ids on the device, at most 128 of them (the EOS ids
    included): more is the client's mistake; without min_tokens any number is served."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = (CHAT if chat else {"model": MODEL_NAME, "prompt": "x"}) | {
        "stop_token_ids": list(range(1, 200)), "max_tokens": 2}
    r = httpx.post(server.url + path, json=body | {"min_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    assert "stop_token_ids" in r.json()["error"]["message"]
    assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200


def test_agentx_request_shape_raw_http(server, tok) -> None:
    """What the AgentX harness sends and reads: streaming chat with max_completion_tokens,
    ignore_eos and include_usage; usage on the last chunk before [DONE]; TTFT from the first
    chunk with non-empty content."""
    body = {"model": MODEL_NAME, "stream": True, "max_completion_tokens": 30, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Read the error message carefully."}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    usage = chunks[-1]["usage"]
    prompt_len = len(chat_ids(tok, body["messages"]))
    assert usage["completion_tokens"] == 30
    assert usage["prompt_tokens"] == prompt_len
    assert usage["total_tokens"] == prompt_len + 30
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": [9, 10, 11, 12]}),
])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path, body) -> None:
    """vLLM's stream_options.continuous_usage_stats (it was accepted and ignored): each chunk
    carries the usage so far, the completion tokens never shrinking, up to the final usage."""
    body = body | {"stream": True, "max_tokens": 12, "ignore_eos": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-2] == 12
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"]
               for c in chunks)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 600}, 400,
     "prompt has 600 tokens; max_model_len is 512"),
    ("/v1/chat/completions", CHAT | {"temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", CHAT | {"top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", CHAT | {"top_k": -5}, 400, "top_k"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": "many"}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"n": 2}, 400, "only n=1 is supported"),
    ("/v1/chat/completions", CHAT | {"seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", CHAT | {"stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "unsupported role wizard"),
    ("/v1/chat/completions", CHAT | {"messages": [{"content": "x"}]}, 400,
     "messages[0]: expected an object with a string 'role'"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "batches of 2"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [7, 100000]}, 400, "vocabulary"),
    ("/v1/chat/completions", CHAT | {"model": "gpt-5"}, 404, "gpt-5"),
    ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "does not exist"),
])
def test_bad_input_is_rejected_precisely(server, path, body, status, fragment) -> None:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    assert error["code"] == status


def test_malformed_json_is_400(server, engine) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "malformed JSON" in r.json()["error"]["message"]
    assert_no_blocks_held(engine)  # nothing reached the engine from any bad request


def test_openai_client_sees_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError, match="max_model_len is 512"):
        client.completions.create(model=MODEL_NAME, prompt=[5] * 513)


def test_api_key_is_required_when_set(engine, tok) -> None:
    """A second app on the same engine, with a key: /v1/* need it, /health does not."""
    with serve(engine, api_key="s3cret") as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        wrong = httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(f"{s.url}/health").status_code == 200
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0)
        r2 = good.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"],
                                          max_tokens=3)
        assert r2.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0).models.list()


# ------------------------------------------------------------------------------------------------
# Disconnects free blocks; metrics
# ------------------------------------------------------------------------------------------------
def _aborted(server: LiveServer) -> float:
    return _sample(httpx.get(f"{server.url}/metrics").text, "vllm:request_success_total",
                   finished_reason="abort")


def test_streaming_disconnect_aborts_and_frees_blocks(server, engine) -> None:
    body = CHAT | {"max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]  # a few chunks: the request is running
        assert any(line.startswith("data: ") for line in seen)
        running = engine.call_in_core(lambda e: e.stats())
        assert running.num_running == 1 and running.num_free_blocks < running.num_total_blocks
    # Leaving the `with` closes the connection mid-stream.
    assert_no_blocks_held(engine)
    assert _aborted(server) >= 1  # ended by the abort, not by running to max_tokens


def test_non_streaming_disconnect_aborts_and_frees_blocks(server, engine) -> None:
    aborted_before = _aborted(server)
    body = CHAT | {"max_tokens": 490, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)
    assert_no_blocks_held(engine)
    assert _aborted(server) == aborted_before + 1


def test_metrics_have_vllm_names_and_count_requests(server, client) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=MODEL_NAME, prompt=[9, 10, 11, 12], max_tokens=5,
                              temperature=0.0, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert f'{name}{{' in text and f'model_name="{MODEL_NAME}"' in text, name
    delta = _sample(text, "vllm:generation_tokens_total") - _sample(
        before, "vllm:generation_tokens_total")
    assert delta == 5
    assert _sample(text, "vllm:prompt_tokens_total") - _sample(
        before, "vllm:prompt_tokens_total") == 4
    assert _sample(text, "vllm:time_to_first_token_seconds_count") - _sample(
        before, "vllm:time_to_first_token_seconds_count") == 1
    assert _sample(text, "vllm:inter_token_latency_seconds_count") - _sample(
        before, "vllm:inter_token_latency_seconds_count") == 4
    assert _sample(text, "vllm:num_requests_running") == 0


PHASES = ("queue", "prefill", "decode", "inference")


def _deltas(before: str, after: str, *names: str) -> dict[str, float]:
    return {n: _sample(after, n) - _sample(before, n) for n in names}


def test_request_phases_and_token_histograms(server, client, engine) -> None:
    """One request through the real engine: each per-request histogram counts it once; its
    phases (the engine's times) add up to its end-to-end latency (the server's, which also
    holds the hand-offs between the event loop and the engine core) and inference is prefill +
    decode; the tokens scheduled per step add up to the prompt and every output token but the
    last (which is sampled, never fed)."""
    wait_until_idle(engine)
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=MODEL_NAME, prompt=[9, 10, 11, 12], max_tokens=5,
                              temperature=0.0, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    counts = _deltas(before, text, *(f"vllm:request_{p}_time_seconds_count" for p in PHASES),
                     "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                     "vllm:request_params_max_tokens_count", "vllm:request_params_n_count")
    assert set(counts.values()) == {1}, counts
    sums = _deltas(before, text, *(f"vllm:request_{p}_time_seconds_sum" for p in PHASES),
                   "vllm:e2e_request_latency_seconds_sum", "vllm:request_prompt_tokens_sum",
                   "vllm:request_generation_tokens_sum", "vllm:request_params_max_tokens_sum",
                   "vllm:request_params_n_sum", "vllm:iteration_tokens_total_sum",
                   "vllm:iteration_tokens_total_count")
    queue, prefill, decode, inference = (sums[f"vllm:request_{p}_time_seconds_sum"]
                                         for p in PHASES)
    e2e = sums["vllm:e2e_request_latency_seconds_sum"]
    assert min(queue, prefill, decode) >= 0 and prefill > 0 and decode > 0, sums
    assert abs(inference - (prefill + decode)) < 1e-6, sums
    assert 0 <= e2e - (queue + prefill + decode) < max(0.1, 0.25 * e2e), sums
    assert (sums["vllm:request_prompt_tokens_sum"], sums["vllm:request_generation_tokens_sum"],
            sums["vllm:request_params_max_tokens_sum"], sums["vllm:request_params_n_sum"]) == (
        4, 5, 5, 1)
    # one prefill step of the 4 prompt tokens, then 4 decode steps of one token each
    assert sums["vllm:iteration_tokens_total_sum"] == 4 + 5 - 1, sums
    assert sums["vllm:iteration_tokens_total_count"] == 5, sums
    assert f'vllm:iteration_tokens_total_bucket{{le="1.0",model_name="{MODEL_NAME}"}}' in text


def test_queue_time_of_a_request_behind_another(make_async_engine) -> None:
    """With one sequence at a time, a request sent while another runs waits in the queue until
    that one ends: its queue time is (nearly) the rest of the first one's run, measured here
    from the client; an implementation that reads 0, or times the queue from the first token,
    falls short of it."""
    engine = make_async_engine("--max-num-seqs", "1")
    with serve(engine) as server:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 120,
                "ignore_eos": True, "temperature": 0.0}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True},
                          timeout=60) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is running
            sent = time.monotonic()
            with httpx.Client(timeout=60) as c:
                pending = c.build_request("POST", f"{server.url}/v1/completions",
                                          json=body | {"max_tokens": 2})
                # the second request's own thread: this one keeps reading the first stream
                result: list[httpx.Response] = []
                worker = threading.Thread(target=lambda: result.append(c.send(pending)))
                worker.start()
                for _ in lines:
                    pass  # the first request runs to its end
                first_done = time.monotonic()
                worker.join(60)
        assert result and result[0].status_code == 200
        text = httpx.get(f"{server.url}/metrics").text
    assert _sample(text, "vllm:request_queue_time_seconds_count") == 2
    waited = first_done - sent  # the second request's wait as the client saw it, a little more
    assert waited > 0.2, "the first request ended too soon for the test to mean anything"
    # the first request's queue time is nearly 0: the sum is the second's
    assert 0.5 * waited < _sample(text, "vllm:request_queue_time_seconds_sum") < waited + 0.25


def _sample(exposition: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` with these labels (0 when there is none yet)."""
    return sum(s.value for family in text_string_to_metric_families(exposition)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
