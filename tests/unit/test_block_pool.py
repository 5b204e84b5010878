"""Block pool: reference counts, LRU free queue, hash map, and its integrity check."""

from __future__ import annotations

import random

import pytest

from dsaserve.kv.block_pool import BlockPool, OutOfBlocksError
from dsaserve.kv.events import KVEventSink


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_allocate_free_round_trip() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 5 and pool.usage == 3 / 8
    assert all(pool.ref_count(b) == 1 for b in a)
    pool.free(a)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_integrity()


def test_allocate_raises_when_short_and_takes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_freed_blocks_are_reused_lru_with_a_request_tail_first() -> None:
    pool = BlockPool(6, enable_caching=True)
    first = pool.allocate(3)  # [0, 1, 2]
    second = pool.allocate(3)  # [3, 4, 5]
    pool.free(first)  # queue: 2 1 0
    pool.free(second)  # queue: 2 1 0 5 4 3
    assert pool.allocate(6) == [2, 1, 0, 5, 4, 3]


def test_touch_shares_and_rescues_free_cached_blocks() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    assert pool.cache_block(a[0], h(1))
    pool.free(a)
    assert pool.lookup(h(1)) == a[0], "a freed cached block stays findable"
    pool.touch([a[0]])  # prefix hit on a free block: leaves the free queue
    assert pool.ref_count(a[0]) == 1 and pool.num_free_blocks == 3
    pool.touch([a[0]])  # a second request shares it
    assert pool.ref_count(a[0]) == 2
    pool.check_integrity()
    pool.free([a[0]])
    assert pool.num_free_blocks == 3
    pool.free([a[0]])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_allocating_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    a = pool.allocate(2)
    pool.cache_block(a[0], h(1))
    pool.cache_block(a[1], h(2))
    pool.free(a)  # queue: a1 a0 (tail block first)
    assert pool.allocate(1) == [a[1]]
    assert pool.lookup(h(2)) is None and pool.block_hash(a[1]) is None
    assert pool.lookup(h(1)) == a[0]
    pool.check_integrity()


def test_cache_block_rules() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    assert pool.cache_block(a, h(1))
    assert pool.cache_block(a, h(1)), "re-caching under the same hash is a no-op"
    assert not pool.cache_block(b, h(1)), "duplicate content keeps the first block"
    assert pool.block_hash(b) is None
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, h(2))
    pool.free([c])
    with pytest.raises(ValueError, match="free"):
        pool.cache_block(c, h(3))
    pool.check_integrity()
    off = BlockPool(2, enable_caching=False)
    x = off.allocate(1)[0]
    assert not off.cache_block(x, h(1)) and off.lookup(h(1)) is None


def test_double_free_is_rejected_without_side_effects() -> None:
    pool = BlockPool(3, enable_caching=False)
    a = pool.allocate(2)
    pool.free([a[0]])
    with pytest.raises(ValueError, match=f"block {a[0]} is already free"):
        pool.free([a[1], a[0]])
    assert pool.ref_count(a[1]) == 1
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    pool.cache_block(a[0], h(1))
    free_block = next(b for b in range(4) if b not in a)
    pool._ref[a[1]], pool._ref[free_block] = 0, 1  # counts still add up; per-block state does not
    with pytest.raises(AssertionError, match=f"block {a[1]} has ref 0 but is not in the free"):
        pool.check_integrity()
    pool._ref[a[1]], pool._ref[free_block] = 1, 0
    pool.check_integrity()
    pool._cached[h(9)] = a[1]  # map names a block that holds no such hash
    with pytest.raises(AssertionError, match="hash map"):
        pool.check_integrity()
    del pool._cached[h(9)]
    pool._free[a[0]] = None  # in use and in the free queue
    with pytest.raises(AssertionError, match="free"):
        pool.check_integrity()


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    pool = BlockPool(16, enable_caching=True)
    held: list[list[int]] = []  # one list per simulated request
    next_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            held.append(pool.allocate(rng.randint(1, min(3, pool.num_free_blocks))))
        elif op < 0.6 and held:
            block = rng.choice(rng.choice(held))
            if pool.block_hash(block) is None:
                next_hash += 1
                assert pool.cache_block(block, h(next_hash))
        elif op < 0.75 and held:
            shared = rng.choice(held)[:1]  # a prefix hit on another request's first block
            pool.touch(shared)
            held.append(list(shared))
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        pool.check_integrity()
        refs = sum(pool.ref_count(b) for b in range(16))
        assert refs == sum(len(x) for x in held)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == 16
    pool.check_integrity()


