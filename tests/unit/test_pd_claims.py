"""A P/D consumer giving back its claims (disagg/claims.py), engines in one process (shm; NIXL
where it imports): a decode request refused after its check gives its claim back, so another
decode request with the same params is served before the producer's timeout; one aborted before
its READs frees the producer's blocks at once; a failed READ frees them once every rank
settled; a forged release (wrong claimant, unknown request, other engine, malformed) is refused
and changes nothing; a producer that is gone or silent costs the consumer a log line, not a step,
and holds up no release to another producer (then or at shutdown); the sender's threads are capped
and stop once idle. Every engine's invariants after every scenario, every block free at the end."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from test_pd_async_read import SlowReads, _decode_side_clean

from dsaserve.config import DisaggConfig
from dsaserve.core import KVTransferParams, RequestError, SamplingParams
from dsaserve.disagg import offline
from dsaserve.disagg.claims import Release, ReleaseSender
from dsaserve.disagg.connector import ConnectorScheduler, EngineLayout, fetch_remote
from dsaserve.disagg.transport import SideChannel, fetch_metadata, nixl_available
from dsaserve.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BACKENDS = ["shm"] + (["nixl"] if nixl_available() else [])
LONG_TIMEOUT_S = 120.0  # the producer's abort timeout: "at once" is well before it
MAX_STEPS = 500
SILENT_TIMEOUT_S = 60.0  # the consumer's transfer timeout where a producer is silent


def _disagg(role: str, backend: str, **kw) -> DisaggConfig:
    return DisaggConfig(kv_role=role, backend=backend, side_channel_port=0, **kw)


def _producer(config, backend: str) -> LLMEngine:
    return LLMEngine.from_config(dataclasses.replace(
        config, disagg=_disagg("kv_producer", backend, abort_timeout_s=LONG_TIMEOUT_S)))


def _consumer(config, backend: str, **kw) -> LLMEngine:
    return LLMEngine.from_config(dataclasses.replace(
        config, disagg=_disagg("kv_consumer", backend, **kw)))


def _all_free(*engines: LLMEngine) -> None:
    for e in engines:
        e.check_integrity()
        s = e.stats()
        assert s.num_free_blocks == s.num_total_blocks and not e.scheduler.requests


def _claims(p: LLMEngine) -> dict[str, str]:
    return dict(p.scheduler.connector._claims)


def test_a_claim_names_a_million_token_request_s_blocks():
    """A 1M-token request holds 16K+ block ids: more than a side-channel question may carry,
    so the claim names them by digest. The exact ids claim it; one id off does not."""
    producer = ConnectorScheduler(_disagg("kv_producer", "shm"), "e0",
                                  EngineLayout(block_size=64, dcp_size=1, interleave=1,
                                               tp_size=1), [b"{}"])
    try:
        ids = tuple(range(7, 7 + (1 << 20) // 64 + 1))
        producer.held["long"] = SimpleNamespace(
            request=SimpleNamespace(block_ids=list(ids)), deadline=time.monotonic() + 60)
        producer._publish()
        params = KVTransferParams(do_remote_prefill=True, remote_engine_id="e0",
                                  remote_request_id="long", remote_block_ids=ids,
                                  remote_host=producer.side_channel.host,
                                  remote_port=producer.side_channel.port)
        off_by_one = dataclasses.replace(params, remote_block_ids=ids[:-1] + (ids[-1] + 1,))
        assert not fetch_remote(off_by_one, 5.0, "d0")["claim"]["granted"]
        answer = fetch_remote(params, 5.0, "d1")
        assert answer["claim"] == {"request": "long", "granted": True}
        assert answer["held"]["long"] == list(ids) and producer._claims == {"long": "d1"}
    finally:
        producer.side_channel.close()


def _step_until_freed(p: LLMEngine, rid: str, within_s: float) -> float:
    """Step the producer until it no longer holds `rid`; the seconds it took."""
    t0 = time.monotonic()
    while rid in p.scheduler.connector.held:
        assert time.monotonic() - t0 < within_s, f"{rid} still held after {within_s} s"
        p.step()
        p.check_integrity()
    return time.monotonic() - t0


def _serve(p: LLMEngine, d: LLMEngine, tokens: dict[str, list[int]]) -> None:
    """Step the pair until both are idle, the decode side's tokens into `tokens` (no output
    may carry an error), both engines' invariants checked after every step."""
    for _ in range(MAX_STEPS):
        if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
            return
        for out in d.step():
            assert out.error is None
            tokens[out.request_id] += out.new_token_ids
        p.step()
        for e in (p, d):
            e.check_integrity()


