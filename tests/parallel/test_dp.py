"""Data parallelism: two replicas behind one engine give the single engine's greedy output, spread
requests by load, keep each request (and its abort) on its replica, compute concurrently, and fail
as one when a replica's worker dies; nothing is leaked."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator

import pytest

from dsaserve.core import ModelRunnerOutput, RequestError, SamplingParams, SchedulerOutput
from dsaserve.engine.dp import DataParallelEngine, pick_replica
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import EngineDeadError, InProcessExecutor, MultiprocExecutor
from dsaserve.engine.runner import ModelRunner

pytestmark = pytest.mark.parallel


def _pids(engine: DataParallelEngine) -> tuple[int, ...]:
    return tuple(pid for r in engine.replicas for pid in r.executor.pids)


def _drain(engine: DataParallelEngine) -> list[tuple[str, tuple[int, ...], str | None]]:
    """Step to the end, checking every invariant after each step; (id, tokens, finish reason)."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()]
        engine.check_integrity()
    return outputs


def _assert_no_leak(engine: DataParallelEngine) -> None:
    engine.check_integrity()
    for replica in engine.replicas:
        stats = replica.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"


@pytest.fixture(scope="module")
def dp2(parallel_config, assert_gone) -> Iterator[DataParallelEngine]:
    engine = LLMEngine.from_config(parallel_config(dp=2, max_num_batched_tokens=48))
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == 2
    assert all(isinstance(r.executor, MultiprocExecutor) for r in engine.replicas)
    yield engine
    pids = _pids(engine)
    engine.shutdown()
    assert_gone(pids)


def test_pick_replica_by_load() -> None:
    assert pick_replica([(0, 0), (0, 0)]) == 0  # ties → lowest index
    assert pick_replica([(2, 0), (1, 9)]) == 1  # fewest unfinished requests first
    assert pick_replica([(1, 5), (1, 3)]) == 1  # then fewest used KV blocks
    assert pick_replica([(1, 3), (1, 3), (0, 7)]) == 2


