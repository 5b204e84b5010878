"""P/D over HTTP: a prefill server, a decode server (NixlConnector over shared memory) and
`dsaserve router` in P/D mode between them. Text through the router equals the aggregated
server's (completions, chat, streaming); the prefill response carries vLLM's
kv_transfer_params; corrupt or replayed params are a 400; a prefill engine gone mid-transfer
fails that request with an error and the decode server serves the next; no block is leaked on
either side."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import MODEL_NAME, LiveServer, serve

from dsaserve.core import KVTransferParams, RequestError, SamplingParams
from dsaserve.disagg.launch import parse_pd_spec, server_commands, shared_flags, wait_healthy
from dsaserve.router.app import PREFILL_HEADER, create_router_app
from dsaserve.router.config import RouterConfig

pytestmark = pytest.mark.server

PROMPT = "The harbour town woke early. Before the sun"
CHAT = [{"role": "user", "content": "Tell me about the harbour town."}]


def _kv(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_connector_extra_config": {"backend": "shm", "side_channel_port": 0}})


@pytest.fixture(scope="module")
def servers(make_async_engine) -> Iterator[dict]:
    engines = {"agg": make_async_engine(),
               "prefill": make_async_engine("--kv-transfer-config", _kv("kv_producer")),
               "decode": make_async_engine("--kv-transfer-config", _kv("kv_consumer"))}
    with serve(engines["agg"]) as agg, serve(engines["prefill"]) as p, \
            serve(engines["decode"]) as d:
        proxy = LiveServer(create_router_app(RouterConfig(
            prefill_backends=(p.url,), decode_backends=(d.url,), request_timeout_s=60)))
        try:
            yield {"agg": agg, "prefill": p, "decode": d, "proxy": proxy, "engines": engines}
        finally:
            proxy.close()


def _check_no_leak(servers, within: float = 10.0) -> None:
    """Every block free and every invariant held on both engines, within `within` seconds: the
    producer learns that its blocks were read from the consumer's notification, which its core
    handles after the decode response may already have reached the client."""
    for name in ("prefill", "decode"):
        engine = servers["engines"][name]

        def check(e):
            e.check_integrity()
            s = e.stats()
            return s.num_free_blocks == s.num_total_blocks and not e.has_unfinished_requests()

        deadline = time.monotonic() + within
        while not engine.call_in_core(check):
            assert time.monotonic() < deadline, f"{name}: blocks still in use after {within} s"
            time.sleep(0.05)


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_proxy_equals_aggregated(servers) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    ref = _post(servers["agg"], "/v1/completions", body).json()["choices"][0]["text"]
    r = _post(servers["proxy"], "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers[PREFILL_HEADER] == servers["prefill"].url
    assert r.json()["choices"][0]["text"] == ref
    assert r.json()["usage"]["completion_tokens"] == 12
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True}
    ref_chat = _post(servers["agg"], "/v1/chat/completions", chat).json()
    r = _post(servers["proxy"], "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == ref_chat["choices"][0]["message"]
    # streamed through the proxy
    with httpx.stream("POST", f"{servers['proxy'].url}/v1/completions",
                      json=dict(body, stream=True), timeout=60) as s:
        frames = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    text = "".join(c["text"] for f in frames[:-1] for c in json.loads(f)["choices"])
    assert text == ref
    _check_no_leak(servers)


def test_prefill_params_then_replay_is_400(servers) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = _post(servers["prefill"], "/v1/completions", body)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    for field in ("do_remote_prefill", "do_remote_decode", "remote_engine_id",
                  "remote_block_ids", "remote_host", "remote_port", "tp_size"):
        assert field in params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    decode = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True}
    for corrupt, message in [
        (dict(params, remote_engine_id="someone-else"), "remote_engine_id"),
        (dict(params, remote_block_ids=[10**6]), "remote_block_ids"),
        (dict(params, remote_block_ids="x"), "remote_block_ids"),
        ("not an object", "kv_transfer_params"),
    ]:
        r = _post(servers["decode"], "/v1/completions", dict(decode, kv_transfer_params=corrupt))
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    r = _post(servers["decode"], "/v1/completions", dict(decode, kv_transfer_params=params))
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()  # only where P/D set it
    r = _post(servers["decode"], "/v1/completions", dict(decode, kv_transfer_params=params))
    assert r.status_code == 400 and "not held" in r.json()["error"]["message"]
    _check_no_leak(servers)


def test_the_same_params_twice_at_once_one_is_400(servers) -> None:
    """Two decode requests with one prefill's params at the same time: one is served, the other
    refused with 400 before it READs (claimed by the first's check, or consumed by its READ)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = _post(servers["prefill"], "/v1/completions", body).json()["kv_transfer_params"]
    decode = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True, "kv_transfer_params": params}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: _post(servers["decode"], "/v1/completions", decode),
                                range(2)))
    assert sorted(r.status_code for r in replies) == [200, 400], [r.text for r in replies]
    (refused,) = [r for r in replies if r.status_code == 400]
    message = refused.json()["error"]["message"]
    assert "already being read by another decode request" in message or "not held" in message
    _check_no_leak(servers)