def _silence(p: LLMEngine) -> threading.Event:
    """From now on `p`'s side channel takes each question and answers none until the event is
    set (then as before)."""
    side = p.scheduler.connector.side_channel
    answer, answering = side._ask, threading.Event()
    side._ask = lambda q: answering.wait(2 * SILENT_TIMEOUT_S) and answer(q)
    return answering


def _sender_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kv-claim-release"}


def _until_stopped(before: set[threading.Thread], within_s: float = 10.0) -> None:
    """Wait until every sender thread started since `before` was taken has stopped (idle)."""
    t0 = time.monotonic()
    while _sender_threads() - before:
        assert time.monotonic() - t0 < within_s, f"sender threads still alive after {within_s} s"
        time.sleep(0.02)


def _release(p: LLMEngine, question: dict) -> dict:
    """A release question sent to the producer's side channel by hand."""
    side = p.scheduler.connector.side_channel
    return json.loads(fetch_metadata(side.port, side.host, 5.0, json.dumps(question).encode()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_refused_after_its_check_gives_its_claim_back(model_dirs, engine_config,
                                                                mixed_prompts, backend):
    """Refused after the check's fetch claimed the held request — its id in use, its prompt past
    the decode engine's max_model_len — the claim is dropped and the blocks stay held: another
    decode request with the same params is served, long before the producer's timeout, with the
    aggregated engine's output."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    prompt = max(prompts, key=len)
    reference = LLMEngine.from_config(config).generate([prompt], GREEDY)[0]
    p = _producer(config, backend)
    d = _consumer(config, backend)
    short = _consumer(dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_model_len=len(prompt) - 1)), backend)
    try:
        t0 = time.monotonic()
        params = offline.prefill(p, "a", prompt)
        # 1. an id in use: its fetch (off the core, as the server does it) claimed "a"
        other = offline.prefill(p, "o", min(prompts, key=len))
        d.add_request("busy", min(prompts, key=len), GREEDY, kv_transfer_params=other)
        fetched = fetch_remote(params, 5.0, "busy")
        assert fetched["claim"] == {"request": "a", "granted": True}
        assert _claims(p)["a"] == "busy"
        with pytest.raises(RequestError, match="already in use"):
            d.add_request("busy", prompt, GREEDY, kv_transfer_params=params, kv_remote=fetched)
        assert d.connector.flush_releases(10)
        assert "a" not in _claims(p) and _claims(p)["o"] == "busy"  # the live one's kept
        d.check_integrity()
        # 2. a prompt past the decode engine's max_model_len: refused after its check
        with pytest.raises(RequestError, match="max_model_len"):
            short.add_request("s", prompt, GREEDY, kv_transfer_params=params)
        assert short.connector.flush_releases(10) and "a" not in _claims(p)
        assert short.connector.num_claimed == 0 and "a" in p.scheduler.connector.held
        _all_free(short)
        # 3. another decode request with the same params is served
        tokens: dict[str, list[int]] = {"b": [], "busy": []}
        d.add_request("b", prompt, GREEDY, kv_transfer_params=params)
        _serve(p, d, tokens)
        assert tokens["b"] == reference and len(tokens["busy"]) == GREEDY.max_tokens
        assert time.monotonic() - t0 < LONG_TIMEOUT_S / 2  # not the timeout's doing
        assert not _claims(p) and d.connector.num_claimed == 0
        _all_free(p, d)
    finally:
        for e in (p, d, short):
            e.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abort_before_the_reads_frees_the_producer_blocks_at_once(model_dirs, engine_config,
                                                                     mixed_prompts, backend):
    """A decode request aborted after its check, before its READs were posted (waiting, as a
    client disconnect or an HTTP abort leaves it): the producer frees the held blocks at its
    next step, not at its timeout; nothing leaks on either side. A later replay of the params
    is refused (not held), and the decode engine serves the next request."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    p = _producer(config, backend)
    d = _consumer(config, backend)
    try:
        params = offline.prefill(p, "a", prompts[0])
        d.add_request("a", prompts[0], GREEDY, kv_transfer_params=params)
        assert _claims(p) == {"a": "a"} and d.connector.num_claimed == 1
        with pytest.raises(RequestError, match="already in use"):  # a plain one, same id
            d.add_request("a", prompts[1], GREEDY)
        assert _claims(p) == {"a": "a"} and d.connector.num_claimed == 1  # still a's
        d.check_integrity()
        t0 = time.monotonic()
        d.abort_request("a")  # the engine core's abort path: queued, never waited on
        assert time.monotonic() - t0 < 0.5
        assert d.connector.num_claimed == 0
        d.check_integrity()
        assert d.connector.flush_releases(10)
        assert _step_until_freed(p, "a", within_s=10) < 10 < LONG_TIMEOUT_S
        assert not _claims(p) and not p.has_unfinished_requests()
        _all_free(p)
        for out in d.step():  # the abort's output
            assert out.request_id == "a" and out.finish_reason == "abort"
        _all_free(d)
        with pytest.raises(RequestError, match="not held"):
            d.add_request("a2", prompts[0], GREEDY, kv_transfer_params=params)
        # the pair still serves
        reference = LLMEngine.from_config(config).generate(prompts[1:], GREEDY)
        assert offline.generate(p, d, prompts[1:], GREEDY, tag="next") == reference
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forged_release_is_refused_and_changes_nothing(model_dirs, engine_config,
                                                         mixed_prompts, backend):
    """Releases by anyone but the claimant (another decode request, an unknown held request,
    another engine's id, malformed fields, a request not yet claimed) are answered "released":
    false; the claims and held blocks are as before, the producer keeps serving, and the
    claimant then reads to the aggregated engine's output."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts, GREEDY)
    p = _producer(config, backend)
    d = _consumer(config, backend)
    try:
        params = offline.prefill(p, "a", prompts[0])
        unclaimed = offline.prefill(p, "u", prompts[1])
        d.add_request("a", prompts[0], GREEDY, kv_transfer_params=params)
        engine = params.remote_engine_id
        before = (_claims(p), dict(p.scheduler.connector.held))
        forged = [
            {"release": "a", "by": "mallory", "engine": engine, "free": True},
            {"release": "zzz", "by": "a", "engine": engine, "free": True},
            {"release": "a", "by": "a", "engine": "other-engine", "free": True},
            {"release": "a", "by": "a", "engine": engine, "free": "yes"},
            {"release": ["a"], "by": "a", "engine": engine, "free": True},
            {"release": "u", "by": "u", "engine": engine, "free": True},  # nobody claimed it
        ]
        for q in forged:
            assert _release(p, q)["released"] is False, q
        side = p.scheduler.connector.side_channel
        assert fetch_metadata(side.port, side.host, 5.0, b"{not json")  # answered, alive
        for _ in range(3):
            p.step()
        assert (_claims(p), dict(p.scheduler.connector.held)) == before
        p.check_integrity()
        d.add_request("u", prompts[1], GREEDY, kv_transfer_params=unclaimed)  # still held
        tokens: dict[str, list[int]] = {"a": [], "u": []}
        _serve(p, d, tokens)
        assert [tokens["a"], tokens["u"]] == reference
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_failed_read_frees_the_producer_blocks_once_settled(model_dirs, engine_config,
                                                             mixed_prompts):
    """One READ fails after the others landed: once every READ settled, the consumer gives the
    claim back unread and the producer frees the blocks long before its timeout."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompt = mixed_prompts()[0]
    p = _producer(config, "shm")
    d = _consumer(config, "shm")
    try:
        params = offline.prefill(p, "b", prompt)
        slow = SlowReads(d.runner.connector.transport, polls=2, fail=1)
        d.add_request("b", prompt, GREEDY, kv_transfer_params=params)
        errors = []
        for _ in range(MAX_STEPS):
            errors += [o.error for o in d.step() if o.error is not None]
            d.check_integrity()
            if errors:
                break
        assert errors and "went away mid-READ" in errors[0]
        assert slow.num_landed == slow.num_posted - 1 > 0
        slow.restore()
        assert d.connector.flush_releases(10) and d.connector.num_claimed == 0
        assert _step_until_freed(p, "b", within_s=10) < LONG_TIMEOUT_S
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_producer_gone_costs_the_consumer_nothing(model_dirs, engine_config, mixed_prompts):
    """The producer shut down between the check and the abort: the release fails on the sender
    thread (logged), the consumer's abort returns at once and its engine keeps serving."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    p = _producer(config, "shm")
    d = _consumer(config, "shm", transfer_timeout_s=1.0)
    try:
        params = offline.prefill(p, "a", prompts[0])
        d.add_request("a", prompts[0], GREEDY, kv_transfer_params=params)
        p.shutdown()
        t0 = time.monotonic()
        d.abort_request("a")
        assert time.monotonic() - t0 < 0.5
        assert d.connector.flush_releases(10)
        assert d.connector._releases.num_failed == 1 and d.connector._releases.num_released == 0
        d.step()
        _all_free(d)
        reference = LLMEngine.from_config(config).generate(prompts[1:], GREEDY)
        assert d.generate(prompts[1:], GREEDY) == reference
        _all_free(d)
    finally:
        d.shutdown()


def test_the_sender_never_blocks_on_a_silent_producer():
    """A producer that accepts and never answers: `send` returns at once; the release fails
    after the timeout on the sender's thread, and the next one is still sent."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        port = silent.getsockname()[1]
        params = KVTransferParams(do_remote_prefill=True, remote_engine_id="e",
                                  remote_request_id="r", remote_host="127.0.0.1",
                                  remote_port=port)
        sender = ReleaseSender(timeout_s=0.3)
        t0 = time.monotonic()
        sender.send(Release("x", params, free=True))
        sender.send(Release("y", params, free=False))
        assert time.monotonic() - t0 < 0.1
        assert sender.flush(10) and sender.num_failed == 2 and sender.num_released == 0
        assert json.loads(Release("x", params, free=True).question()) == {
            "release": "r", "by": "x", "engine": "e", "free": True}
    finally:
        silent.close()


def _params(rid: str, port: int) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_engine_id="e", remote_request_id=rid,
                            remote_host="127.0.0.1", remote_port=port)


class _Answering:
    """A producer's side channel that answers every release "released", noting the questions
    and, at each, what the sender had failed so far and how many sender threads were alive."""

    def __init__(self, sender: ReleaseSender | None = None) -> None:
        self.sender = sender
        self.asked: list[str] = []  # the releasing decode request ids, in arrival order
        self.failed_before: list[int] = []
        self.num_threads: list[int] = []
        self.side = SideChannel(lambda: b"{}", ask=self._ask)

    def _ask(self, question: bytes) -> bytes:
        self.asked.append(json.loads(question)["by"])
        if self.sender is not None:
            self.failed_before.append(self.sender.num_failed)
        self.num_threads.append(len(_sender_threads()))
        return json.dumps({"released": True}).encode()


def test_releases_to_another_producer_do_not_wait_for_a_silent_one():
    """Releases queued to a silent producer (two, its timeout 60 s) then to a healthy one
    (three): the healthy one's are all answered, in order, while the silent one's first is still
    unanswered; the silent one's fail once it drops its connections."""
    silent = socket.create_server(("127.0.0.1", 0))
    healthy = _Answering()
    try:
        sender = ReleaseSender(timeout_s=SILENT_TIMEOUT_S)
        for rid in ("a1", "a2"):
            sender.send(Release(rid, _params("r" + rid, silent.getsockname()[1]), free=True))
        for rid in ("b1", "b2", "b3"):
            sender.send(Release(rid, _params("r" + rid, healthy.side.port), free=True))
        t0 = time.monotonic()
        while sender.num_released < 3:
            assert time.monotonic() - t0 < SILENT_TIMEOUT_S / 2, "queued behind the silent one"
            time.sleep(0.02)
        assert healthy.asked == ["b1", "b2", "b3"]
        assert sender.num_pending == 2 and sender.num_failed == 0
        silent.close()  # its queued connections reset: the silent one's releases fail now
        assert sender.flush(SILENT_TIMEOUT_S / 2) and sender.num_failed == 2
    finally:
        silent.close()
        healthy.side.close()


def test_the_sender_threads_are_capped_take_turns_and_stop_when_idle():
    """One thread allowed: a release to a healthy producer queued after two to a silent one
    waits for the first of those only (the endpoints take turns, each one's in order). Four
    allowed, four silent producers and a healthy one: never more than four threads, the healthy
    one's answered in order. Once idle, every thread stops; after `close` a release is dropped,
    no thread started."""
    before = _sender_threads()
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(4)]
    ports = [s.getsockname()[1] for s in silent]
    sender = ReleaseSender(timeout_s=1.0, max_threads=1, idle_s=0.2)
    healthy = _Answering(sender)
    try:
        sender.send(Release("a1", _params("x", ports[0]), free=True))
        sender.send(Release("a2", _params("y", ports[0]), free=True))
        sender.send(Release("b1", _params("z", healthy.side.port), free=True))
        assert sender.flush(30) and sender.num_released == 1 and sender.num_failed == 2
        assert healthy.asked == ["b1"] and healthy.failed_before == [1]  # after a1, before a2
        assert max(healthy.num_threads) - len(before) <= 1
        _until_stopped(before)
        assert sender.num_threads == 0

        sender = healthy.sender = ReleaseSender(timeout_s=1.0, max_threads=4, idle_s=0.2)
        for i, port in enumerate(ports):
            sender.send(Release(f"s{i}", _params(f"s{i}", port), free=True))
        for i in range(6):
            sender.send(Release(f"h{i}", _params(f"h{i}", healthy.side.port), free=False))
        assert sender.flush(30) and sender.num_released == 6 and sender.num_failed == 4
        assert healthy.asked[1:] == [f"h{i}" for i in range(6)]
        assert max(healthy.num_threads[1:]) - len(before) <= 4
        _until_stopped(before)
        assert sender.num_threads == 0
        sender.close()
        sender.send(Release("late", _params("late", healthy.side.port), free=True))
        assert sender.num_failed == 5 and sender.num_pending == 0
        assert not _sender_threads() - before and healthy.asked[-1] == "h5"
    finally:
        for s in silent:
            s.close()
        healthy.side.close()


