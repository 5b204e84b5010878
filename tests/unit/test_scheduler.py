"""The scheduler driven by a fake runner that keeps a paged token-id "KV cache" per DCP rank.

The fake runner applies the typed diff exactly as the real runner does, checks its view against
the scheduler's requests, and before each step reads every computed position back through the
block table (layout.context_slots) — so a wrong prefix hit, a block reused while still needed or a
wrong slot shows up as a wrong token. Its "model" is a deterministic function of the context, so
outputs must equal an unscheduled reference whatever the batching, chunking or preemption.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dsaserve.config import CacheConfig, ConfigError, SchedulerConfig
from dsaserve.core import (
    ModelRunnerOutput,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from dsaserve.engine.scheduler import Scheduler, iteration_token_buckets
from dsaserve.kv import layout
from dsaserve.kv import manager as manager_module
from dsaserve.kv.prefix_cache import request_block_hashes

NextToken = Callable[[list[int]], int]


def mix(tokens: list[int]) -> int:
    """The fake model: a deterministic next token, sensitive to every token and its position."""
    acc = 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return 100 + acc % 50


@dataclass
class _RunnerReq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, sched: Scheduler, block_size: int, dcp_size: int = 1, interleave: int = 1,
                 next_token: NextToken = mix) -> None:
        self.sched, self.b, self.n, self.i = sched, block_size, dcp_size, interleave
        self.next_token = next_token
        slots = sched.kv.num_blocks * block_size
        # Per rank: slot → (position, token id) last written there.
        self.kv: list[list[tuple[int, int] | None]] = [[None] * slots for _ in range(dcp_size)]
        self.reqs: dict[str, _RunnerReq] = {}

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            self.reqs.pop(rid, None)
        for new in so.new_requests:
            assert new.request_id not in self.reqs, "a new request the runner already holds"
            self.reqs[new.request_id] = _RunnerReq(list(new.token_ids), list(new.block_ids),
                                                   new.num_computed_tokens)
        for c in so.cached_requests:
            st = self.reqs[c.request_id]
            st.token_ids += c.new_token_ids
            if c.num_kept_blocks is not None:
                del st.block_ids[c.num_kept_blocks :]
            st.block_ids += c.new_block_ids
            st.num_computed_tokens = c.num_computed_tokens

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(so)
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            st, req = self.reqs[rid], self.sched.requests[rid]
            assert st.token_ids == req.all_token_ids, f"{rid}: runner tokens diverged"
            assert st.block_ids == req.block_ids, f"{rid}: runner blocks diverged"
            assert st.num_computed_tokens == req.num_computed_tokens
            start = st.num_computed_tokens
            self._check_context(st, start)
            self._write(st, start, start + n)
            st.num_computed_tokens = start + n
            done = start + n == len(st.token_ids)
            sampled[rid] = [self.next_token(st.token_ids)] if done else []
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _check_context(self, st: _RunnerReq, seq_len: int) -> None:
        for r in range(self.n):
            slots, positions = layout.context_slots(seq_len, st.block_ids, self.b, self.n, r,
                                                    self.i)
            for slot, pos in zip(slots.tolist(), positions.tolist(), strict=True):
                assert self.kv[r][slot] == (pos, st.token_ids[pos]), f"rank {r} pos {pos}"

    def _write(self, st: _RunnerReq, start: int, end: int) -> None:
        pos = torch.arange(start, end)
        table = torch.tensor([st.block_ids], dtype=torch.int32)
        written = torch.zeros_like(pos)
        for r in range(self.n):
            slots = layout.slot_mapping(pos, torch.zeros_like(pos), table, self.b, self.n, r,
                                        self.i)
            for p, slot in zip(pos.tolist(), slots.tolist(), strict=True):
                if slot >= 0:
                    self.kv[r][slot] = (p, st.token_ids[p])
            written += (slots >= 0).long()
        assert bool((written == 1).all()), "every new token is written by exactly one rank"


def reference_output(prompt: list[int], params: SamplingParams, eos: tuple[int, ...],
                     max_model_len: int, next_token: NextToken = mix) -> tuple[list[int], str]:
    """What a request must produce, computed one token at a time with no scheduler."""
    out: list[int] = []
    while True:
        tok = next_token(prompt + out)
        out.append(tok)
        if len(out) >= params.min_tokens:
            if (not params.ignore_eos and tok in eos) or tok in params.stop_token_ids:
                return out, "stop"
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"


def make_sched(block_size: int = 4, num_blocks: int = 64, dcp: int = 1, caching: bool = True,
               num_speculative_tokens: int = 0, **sched_kw: int | bool) -> Scheduler:
    return Scheduler(SchedulerConfig(**sched_kw), CacheConfig(block_size=block_size,
                     enable_prefix_caching=caching), num_blocks, dcp_size=dcp,
                     num_speculative_tokens=num_speculative_tokens)


def req(rid: str, prompt: list[int], max_tokens: int = 5, salt: str | None = None,
        eos: tuple[int, ...] = (), **params: int | bool | tuple[int, ...]) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   cache_salt=salt, eos_token_ids=eos)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 97 for i in range(n)]


def drive(sched: Scheduler, runner: FakeRunner, on_step: Callable[[SchedulerOutput], None]
          = lambda so: None, max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    """Step until every request ends, checking the scheduler's invariants after every phase."""
    cfg = sched.config
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.check_integrity()
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert all(n >= 1 for n in so.num_scheduled_tokens.values()), "0 tokens scheduled"
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        on_step(so)
        for o in sched.update_from_output(so, runner.execute(so)):
            outputs[o.request_id].append(o)
        sched.check_integrity()
    else:
        pytest.fail("requests did not finish")
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    return outputs


