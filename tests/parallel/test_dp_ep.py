"""DP + EP (`--data-parallel-size 2 --enable-expert-parallel`): the routed experts sharded over
both replicas' ranks, the replicas stepping in lock-step (engine/dp.py, parallel/lockstep.py).
Greedy output equals the single engine's with both replicas busy, with one idle (its empty
steps still serve the other's rows), with TP2 replicas, with MTP3 drafts (the MTP layer's
dispatches completed on steps that draft less), and with async scheduling; each rank holds its
share of the experts; a worker of one replica dying fails the whole engine, and a replica that
cannot start ends the other's start-up; nothing leaks."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from dsaserve.config import SpecConfig
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import EngineDeadError, MultiprocExecutor

pytestmark = pytest.mark.parallel


def _dp_ep(parallel_config, **kw):
    return parallel_config(dp=2, ep=True, max_num_batched_tokens=48, **kw)


def _pids(engine: DataParallelEngine) -> tuple[int, ...]:
    return tuple(pid for r in engine.replicas for pid in r.executor.pids)


def _close(engine: DataParallelEngine, assert_gone) -> None:
    pids = _pids(engine)
    engine.shutdown()
    assert_gone(pids)


def _assert_no_leak(engine: DataParallelEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"


def test_greedy_matches_single_engine(parallel_config, prompts, greedy, reference_outputs,
                                      assert_gone, hang_guard) -> None:
    with hang_guard(300):
        engine = LLMEngine.from_config(_dp_ep(parallel_config))
        assert isinstance(engine, DataParallelEngine)
        try:
            # each rank holds half the routed experts: they are sharded over both replicas
            n = engine.config.model.n_routed_experts
            for replica in engine.replicas:
                assert replica.executor.call("experts_held") == [n // 2]
            assert engine.generate(prompts, greedy) == reference_outputs
            assert all(r.stats().prefix_cache_queries > 0 for r in engine.replicas)  # both ran
            _assert_no_leak(engine)
            # one request: replica 1 has nothing to run, and steps empty beside replica 0
            assert engine.generate(prompts[:1], greedy) == reference_outputs[:1]
            _assert_no_leak(engine)
        finally:
            _close(engine, assert_gone)


def test_tp2_replicas_match_single_engine(parallel_config, prompts, greedy, reference_outputs,
                                          assert_gone, hang_guard) -> None:
    """Two replicas of TP2: their TP groups within each replica (global ranks 0-1 and 2-3),
    the experts over all four ranks."""
    with hang_guard(300):
        engine = LLMEngine.from_config(_dp_ep(parallel_config, tp=2))
        try:
            n = engine.config.model.n_routed_experts
            for replica in engine.replicas:
                assert replica.executor.call("experts_held") == [n // 4] * 2
            assert engine.generate(prompts, greedy) == reference_outputs
            _assert_no_leak(engine)
        finally:
            _close(engine, assert_gone)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mtp3_greedy_matches_single_engine(parallel_config, draftable, prompts, greedy,
                                           draftable_reference, assert_gone, hang_guard,
                                           async_scheduling) -> None:
    base = _dp_ep(parallel_config)
    config = dataclasses.replace(base, model_path=str(draftable),
                                 speculative=SpecConfig(num_speculative_tokens=3),
                                 scheduler=dataclasses.replace(
                                     base.scheduler, async_scheduling=async_scheduling))
    with hang_guard(300):
        engine = LLMEngine.from_config(config)
        try:
            assert engine.generate(prompts, greedy) == draftable_reference
            assert engine.generate(prompts[:1], greedy) == draftable_reference[:1]
            stats = engine.stats()
            assert stats.spec_decode_num_accepted_tokens > 0
            _assert_no_leak(engine)
        finally:
            _close(engine, assert_gone)


def test_async_scheduling_matches_single_engine(parallel_config, prompts, greedy,
                                                reference_outputs, assert_gone,
                                                hang_guard) -> None:
    base = _dp_ep(parallel_config)
    config = dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, async_scheduling=True))
    with hang_guard(300):
        engine = LLMEngine.from_config(config)
        try:
            assert engine.generate(prompts, greedy) == reference_outputs
            assert engine.generate(prompts[:1], greedy) == reference_outputs[:1]
            _assert_no_leak(engine)
        finally:
            _close(engine, assert_gone)


def test_a_dead_worker_fails_every_replica(parallel_config, prompts, greedy, assert_gone,
                                           hang_guard) -> None:
    """Replica 1's worker killed while replica 0 works alone (one request): replica 0's ranks
    would wait in the experts' collective for it; the engine fails as one, every worker gone."""
    with hang_guard(300):
        engine = LLMEngine.from_config(_dp_ep(parallel_config))
        pids = _pids(engine)
        engine.add_request("q0", prompts[0], greedy)
        assert engine.replicas[0].scheduler.requests and not engine.replicas[1].scheduler.requests
        engine.step()
        os.kill(engine.replicas[1].executor.pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        engine.shutdown()
        assert_gone(pids)


def test_a_replica_failing_to_start_ends_the_others_start(parallel_config, monkeypatch,
                                                          assert_gone, hang_guard) -> None:
    """Replica 1 fails before its workers exist; replica 0's workers would wait for them in the
    process group's rendezvous forever: its start-up is abandoned, its workers stopped, and the
    root cause is what the caller sees."""
    real = MultiprocExecutor.__init__
    started: list[MultiprocExecutor] = []

    def init(self, config, **kw):
        if kw.get("replica") == 1:
            raise RuntimeError("replica 1 cannot start")
        started.append(self)
        real(self, config, **kw)

    monkeypatch.setattr(MultiprocExecutor, "__init__", init)
    with hang_guard(120), pytest.raises(RuntimeError, match="replica 1 cannot start"):
        LLMEngine.from_config(_dp_ep(parallel_config))
    assert len(started) == 1
    assert_gone(started[0].pids)
