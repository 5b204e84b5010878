"""Asynchronous P/D READs (disagg/receiving.py), two single-rank engines in one process (shm;
NIXL where it imports): while one request's READs are in flight (a transport whose READs land
only after N polls, or shared memory's copy thread held back) the other requests keep decoding,
and the received request then decodes to the aggregated engine's greedy output; a READ failing
mid-way frees everything; an abort while receiving frees the blocks, the host window (into a
spilling HiSparse engine) and the id at once, the READs cancelled, and the same id sent again
is served; a decode engine shut down with READs in flight cancels them, then gives its claims
back (the producer frees its blocks at its next step), and does not hang on a producer gone or
silent — both engines' invariants checked after every step. Also: the tally of several ranks'
reports, the READ timeout."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from dsaserve.config import DisaggConfig, HiSparseConfig
from dsaserve.core import ModelRunnerOutput, SamplingParams
from dsaserve.disagg import offline
from dsaserve.disagg.receiving import PostedRead, RecvTally
from dsaserve.disagg.shmcopy import CopyJob, CopyState, CopyThread
from dsaserve.disagg.transport import (
    KVTransport,
    Transfer,
    TransferError,
    make_transport,
    nixl_available,
)
from dsaserve.engine.engine import LLMEngine

SAMPLING = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BACKENDS = ["shm"] + (["nixl"] if nixl_available() else [])
MAX_STEPS = 500  # a bound on every stepping loop: a bug fails the test rather than hangs it
LONG_TIMEOUT_S = 120.0  # a producer's abort timeout: "at its next step" is well before it


class SlowReads:
    """Every READ a transport posts from now on (`read`, or `read_regions`: one transfer over
    several items, as the connector posts a request's) stays in flight for `polls` polls: its
    items' bytes land (the real READ runs, item by item) only at the last one, where item
    number `fail` (in posting order, over every transfer) fails instead: the transfer fails,
    its other items landed ("mid-way"). A cancelled READ never lands. The counts are of
    items."""

    def __init__(self, transport: KVTransport, polls: int, fail: int | None = None) -> None:
        self.transport, self.polls, self.fail = transport, polls, fail
        self.real_read, self.real_poll = transport.read, transport.poll
        self.real_cancel = transport.cancel
        self.num_posted = self.num_landed = self.num_cancelled = 0
        transport.read = self.read  # type: ignore[method-assign]
        transport.read_regions = self.read_regions  # type: ignore[method-assign]
        transport.poll = self.poll  # type: ignore[method-assign]
        transport.cancel = self.cancel  # type: ignore[method-assign]

    def read(self, peer: str, local: str, remote: str, segments=None,
             notify: bytes = b"") -> Transfer:
        return self.read_regions(peer, [(local, remote, segments)], notify)

    def read_regions(self, peer: str, items, notify: bytes = b"") -> Transfer:
        first = self.num_posted
        self.num_posted += len(items)
        handle = {"indices": range(first, self.num_posted), "polls": 0, "peer": peer,
                  "items": list(items), "notify": notify}
        return Transfer(peer, notify, handle)

    def poll(self, xfer: Transfer) -> bool:
        h = xfer.handle
        if not isinstance(h, dict):
            return self.real_poll(xfer)
        h["polls"] += 1
        if h["polls"] < self.polls:
            return False
        xfer.done = True
        for index, (local, remote, segments) in zip(h["indices"], h["items"], strict=True):
            if index != self.fail:
                self.transport.wait(self.real_read(h["peer"], local, remote, segments),
                                    timeout_s=10)
                self.num_landed += 1
        if self.fail in h["indices"]:
            raise TransferError("the prefill engine went away mid-READ")
        if h["notify"]:
            self.transport.send_notification(h["peer"], h["notify"])
        return True

    def cancel(self, xfer: Transfer) -> None:
        if not isinstance(xfer.handle, dict):
            return self.real_cancel(xfer)
        if not xfer.done:
            xfer.done = True
            self.num_cancelled += len(xfer.handle["items"])

    def restore(self) -> None:
        del self.transport.read, self.transport.read_regions  # the class's
        del self.transport.poll, self.transport.cancel


class HeldCopies:
    """Shared memory's copy thread holds every READ it takes from now on until `release()` (or
    until the READ is cancelled): a READ really in flight, posted by the real transport."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released = threading.Event()
        self.copied: list[CopyJob] = []  # jobs whose bytes were copied, in order
        real = CopyThread._copy

        def held(thread: CopyThread, job: CopyJob) -> bool:
            while not (self.released.wait(0.002) or job.cancelled):
                pass
            landed = real(thread, job)
            if landed:
                self.copied.append(job)
            return landed

        monkeypatch.setattr(CopyThread, "_copy", held)

    def release(self) -> None:
        self.released.set()


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shm-copy-")]