def test_greedy_matches_single_engine(dp2, prompts, greedy, reference_outputs) -> None:
    ids = [f"q{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        dp2.add_request(rid, prompt, greedy)
    # Spread by load: each replica gets the next request when it has fewer (ties → replica 0).
    assert [sorted(r.scheduler.requests) for r in dp2.replicas] == [["q0", "q2", "q4"],
                                                                    ["q1", "q3"]]
    dp2.check_integrity()
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, new, _ in _drain(dp2):
        tokens[rid] += new
    assert [tokens[rid] for rid in ids] == reference_outputs
    _assert_no_leak(dp2)
    # Again through generate(): both replicas now hit their prefix caches.
    assert dp2.generate(prompts, greedy) == reference_outputs
    assert all(r.stats().prefix_cache_hits > 0 for r in dp2.replicas)
    stats = dp2.stats()
    assert stats.num_total_blocks == 2 * 64 and stats.num_free_blocks == 2 * 64
    assert stats.prefix_cache_hits == sum(r.stats().prefix_cache_hits for r in dp2.replicas)
    _assert_no_leak(dp2)


def test_abort_follows_the_request_to_its_replica(dp2, prompts) -> None:
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    dp2.add_request("a0", prompts[0], long)
    dp2.add_request("a1", prompts[1], long)
    assert "a1" in dp2.replicas[1].scheduler.requests
    dp2.step()
    dp2.abort_request("a1")
    assert "a1" not in dp2.replicas[1].scheduler.requests
    dp2.check_integrity()
    # The id is free again at once; the old request's "abort" output must not unpin the new one.
    dp2.add_request("a1", prompts[2], SamplingParams(max_tokens=3, temperature=0.0,
                                                     ignore_eos=True))
    dp2.abort_request("unknown")  # ignored, as in LLMEngine
    reasons = [(rid, reason) for rid, _, reason in _drain(dp2) if reason is not None]
    assert reasons == [("a1", "abort"), ("a1", "length"), ("a0", "length")]
    dp2.abort_request("a0")  # finished: ignored
    _assert_no_leak(dp2)


def test_request_ids_are_unique_across_replicas(dp2, prompts, greedy) -> None:
    dp2.add_request("dup", prompts[0], greedy)  # replica 0; replica 1 alone would accept "dup"
    with pytest.raises(RequestError, match="'dup' is already in use"):
        dp2.add_request("dup", prompts[1], greedy)
    with pytest.raises(RequestError, match="prompt is empty"):
        dp2.add_request("empty", [], greedy)
    dp2.check_integrity()  # a rejected request is pinned nowhere
    dp2.abort_request("dup")
    _drain(dp2)
    _assert_no_leak(dp2)


class _Recording:
    """An in-process executor that logs the order in which the engine drives it."""

    def __init__(self, runner: ModelRunner, index: int, log: list[tuple[str, int]]) -> None:
        self._inner = InProcessExecutor(runner)
        self.world_size, self.num_blocks = 1, runner.num_blocks
        self._index, self._log = index, log

    def execute_async(self, scheduler_output: SchedulerOutput) -> None:
        self._log.append(("send", self._index))
        self._inner.execute_async(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        self._log.append(("collect", self._index))
        return self._inner.collect()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_async(scheduler_output)
        return self.collect()

    def call(self, name: str, *args: object) -> list[object]:
        return self._inner.call(name, *args)

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_log_of_two_replicas_with_workers(parallel_config, prompts, greedy, assert_gone,
                                               tmp_path, async_scheduling) -> None:
    """--step-log under -dp 2 (each replica's runner in a worker process): one file, a line
    per step of each replica (its `dp_rank`, its own step count), their tokens the tokens
    the engine returned."""
    config = parallel_config(dp=2)
    path = tmp_path / "steps.jsonl"
    config = dataclasses.replace(config, step_log=str(path), scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=async_scheduling))
    engine = LLMEngine.from_config(config)
    pids = _pids(engine)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"q{i}", prompt, greedy)
    emitted = sum(len(new) for _, new, _ in _drain(engine))
    engine.shutdown()
    assert_gone(pids)
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    for rank in (0, 1):
        mine = [line for line in lines if line["dp_rank"] == rank]
        assert [line["step"] for line in mine] == list(range(len(mine))) and len(mine) > 5
        assert all(line["async"] is async_scheduling for line in mine)
    assert sum(line["num_sampled"] for line in lines) == emitted == 4 * greedy.max_tokens
    assert all(line["launch_ms"] > 0 and line["gpu_forward_ms"] is None for line in lines)


def test_step_sends_every_replica_before_collecting_any(parallel_config, prompts, greedy,
                                                        reference_outputs) -> None:
    config = parallel_config(dp=2)
    log: list[tuple[str, int]] = []
    engine = DataParallelEngine(config, [
        LLMEngine(config, _Recording(ModelRunner(config), i, log), None) for i in range(2)
    ], None)
    engine.add_request("x", prompts[0], greedy)
    engine.add_request("y", prompts[1], greedy)
    engine.step()
    assert log == [("send", 0), ("send", 1), ("collect", 0), ("collect", 1)]
    engine.abort_request("y")
    log.clear()
    outputs = _drain(engine)
    # Replica 1 is told once to forget "y", then left alone while replica 0 finishes "x".
    assert log[:4] == [("send", 0), ("send", 1), ("collect", 0), ("collect", 1)]
    assert set(log[4:]) == {("send", 0), ("collect", 0)}
    x_tokens = [t for rid, new, _ in outputs if rid == "x" for t in new]
    assert x_tokens == reference_outputs[0][1:]  # its first token came from the first step
    _assert_no_leak(engine)


def test_dead_replica_stops_every_worker(parallel_config, prompts, greedy, assert_gone,
                                         hang_guard) -> None:
    engine = LLMEngine.from_config(parallel_config(dp=2))
    assert isinstance(engine, DataParallelEngine)
    pids = _pids(engine)
    try:
        for i, prompt in enumerate(prompts[:2]):
            engine.add_request(f"r{i}", prompt, greedy)
        engine.step()
        os.kill(engine.replicas[1].executor.pids[0], signal.SIGKILL)
        with hang_guard(60), pytest.raises(EngineDeadError,
                                           match="worker rank 0 exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert_gone(pids)  # replica 0's healthy worker too
    finally:
        engine.shutdown()
    assert_gone(pids)