def test_streamed_prefill_carries_the_params_on_its_last_chunk(servers) -> None:
    """A streamed prefill (vLLM's field on streamed chunks) carries kv_transfer_params on the
    chunk with finish_reason only; a decode request with them gives the aggregated text."""
    agg = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
           "ignore_eos": True}
    ref = _post(servers["agg"], "/v1/completions", agg).json()["choices"][0]["text"]
    for path, key in (("/v1/completions", "text"), ("/v1/chat/completions", "delta")):
        body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0.0, "stream": True,
                "kv_transfer_params": {"do_remote_decode": True},
                **({"prompt": PROMPT} if key == "text" else {"messages": CHAT})}
        with httpx.stream("POST", f"{servers['prefill'].url}{path}", json=body,
                          timeout=60) as s:
            frames = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        carrying = [f for f in frames if "kv_transfer_params" in f]
        assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] is not None
        assert carrying[0]["kv_transfer_params"]["do_remote_prefill"] is True
        if key == "text":
            r = _post(servers["decode"], path, dict(
                agg, kv_transfer_params=carrying[0]["kv_transfer_params"]))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref
        else:  # free the held blocks as a decode engine would
            r = _post(servers["decode"], path, {
                "model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "temperature": 0.0,
                "kv_transfer_params": carrying[0]["kv_transfer_params"]})
            assert r.status_code == 200, r.text
    _check_no_leak(servers)


