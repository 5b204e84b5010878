"""--async-scheduling across ranks and replicas (gloo worker processes, CPU): step k + 1 is
submitted to every rank before step k's results are read (engine/worker.py SubmitStep / Flush);
each rank takes its own copy of step k's samples (and MTP drafts) on the device. Greedy output
equals the single-rank engine's, plain and with MTP3, under TP × DCP, TP × EP, DP, PCP and
PCP × DCP (chunked prefills split over the PCP ranks beside decode rows that continue); aborts
while a step is in flight leak nothing; a worker that dies mid-flight ends the engine loudly;
reading out of order or calling the ranks with an answer unread is refused."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator

import pytest

from dsaserve.config import SpecConfig
from dsaserve.core import EngineDeadError, SamplingParams
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine

pytestmark = pytest.mark.parallel

LAYOUTS = {
    "tp2_dcp2": dict(tp=2, dcp=2, max_num_batched_tokens=33),
    "tp2_ep": dict(tp=2, ep=True, max_num_batched_tokens=48),
    "dp2": dict(dp=2, max_num_batched_tokens=48),
    # the prefill node's layouts: prompts of 21-87 tokens in chunks of at most 24 (split over
    # the PCP ranks), decode rows joining them continue from the last step, replicated
    "pcp2": dict(pcp=2, max_num_batched_tokens=24),
    "pcp2_dcp2": dict(pcp=2, dcp=2, interleave=16, max_num_batched_tokens=24),
}


def _async(config, k: int = 0):
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=True))
    if k:
        config = dataclasses.replace(config, speculative=SpecConfig(num_speculative_tokens=k))
    return config


def _pids(engine: LLMEngine | DataParallelEngine) -> tuple[int, ...]:
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    return tuple(p for r in replicas for p in r.executor.pids)


@pytest.fixture
def start(assert_gone) -> Iterator:
    """start(config) → engine; every engine started is shut down and its workers reaped."""
    started: list[LLMEngine | DataParallelEngine] = []

    def build(config):
        started.append(LLMEngine.from_config(config))
        return started[-1]

    yield build
    for engine in started:
        pids = _pids(engine)
        engine.shutdown()
        assert_gone(pids)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_greedy_matches_single_rank(start, layout, parallel_config, prompts, greedy,
                                          reference_outputs):
    engine = start(_async(parallel_config(**LAYOUTS[layout])))
    for _ in range(2):  # the second round starts from prefix hits
        assert engine.generate(prompts, greedy) == reference_outputs
        engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("layout", ["tp2_dcp2", "dp2", "pcp2_dcp2"])
def test_async_mtp_greedy_matches_single_rank(start, layout, parallel_config, draftable,
                                              prompts, greedy, draftable_reference):
    config = dataclasses.replace(parallel_config(**LAYOUTS[layout]), model_path=str(draftable))
    engine = start(_async(config, k=3))
    assert engine.generate(prompts, greedy) == draftable_reference
    engine.check_integrity()
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_async_dp_seeded_sampling_equals_sync(start, parallel_config, prompts):
    """Each replica's ranks sample from per-request generators: the same seeded tokens as the
    synchronous engine of the same layout."""
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    config = parallel_config(**LAYOUTS["dp2"])
    expected = start(config).generate(prompts, params)
    assert start(_async(config)).generate(prompts, params) == expected


@pytest.mark.parametrize("layout", ["dp2", "pcp2"])
def test_async_abort_in_flight_leaks_nothing(start, layout, parallel_config, prompts, greedy):
    engine = start(_async(parallel_config(**LAYOUTS[layout]), k=0))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", prompts[i], long)
    for _ in range(3):
        engine.step()
    engine.abort_request("a1")  # (DP: replica 1) a step in flight for it
    engine.abort_request("a2")  # (DP: replica 0)
    engine.add_request("a1", prompts[4], greedy)  # the id is free at once
    reasons: dict[str, list[str]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons.setdefault(out.request_id, []).append(out.finish_reason)
        engine.check_integrity()
    assert reasons == {"a0": ["length"], "a1": ["abort", "length"], "a2": ["abort"],
                       "a3": ["length"]}
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_worker_killed_with_a_step_in_flight(parallel_config, prompts, greedy, assert_gone,
                                             hang_guard):
    engine = LLMEngine.from_config(_async(parallel_config(tp=2)))
    pids = engine.executor.pids
    try:
        engine.add_request("r", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        with hang_guard(60), pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(50):
                engine.step()
    finally:
        engine.shutdown()
    assert_gone(pids)


def test_submitted_steps_are_read_in_order(start, parallel_config, prompts, greedy):
    engine = start(_async(parallel_config(tp=2)))
    executor = engine.executor
    engine.add_request("r", prompts[0], greedy)
    first = executor.submit(engine.scheduler.schedule())
    second = executor.submit(engine.scheduler.schedule())
    with pytest.raises(RuntimeError, match="answer is unread"):
        executor.call("kv_row_bytes")
    with pytest.raises(RuntimeError, match="in the order they were submitted"):
        second.result()
    assert first.result().sampled_token_ids["r"]  # the prefill's token
    assert first.result() is first.result()  # read once, kept
    assert second.result().sampled_token_ids["r"]  # answered by a Flush
    assert len(executor.call("kv_row_bytes")) == 2
