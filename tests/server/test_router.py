"""`dsaserve router` in front of real `dsaserve serve` processes (tiny model, 127.0.0.1): the
agentic replay (stickiness, balance, hit rate against round-robin), precise vs approximate prefix
indexes, greedy equality with direct calls, and each fault (a killed backend, retry before
streaming, a failure mid-stream, a client that leaves, a flood, bad input).

Backends are separate processes (what the router meets in production); routers run in this
process on uvicorn threads so the tests can read their state, and one test starts the CLI.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from server_harness import TEST_FLAGS, LiveServer

from dsaserve.bench.agentx import main as agentx_main
from dsaserve.bench.agentx import parse_prefix_cache
from dsaserve.bench.traces import Workload, WorkloadSpec, generate, write_workload
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.router.app import BACKEND_HEADER, create_router_app
from dsaserve.router.config import RouterConfig
from dsaserve.router.scoring import longest_prefix_match
from dsaserve.serve.ports import free_port
from dsaserve.serve.prompt import render_chat
from dsaserve.tokenizer import Tokenizer

pytestmark = pytest.mark.server

BLOCK_SIZE = 16  # TEST_FLAGS
TIMEOUT = httpx.Timeout(60.0, connect=5.0)  # no request may hang past this


# ------------------------------------------------------------------------------------------------
# Backends: `dsaserve serve` processes that can be killed and restarted on the same ports
# ------------------------------------------------------------------------------------------------
class BackendProcess:
    def __init__(self, model_dir: Path, log_dir: Path, *flags: str) -> None:
        self.port, self.events_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://127.0.0.1:{self.events_port}"})
        self.cmd = [sys.executable, "-m", "dsaserve.serve.cli", str(model_dir), "--port",
                    str(self.port), *TEST_FLAGS, *flags, "--kv-events-config", events]
        self.log = log_dir / f"backend-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BackendProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # a crash, not a graceful stop
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text


def metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def backends(tiny_model_dir: Path, tmp_path_factory) -> Iterator[list[BackendProcess]]:
    log_dir = tmp_path_factory.mktemp("router-logs")
    procs = [BackendProcess(tiny_model_dir, log_dir).start() for _ in range(2)]
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def small_backend(tiny_model_dir: Path, tmp_path_factory) -> Iterator[BackendProcess]:
    """A backend with a 24-block pool (evictions come fast); the fault tests kill it."""
    proc = BackendProcess(tiny_model_dir, tmp_path_factory.mktemp("router-small"),
                          "--num-gpu-blocks-override", "24", "--max-model-len", "256").start()
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def start_router(urls: list[str], **config: object) -> LiveServer:
    return LiveServer(create_router_app(RouterConfig(backends=tuple(urls), **config)))


def router_state(router: LiveServer) -> dict:
    return httpx.get(f"{router.url}/router/state", timeout=5).json()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------------------------------------
# The agentic replay
# ------------------------------------------------------------------------------------------------
NUM_SESSIONS, NUM_TURNS = 5, 4


def spec(seed: int) -> WorkloadSpec:
    # Per-session system prompts (shared_prefix=False), as the AgentX harness sends Weka traces.
    # An odd number of sessions: when the sessions' turns arrive in lockstep rounds (a loaded
    # machine), round robin over 2 replicas then moves every turn to the other replica, as it
    # does half the time otherwise; with an even number it would keep every session on one
    # replica by accident and look like prefix routing.
    return WorkloadSpec(num_sessions=NUM_SESSIONS, num_turns=NUM_TURNS, block_size=BLOCK_SIZE,
                        system_tokens=48,
                        tool_tokens=16, task_tokens=48, tool_result_tokens=(16, 48),
                        output_tokens=(4, 8), think_time_s=(0.0, 0.05), shared_prefix=False,
                        seed=seed)


async def replay(url: str, workload: Workload, *, lockstep: bool = False
                 ) -> list[tuple[str, int, str, int, int]]:
    """Every session at once, turns in order; (session, turn, backend, prompt, cached tokens).
    `lockstep`: one request at a time instead, in rounds (every session's turn 0, then every
    session's turn 1, ...), no think time: an order that does not depend on the machine's
    load."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        async def send(s, t) -> tuple[str, int, str, int, int]:
            body = {"messages": s.prompt(t.index), "max_completion_tokens": t.output_tokens,
                    "ignore_eos": True, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
                usage = json.loads(lines[-1][6:])["usage"]
                return (s.id, t.index, r.headers[BACKEND_HEADER], usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"])

        if lockstep:
            return [await send(s, s.turns[i]) for i in range(len(workload.sessions[0].turns))
                    for s in workload.sessions]

        async def session(s) -> list[tuple[str, int, str, int, int]]:
            out = []
            for t in s.turns:
                await asyncio.sleep(t.think_time_s)
                out.append(await send(s, t))
            return out

        per_session = await asyncio.gather(*(session(s) for s in workload.sessions))
    return [r for rs in per_session for r in rs]


def hit_rate(backends: list[BackendProcess], before: list[str], after: list[str]) -> float:
    b = [parse_prefix_cache(t) for t in before]
    a = [parse_prefix_cache(t) for t in after]
    hits = sum(x.hits - y.hits for x, y in zip(a, b, strict=True))
    queries = sum(x.queries - y.queries for x, y in zip(a, b, strict=True))
    return hits / queries


def test_replay_prefix_routing_is_sticky_balanced_and_beats_round_robin(backends, tok,
                                                                         capsys) -> None:
    urls = [b.url for b in backends]
    results = {}
    for policy, seed in (("prefix", 1), ("round-robin", 2)):  # fresh sessions: cold caches
        workload = generate(spec(seed), tok)
        router = start_router(urls, policy=policy, prefix_index="precise")
        try:
            before = [b.metrics() for b in backends]
            routed_before = parse_prefix_cache(httpx.get(f"{router.url}/metrics").text)
            # round robin in lockstep rounds: with an odd number of sessions it then moves
            # every turn to the other replica, deterministically (its reuse under concurrent
            # arrivals moved with the machine's load: 59-83 % of the reusable prefix)
            records = asyncio.run(replay(router.url, workload, lockstep=policy == "round-robin"))
            after = [b.metrics() for b in backends]
            routed_after = parse_prefix_cache(httpx.get(f"{router.url}/metrics").text)
        finally:
            router.close()
        # The router re-exports the backends' counters: a hit rate read through it is theirs.
        assert routed_after.rate_since(routed_before) == pytest.approx(
            hit_rate(backends, before, after))
        by_turn = {(s, t): (backend, prompt, cached) for s, t, backend, prompt, cached in records}
        later = [(s, t) for s, t, _, _, _ in records if t > 0]
        sticky = sum(by_turn[(s, t)][0] == by_turn[(s, t - 1)][0] for s, t in later) / len(later)
        # A turn re-sends the previous turn's prompt: every full block of it can be a hit.
        reusable = sum(by_turn[(s, t - 1)][1] // BLOCK_SIZE * BLOCK_SIZE for s, t in later)
        cached = sum(by_turn[k][2] for k in later)
        counts = [sum(r[2] == u for r in records) for u in urls]
        results[policy] = (sticky, counts, hit_rate(backends, before, after), cached / reusable)
    with capsys.disabled():
        for policy, (sticky, counts, rate, reused) in results.items():
            print(f"\n[router replay] {policy}: turns on their prefix's replica {sticky:.0%}, "
                  f"requests per replica {counts}, prefix-cache hit rate {rate:.1%} "
                  f"({reused:.0%} of the reusable prefix)")

    sticky, counts, prefix_rate, prefix_reused = results["prefix"]
    assert sticky >= 0.95
    # balanced to within one session (a session's turns stay together: 3 sessions and 2)
    assert max(counts) - min(counts) <= NUM_TURNS and sum(counts) == NUM_SESSIONS * NUM_TURNS, \
        counts
    assert prefix_reused >= 0.95  # the hit rate is what the replay's shared prefixes allow
    _, rr_counts, rr_rate, rr_reused = results["round-robin"]
    assert rr_counts == [NUM_SESSIONS * NUM_TURNS // 2] * 2
    assert prefix_rate >= rr_rate + 0.1 and prefix_reused >= rr_reused + 0.2, results


def test_precise_and_approximate_agree_without_evictions(backends, tok) -> None:
    """The same match on every backend for every prompt the replay sent (nothing was evicted:
    256 blocks per backend hold the whole workload)."""
    router = start_router([b.url for b in backends], prefix_index="precise")
    workload = generate(spec(3), tok)
    state = router._server.config.app.state.router
    try:
        asyncio.run(replay(router.url, workload))
        prompts = [request_block_hashes(render_chat(tok, s.prompt(t.index)), BLOCK_SIZE, None)
                   for s in workload.sessions for t in s.turns]

        def matches(index) -> list[int]:
            return [longest_prefix_match(h, lambda x, u=b.url: index.holds(u, x))
                    for h in prompts for b in state.pool.backends]

        # Events trail the responses by a step: wait until the last ones have landed.
        wait_for(lambda: matches(state.picker.precise) == matches(state.picker.approximate), 10,
                 "the precise index to catch up")
        assert sum(matches(state.picker.precise)) >= sum(len(h) for h in prompts)
    finally:
        router.close()


def test_precise_wins_after_evictions(small_backend: BackendProcess, tok) -> None:
    """A backend with 24 blocks of 16 tokens, prompts of ~7: the fourth evicts the first's tail.
    The approximate index still claims it; the precise index (events) knows it is gone and
    predicts the backend's real hit."""
    small = small_backend
    router = start_router([small.url], prefix_index="precise")
    state = router._server.config.app.state.router
    try:
        def prompt(i: int) -> list[dict[str, str]]:
            words = " ".join(f"w{i}x{j}" for j in range(20))
            return [{"role": "user", "content": f"session {i}: {words}"}]

        def send(i: int) -> int:
            r = httpx.post(f"{router.url}/v1/chat/completions", timeout=TIMEOUT,
                           json={"messages": prompt(i), "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        def predicted(i: int) -> tuple[int, int]:
            hashes = request_block_hashes(render_chat(tok, prompt(i)), BLOCK_SIZE, None)
            hashes = hashes[: (len(render_chat(tok, prompt(i))) - 1) // BLOCK_SIZE]
            return tuple(longest_prefix_match(hashes, lambda h, x=x: x.holds(small.url, h))
                         * BLOCK_SIZE for x in (state.picker.approximate,
                                                state.picker.precise))

        send(0)
        wait_for(lambda: predicted(0)[1] > 0, 10, "the stored events")
        approx, precise = predicted(0)
        assert approx == precise > 0  # nothing evicted yet: both right
        for i in range(1, 4):  # ~7 blocks each: the fourth prompt reuses prompt 0's tail blocks
            send(i)
        wait_for(lambda: predicted(0)[1] < approx, 10, "the removed events")
        approx_after, precise_after = predicted(0)
        assert approx_after == approx  # the approximate index cannot know
        assert send(0) == precise_after < approx_after  # precise predicted the real hit
    finally:
        router.close()


def test_greedy_outputs_through_the_router_equal_direct_calls(backends) -> None:
    router = start_router([b.url for b in backends])
    try:
        chat = {"messages": [{"role": "user", "content": "count the blocks of the cache"}],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        text = {"prompt": "the router sends this prompt", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        for path, body, field in (("/v1/chat/completions", chat, "message"),
                                  ("/v1/completions", text, "text")):
            direct = httpx.post(f"{backends[0].url}{path}", json=body, timeout=TIMEOUT).json()
            routed = httpx.post(f"{router.url}{path}", json=body, timeout=TIMEOUT).json()
            pick = (lambda r: r["choices"][0]["message"]["content"]) if field == "message" \
                else (lambda r: r["choices"][0]["text"])
            assert pick(routed) == pick(direct) and pick(direct)
            with httpx.stream("POST", f"{router.url}{path}", json={**body, "stream": True},
                              timeout=TIMEOUT) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            key = "delta" if field == "message" else None
            streamed = "".join((c["choices"][0][key].get("content") or "") if key
                               else c["choices"][0]["text"] for c in chunks if c["choices"])
            assert streamed == pick(direct)
        models = httpx.get(f"{router.url}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == httpx.get(f"{backends[0].url}/v1/models").json()[
            "data"][0]["id"]
    finally:
        router.close()


def test_bad_input_is_a_400_and_the_router_survives(backends) -> None:
    router = start_router([b.url for b in backends])
    try:
        url = f"{router.url}/v1/chat/completions"
        r = httpx.post(url, content=b"{not json", timeout=TIMEOUT,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        r = httpx.post(url, json=[1, 2], timeout=TIMEOUT)
        assert r.status_code == 400
        # The router cannot render these messages; the backend judges them, as `serve` does.
        r = httpx.post(url, json={"messages": "hi"}, timeout=TIMEOUT)
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "a"}]},
                       timeout=TIMEOUT)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    finally:
        router.close()


# ------------------------------------------------------------------------------------------------
# Faults
# ------------------------------------------------------------------------------------------------
def test_a_killed_backend_is_taken_out_and_put_back(backends, small_backend) -> None:
    victim = small_backend
    router = start_router([backends[0].url, victim.url], health_check_interval_s=0.2,
                          health_check_max_backoff_s=0.5, health_check_timeout_s=1.0)
    body = {"prompt": "a short prompt", "max_tokens": 2}
    try:
        victim.kill()
        wait_for(lambda: not router_state(router)["backends"][1]["healthy"], 5,
                 "the router to notice the dead backend")
        for _ in range(6):  # every request goes to the live one, none fails
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200 and r.headers[BACKEND_HEADER] == backends[0].url
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
        victim.start()  # the same ports: it comes back
        victim.wait_healthy()
        wait_for(lambda: router_state(router)["backends"][1]["healthy"], 5,
                 "the router to put the backend back")
        seen = {httpx.post(f"{router.url}/v1/completions", json=body,
                           timeout=TIMEOUT).headers[BACKEND_HEADER] for _ in range(4)}
        assert victim.url in seen
        assert metric(httpx.get(f"{router.url}/metrics").text,
                      "dsaserve_router_backend_healthy", backend=victim.url) == 1.0
    finally:
        router.close()


def fake_backend(mode: str) -> LiveServer:
    """A backend that answers /health and /kv_info but fails completions: `503` before anything
    is sent, `mid-stream` after one SSE chunk (it then drops the connection), or `hang` (never
    answers)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/kv_info")
    async def kv_info() -> dict:
        return {"model": "tiny-test", "block_size": BLOCK_SIZE, "enable_prefix_caching": True,
                "data_parallel_size": 1, "kv_events_endpoints": []}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        if mode == "503":
            return JSONResponse({"error": {"message": "engine is not running"}}, 503)
        if mode == "hang":  # until the router gives up (then the server can stop at once)
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            return Response(status_code=499)

        async def body():
            yield b'data: {"choices": [{"index": 0, "text": "partial"}]}\n\n'
            await asyncio.sleep(0.1)
            raise RuntimeError("backend crashed mid-stream")  # uvicorn drops the connection

        return StreamingResponse(body(), media_type="text/event-stream")

    return LiveServer(app)


def test_failures_before_streaming_are_retried_elsewhere(backends) -> None:
    broken = fake_backend("503")
    gone = fake_backend("503")
    # Long health intervals: the router learns of the failures from the requests themselves.
    router = start_router([broken.url, gone.url, backends[0].url], policy="round-robin",
                          max_retries=2, health_check_interval_s=60)
    gone.close()  # now nothing listens there: connection refused
    try:
        for stream in (False, True):
            for _ in range(3):
                r = httpx.post(f"{router.url}/v1/completions", timeout=TIMEOUT,
                               json={"prompt": "retry me", "max_tokens": 2, "stream": stream})
                assert r.status_code == 200 and r.headers[BACKEND_HEADER] == backends[0].url
        m = httpx.get(f"{router.url}/metrics").text
        assert metric(m, "dsaserve_router_retries_total") >= 2
        assert metric(m, "dsaserve_router_proxy_errors_total", backend=broken.url,
                      kind="status_5xx") >= 1
        assert metric(m, "dsaserve_router_proxy_errors_total", backend=gone.url,
                      kind="connect") == 1  # then taken out until a health check answers
        # No retries allowed and only failing backends left: a clear error, at once.
        lone = start_router([broken.url], max_retries=0, health_check_interval_s=60)
        try:
            r = httpx.post(f"{lone.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
            assert r.status_code == 502 and "503" in r.json()["error"]["message"]
        finally:
            lone.close()
    finally:
        router.close()
        broken.close()


def test_a_failure_mid_stream_fails_fast_with_an_error_frame() -> None:
    crashing = fake_backend("mid-stream")
    router = start_router([crashing.url], health_check_interval_s=60)
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "x", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "partial" in lines[0]
        assert "failed mid-stream" in json.loads(lines[-2][6:])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
    finally:
        router.close()
        crashing.close()


def test_a_silent_backend_times_out_instead_of_hanging() -> None:
    silent = fake_backend("hang")
    router = start_router([silent.url], request_timeout_s=0.5, max_retries=0,
                          health_check_interval_s=60)
    try:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{router.url}/v1/completions", timeout=TIMEOUT,
                           json={"prompt": "x", "stream": stream})
            assert r.status_code == 502 and "timed out" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 5
    finally:
        router.close()
        silent.close()


def test_a_client_disconnect_aborts_the_backend_request(backends) -> None:
    backend = backends[1]
    router = start_router([backend.url])
    aborted = metric(backend.metrics(), "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "go on and on", "max_tokens": 400, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True},
                          timeout=TIMEOUT) as r:
            next(r.iter_lines())  # the stream started; leave
        # Not streaming: the client gives up after 0.3 s.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json=body, timeout=0.3)
        wait_for(lambda: metric(backend.metrics(), "vllm:request_success_total",
                                finished_reason="abort") == aborted + 2, 10,
                 "both backend requests to be aborted")
        wait_for(lambda: metric(backend.metrics(), "vllm:num_requests_running") == 0, 5,
                 "the backend to go idle")
        wait_for(lambda: router_state(router)["backends"][0]["num_active"] == 0, 5,
                 "the router to release the requests")
    finally:
        router.close()


def test_a_flood_gets_429_not_unbounded_queues(backends) -> None:
    router = start_router([b.url for b in backends], max_concurrent_requests=2,
                          max_queued_requests=2)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(
                client.post(f"{router.url}/v1/completions",
                            json={"prompt": f"flood {i}", "max_tokens": 16, "ignore_eos": True})
                for i in range(12)))

    try:
        statuses = [r.status_code for r in asyncio.run(flood())]
        assert set(statuses) == {200, 429} and statuses.count(200) >= 4, statuses
        assert statuses.count(429) == 12 - statuses.count(200)
        m = httpx.get(f"{router.url}/metrics").text
        assert metric(m, "dsaserve_router_rejected_total", reason="queue_full") == \
            statuses.count(429)
        assert metric(m, "dsaserve_router_queued_requests") == 0
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "after", "max_tokens": 1},
                       timeout=TIMEOUT)
        assert r.status_code == 200  # every slot came back
    finally:
        router.close()


def test_no_healthy_backend_is_a_503(tmp_path: Path) -> None:
    router = start_router([f"http://127.0.0.1:{free_port()}"], health_check_interval_s=60)
    try:
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 503 and "no healthy backend" in r.json()["error"]["message"]
        h = httpx.get(f"{router.url}/health", timeout=5)
        assert h.status_code == 503 and "no healthy backend" in h.json()["error"]["message"]
    finally:
        router.close()


def test_the_router_cli(backends, tok, tmp_path: Path, capsys) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "dsaserve.cli", "router", "--port", str(port),
           "--backend", backends[0].url, "--backend", backends[1].url, "--prefix-index", "precise"]
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the router to start")
        r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT,
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "dsaserve_router_requests_total" in httpx.get(f"{url}/metrics").text
        # The AgentX replay tool drives the router as it drives `serve`, hit rate included.
        small = WorkloadSpec(num_sessions=2, num_turns=2, block_size=BLOCK_SIZE, system_tokens=48,
                             tool_tokens=16, task_tokens=32, tool_result_tokens=(16, 32),
                             output_tokens=(2, 4), think_time_s=(0.0, 0.0), seed=5)
        write_workload(generate(small, tok), tmp_path / "trace")
        assert agentx_main(["--trace", str(tmp_path / "trace"), "--url", url, "--mode", "replay",
                            "--think-time-scale", "0"]) == 0
        out = capsys.readouterr().out
        assert re.search(r"errors +0\n", out), out
        assert re.search(r"prefix-cache hit rate \(/metrics\) +[1-9][0-9.]* %", out), out
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run([sys.executable, "-m", "dsaserve.cli", "router", "--backend", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--backend" in bad.stderr
