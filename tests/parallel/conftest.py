"""Fixtures of the multi-process tests: engine configs with a parallel layout, the prompts and the
single-rank reference outputs every layout must reproduce, and checks that no worker is left.
Helpers are handed out as fixtures (test modules do not import conftest)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType

import pytest

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ConfigFactory = Callable[..., EngineConfig]


def _build_config(model_dir: Path, *, tp: int = 1, pcp: int = 1, dp: int = 1, dcp: int = 1,
                 ep: bool = False, dcp_comm_backend: str = "ag_rs", interleave: int = 1,
                 max_num_batched_tokens: int = 512, num_blocks: int = 64) -> EngineConfig:
    """The tiny engine of tests/conftest.py's `engine_config`, with a parallel layout."""
    return EngineConfig(
        model_path=str(model_dir),
        model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=16, num_gpu_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=256),
        attention=AttentionConfig(sparse_mla_force_mqa=True),
        parallel=ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                data_parallel_size=dp, decode_context_parallel_size=dcp,
                                enable_expert_parallel=ep, dcp_comm_backend=dcp_comm_backend,
                                cp_kv_cache_interleave_size=interleave),
    )


@pytest.fixture(scope="session")
def tiny_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-glm5"]


@pytest.fixture(scope="session")
def reference_outputs(tiny_dir: Path, mixed_prompts) -> list[list[int]]:
    """Greedy outputs of the single-rank, single-process engine: one request at a time, whole
    prompts, no prefix cache."""
    from dsaserve.engine.engine import LLMEngine

    config = _build_config(tiny_dir)
    config = EngineConfig(config.model_path, config.model,
                          cache=CacheConfig(block_size=16, num_gpu_blocks=64,
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512,
                                                    max_model_len=256),
                          attention=config.attention)
    engine = LLMEngine.from_config(config)
    return [engine.generate([p], GREEDY)[0] for p in mixed_prompts()]


def _assert_gone(pids: tuple[int, ...]) -> None:
    """Every process has exited and been reaped (no orphan, no zombie)."""
    assert pids, "no worker pids to check"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@contextmanager
def _hang_guard(seconds: int) -> Iterator[None]:
    """Turn a hang into a test failure (not a timing assertion: the limit is far above need)."""

    def fail(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"hung for {seconds} s")

    previous: Callable | int | None = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def draftable(draftable_dirs) -> Path:
    """The tiny GLM-5 checkpoint whose MTP drafts are often accepted (tests/conftest.py)."""
    return draftable_dirs["tiny-glm5"]


@pytest.fixture(scope="session")
def draftable_reference(draftable, prompts) -> list[list[int]]:
    """The draftable checkpoint's greedy outputs: single rank, no drafts, one request at a time."""
    from dsaserve.engine.engine import LLMEngine

    base = _build_config(draftable)
    config = EngineConfig(base.model_path, base.model,
                          cache=CacheConfig(block_size=16, num_gpu_blocks=64,
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256),
                          attention=base.attention)
    engine = LLMEngine.from_config(config)
    return [engine.generate([p], GREEDY)[0] for p in prompts]


@pytest.fixture(scope="session")
def greedy() -> SamplingParams:
    return GREEDY


@pytest.fixture(scope="session")
def prompts(mixed_prompts) -> list[list[int]]:
    return mixed_prompts()


@pytest.fixture(scope="session")
def parallel_config(tiny_dir: Path) -> ConfigFactory:
    """parallel_config(tp=, pcp=, dp=, dcp=, ep=, dcp_comm_backend=, interleave=,
    max_num_batched_tokens=, num_blocks=) → EngineConfig."""
    return lambda **kw: _build_config(tiny_dir, **kw)


@pytest.fixture(scope="session")
def assert_gone() -> Callable[[tuple[int, ...]], None]:
    return _assert_gone


@pytest.fixture(scope="session")
def hang_guard() -> Callable[[int], AbstractContextManager[None]]:
    return _hang_guard