def assert_matches_reference(outputs: dict[str, list[RequestOutput]], requests: list[Request],
                             max_model_len: int) -> None:
    for r in requests:
        outs = outputs[r.request_id]
        tokens = [t for o in outs for t in o.new_token_ids]
        expect, reason = reference_output(r.prompt_token_ids, r.sampling_params,
                                          r.eos_token_ids, max_model_len)
        assert tokens == expect, r.request_id
        assert outs[-1].finished and outs[-1].finish_reason == reason
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].num_output_tokens == len(expect) == len(r.output_token_ids)


# ---- chunked prefill -----------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 3, 7, 16, 64])
def test_chunked_prefill_under_several_budgets(budget: int) -> None:
    sched = make_sched(max_num_batched_tokens=budget, max_model_len=64, caching=False)
    requests = [req(f"r{i}", prompt(i, n), max_tokens=4) for i, n in enumerate([5, 17, 30, 2])]
    for r in requests:
        sched.add_request(r)
    scheduled: dict[str, int] = defaultdict(int)

    def on_step(so: SchedulerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            scheduled[rid] += n

    outputs = drive(sched, FakeRunner(sched, 4), on_step)
    assert_matches_reference(outputs, requests, 64)
    for r in requests:  # every token computed once: the prompt and all outputs but the last
        assert scheduled[r.request_id] == r.num_prompt_tokens + len(r.output_token_ids) - 1


def test_chunk_sizes_follow_the_budget() -> None:
    sched = make_sched(max_num_batched_tokens=8, max_model_len=64, caching=False)
    sched.add_request(req("a", prompt(1, 20), max_tokens=2))
    sched.add_request(req("b", prompt(2, 3), max_tokens=2))
    runner = FakeRunner(sched, 4)
    steps = []
    for _ in range(4):
        so = sched.schedule()
        steps.append(dict(so.num_scheduled_tokens))
        sched.update_from_output(so, runner.execute(so))
    # a: 8 + 8 + 4 (prompt) then a decode; b waits for budget, fills the remainder of step 3.
    assert steps == [{"a": 8}, {"a": 8}, {"a": 4, "b": 3}, {"a": 1, "b": 1}]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_sched(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False,
                       caching=False)
    sched.add_request(req("a", prompt(1, 20), max_tokens=3))
    sched.add_request(req("b", prompt(2, 20), max_tokens=3))
    runner = FakeRunner(sched, 4)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 20}, "b does not fit the remaining 12 tokens"
    sched.update_from_output(so, runner.execute(so))
    outputs = drive(sched, runner)
    assert outputs["b"][-1].finished