def _claim_on_two(config, backend: str, prompts: list[list[int]]):
    """Producers A and B, a decode engine with a waiting request claiming each ("a" on A, then
    "b" on B); A then goes silent (the event makes it answer)."""
    a, b = _producer(config, backend), _producer(config, backend)
    d = _consumer(config, backend, transfer_timeout_s=SILENT_TIMEOUT_S)
    for rid, p, prompt in zip("ab", (a, b), prompts, strict=True):
        d.add_request(rid, prompt, GREEDY, kv_transfer_params=offline.prefill(p, rid, prompt))
        assert _claims(p) == {rid: rid}
    assert d.connector.num_claimed == 2
    return a, b, d, _silence(a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_silent_producer_holds_up_no_release_to_another(model_dirs, engine_config,
                                                          mixed_prompts, monkeypatch, backend):
    """Decode requests claiming on a silent producer A and a healthy one B, aborted in that
    order: B frees its blocks long before A's release could time out (60 s), while A's is still
    unanswered; A's answer, once it comes, frees A's. Every engine's invariants after each step
    of the way; the sender's threads stop once idle."""
    monkeypatch.setattr(ReleaseSender, "IDLE_S", 0.2)
    before = _sender_threads()
    config = engine_config(model_dirs["tiny-glm5"])
    a, b, d, answering = _claim_on_two(config, backend, mixed_prompts()[:2])
    try:
        d.abort_request("a")
        d.abort_request("b")
        assert d.connector.num_claimed == 0
        _step_until_freed(b, "b", within_s=SILENT_TIMEOUT_S / 2)
        releases = d.connector._releases
        # B freed its blocks on the release's question; the sender counts B's answer when its
        # thread reads it, a moment later (far inside A's timeout)
        t0 = time.monotonic()
        while releases.num_released < 1 and time.monotonic() - t0 < SILENT_TIMEOUT_S / 4:
            time.sleep(0.01)
        assert releases.num_released == 1 and releases.num_pending == 1
        assert "a" in a.scheduler.connector.held and _claims(a) == {"a": "a"}
        assert sorted(o.request_id for o in d.step()) == ["a", "b"]  # the aborts' outputs
        _all_free(b, d)
        a.check_integrity()
        answering.set()
        assert d.connector.flush_releases(30) and releases.num_released == 2
        _step_until_freed(a, "a", within_s=10)
        _all_free(a, b, d)
        _until_stopped(before)
    finally:
        answering.set()
        for e in (a, b, d):
            e.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shutdown_gives_back_to_a_healthy_producer_past_a_silent_one(
        model_dirs, engine_config, mixed_prompts, monkeypatch, caplog, backend):
    """A decode engine shut down with claims on a silent producer A (given back first) and a
    healthy one B: within the shutdown's 2 s, B's release is answered (B frees its blocks at
    its next step), A's is logged unanswered; A's, queued before the shutdown, still goes once
    A answers, and frees A's blocks. Nothing leaked on any side; the threads stop once idle."""
    monkeypatch.setattr(ReleaseSender, "IDLE_S", 0.2)
    before = _sender_threads()
    config = engine_config(model_dirs["tiny-glm5"])
    a, b, d, answering = _claim_on_two(config, backend, mixed_prompts()[:2])
    try:
        d.shutdown()
        assert "unanswered" in caplog.text
        _decode_side_clean(d)
        releases = d.connector._releases
        assert releases.num_released == 1 and releases.num_pending == 1
        b.step()  # B's next step frees them
        assert "b" not in b.scheduler.connector.held and not _claims(b)
        _all_free(b)
        assert "a" in a.scheduler.connector.held
        a.check_integrity()
        answering.set()
        assert releases.flush(30) and releases.num_released == 2
        a.step()
        assert not a.scheduler.connector.held and not _claims(a)
        _all_free(a)
        _until_stopped(before)
    finally:
        answering.set()
        for e in (a, b, d):
            e.shutdown()
