"""The engine-core thread: typed messages, admission, shutdown, and what clients see when the engine
dies mid-flight (an SSE error event then [DONE], a 500, /health 503; nothing hangs)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import MODEL_NAME, serve, server_engine_config

from dsaserve.core import RequestError, SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine, EngineDeadError

pytestmark = pytest.mark.server

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400, "ignore_eos": True}


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_core_blocks_while_idle(make_async_engine) -> None:
    """No busy loop: with nothing to do, the core waits on its inbox and never polls the engine."""
    engine = make_async_engine()
    blocked = threading.Event()
    calls = 0

    class WatchedInbox(queue.Queue):
        def get(self, block: bool = True, timeout: float | None = None):
            if block:
                blocked.set()
            return super().get(block, timeout)

    def install(e: LLMEngine) -> None:  # runs on the core thread, between two loop iterations
        nonlocal calls
        real = e.has_unfinished_requests

        def counting() -> bool:
            nonlocal calls
            calls += 1
            return real()

        e.has_unfinished_requests = counting
        engine._inbox = WatchedInbox()

    engine.call_in_core(install)
    assert blocked.wait(10)  # the core went back to waiting on its (new) inbox
    before = calls
    time.sleep(0.3)
    assert calls == before  # not a single poll while idle
    engine.call_in_core(lambda e: None)  # and a message still wakes it up
    _wait_for(lambda: calls > before, "the core to look at the engine again")


def test_admission_rejection_and_shutdown(make_async_engine) -> None:
    engine = make_async_engine()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        with pytest.raises(RequestError, match="prompt has 600 tokens; max_model_len is 512"):
            await engine.add_request("too-long", [5] * 600, params)
        stream = await engine.add_request("r1", [5, 6, 7], params)
        with pytest.raises(RequestError, match="already in use"):
            await engine.add_request("r1", [5, 6, 7], params)
        first = await anext(aiter(stream))
        assert len(first.new_token_ids) == 1 and not first.finished
        await asyncio.to_thread(engine.shutdown)  # stops after the current step
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", [5, 6, 7], params)

    asyncio.run(scenario())
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        engine.call_in_core(lambda e: None)


def test_a_retry_under_an_aborted_id_gets_only_its_own_outputs(make_async_engine) -> None:
    """A client aborts a request and sends it again under the same id at once: the retry is
    admitted, and the first one's "abort" answer (given by the engine at its next step, when the
    retry is already registered) never reaches the retry's stream."""
    engine = make_async_engine()
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        first = await engine.add_request("r", [5, 6, 7], long)
        assert not (await anext(aiter(first))).finished
        first.abort()
        retry = await engine.add_request("r", [5, 6, 7], short)
        outs = [o async for o in retry]
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 5

    asyncio.run(scenario())
    assert engine.call_in_core(lambda e: not e.has_unfinished_requests())


def test_outputs_reach_the_loop_that_added_each_request(make_async_engine) -> None:
    """Two event loops (two servers on one engine) each get exactly their own requests' outputs."""
    engine = make_async_engine()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results: dict[str, list[int]] = {}

    def run_loop(request_id: str, prompt: list[int]) -> None:
        async def go() -> None:
            stream = await engine.add_request(request_id, prompt, params)
            results[request_id] = [t async for out in stream for t in out.new_token_ids]

        asyncio.run(go())

    threads = [threading.Thread(target=run_loop, args=(f"loop{i}", [10 + i, 11, 12]))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    reference = engine.call_in_core(
        lambda e: e.generate([[10, 11, 12], [11, 11, 12]], params))
    assert [results["loop0"], results["loop1"]] == reference
    engine.call_in_core(lambda e: e.check_integrity())


@pytest.fixture
def failing_engine(make_async_engine, tiny_model_dir: Path) -> tuple[AsyncEngine, threading.Event]:
    """An engine whose step() raises once `fail` is set (a model crash, a device error, ...)."""
    llm = LLMEngine.from_config(server_engine_config(tiny_model_dir))
    fail = threading.Event()
    real_step = llm.step

    def step():
        if fail.is_set():
            raise RuntimeError("injected device failure")
        return real_step()

    llm.step = step
    return make_async_engine(engine=llm), fail


def test_engine_death_fails_in_flight_requests_and_health(failing_engine) -> None:
    engine, fail = failing_engine
    with serve(engine) as server, ThreadPoolExecutor(1) as pool:
        url = f"{server.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=CHAT | {"stream": True}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: admitted
            blocking = pool.submit(httpx.post, url, json=CHAT, timeout=30)
            _wait_for(lambda: engine.stats().num_running == 2, "both requests to run")
            fail.set()
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "injected device failure" in error["message"]
        response = blocking.result(timeout=30)
        assert response.status_code == 500
        assert "injected device failure" in response.json()["error"]["message"]

        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
        late = httpx.post(url, json=CHAT)
        assert late.status_code == 503
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"])
        assert e.value.status_code == 503


def test_openai_client_raises_on_a_stream_cut_by_engine_death(failing_engine) -> None:
    engine, fail = failing_engine
    with serve(engine) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"],
                                                max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="injected device failure"):
            for i, _ in enumerate(stream):
                if i == 2:
                    fail.set()


def test_an_unexpected_error_adding_one_request_fails_only_it(make_async_engine,
                                                               tiny_model_dir: Path) -> None:
    """An engine bug met while adding one request (not a RequestError): that request gets a 500
    naming it, the engine core lives on and serves the next request, nothing leaks."""
    llm = LLMEngine.from_config(server_engine_config(tiny_model_dir))
    real_add = llm.add_request

    def add_request(request_id, prompt_token_ids, params, **kw):
        if params.max_tokens == 7:  # the poisoned request
            raise IndexError("injected bug in add_request")
        return real_add(request_id, prompt_token_ids, params, **kw)

    llm.add_request = add_request
    engine = make_async_engine(engine=llm)
    with serve(engine) as server:
        url = f"{server.url}/v1/completions"
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 7}, timeout=30)
        assert r.status_code == 500 and "injected bug" in r.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 7, "stream": True}, timeout=30)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]  # an error frame, not a silent "abort"
        assert error["code"] == 500 and "injected bug in add_request" in error["message"]
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert engine.call_in_core(lambda e: e.stats().num_free_blocks
                                   == e.stats().num_total_blocks)