# ---- prefix cache --------------------------------------------------------------------------------
@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_prefix_hits_reuse_the_right_kv(dcp: int, interleave: int) -> None:
    sched = make_sched(block_size=4, dcp=dcp, max_model_len=128)
    unit = 4 * dcp  # the scheduler block and hash unit
    base = prompt(3, 3 * unit + 1)
    runner = FakeRunner(sched, 4, dcp, interleave)
    first = req("first", base, max_tokens=3)
    sched.add_request(first)
    drive(sched, runner)
    assert first.num_cached_tokens == 0
    # A follow-up turn: the old prompt and answer, then more. Its KV is read through the hit
    # blocks by the fake runner, so a wrong hit fails there.
    turn2 = req("turn2", first.all_token_ids + prompt(4, 5), max_tokens=3)
    salted = req("salted", base + [1], max_tokens=3, salt="tenant")
    sched.add_request(turn2)
    sched.add_request(salted)
    outputs = drive(sched, runner)
    full_blocks = (len(base) + 3 - 1) // unit  # blocks fully computed by `first`
    assert turn2.num_cached_tokens == full_blocks * unit > 0
    assert outputs["turn2"][-1].num_cached_tokens == turn2.num_cached_tokens
    assert salted.num_cached_tokens == 0, "cache_salt must separate prefixes"
    assert_matches_reference(outputs, [turn2, salted], 128)
    stats = sched.stats()
    assert stats.prefix_cache_hits == turn2.num_cached_tokens
    assert stats.prefix_cache_queries == first.num_tokens - 3 + turn2.num_prompt_tokens + len(
        salted.prompt_token_ids)


def test_a_prompt_is_hashed_when_it_arrives(monkeypatch) -> None:
    """Its full blocks' hashes exist once it is added (a long prompt's hashing is not in the
    step that admits it), and that step hashes nothing more; without prefix caching, none."""
    sched = make_sched(block_size=4, max_model_len=64)
    r = req("a", prompt(1, 14))
    sched.add_request(r)
    assert r.block_hashes == request_block_hashes(r.prompt_token_ids, 4, None)
    assert len(r.block_hashes) == 3
    hashed = []
    monkeypatch.setattr(manager_module, "extend_block_hashes",
                        lambda *a: hashed.append(a) or 0)
    sched.schedule()
    assert not hashed
    plain = make_sched(block_size=4, caching=False, max_model_len=64)
    r = req("b", prompt(1, 14))
    plain.add_request(r)
    assert r.block_hashes == []


def test_identical_prompt_never_hits_its_last_token() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    runner = FakeRunner(sched, 4)
    sched.add_request(req("a", prompt(5, 12), max_tokens=1))
    drive(sched, runner)
    b = req("b", prompt(5, 12), max_tokens=2)
    sched.add_request(b)
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 4}
    sched.update_from_output(so, runner.execute(so))
    drive(sched, runner)


def test_concurrent_identical_prompts_share_blocks() -> None:
    sched = make_sched(block_size=4, max_model_len=64, max_num_batched_tokens=8)
    runner = FakeRunner(sched, 4)
    a = req("a", prompt(6, 12), max_tokens=4)
    sched.add_request(a)
    so = sched.schedule()  # a's first 8 tokens: 2 blocks computed and cached
    sched.update_from_output(so, runner.execute(so))
    b = req("b", prompt(6, 12), max_tokens=4)
    sched.add_request(b)
    so = sched.schedule()  # a's last 4 tokens, and b's last 4 after a hit on 8
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert b.block_ids[2] != a.block_ids[2], "the partial block is private"
    assert sched.kv.pool.ref_count(a.block_ids[0]) == 2
    first = sched.update_from_output(so, runner.execute(so))  # both fill block 2
    assert sched.kv.pool.lookup(b.block_hashes[2]) == a.block_ids[2], "a's copy is cached"
    outputs = drive(sched, runner)
    for o in first:
        outputs[o.request_id].insert(0, o)
    assert_matches_reference(outputs, [a, b], 64)