def _disagg(role: str, backend: str, abort_timeout_s: float = 480.0, **kw) -> DisaggConfig:
    return DisaggConfig(kv_role=role, backend=backend, side_channel_port=0,
                        abort_timeout_s=abort_timeout_s, **kw)


def _engines(config, backend: str, abort_timeout_s: float = 480.0, decode_config=None,
             **decode_kw):
    p = LLMEngine.from_config(dataclasses.replace(
        config, disagg=_disagg("kv_producer", backend, abort_timeout_s)))
    d = LLMEngine.from_config(dataclasses.replace(
        decode_config or config, disagg=_disagg("kv_consumer", backend, **decode_kw)))
    return p, d


class Driver:
    """Both engines stepped together, their invariants checked after every step; the tokens,
    errors and finish reasons the decode engine gave per request."""

    def __init__(self, p: LLMEngine, d: LLMEngine) -> None:
        self.p, self.d = p, d
        self.tokens: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.steps = 0

    def add(self, rid: str, prompt: list[int]) -> None:
        params = offline.prefill(self.p, rid, prompt)
        self.d.add_request(rid, prompt, SAMPLING, kv_transfer_params=params)
        self.tokens[rid] = []

    def add_decoding(self, rid: str, prompt: list[int]) -> None:
        """Add a request and step until it decoded its first token (its READs landed)."""
        self.add(rid, prompt)
        while not self.tokens[rid]:
            self.step()

    def step(self) -> None:
        self.steps += 1
        assert self.steps < MAX_STEPS, "the engines stopped making progress"
        for o in self.d.step():
            self.tokens[o.request_id] += o.new_token_ids
            if o.error is not None:
                self.errors[o.request_id] = o.error
            if o.finished:
                self.reasons[o.request_id] = o.finish_reason
        if self.p.has_unfinished_requests():
            self.p.step()
        self.p.check_integrity()
        self.d.check_integrity()

    def drain(self) -> None:
        """Until neither engine holds anything; then an empty step tells the runners."""
        while self.d.has_unfinished_requests() or self.p.has_unfinished_requests():
            self.step()
        self.step()
        for e in (self.p, self.d):
            s = e.stats()
            assert s.num_free_blocks == s.num_total_blocks, "a block leaked"


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_others_decode_while_a_read_is_in_flight(model_dirs, engine_config, mixed_prompts,
                                                 backend, scheduling):
    """With --async-scheduling on the consumer each step posts its READs and polls the others
    after its launch, and a step whose only work is READs in flight is still sent (to poll
    them); what landed is read one step later."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts, SAMPLING)
    p, d = _engines(config, backend,
                    decode_config=_async(config) if scheduling == "async" else None)
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        slow = SlowReads(d.runner.connector.transport, polls=4)
        run.add("b", prompts[1])
        overlapped = held = 0
        while True:
            before = len(run.tokens["a"])
            run.step()
            if "b" not in d.scheduler.receiving:
                break
            # b's READs are in flight: it is not computed, the producer still holds its blocks
            # (notified only once they landed), and a decoded a token in this very step
            assert not run.tokens["b"] and "b" not in d.runner.requests
            held += "b" in p.scheduler.connector.held
            assert len(run.tokens["a"]) == before + 1
            overlapped += 1
        # the READs landed at their 4th poll; async: the consumer learns it with that step's
        # results, a step after the producer was notified
        lag = scheduling == "async"
        assert overlapped == slow.polls - 1 + lag and held >= overlapped - lag
        assert slow.num_posted > 0 and slow.num_landed == slow.num_posted
        slow.restore()
        run.drain()
        assert not run.errors
        assert [run.tokens["a"], run.tokens["b"]] == reference
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_step_is_launched_before_its_reads_are_posted(model_dirs, engine_config,
                                                          mixed_prompts, backend, scheduling,
                                                          monkeypatch):
    """The step that admits a request whose KV is READ launches the running requests' forward
    first and only then posts the READs (the host's plans and posts no longer delay the
    others' kernels: docs/disagg.md, "the posting step"); the READ request still decodes to
    the aggregated engine's greedy output, and the other one too."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts, SAMPLING)
    p, d = _engines(config, backend,
                    decode_config=_async(config) if scheduling == "async" else None)
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        events: list[str] = []  # in call order, within the posting step
        forward, post = d.runner._forward, d.runner.connector.start_receives

        def recorded_forward(*args, **kw):
            events.append("forward")
            return forward(*args, **kw)

        def recorded_post(recvs, *args, **kw):
            events.append("post " + ",".join(r.request_id for r in recvs))
            return post(recvs, *args, **kw)

        monkeypatch.setattr(d.runner, "_forward", recorded_forward)
        monkeypatch.setattr(d.runner.connector, "start_receives", recorded_post)
        run.add("b", prompts[1])
        run.step()  # schedules a's next token and b's READs: a's forward, then b's posting
        assert events == ["forward", "post b"], events
        assert "b" in d.scheduler.requests and not run.errors
        run.drain()
        assert events.count("post b") == 1 and not run.errors
        assert [run.tokens["a"], run.tokens["b"]] == reference
    finally:
        p.shutdown()
        d.shutdown()


def test_a_read_failing_midway_frees_everything(model_dirs, engine_config, mixed_prompts):
    """One READ fails after the others landed: the request ends with the reason (once nothing
    is in flight), the others keep decoding to the reference, the producer frees the unread
    blocks (the claim given back unread once every READ settled, test_pd_claims.py; or its
    timeout); nothing leaks."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts[:1], SAMPLING)[0]
    p, d = _engines(config, "shm", abort_timeout_s=1.0)
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        slow = SlowReads(d.runner.connector.transport, polls=3, fail=1)
        run.add("b", prompts[1])
        while "b" not in run.errors:
            run.step()
        assert "went away mid-READ" in run.errors["b"] and run.reasons["b"] == "abort"
        assert not run.tokens["b"] and "b" not in d.scheduler.requests
        assert slow.num_landed == slow.num_posted - 1 > 0  # the others landed: "mid-way"
        assert len(run.tokens["a"]) > 1  # a decoded meanwhile
        slow.restore()
        run.drain()  # the producer frees b's blocks (b's claim given back unread)
        assert run.tokens["a"] == reference and list(run.errors) == ["b"]
    finally:
        p.shutdown()
        d.shutdown()


def _hisparse_decode_config(engine_config, model_dir):
    """A spilling HiSparse decode engine (docs/hisparse.md): small pages, 16 MLA pages."""
    cfg = engine_config(model_dir, block_size=4, num_blocks=100, max_model_len=64)
    topk = cfg.model.index_topk
    att = dataclasses.replace(cfg.attention, hisparse_device_buffer_size=topk,
                              hisparse_device_mla_pages=16, hisparse_config_given=True)
    return cfg, dataclasses.replace(cfg, attention=att,
                                    hisparse=HiSparseConfig(host_pool_bytes=16 << 20))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("into", ["gpu pages", "hisparse host pool"])
def test_abort_while_receiving_frees_everything_at_once(model_dirs, engine_config, into,
                                                        backend):
    """An abort while the READs are in flight answers "abort" and frees the request's blocks
    and id at once; the next step cancels its READs first thing (none of them lands), gives
    back its host window (into a spilling HiSparse engine) and notifies the producer, which
    frees its blocks before any timeout; the other request decodes to the reference."""
    model_dir = model_dirs["tiny-glm5"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (20, 40)]
    if into == "gpu pages":
        plain = decode_config = engine_config(model_dir, block_size=4, num_blocks=100,
                                              max_model_len=64)
    else:
        plain, decode_config = _hisparse_decode_config(engine_config, model_dir)
    reference = LLMEngine.from_config(plain).generate(prompts[:1], SAMPLING)[0]
    p, d = _engines(plain, backend, decode_config=decode_config)
    rt = d.runner.hisparse
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        slow = SlowReads(d.runner.connector.transport, polls=4)
        run.add("b", prompts[1])
        run.step()  # b's READs posted
        assert "b" in d.scheduler.receiving and slow.num_posted > 0
        if rt is not None:
            assert "b" in rt.entries
        num_free = d.stats().num_free_blocks
        num_blocks = len(d.scheduler.requests["b"].block_ids)
        d.abort_request("b")
        # at once: the id and the blocks are free (the READs are cancelled before any step
        # can hand the blocks to another request)
        assert "b" not in d.scheduler.requests and "b" not in d.scheduler.receiving
        assert d.stats().num_free_blocks == num_free + num_blocks
        d.check_integrity()
        assert d.has_unfinished_requests()  # a step must tell the runner
        run.step()
        assert run.reasons["b"] == "abort" and "b" not in run.errors
        assert slow.num_cancelled == slow.num_posted and slow.num_landed == 0
        assert d.runner.connector.num_receiving == 0
        if rt is not None:
            assert "b" not in rt.entries
        while "b" in p.scheduler.connector.held:  # notified: freed before any timeout
            run.step()
        slow.restore()
        run.drain()
        assert run.tokens["a"] == reference and not run.errors
    finally:
        p.shutdown()
        d.shutdown()


def test_shm_reads_in_flight_while_others_decode(model_dirs, engine_config, mixed_prompts,
                                                 monkeypatch):
    """Shared memory's READs land on its copy thread: the step that posts them returns at once
    (the copies are held back), the request stays receiving over several steps while the other
    decodes a token in each, and once the copies run it decodes to the reference; shutting the
    engines down leaves no copy thread."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts, SAMPLING)
    threads_before = set(_copy_threads())
    p, d = _engines(config, "shm")
    held = None
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        held = HeldCopies(monkeypatch)
        run.add("b", prompts[1])
        for _ in range(4):
            before = len(run.tokens["a"])
            t0 = time.monotonic()
            run.step()
            assert time.monotonic() - t0 < 10  # not waiting for b's copies (held for good)
            assert "b" in d.scheduler.receiving and d.runner.connector.num_receiving == 1
            assert len(run.tokens["a"]) == before + 1 and not held.copied
            assert "b" in p.scheduler.connector.held
        held.release()
        run.drain()
        assert held.copied and not run.errors
        assert [run.tokens["a"], run.tokens["b"]] == reference
    finally:
        if held is not None:
            held.release()
        p.shutdown()
        d.shutdown()
    assert set(_copy_threads()) <= threads_before


def test_the_same_id_again_right_after_an_abort_while_receiving(model_dirs, engine_config,
                                                               monkeypatch):
    """A client retries an aborted request under its id while its READs are still held in
    flight: accepted at once; the step that posts the new READs first cancels the old ones
    (they never copy, though the new request now owns some of their blocks), and the retry
    decodes to the reference; both engines' invariants hold throughout, nothing leaks."""
    model_dir = model_dirs["tiny-glm5"]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (20, 40)]
    # a small pool: the retry's blocks come partly from the aborted request's
    config = engine_config(model_dir, block_size=4, num_blocks=24, max_model_len=64)
    reference = LLMEngine.from_config(config).generate(prompts, SAMPLING)
    p, d = _engines(config, "shm")
    held = None
    try:
        run = Driver(p, d)
        run.add_decoding("a", prompts[0])
        held = HeldCopies(monkeypatch)
        run.add("b", prompts[1])
        run.step()  # b's READs posted, held in flight
        old_jobs = [x.handle for x in d.runner.connector._receiving["b"].transfers]
        old_blocks = set(d.scheduler.requests["b"].block_ids)
        assert old_jobs and all(j.state is not CopyState.DONE for j in old_jobs)
        retry = offline.prefill(p, "b-retry", prompts[1])

        d.abort_request("b")
        d.add_request("b", prompts[1], SAMPLING, kv_transfer_params=retry)  # no "in use"
        d.check_integrity()
        run.tokens["b"] = []
        run.step()  # cancels the old READs, then posts the retry's into the same blocks
        assert old_blocks & set(d.scheduler.requests["b"].block_ids)
        assert all(j.state is CopyState.CANCELLED for j in old_jobs)
        assert "b" in d.scheduler.receiving and d.runner.connector.num_receiving == 1
        assert run.reasons["b"] == "abort"  # the first one's answer
        del run.reasons["b"]
        held.release()
        run.drain()  # both held requests freed on the producer: "b" by the cancel's notice
        assert not any(j in held.copied for j in old_jobs) and held.copied
        assert not run.errors and run.reasons["b"] == "length"
        assert [run.tokens["a"], run.tokens["b"]] == reference
    finally:
        if held is not None:
            held.release()
        p.shutdown()
        d.shutdown()


