"""`disagg/prefill_process.py`: a prefill engine in a spawned process, the decode engine in this
one (as deployed, and as benchmarks/pd_e2e.py runs them). Greedy P/D across the two processes
equals the single-rank engine's output, bytes moved are the prompt's, the producer frees what was
read; every failure is an error in bounded time and leaves no process and no shm file behind: an
exception in the child, the child killed, a drain that cannot finish, an exception here, and
this process killed."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time

import pytest

from dsaserve.config import DisaggConfig, EngineConfig
from dsaserve.core import RequestError, SamplingParams
from dsaserve.disagg import transport
from dsaserve.disagg.kvio import row_bytes
from dsaserve.disagg.prefill_process import PrefillProcess, PrefillProcessError
from dsaserve.engine.engine import LLMEngine

pytestmark = pytest.mark.parallel

BACKENDS = ["shm"] + (["nixl"] if transport.nixl_available() else [])


def _role(config: EngineConfig, role: str, backend: str = "shm") -> EngineConfig:
    return dataclasses.replace(config, disagg=DisaggConfig(kv_role=role, backend=backend,
                                                           side_channel_port=0))


def _shm_files(agents: list[str]) -> list[str]:
    return [p.name for a in agents for p in transport._shm_dir().glob(f"dsaserve-kv-{a}-*")]


def _decode(d: LLMEngine, rid: str, prompt: list[int], params, sampling: SamplingParams
            ) -> list[int]:
    d.add_request(rid, prompt, sampling, kv_transfer_params=params)
    tokens: list[int] = []
    while d.has_unfinished_requests():
        for out in d.step():
            if out.error is not None:
                raise RequestError(out.error)
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_across_processes_equals_aggregated(parallel_config, prompts, reference_outputs,
                                               greedy, assert_gone, hang_guard, backend):
    config = parallel_config()
    with hang_guard(300):
        d = LLMEngine.from_config(_role(config, "kv_consumer", backend))
        assert isinstance(d, LLMEngine)
        try:
            with PrefillProcess(_role(config, "kv_producer", backend)) as p:
                assert p.pid != os.getpid() and p.is_alive()
                per_token = row_bytes(d.runner.caches).per_token
                for i, prompt in enumerate(prompts[:3]):
                    params = p.prefill(f"r{i}", prompt)
                    assert params.do_remote_prefill and params.remote_num_tokens == len(prompt)
                    before = sum(d.executor.call("kv_bytes_received"))
                    hits = d.stats().prefix_cache_hits
                    assert _decode(d, f"r{i}", prompt, params, greedy) == reference_outputs[i]
                    cached = d.stats().prefix_cache_hits - hits  # the decode side's own blocks
                    moved = sum(d.executor.call("kv_bytes_received")) - before
                    assert moved == (len(prompt) - 1 - cached) * per_token > 0
                    p.drain(tick=d.step)  # the producer learnt the blocks were read and freed
                    # them; checked
                    d.check_integrity()
                pid, agents = p.pid, list(p.agents)
            assert not p.is_alive()
            assert_gone((pid,))
            assert not _shm_files(agents)
        finally:
            d.shutdown()


def test_an_exception_in_the_child_is_raised_here(parallel_config, assert_gone, hang_guard):
    """A prompt the producer refuses: the child's traceback, the child gone."""
    with hang_guard(120):
        p = PrefillProcess(_role(parallel_config(), "kv_producer"), timeout_s=60)
        with pytest.raises(PrefillProcessError, match="RequestError"):
            p.prefill("too-long", list(range(4, 4 + 300)))  # max_model_len 256
        assert not p.is_alive()
        assert_gone((p.pid,))
        assert not _shm_files(list(p.agents))
        with pytest.raises(PrefillProcessError, match="exited"):
            p.prefill("after", [5, 6, 7])
        p.close()  # idempotent


def test_a_killed_child_and_a_drain_that_cannot_finish(parallel_config, assert_gone,
                                                       hang_guard):
    """SIGKILL: the next call raises at once (its pipe and sentinel), its shm files are swept.
    A held request no consumer reads: the drain's timeout is an error, the child stopped."""
    config = _role(parallel_config(), "kv_producer")
    with hang_guard(180):
        p = PrefillProcess(config, timeout_s=60)
        p.prefill("held", [5, 6, 7, 8, 9])
        agents = list(p.agents)
        assert _shm_files(agents)
        os.kill(p.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(PrefillProcessError, match="exited with code -9"):
            p.prefill("next", [5, 6, 7])
        assert time.monotonic() - start < 10
        assert_gone((p.pid,))
        assert not _shm_files(agents)  # a killed shm agent cannot unlink them: swept for it

        p = PrefillProcess(config, timeout_s=60)
        p.prefill("never-read", [5, 6, 7, 8, 9])
        with pytest.raises(PrefillProcessError, match="still unfinished"):
            p.drain(timeout_s=1.0)
        assert not p.is_alive()
        assert_gone((p.pid,))


def test_an_exception_here_stops_the_child(parallel_config, assert_gone, hang_guard):
    with hang_guard(120), pytest.raises(ValueError, match="the benchmark failed"):
        with PrefillProcess(_role(parallel_config(), "kv_producer")) as p:
            pid = p.pid
            raise ValueError("the benchmark failed")
    assert_gone((pid,))


def _exited(pid: int) -> bool:
    """Not our child, so not ours to reap: gone, or a zombie its new parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _own_prefill_process(config: EngineConfig, q: mp.Queue) -> None:
    p = PrefillProcess(config)
    q.put(p.pid)
    time.sleep(300)  # until killed


def test_the_child_ends_when_this_process_is_killed(parallel_config, hang_guard):
    """No orphan: a launcher SIGKILLed (no `finally`, no finalizer) takes its prefill process
    with it (the parent-death signal, then the engine's own shutdown)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with hang_guard(180):
        launcher = ctx.Process(target=_own_prefill_process,
                               args=(_role(parallel_config(), "kv_producer"), q))
        launcher.start()
        try:
            child = q.get(timeout=120)
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.join(10)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not _exited(child):
                time.sleep(0.1)
            if not _exited(child):
                os.kill(child, signal.SIGKILL)
                pytest.fail(f"the prefill process {child} outlived its launcher by 30 s")
        finally:
            if launcher.is_alive():
                launcher.kill()
                launcher.join()