# ---- preemption ----------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("dcp", [1, 2])
def test_preemption_under_a_tiny_pool_then_identical_completion(caching: bool, dcp: int) -> None:
    max_len = 32
    sched = make_sched(block_size=4, dcp=dcp, num_blocks=32 // (4 * dcp), caching=caching,
                       max_model_len=max_len, max_num_batched_tokens=16)
    requests = [req(f"r{i}", prompt(10 + i, 9 + i), max_tokens=14) for i in range(4)]
    for r in requests:
        sched.add_request(r)
    preempted_seen: set[str] = set()

    def on_step(so: SchedulerOutput) -> None:
        preempted_seen.update(so.finished_request_ids)
        new_ids = {n.request_id for n in so.new_requests}
        for n in so.new_requests:  # a rebuilt request carries its outputs in its "prompt"
            r = sched.requests[n.request_id]
            assert list(n.token_ids) == r.all_token_ids
        assert not new_ids & set(so.finished_request_ids) or all(
            sched.requests[i].num_preemptions for i in new_ids & set(so.finished_request_ids))

    outputs = drive(sched, FakeRunner(sched, 4, dcp), on_step)
    assert sched.stats().num_preemptions > 0
    preempted = {r.request_id for r in requests if r.num_preemptions}
    assert preempted and preempted <= preempted_seen, "the runner must drop preempted requests"
    assert_matches_reference(outputs, requests, max_len)


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    sched = make_sched(block_size=4, num_blocks=8, max_model_len=32, caching=False,
                       max_num_seqs=2)
    runner = FakeRunner(sched, 4)
    a, b = req("a", prompt(1, 14), max_tokens=18), req("b", prompt(2, 14), max_tokens=18)
    c = req("c", prompt(3, 4), max_tokens=2)  # queued behind them (max_num_seqs = 2)
    for r in (a, b, c):
        sched.add_request(r)
    for _ in range(8):
        so = sched.schedule()
        sched.check_integrity()
        if b.num_preemptions:
            break
        sched.update_from_output(so, runner.execute(so))
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert "b" in so.finished_request_ids and so.num_scheduled_tokens.keys() == {"a"}
    assert list(sched.waiting) == [b, c], "the preempted request goes to the front"
    assert b.num_computed_tokens == 0 and not b.block_ids
    assert b.output_token_ids, "outputs survive preemption"
    sched.update_from_output(so, runner.execute(so))
    drive(sched, runner)