def test_prefill_engine_gone_mid_transfer(servers) -> None:
    """The prefill side's KV disappears between the decode side's check and its read (as when
    the prefill process dies): that request gets an error, the next one is served."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = _post(servers["prefill"], "/v1/completions", body).json()["kv_transfer_params"]
    decode_engine = servers["engines"]["decode"]

    def break_reads(e):  # the decode rank's view of the prefill agent now points at nothing
        t = e.runner.connector.transport
        saved = {k: dict(v.regions) for k, v in t.peers.items()}
        for peer in t.peers.values():
            peer.regions = {n: type(r)(r.name, r.nbytes, 0, r.path + "-gone")
                            for n, r in peer.regions.items()}
        t._remote.clear()
        return saved

    saved = decode_engine.call_in_core(break_reads)
    decode = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True, "kv_transfer_params": params}
    r = _post(servers["decode"], "/v1/completions", decode)
    assert r.status_code == 500, r.text
    assert "reading the prompt's KV from the prefill engine failed" in \
        r.json()["error"]["message"]

    def restore(e):
        t = e.runner.connector.transport
        for name, regions in saved.items():
            t.peers[name].regions = regions

    decode_engine.call_in_core(restore)
    # the next request through the proxy is served (the prefill side frees the unread blocks
    # after its timeout: test_pd_connector.py)
    r = _post(servers["proxy"], "/v1/completions", dict(body, max_tokens=3, ignore_eos=True,
                                                         kv_transfer_params=None))
    assert r.status_code == 200, r.text
    decode_engine.call_in_core(lambda e: e.check_integrity())


def test_pd_spec_parsing() -> None:
    spec = parse_pd_spec("prefill: -pcp 2 -dcp 2 ; decode: -dp 2")
    assert spec == {"prefill": ["-pcp", "2", "-dcp", "2"], "decode": ["-dp", "2"]}
    cmds = server_commands("tiny-glm5", spec, {"prefill": 1, "decode": 2}, 3, "shm")
    kv = json.loads(cmds["prefill"][cmds["prefill"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"] == {
        "backend": "shm", "side_channel_port": 3}
    from dsaserve.config import ConfigError

    for bad, message in [("middle: -dp 2", "expected"), ("prefill: --port 3", "--port"),
                         ("prefill: ; prefill:", "twice")]:
        with pytest.raises(ConfigError, match=message):
            parse_pd_spec(bad)


def test_a_pd_server_refusing_its_flags_is_a_usage_error_naming_pd() -> None:
    """`--pd 'prefill: --bogus'`: the server prints its usage error and exits 2; the launcher
    added a RuntimeError traceback under it. Now a ConfigError naming --pd (a usage error)."""
    from dsaserve.config import ConfigError

    refused = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    with pytest.raises(ConfigError, match="--pd: the prefill server refused its flags"):
        wait_healthy("prefill", "http://127.0.0.1:1", refused, 60)
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(RuntimeError, match="exited with status 1"):
        wait_healthy("decode", "http://127.0.0.1:1", crashed, 60)


def test_each_pd_server_takes_half_the_cores(monkeypatch) -> None:
    """Two servers on one machine: each gets half the cores as OMP_NUM_THREADS (unless set),
    and an executor's workers split that budget, not the machine's."""
    from dsaserve.disagg.launch import server_env
    from dsaserve.engine.executor import cpu_threads_per_worker

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert server_env({"A": "1"}) == {"A": "1", "OMP_NUM_THREADS": "8"}
    assert server_env({"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "3"}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_per_worker(2) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert cpu_threads_per_worker(2) == 4 and cpu_threads_per_worker(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # more than the cores: the cores
    assert cpu_threads_per_worker(2) == 8


def test_both_pd_servers_take_the_served_name_and_the_parsers() -> None:
    from dsaserve.serve import cli as serve_cli

    parser = serve_cli._configure(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--pd", "prefill: ; decode:", "--served-model-name", "m",
                              "--enable-auto-tool-choice", "--tool-call-parser", "glm47",
                              "--reasoning-parser", "glm45"])
    assert shared_flags(args) == ["--served-model-name", "m", "--enable-auto-tool-choice",
                                  "--tool-call-parser", "glm47", "--reasoning-parser", "glm45"]
    assert shared_flags(parser.parse_args(["--pd", "prefill: ; decode:"])) == []


def test_both_pd_servers_take_the_chat_prompt_flags() -> None:
    """Both sides must render a chat request to the same ids (and the router, which gets the
    template's text)."""
    from dsaserve.serve import cli as serve_cli

    parser = serve_cli._configure(argparse.ArgumentParser(allow_abbrev=False))
    template = "{{ messages[0].content }}"
    args = parser.parse_args(["--pd", "prefill: ; decode:", "--chat-template", template])
    assert shared_flags(args) == ["--chat-template", template]
    args = parser.parse_args(["--pd", "prefill: ; decode:", "--tokenizer-mode", "deepseek_v32"])
    assert shared_flags(args) == ["--tokenizer-mode", "deepseek_v32"]


def test_an_unreachable_prefill_host_stalls_only_its_request(make_async_engine) -> None:
    """The side channel is read off the engine core's thread: while one decode request waits on
    a prefill host that accepts but never answers, another request is served; the stuck one then
    gets a 400 naming the host."""
    import socket
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    port = silent.getsockname()[1]
    accepted = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        conn, _ = silent.accept()
        conns.append(conn)
        accepted.set()  # holds the connection open and says nothing

    threading.Thread(target=accept, daemon=True).start()
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                     "kv_connector_extra_config": {"backend": "shm", "transfer_timeout_s": 3}})
    engine = make_async_engine("--kv-transfer-config", kv)
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
              "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": port,
              "remote_block_size": 16, "remote_num_tokens": 3}
    try:
        with serve(engine) as server:
            stuck: list[httpx.Response] = []
            t = threading.Thread(target=lambda: stuck.append(_post(
                server, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 6, 7],
                                            "max_tokens": 2, "kv_transfer_params": params})))
            t.start()
            assert accepted.wait(30)
            r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT,
                                                  "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and t.is_alive()  # served while the other one waits
            t.join(60)
            assert stuck[0].status_code == 400
            assert f"127.0.0.1:{port} cannot be reached" in stuck[0].json()["error"]["message"]
    finally:
        for c in conns:
            c.close()
        silent.close()