def _decode_side_clean(d: LLMEngine) -> None:
    """A decode engine after its shutdown: its invariants, every block free, no request and
    no claim left (its executor is gone: the scheduler's own checks)."""
    d.scheduler.check_integrity()
    s = d.stats()
    assert s.num_free_blocks == s.num_total_blocks and not d.scheduler.requests
    assert d.connector.num_claimed == 0


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_engine_shut_down_with_reads_in_flight(model_dirs, engine_config,
                                                         mixed_prompts, monkeypatch, backend,
                                                         scheduling):
    """Shutdown with READs in flight (a and b; c aborted while receiving just before, with no
    step to tell its ranks): the READs are cancelled (none lands, then or later; shm: the copy
    thread held back, then gone), the decode engine's blocks are all free and its claims given
    back, one release each, after the cancels: the producer frees all three at its next step,
    not at its 120 s timeout. The same with --async-scheduling (the step that posted the READs
    still unread)."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:3]
    threads_before = set(_copy_threads())
    p, d = _engines(config, backend, abort_timeout_s=LONG_TIMEOUT_S,
                    decode_config=_async(config) if scheduling == "async" else None)
    held = HeldCopies(monkeypatch) if backend == "shm" else None
    slow = None if held else SlowReads(d.runner.connector.transport, polls=MAX_STEPS)
    try:
        run = Driver(p, d)
        for rid, prompt in zip("abc", prompts, strict=True):
            run.add(rid, prompt)
        run.step()  # all posted, held in flight
        xfers = [x for posted in d.runner.connector._receiving.values()
                 for x in posted.transfers]
        assert xfers and d.runner.connector.num_receiving == 3
        d.abort_request("c")
        assert d.connector.num_claimed == 3  # c's until its ranks cancel
        t0 = time.monotonic()
        d.shutdown()
        assert time.monotonic() - t0 < 10
        if held is not None:
            assert all(x.handle.state is CopyState.CANCELLED for x in xfers)
            held.release()
            assert not held.copied and set(_copy_threads()) <= threads_before
        else:
            assert slow.num_cancelled == slow.num_posted > 0 and slow.num_landed == 0
        _decode_side_clean(d)
        releases = d.connector._releases
        assert releases.num_released == 3 and releases.num_failed == 0
        assert sorted(p.scheduler.connector.held) == ["a", "b", "c"]
        p.step()  # the next step frees them all
        assert not p.scheduler.connector.held and not p.scheduler.connector._claims
        p.check_integrity()
        s = p.stats()
        assert s.num_free_blocks == s.num_total_blocks
    finally:
        if held is not None:
            held.release()
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("producer", ["gone", "silent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_engine_shut_down_when_its_producer_cannot_answer(
        model_dirs, engine_config, mixed_prompts, caplog, backend, producer):
    """The producer shut down before the decode engine (its side channel refuses), or silent
    (its side channel takes the release and does not answer): the decode engine's shutdown
    with READs in flight still returns well before its 60 s transfer timeout, the READs
    cancelled, nothing leaked on its side; a producer gone costs one failed release per
    request, a silent one a warning — and its answer, once it comes, still frees the blocks."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompts = mixed_prompts()[:2]
    p, d = _engines(config, backend, abort_timeout_s=LONG_TIMEOUT_S, transfer_timeout_s=60.0)
    side = p.scheduler.connector.side_channel
    answer, answering = side._ask, threading.Event()
    try:
        run = Driver(p, d)
        for rid, prompt in zip("ab", prompts, strict=True):
            run.add(rid, prompt)
        slow = SlowReads(d.runner.connector.transport, polls=MAX_STEPS)
        run.step()  # both posted, in flight
        assert d.runner.connector.num_receiving == 2 and slow.num_posted > 0
        if producer == "gone":
            p.shutdown()
        else:
            side._ask = lambda q: answering.wait(60) and answer(q)
        t0 = time.monotonic()
        d.shutdown()
        assert time.monotonic() - t0 < 30  # not the sender's 60 s timeout
        assert slow.num_cancelled == slow.num_posted and slow.num_landed == 0
        _decode_side_clean(d)
        releases = d.connector._releases
        if producer == "gone":
            assert releases.num_failed == 2 and releases.num_released == 0
        else:
            assert "unanswered" in caplog.text and releases.num_pending == 2
            assert sorted(p.scheduler.connector.held) == ["a", "b"]
            answering.set()
            assert d.connector.flush_releases(30) and releases.num_released == 2
            p.step()
            assert not p.scheduler.connector.held
            p.check_integrity()
    finally:
        answering.set()
        p.shutdown()
        d.shutdown()