class _Log(KVEventSink):
    """Records the pool's `removed` calls and its `on_evict` calls, in one sequence."""

    def __init__(self) -> None:
        self.removed_calls: list[list[bytes]] = []
        self.evicted: list[int] = []

    def removed(self, block_hashes: list[bytes], medium: str = "GPU") -> None:
        self.removed_calls.append(list(block_hashes))


def _state(pool: BlockPool) -> tuple:
    return list(pool._ref), list(pool._hash), dict(pool._cached), list(pool._free)


def test_allocating_n_blocks_at_once_equals_n_single_allocations() -> None:
    """Bulk allocation: the same blocks in the same order, the same hashes evicted (reported in
    one `removed` call, in free-queue order) and `on_evict` calls, the same state after, from
    many random pool histories (cached free blocks, plain free ones, touched hits)."""
    rng = random.Random(1)
    next_hash = 0
    for trial in range(200):
        logs = [_Log(), _Log()]
        pools = [BlockPool(24, enable_caching=trial % 5 != 0, events=log) for log in logs]
        for pool, log in zip(pools, logs, strict=True):
            pool.on_evict = log.evicted.append
        held: list[list[int]] = []
        for _ in range(rng.randint(0, 80)):  # the same history on both pools
            op = rng.random()
            if op < 0.35 and pools[0].num_free_blocks:
                n = rng.randint(1, min(4, pools[0].num_free_blocks))
                got = [pool.allocate(n) for pool in pools]
                assert got[0] == got[1]
                held.append(got[0])
            elif op < 0.7 and held:
                block = rng.choice(rng.choice(held))
                if pools[0].block_hash(block) is None:
                    next_hash += 1
                    for pool in pools:
                        pool.cache_block(block, h(next_hash))
            elif op < 0.8 and held:
                shared = rng.choice(held)[:1]
                for pool in pools:
                    pool.touch(shared)
                held.append(list(shared))
            elif held:
                blocks = held.pop(rng.randrange(len(held)))
                for pool in pools:
                    pool.free(blocks)
        for blocks in held[::2]:  # about half of what is held goes back, cached or not
            for pool in pools:
                pool.free(blocks)
        for log in logs:
            log.removed_calls.clear()
            log.evicted.clear()
        n = rng.randint(0, pools[0].num_free_blocks)
        bulk = pools[0].allocate(n)
        singles = [b for _ in range(n) for b in pools[1].allocate(1)]
        assert bulk == singles
        assert len(logs[0].removed_calls) <= 1, "one removed event per allocation"
        assert sum(logs[0].removed_calls, []) == sum(logs[1].removed_calls, [])
        assert all(len(call) == 1 for call in logs[1].removed_calls)
        assert logs[0].evicted == logs[1].evicted
        assert [b for b in bulk if pools[0].block_hash(b) is None] == bulk
        assert _state(pools[0]) == _state(pools[1])
        for pool in pools:
            pool.check_integrity()


def test_a_bulk_allocation_evicts_and_reports_in_lru_order() -> None:
    log = _Log()
    pool = BlockPool(6, enable_caching=True, events=log)
    pool.on_evict = log.evicted.append
    a = pool.allocate(3)
    b = pool.allocate(3)
    for i, block in enumerate(a + b):
        if block != b[1]:  # one free block without a hash among them
            pool.cache_block(block, h(i))
    pool.free(a)  # queue: a2 a1 a0
    pool.free(b)  # queue: a2 a1 a0 b2 b1 b0
    assert pool.allocate(5) == [a[2], a[1], a[0], b[2], b[1]]
    assert log.removed_calls == [[h(2), h(1), h(0), h(5)]]
    assert log.evicted == [a[2], a[1], a[0], b[2]]
    assert pool.lookup(h(3)) == b[0] and pool.num_free_blocks == 1
    pool.check_integrity()