def test_an_aborted_decode_request_frees_the_producer_blocks(make_async_engine) -> None:
    """Through the engine cores (`AsyncEngine`, as the server runs them): a decode request whose
    id is in use is refused before its fetch claims anything; one aborted by its client while it
    waits for a seat (checked and claimed, its READs not posted) has the producer free the held
    blocks at once, long before the producer's 120 s timeout; no block left on either side."""
    extra = {"backend": "shm", "side_channel_port": 0, "abort_timeout_s": 120}
    kv = {"kv_connector": "NixlConnector", "kv_connector_extra_config": extra}
    prefill = make_async_engine("--kv-transfer-config",
                                json.dumps(dict(kv, kv_role="kv_producer")))
    decode = make_async_engine("--kv-transfer-config", json.dumps(dict(kv, kv_role="kv_consumer")),
                               "--max-num-seqs", "1")
    prompt = list(range(5, 45))
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    def in_core(engine, fn):
        return asyncio.to_thread(engine.call_in_core, fn)

    async def scenario() -> None:
        stream = await prefill.add_request("a", prompt, once,
                                           kv_transfer_params=KVTransferParams(
                                               do_remote_decode=True))
        params = [o async for o in stream][-1].kv_transfer_params
        assert params is not None
        busy = await decode.add_request("busy", [5, 6, 7], long)  # holds the only seat
        assert not (await anext(aiter(busy))).finished
        with pytest.raises(RequestError, match="already in use"):
            await decode.add_request("busy", prompt, long, kv_transfer_params=params)
        assert await in_core(prefill, lambda e: dict(e.scheduler.connector._claims)) == {}
        waiting = await decode.add_request("a", prompt, long, kv_transfer_params=params)
        assert await in_core(prefill, lambda e: dict(e.scheduler.connector._claims)) == {
            "a": "a"}
        assert await in_core(decode, lambda e: "a" in [r.request_id
                                                       for r in e.scheduler.waiting])
        t0 = time.monotonic()
        waiting.abort()  # the client went away
        while await in_core(prefill, lambda e: "a" in e.scheduler.connector.held):
            assert time.monotonic() - t0 < 30, "the producer still holds the blocks"
            await asyncio.sleep(0.05)
        busy.abort()

    asyncio.run(scenario())
    for engine in (prefill, decode):
        def check(e):
            e.check_integrity()
            s = e.stats()
            return s.num_free_blocks == s.num_total_blocks and not e.has_unfinished_requests()

        deadline = time.monotonic() + 30
        while not engine.call_in_core(check):
            assert time.monotonic() < deadline, "blocks still in use"
            time.sleep(0.05)