def test_tally_waits_for_every_rank():
    """Ranks settle a request's READs in different steps: it arrived once every rank read its
    share, and failed (with the first reason) once every rank settled it, one failing."""
    tally = RecvTally(num_ranks=2)
    out = lambda done=(), failed=None: ModelRunnerOutput(  # noqa: E731
        sampled_token_ids={}, kv_recvs_done=tuple(done), kv_recvs_failed=failed or {})
    assert tally.merge([out(["x"]), out()]) == ((), {})
    assert tally.merge([out(), out(failed={"y": "gone"})]) == ((), {})
    assert tally.merge([out(["z"]), out(["x", "z"])]) == (("x", "z"), {})
    assert tally.merge([out(failed={"y": "lost"}), out()]) == ((), {"y": "gone"})
    assert tally.merge([out(), out()]) == ((), {})
    # an abort while receiving: rank 0's earlier report is void, so the same id sent again
    # arrives only once both ranks read its share anew
    assert tally.merge([out(["w"]), out(failed={"v": "gone"})]) == ((), {})
    tally.forget(["w", "v"])
    assert tally.merge([out(), out(["w"])]) == ((), {})
    assert tally.merge([out(["w"]), out(["v"])]) == (("w",), {})
    assert tally.merge([out(["v"]), out()]) == (("v",), {})


