"""Worker processes driven in lock-step over gloo: a TP=2 and a PCP=2 world produce the greedy
output of the single-rank engine; call() reaches every rank; a killed or failing worker makes the
engine raise EngineDeadError (never hang) and leaves no process behind."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsaserve.core import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import (
    EngineDeadError,
    InProcessExecutor,
    MultiprocExecutor,
    worker_device,
)
from dsaserve.engine.runner import ModelRunner

pytestmark = pytest.mark.parallel

# An engine process that starts a TP=2 world, prints the worker pids and waits to be killed.
_ENGINE_PROCESS = """
import sys
from dsaserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from dsaserve.engine.executor import MultiprocExecutor

model = sys.argv[1]
executor = MultiprocExecutor(EngineConfig(
    model, ModelConfig.from_file(model), cache=CacheConfig(block_size=16, num_gpu_blocks=64),
    scheduler=SchedulerConfig(max_model_len=256), parallel=ParallelConfig(tensor_parallel_size=2)))
print(*executor.pids, flush=True)
sys.stdin.read()
"""


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    return outs


def _engine(config) -> LLMEngine:
    engine = LLMEngine.from_config(config)
    assert isinstance(engine, LLMEngine) and isinstance(engine.executor, MultiprocExecutor)
    return engine


def _module_engine(config, assert_gone) -> Iterator[LLMEngine]:
    """A module-scoped engine whose workers must all be gone after shutdown."""
    engine = _engine(config)
    yield engine
    pids = engine.executor.pids
    engine.executor.shutdown()
    assert_gone(pids)


@pytest.fixture(scope="module")
def tp2(parallel_config, assert_gone) -> Iterator[LLMEngine]:
    # A 33-token budget: chunked prefills and decodes share steps.
    yield from _module_engine(parallel_config(tp=2, max_num_batched_tokens=33), assert_gone)


@pytest.fixture(scope="module")
def pcp2(parallel_config, assert_gone) -> Iterator[LLMEngine]:
    # A 48-token budget: split prefill chunks, replicated short chunks and decodes in one step.
    yield from _module_engine(parallel_config(pcp=2, max_num_batched_tokens=48), assert_gone)


@pytest.fixture(scope="module")
def pcp2_dcp2_ep(parallel_config, assert_gone) -> Iterator[LLMEngine]:
    # The prefill node's layout: KV sharded by whole pages, experts split, chunked prefills.
    yield from _module_engine(parallel_config(pcp=2, dcp=2, ep=True, interleave=16,
                                        max_num_batched_tokens=48), assert_gone)


@pytest.fixture(scope="module")
def tp2_dcp2_a2a(parallel_config, assert_gone) -> Iterator[LLMEngine]:
    yield from _module_engine(parallel_config(tp=2, dcp=2, dcp_comm_backend="a2a",
                                        max_num_batched_tokens=33), assert_gone)


@pytest.mark.parametrize("layout", ["tp2", "pcp2", "pcp2_dcp2_ep", "tp2_dcp2_a2a"])
def test_greedy_matches_single_rank(request, layout, prompts, greedy, reference_outputs) -> None:
    engine: LLMEngine = request.getfixturevalue(layout)
    assert engine.executor.world_size == 2 and engine.runner is None
    assert _run(engine, prompts, greedy) == reference_outputs
    # The second round starts from prefix-cache hits and must not change a token.
    assert _run(engine, prompts, greedy) == reference_outputs
    assert engine.stats().prefix_cache_hits > 0


def test_single_rank_engine_runs_in_process(parallel_config) -> None:
    engine = LLMEngine.from_config(parallel_config())
    assert isinstance(engine.executor, InProcessExecutor)
    assert engine.runner is engine.executor.runner


def test_call_reaches_every_rank(parallel_config, prompts, assert_gone) -> None:
    config = parallel_config(tp=2)
    executor = MultiprocExecutor(config)  # its own world: the probe writes KV blocks
    pids = executor.pids
    try:
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert executor.call("__getattribute__", "num_blocks") == [64, 64]
        assert executor.num_blocks == 64
        prompt = prompts[3]
        probe = SchedulerOutput(
            new_requests=(NewRequestData("probe", tuple(prompt), SamplingParams(),
                                         tuple(range(-(-len(prompt) // 16))), 0),),
            cached_requests=(), num_scheduled_tokens={"probe": len(prompt)},
            finished_request_ids=())
        per_rank = executor.call("execute_all_logits", probe)
        expected = ModelRunner(config).execute_all_logits(probe)["probe"]  # [len(prompt), V]
        assert len(per_rank) == 2
        for logits in per_rank:
            torch.testing.assert_close(logits["probe"], expected)
    finally:
        executor.shutdown()
    assert_gone(pids)


def test_killed_worker_blocked_peer_fails_loudly(parallel_config, prompts, greedy, assert_gone,
                                                 hang_guard) -> None:
    """Rank 1 is frozen before a prefill step and killed during it, while rank 0 waits for it in
    a collective: the step raises, naming rank 1, and rank 0 is stopped too."""
    engine = _engine(parallel_config(pcp=2))
    pids = engine.executor.pids
    killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy)
        os.kill(pids[1], signal.SIGSTOP)  # it can never answer the step below
        killer.start()
        with hang_guard(60), pytest.raises(EngineDeadError,
                                           match="worker rank 1 exited with code -9"):
            engine.step()
        assert_gone(pids)
        with hang_guard(60), pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()  # dead for good, at once
    finally:
        killer.cancel()
        engine.executor.shutdown()
    assert_gone(pids)


def test_worker_killed_between_steps(parallel_config, prompts, greedy, assert_gone,
                                     hang_guard) -> None:
    engine = _engine(parallel_config(tp=2))
    pids = engine.executor.pids
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy)
        engine.step()
        os.kill(pids[0], signal.SIGKILL)
        with hang_guard(60), pytest.raises(EngineDeadError,
                                           match="worker rank 0 exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert_gone(pids)
    finally:
        engine.executor.shutdown()


def test_worker_exception_is_reported_with_its_traceback(parallel_config, assert_gone,
                                                         hang_guard) -> None:
    executor = MultiprocExecutor(parallel_config(tp=2))
    pids = executor.pids
    ghost = SchedulerOutput(new_requests=(),
                            cached_requests=(CachedRequestData("ghost", (), (), 0),),
                            num_scheduled_tokens={"ghost": 1}, finished_request_ids=())
    try:
        with hang_guard(60), pytest.raises(EngineDeadError) as info:
            executor.execute(ghost)  # every rank raises KeyError in the runner
        message = str(info.value)
        assert "raised:\nTraceback (most recent call last):" in message
        assert "in _apply_diff" in message and "KeyError: 'ghost'" in message
        assert_gone(pids)
        assert not Path(executor._rendezvous_dir).exists()
        with pytest.raises(EngineDeadError, match="KeyError: 'ghost'"):
            executor.call("__getattribute__", "num_blocks")  # the first cause, every time
    finally:
        executor.shutdown()


def test_worker_start_up_failure_leaves_nothing(parallel_config, tmp_path, hang_guard) -> None:
    before = set(multiprocessing.active_children())
    broken = dataclasses.replace(parallel_config(tp=2), model_path=str(tmp_path))  # no weights
    with hang_guard(60), pytest.raises(EngineDeadError, match="raised:\nTraceback"):
        LLMEngine.from_config(broken)
    assert set(multiprocessing.active_children()) <= before
    assert not list(Path(tmp_path).iterdir())


def test_worker_device() -> None:
    assert worker_device("cpu", 3, 4) == "cpu"
    assert worker_device("cuda", 0) == "cuda:0"
    assert worker_device("cuda", 1, 2) == "cuda:3"  # DP replica 1 of world 2, its rank 1
    assert worker_device("cuda:2", 3, 4) == "cuda:9"
    with pytest.raises(ValueError, match="--device"):
        worker_device("meta", 0)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is its new parent's to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_engine_process_is_killed(tiny_dir, hang_guard) -> None:
    """SIGKILL runs no clean-up in the engine process: the workers notice on their own."""
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_PROCESS, str(tiny_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        with hang_guard(60):
            pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
        engine.kill()
        engine.wait()
        with hang_guard(60):
            while any(_running(pid) for pid in pids):
                time.sleep(0.05)
    finally:
        engine.kill()
        engine.wait()
