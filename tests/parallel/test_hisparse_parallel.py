"""HiSparse under tensor and data parallelism (gloo worker processes, CPU): greedy output equals
the all-GPU single-rank engine's, with contexts longer than the hot buffer (misses served from
the host pool) and, with few MLA pages, long decoders' pages spilled. Each TP rank keeps the
whole pool and resolves the same rows (its latent rows are the same); each DP replica has its
own pool and page map, with or without its experts shared over the replicas (DP + EP). Every
invariant is checked after every step, a second round hits the first one's cached blocks
(spilled ones restored from the host pool), and nothing leaks; the same with
--async-scheduling."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    HiSparseConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine

pytestmark = pytest.mark.parallel

B = 4  # small blocks: many pages per request, so spills are fine-grained
MAX_LEN = 64
PAGES = 16  # cdiv(MAX_LEN, B): one window, the least the engine accepts
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "dp2": dict(data_parallel_size=2),
           # the reference decode engine's layout: the replicas share their experts (DP + EP)
           "dp2ep": dict(data_parallel_size=2, enable_expert_parallel=True)}


def _prompts() -> list[list[int]]:
    """Six prompts of 30-45 tokens (8-12 blocks): beyond the 16-row hot buffer from the
    start, and more blocks at once than 16 MLA pages on either layout."""
    g = torch.Generator().manual_seed(21)
    lens = torch.randint(30, 46, (6,), generator=g).tolist()
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lens]


def _config(model_dir, *, parallel: dict | None = None, mla_pages: int | None = None,
            hisparse: bool = True) -> EngineConfig:
    model = ModelConfig.from_file(model_dir)
    attention = AttentionConfig(sparse_mla_force_mqa=True)
    if hisparse:  # a hot buffer of one top-k: every step of these contexts misses
        attention = dataclasses.replace(attention, hisparse_device_buffer_size=model.index_topk,
                                        hisparse_device_mla_pages=mla_pages,
                                        hisparse_config_given=True)
    return EngineConfig(
        model_path=str(model_dir), model=model,
        cache=CacheConfig(block_size=B, num_gpu_blocks=100),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96,
                                  max_model_len=MAX_LEN),
        attention=attention, parallel=ParallelConfig(**(parallel or {})),
        hisparse=HiSparseConfig(host_pool_bytes=16 << 20) if hisparse else None)


@pytest.fixture(scope="module")
def reference(model_dirs) -> list[list[int]]:
    """The all-GPU single-rank engine (no HiSparse)."""
    engine = LLMEngine.from_config(_config(model_dirs["tiny-glm5"], hisparse=False))
    return engine.generate(_prompts(), PARAMS)


# (layout, MLA pages, --async-scheduling): every rank launches step k + 1 before step k's
# tokens are read (docs/decode.md)
CASES = [(layout, pages, False) for layout in LAYOUTS for pages in (None, PAGES)] + [
    (layout, PAGES, True) for layout in LAYOUTS]


@pytest.fixture(params=CASES, ids=lambda p: f"{p[0]}-{'spill' if p[1] else 'misses'}"
                                            f"{'-async' if p[2] else ''}")
def engine(request, model_dirs, assert_gone) -> Iterator[LLMEngine | DataParallelEngine]:
    layout, pages, async_scheduling = request.param
    config = _config(model_dirs["tiny-glm5"], parallel=LAYOUTS[layout], mla_pages=pages)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=async_scheduling))
    engine = LLMEngine.from_config(config)
    yield engine
    pids = tuple(p for r in _replicas(engine) for p in r.executor.pids)
    engine.shutdown()
    assert_gone(pids)


def _replicas(engine: LLMEngine | DataParallelEngine) -> list[LLMEngine]:
    return list(engine.replicas) if isinstance(engine, DataParallelEngine) else [engine]


def _run(engine: LLMEngine | DataParallelEngine, prompts: list[list[int]], tag: str
         ) -> tuple[list[list[int]], int]:
    """Step to the end, every invariant checked after each step → (outputs, most blocks
    that one replica's running requests held at once)."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, PARAMS)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    most_blocks = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
        most_blocks = max(most_blocks, *(sum(len(r.block_ids) for r in rep.scheduler.running)
                                         for rep in _replicas(engine)))
    engine.step()  # an empty step tells the runners which requests ended
    engine.check_integrity()
    return [out[rid] for rid in ids], most_blocks


def test_greedy_equals_all_gpu_single_rank(engine, reference):
    spilling = _replicas(engine)[0].scheduler.mla is not None
    prompts = _prompts()
    got, most_blocks = _run(engine, prompts, "a")
    assert got == reference
    # a second round hits the first one's cached blocks: spilled ones come back from the pool
    again, _ = _run(engine, prompts, "b")
    assert again == reference
    assert engine.stats().prefix_cache_hits > 0
    for rep in _replicas(engine):
        counters = rep.executor.call("hisparse_counters")
        missed, from_host, live, kept = counters[0]
        assert missed > 0 and from_host > 0, "no miss served from the host pool"
        assert live == 0, "a HiSparse window outlived its request"
        # TP ranks hold the same latent rows and select the same ones: the same misses
        assert all(c[:3] == counters[0][:3] for c in counters)
        stats = rep.stats()
        assert stats.num_running == stats.num_waiting == stats.num_preemptions == 0
        if spilling:
            mla = rep.scheduler.mla
            assert stats.hisparse_mla_spills > 0 and mla.num_restores > 0
            assert all(c[3] == len(mla.host_kept()) for c in counters)
            assert rep.executor.call("hisparse_mla_pages") == [PAGES] * rep.executor.world_size
    if spilling:  # more KV at once than the MLA pages hold, on one replica
        assert most_blocks > PAGES
