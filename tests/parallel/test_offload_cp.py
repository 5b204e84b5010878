"""The host KV tier under PCP2 × DCP2 and TP2 × DCP2 (gloo workers): every rank stores and loads
its own shard of each block. A turn whose prefix was evicted from a small GPU pool is served from
the host tier with the single-rank engine's greedy output, each rank's restored rows equal what it
held before eviction, and nothing is left in flight or held."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import OffloadConfig
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.prefix_cache import request_block_hashes

pytestmark = pytest.mark.parallel


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 512, (n,), generator=g).tolist()


@pytest.mark.parametrize("layout,kv_cache_dtype", [
    (dict(pcp=2, dcp=2), "auto"),
    (dict(tp=2, dcp=2), "fp8_ds_mla"),
])
def test_host_tier_under_dcp(parallel_config, greedy, assert_gone, layout,
                             kv_cache_dtype) -> None:
    base = parallel_config(**layout, num_blocks=10, max_num_batched_tokens=64)
    config = dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, kv_cache_dtype=kv_cache_dtype),
        offload=OffloadConfig(cpu_bytes_to_use=16 << 20))
    single = dataclasses.replace(config, parallel=parallel_config().parallel,
                                 offload=OffloadConfig(),
                                 cache=dataclasses.replace(config.cache, num_gpu_blocks=64))
    ref = LLMEngine.from_config(single)
    engine = LLMEngine.from_config(config)
    pids = engine.executor.pids
    try:
        block = engine.scheduler.block_size  # B · DCP = 32 tokens
        prompt = _tokens(0, 70)
        out = engine.generate([prompt], greedy)[0]
        assert out == ref.generate([prompt], greedy)[0]
        turn2 = prompt + out + _tokens(1, 9)
        keys = request_block_hashes(turn2, block, None)[: (len(prompt) + len(out)) // block]
        pool = engine.scheduler.kv.pool
        before = engine.executor.call("read_blocks", [pool.lookup(k) for k in keys])
        for seed in (2, 3):  # evict every block of turn 1 from the GPU
            other = _tokens(seed, 200)
            assert engine.generate([other], greedy) == ref.generate([other], greedy)
        assert all(pool.lookup(k) is None for k in keys)
        hits = engine.stats().offload_hits
        assert engine.generate([turn2], greedy) == ref.generate([turn2], greedy)
        assert engine.stats().offload_hits - hits == len(keys) * block
        after = engine.executor.call("read_blocks", [pool.lookup(k) for k in keys])
        for rank, (b, a) in enumerate(zip(before, after, strict=True)):
            assert len(b) == len(a) > 0
            for x, y in zip(b, a, strict=True):
                assert torch.equal(x, y), f"rank {rank}: a restored row differs"
        if layout.get("dcp"):  # each rank held its own shard, not a copy of the others'
            assert not all(torch.equal(x, y) for x, y in zip(before[0], before[1], strict=True))
        engine.check_integrity()
        sched = engine.scheduler
        assert not sched.has_unfinished_requests() and not sched.offload.busy
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        assert sched.offload.host.num_free_blocks == sched.offload.host.num_blocks
    finally:
        engine.shutdown()
    assert_gone(pids)