def test_first_scheduling_time_survives_preemption_and_steps_are_bucketed() -> None:
    """A request's scheduled_time is its first scheduling (vLLM's: a preemption does not restart
    its queue time), carried on each of its outputs with its queue time's start; the tokens of
    every step land in the histogram bucket (bounds[i-1], bounds[i]] that holds them."""
    sched = make_sched(block_size=4, num_blocks=8, max_model_len=32, caching=False,
                       max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(sched, 4)
    a, b = req("a", prompt(1, 14), max_tokens=18), req("b", prompt(2, 14), max_tokens=18)
    c = req("c", prompt(3, 4), max_tokens=2)  # queued behind them (max_num_seqs = 2)
    for r in (a, b, c):
        r.arrival_time = time.monotonic()
        sched.add_request(r)
    totals: list[int] = []
    so = sched.schedule()
    totals.append(so.total_num_scheduled_tokens)
    first_b = b.scheduled_time
    assert a.scheduled_time is not None and first_b is not None and c.scheduled_time is None
    outputs = sched.update_from_output(so, runner.execute(so))
    while not b.num_preemptions:
        so = sched.schedule()
        totals.append(so.total_num_scheduled_tokens)
        outputs += sched.update_from_output(so, runner.execute(so))
    more = drive(sched, runner, lambda so: totals.append(so.total_num_scheduled_tokens))
    outputs += [o for outs in more.values() for o in outs]
    assert b.scheduled_time == first_b, "re-admission after a preemption is not a new scheduling"
    assert c.scheduled_time is not None and c.scheduled_time > first_b
    for r in (a, b, c):
        outs = [o for o in outputs if o.request_id == r.request_id]
        assert {(o.queued_time, o.scheduled_time) for o in outs} == {
            (r.arrival_time, r.scheduled_time)}
        times = [o.output_time for o in outs]
        assert times == sorted(times) and times[0] > r.scheduled_time
    h = sched.stats().iteration_tokens
    assert h.bounds == (1, 2, 8, 16)  # the grid below the budget, 2 decode rows, the budget
    steps = [t for t in totals if t]
    edges = (0, *h.bounds, float("inf"))
    assert h.counts == tuple(sum(lo < t <= hi for t in steps)
                             for lo, hi in itertools.pairwise(edges))
    assert h.total == sum(steps)


def test_iteration_token_buckets() -> None:
    assert iteration_token_buckets(512, 32) == (1, 8, 16, 32, 64, 128, 256, 512)
    assert iteration_token_buckets(8192, 48) == (1, 8, 16, 32, 48, 64, 128, 256, 512, 1024,
                                                 2048, 4096, 8192)
    assert iteration_token_buckets(100, 400) == (1, 8, 16, 32, 64, 100)  # decode rows > budget
    assert iteration_token_buckets(1, 1) == (1,)


def test_tiny_pool_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--num-gpu-blocks"):
        make_sched(block_size=4, num_blocks=7, max_model_len=32)
    with pytest.raises(ConfigError, match="needs 4"):
        make_sched(block_size=4, dcp=2, num_blocks=3, max_model_len=32)


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_waiting_and_running() -> None:
    sched = make_sched(max_num_seqs=1, max_model_len=64)
    runner = FakeRunner(sched, 4)
    a, b = req("a", prompt(1, 10), max_tokens=20), req("b", prompt(2, 10))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.abort_requests(["b", "nope"])  # b is waiting; unknown ids are ignored
    assert sched.take_aborted_outputs()[0].finish_reason == "abort"
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.abort_requests(["a"])  # running
    sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    so = sched.schedule()
    assert so.finished_request_ids == ("a",) and so.is_empty, "b never reached the runner"
    (out,) = sched.update_from_output(so, runner.execute(so))
    assert (out.request_id, out.finished, out.finish_reason) == ("a", True, "abort")
    assert out.num_output_tokens == 2 and not runner.reqs


def test_abort_between_schedule_and_update() -> None:
    sched = make_sched(max_model_len=64)
    runner = FakeRunner(sched, 4)
    a = req("a", prompt(1, 10), max_tokens=20)
    sched.add_request(a)
    so = sched.schedule()
    ro = runner.execute(so)
    sched.abort_requests(["a"])
    outs = sched.update_from_output(so, ro)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert a.num_computed_tokens == 0 and not a.output_token_ids
    sched.check_integrity()
    assert sched.schedule().finished_request_ids == ("a",)


# ---- stop rules ----------------------------------------------------------------------------------
def test_max_model_len_stops_with_length() -> None:
    sched = make_sched(max_model_len=16)
    r = req("a", prompt(1, 10), max_tokens=100)
    sched.add_request(r)
    outputs = drive(sched, FakeRunner(sched, 4))
    assert r.num_tokens == 16 and outputs["a"][-1].finish_reason == "length"
    assert_matches_reference(outputs, [r], 16)


def test_eos_min_tokens_ignore_eos_and_stop_ids() -> None:
    def always(tok: int) -> NextToken:
        return lambda tokens: tok

    # the last column: RequestOutput.stop_token_id, set only where a stop id ended the request
    # (the first EOS is checked first and reports none, as vLLM's stop_reason)
    cases = [
        (dict(), (7,), 7, 1, "stop", None),
        (dict(min_tokens=3), (7,), 7, 3, "stop", None),
        (dict(ignore_eos=True), (7,), 7, 5, "length", None),
        (dict(stop_token_ids=(9,)), (), 9, 1, "stop", 9),
        (dict(stop_token_ids=(9,), min_tokens=4), (), 9, 4, "stop", 9),
        (dict(stop_token_ids=(7,)), (7,), 7, 1, "stop", None),
        (dict(stop_token_ids=(7,), ignore_eos=True), (7,), 7, 1, "stop", 7),
        (dict(), (), 9, 5, "length", None),
        # a model with several EOS ids: the first reports none, the others themselves (vLLM
        # makes them stop ids)
        (dict(), (7, 8), 7, 1, "stop", None),
        (dict(), (7, 8), 8, 1, "stop", 8),
        (dict(ignore_eos=True), (7, 8), 8, 5, "length", None),
    ]
    for params, eos, tok, n_out, reason, stop_id in cases:
        sched = make_sched(max_model_len=64)
        r = req("a", prompt(1, 6), max_tokens=5, eos=eos, **params)
        sched.add_request(r)
        outputs = drive(sched, FakeRunner(sched, 4, next_token=always(tok)))
        assert r.output_token_ids == [tok] * n_out, params
        assert outputs["a"][-1].finish_reason == reason, params
        assert [o.stop_token_id for o in outputs["a"]] == [None] * (len(outputs["a"]) - 1) + [
            stop_id], params


def test_max_num_seqs_bounds_the_batch() -> None:
    sched = make_sched(max_num_seqs=2, max_model_len=64)
    requests = [req(f"r{i}", prompt(i, 6), max_tokens=3) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    seen_running: list[int] = []
    outputs = drive(sched, FakeRunner(sched, 4), lambda so: seen_running.append(sched.num_running))
    assert max(seen_running) == 2
    assert_matches_reference(outputs, requests, 64)


# ---- intake and contracts ------------------------------------------------------------------------
def test_add_request_rejects_bad_input() -> None:
    sched = make_sched(max_model_len=16)
    with pytest.raises(RequestError, match="empty"):
        sched.add_request(req("a", []))
    with pytest.raises(RequestError, match="prompt has 16 tokens; max_model_len is 16"):
        sched.add_request(req("a", prompt(1, 16)))
    sched.add_request(req("a", prompt(1, 15), max_tokens=100))  # generation is capped instead
    with pytest.raises(RequestError, match="already in use"):
        sched.add_request(req("a", prompt(1, 3)))
    assert sched.num_waiting == 1


def test_runner_contract_violations_are_loud() -> None:
    sched = make_sched(max_model_len=64, max_num_batched_tokens=4)
    sched.add_request(req("a", prompt(1, 10)))
    so = sched.schedule()
    with pytest.raises(RuntimeError, match="mid-prefill"):
        sched.update_from_output(so, ModelRunnerOutput({"a": [5]}))
    sched2 = make_sched(max_model_len=64)
    sched2.add_request(req("a", prompt(1, 3)))
    so = sched2.schedule()
    with pytest.raises(RuntimeError, match="no sampled token"):
        sched2.update_from_output(so, ModelRunnerOutput({"a": []}))


def test_cached_request_data_carries_only_the_changes() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    runner = FakeRunner(sched, 4)
    sched.add_request(req("a", prompt(1, 7), max_tokens=5))
    so = sched.schedule()
    (new,) = so.new_requests
    assert len(new.token_ids) == 7 and len(new.block_ids) == 2 and new.num_computed_tokens == 0
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # decode of token 8: no new block yet
    (c,) = so.cached_requests
    assert len(c.new_token_ids) == 1 and c.new_block_ids == () and c.num_computed_tokens == 7
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # token 9 needs a third block
    (c,) = so.cached_requests
    assert len(c.new_block_ids) == 1 and c.num_computed_tokens == 8
    sched.update_from_output(so, runner.execute(so))
    drive(sched, runner)


# ---- speculative decoding ------------------------------------------------------------------------
class SpecFakeRunner(FakeRunner):
    """A fake MTP engine: each sampling request gets k drafts, the true continuation (by the fake
    model) except where `wrong(position)` corrupts it, so accepted runs and rejections mix. Drafts
    are verified exactly as greedy rejection sampling does; the k − 1 lookahead positions after
    the last accepted one are written with a marker token (−1), as the MTP draft steps write
    their keys there. A marker or a rejected draft that were ever read back as computed context
    (or found through the prefix cache) fail the context check."""

    def __init__(self, sched: Scheduler, block_size: int, k: int,
                 wrong: Callable[[int], bool] = lambda p: p % 5 == 3, **kw) -> None:
        super().__init__(sched, block_size, **kw)
        self.k, self.wrong = k, wrong
        self.lookahead_writes = 0

    def _put(self, st: _RunnerReq, positions: list[int], tokens: list[int]) -> None:
        pos = torch.tensor(positions)
        table = torch.tensor([st.block_ids], dtype=torch.int32)
        for r in range(self.n):
            slots = layout.slot_mapping(pos, torch.zeros_like(pos), table, self.b, self.n, r,
                                        self.i)
            for p, t, slot in zip(positions, tokens, slots.tolist(), strict=True):
                if slot >= 0:
                    self.kv[r][slot] = (p, t)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(so)
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            st, req = self.reqs[rid], self.sched.requests[rid]
            assert st.token_ids == req.all_token_ids and st.block_ids == req.block_ids
            spec = list(so.scheduled_spec_token_ids.get(rid, ()))
            assert spec == req.spec_token_ids[: len(spec)], "drafts verified out of order"
            start = st.num_computed_tokens
            self._check_context(st, start)
            seq = st.token_ids + spec
            self._put(st, list(range(start, start + n)), seq[start : start + n])
            if start + n - len(spec) < len(st.token_ids):
                sampled[rid] = []  # a prefill chunk
                continue
            ctx, out = list(st.token_ids), []
            for d in spec:  # greedy verification
                t = self.next_token(ctx)
                out.append(t)
                if d != t:
                    break
                ctx.append(d)
            else:
                out.append(self.next_token(ctx))
            sampled[rid] = out
            last = start + n - 1 - len(spec) + len(out) - 1  # the last accepted position
            ahead = list(range(last + 1, last + self.k))
            self._put(st, ahead, [-1] * len(ahead))  # needs the lookahead blocks
            self.lookahead_writes += len(ahead)
            ctx = st.token_ids + out
            proposal = []
            for _ in range(self.k):
                t = self.next_token(ctx)
                proposal.append(t + 1 if self.wrong(len(ctx)) else t)
                ctx.append(t)
            drafts[rid] = proposal
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=drafts)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("budget,num_blocks,caching", [(64, 64, True), (5, 64, True),
                                                       (1, 64, False), (64, 13, True)])
def test_spec_decoding_emits_the_reference_tokens(k, budget, num_blocks, caching) -> None:
    """Output equals the one-token-at-a-time reference whatever the drafts, the budget (1: no
    room for drafts), preemption (13 blocks) or prefix hits; stop ids, EOS, max_tokens and
    max_model_len land inside accepted runs; nothing leaks (drive checks integrity each phase)."""
    max_len = 48
    sched = make_sched(block_size=4, num_blocks=num_blocks, caching=caching, max_model_len=max_len,
                       max_num_batched_tokens=budget, num_speculative_tokens=k)
    runner = SpecFakeRunner(sched, 4, k)
    shared = prompt(9, 13)
    # stop tokens that come late in b's and d's outputs, inside runs of accepted drafts
    free_b, _ = reference_output(shared + prompt(2, 3), SamplingParams(max_tokens=20), (), max_len)
    free_d, _ = reference_output(shared, SamplingParams(max_tokens=20), (), max_len)
    requests = [req("a", shared + prompt(1, 6), max_tokens=30),
                req("b", shared + prompt(2, 3), max_tokens=19, eos=(free_b[7],)),
                req("c", prompt(3, 20), max_tokens=40),  # max_model_len ends it
                req("d", shared, max_tokens=19, stop_token_ids=(free_d[5], free_d[11])),
                req("e", prompt(5, 2), max_tokens=1)]
    for r in requests:
        sched.add_request(r)
    outputs = drive(sched, runner)
    assert_matches_reference(outputs, requests, max_len)
    s = sched.stats()
    if budget > 1:
        assert (runner.lookahead_writes > 0) == (k > 1)
        assert s.spec_decode_num_drafts > 0
        assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
        assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    else:
        assert s.spec_decode_num_drafts == 0  # one token per step leaves no room for drafts
    if num_blocks < 20:
        assert s.num_preemptions > 0


def test_spec_scheduling_counts_and_rollback() -> None:
    """One request, k = 3: its decode schedules 1 + 3 tokens plus 2 lookahead slots; after a
    rejection the blocks past its tokens go back and the runner is told to drop them; full
    blocks are cached only up to the computed (accepted) tokens."""
    sched = make_sched(block_size=4, max_model_len=64, num_speculative_tokens=3)
    runner = SpecFakeRunner(sched, 4, 3, wrong=lambda p: p == 10)  # draft for position 10 wrong
    sched.add_request(req("a", prompt(1, 7), max_tokens=20))
    so = sched.schedule()  # prefill 7 + lookahead 2 → 3 blocks
    assert so.num_scheduled_tokens == {"a": 7} and len(sched.requests["a"].block_ids) == 3
    sched.update_from_output(so, runner.execute(so))  # token 7 sampled, drafts for 8, 9, 10
    a = sched.requests["a"]
    assert (a.num_tokens, a.num_computed_tokens, len(a.spec_token_ids)) == (8, 7, 3)
    assert len(a.block_ids) == 2  # positions 8.. were lookahead only: given back
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_token_ids["a"] == tuple(
        a.spec_token_ids)
    assert len(a.block_ids) == 4  # positions up to 10 + 2 lookahead = 12 → 4 blocks
    (c,) = so.cached_requests
    assert c.num_kept_blocks == 2
    sched.update_from_output(so, runner.execute(so))  # drafts 8, 9 accepted, 10 rejected
    assert (a.num_tokens, a.num_computed_tokens) == (11, 10)
    assert len(a.block_ids) == 3 and sched.kv._num_cached_blocks["a"] == 2
    s = sched.stats()
    assert (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens_per_pos) == (1, 3, (1, 1, 0))
    drive(sched, runner)


def test_spec_lookahead_counts_in_the_pool_check() -> None:
    with pytest.raises(ConfigError, match="2 lookahead tokens"):
        make_sched(block_size=4, num_blocks=16, max_model_len=64, num_speculative_tokens=3)
    make_sched(block_size=4, num_blocks=17, max_model_len=64, num_speculative_tokens=3)


def test_a_request_looks_its_stop_ids_up_in_a_set() -> None:
    """Every emitted token is checked against the request's stop ids: a set built once, not
    the client's list scanned per token (millions of ids slowed every request)."""
    from dsaserve.core import Request

    req = Request("r", [1, 2], SamplingParams(stop_token_ids=tuple(range(10, 20_000, 2))))
    assert isinstance(req.stop_ids, frozenset) and 12 in req.stop_ids and 13 not in req.stop_ids
