"""DP + EP (`--data-parallel-size 2 --enable-expert-parallel`): the routed experts sharded over
both replicas' ranks, the replicas stepping in lock-step (engine/dp.py, parallel/lockstep.py).
Greedy output equals the single engine's with both replicas busy, with one idle (its empty
steps still serve the other's rows), with TP2 replicas, with MTP3 drafts (the MTP layer's
dispatches completed on steps that draft less), and with async scheduling; each rank holds its
share of the experts; a worker of one replica dying fails the whole engine, and a replica that
cannot start ends the other's start-up; nothing leaks.

Decode-only steps are padded to one size on both replicas (engine/dp_padding.py), an idle one
running an all-padding batch of it: every case above takes that path, on both replicas the
same number of times, and its dispatches exchange no row counts (counted step by step)."""

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


def _padded(engine: DataParallelEngine) -> list[tuple[int, int, int, int]]:
    """Per replica (its rank 0): (steps padded to a common size, of them all-padding steps of
    no rows, EP dispatches that exchanged row counts, graph replays: none on the CPU), so
    far."""
    return [r.executor.call("dp_ep_counts")[0] for r in engine.replicas]


def _assert_padded_together(before: list[tuple[int, ...]], after: list[tuple[int, ...]], *,
                            idle: int | None = None) -> None:
    """Between the two counts, both replicas padded the same steps (lock-step), some; with
    `idle` (a replica with no request), that one only through all-padding batches."""
    steps = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    assert steps[0] == steps[1] > 0, f"padded steps per replica {steps}"
    if idle is not None:
        assert after[idle][1] - before[idle][1] == steps[idle], "the idle replica ran rows"


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
            counts = _padded(engine)
            assert engine.generate(prompts, greedy) == reference_outputs
            assert all(r.stats().prefix_cache_queries > 0 for r in engine.replicas)  # both ran
            after = _padded(engine)
            _assert_padded_together(counts, after)
            _assert_no_leak(engine)
            # one request: replica 1 has nothing to run, and steps empty beside replica 0
            assert engine.generate(prompts[:1], greedy) == reference_outputs[:1]
            _assert_padded_together(after, _padded(engine), idle=1)
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
            counts = _padded(engine)
            assert engine.generate(prompts, greedy) == reference_outputs
            _assert_padded_together(counts, _padded(engine))
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
            counts = _padded(engine)
            assert engine.generate(prompts, greedy) == draftable_reference
            after = _padded(engine)
            _assert_padded_together(counts, after)
            assert engine.generate(prompts[:1], greedy) == draftable_reference[:1]
            _assert_padded_together(after, _padded(engine), idle=1)
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
            counts = _padded(engine)
            assert engine.generate(prompts, greedy) == reference_outputs
            after = _padded(engine)
            _assert_padded_together(counts, after)
            assert engine.generate(prompts[:1], greedy) == reference_outputs[:1]
            _assert_padded_together(after, _padded(engine), idle=1)
            _assert_no_leak(engine)
        finally:
            _close(engine, assert_gone)


def test_padded_decode_steps_exchange_no_row_counts(parallel_config, prompts, greedy,
                                                   reference_outputs, assert_gone,
                                                   hang_guard) -> None:
    """Step by step (sync): a step is padded on both replicas or on neither; a padded step's
    dispatches exchange no row counts (every rank knows them: the common size), a step run as
    it is exchanges them at every MoE layer. Padded steps come with both replicas' decode
    batches of different sizes (3 requests and 2), and with replica 1 idle."""
    with hang_guard(300):
        engine = LLMEngine.from_config(_dp_ep(parallel_config))
        try:
            outputs: dict[str, list[int]] = {}
            rows: set[tuple[int, int]] = set()  # requests decoded per replica in padded steps
            for group in (prompts, prompts[:1]):
                ids = [f"{len(group)}-{i}" for i in range(len(group))]
                for rid, prompt in zip(ids, group, strict=True):
                    engine.add_request(rid, prompt, greedy)
                    outputs[rid] = []
                owner = {rid: i for i, r in enumerate(engine.replicas)
                         for rid in r.scheduler.requests}
                while engine.has_unfinished_requests():
                    before = _padded(engine)
                    decoded = [0, 0]
                    for out in engine.step():
                        outputs[out.request_id] += out.new_token_ids
                        decoded[owner[out.request_id]] += 1
                    after = _padded(engine)
                    padded, padding, exchanges = ([a[j] - b[j] for a, b in zip(after, before,
                                                                                strict=True)]
                                                  for j in range(3))
                    assert padded in ([0, 0], [1, 1]), f"padded on one replica only: {padded}"
                    if padded == [1, 1]:
                        assert exchanges == [0, 0], f"a padded step exchanged {exchanges}"
                        # a replica runs an all-padding batch exactly when it has no rows
                        assert padding == [int(n == 0) for n in decoded], (padding, decoded)
                        rows.add((decoded[0], decoded[1]))
                    else:
                        assert min(exchanges) > 0, "a step run as it is exchanged no counts"
                assert [outputs[rid] for rid in ids] == reference_outputs[: len(group)]
            assert (3, 2) in rows and (1, 0) in rows, f"padded steps' requests seen: {rows}"
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