@pytest.mark.parametrize("backend", BACKENDS)
def test_posted_read_polls_and_times_out(backend):
    """Polled READs land without `wait`; a READ still in flight past the deadline is
    cancelled and the request fails, reported only then."""
    with make_transport(backend, f"p-{backend}") as prod, \
            make_transport(backend, f"d-{backend}") as cons:
        src = prod.allocate("src", 4096)
        src.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        dst = cons.allocate("dst", 4096)
        peer = cons.add_peer(prod.metadata())
        posted = PostedRead("r", deadline=time.monotonic() + 10,
                            transfers=[cons.read(peer, "dst", "src")])
        deadline = time.monotonic() + 10
        while not posted.poll(cons, time.monotonic()):
            assert time.monotonic() < deadline
        assert posted.error is None and torch.equal(dst, src)

        slow = SlowReads(cons, polls=1000)
        stuck = PostedRead("s", deadline=0.0, transfers=[cons.read(peer, "dst", "src")])
        assert stuck.poll(cons, now=1.0)
        assert "not done within the transfer timeout" in stuck.error and not stuck.transfers
        slow.restore()


def _async(config):
    return dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=True))


def test_async_mtp3_into_a_spilling_hisparse_engine(draftable_dirs, engine_config):
    """The reference decode engine's mode on one rank: a P/D consumer with HiSparse spilling,
    MTP3 and async scheduling; greedy output equals the aggregated engine's, every invariant
    checked after every step of both engines."""
    from dsaserve.config import SpecConfig

    model_dir = draftable_dirs["tiny-glm5"]
    plain = engine_config(model_dir, block_size=4, num_blocks=100, max_model_len=128)
    att = dataclasses.replace(plain.attention,  # the union of 4 rows' top-k; 128 + 2 tokens
                              hisparse_device_buffer_size=4 * plain.model.index_topk,
                              hisparse_device_mla_pages=33, hisparse_config_given=True)
    decode_config = _async(dataclasses.replace(
        plain, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20),
        speculative=SpecConfig(num_speculative_tokens=3)))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (70, 88, 76)]
    reference = LLMEngine.from_config(plain).generate(prompts, SAMPLING)
    p, d = _engines(plain, "shm", decode_config=decode_config)
    try:
        def check() -> None:
            p.check_integrity()
            d.check_integrity()

        got = offline.generate_together(p, d, prompts, SAMPLING, after_step=check)
        assert got == reference
        assert int(d.runner.hisparse.rows_from_host) > 0  # received spilled: read from the pool
        stats = d.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
    finally:
        p.shutdown()
        d.shutdown()
