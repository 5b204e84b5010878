"""KV cache manager: prefix lookup, slot allocation, caching of full computed blocks, freeing."""

from __future__ import annotations

import pytest

from dsaserve.core import Request, SamplingParams
from dsaserve.kv.manager import KVCacheManager
from dsaserve.kv.prefix_cache import request_block_hashes

BS = 4  # scheduler block (B·N)


def make(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def run_prefill(m: KVCacheManager, req: Request, *others: Request) -> list[int]:
    """Look up, allocate the rest of the prompt, 'compute' it and cache its full blocks."""
    hits, num_hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    m.cache_full_blocks(req)
    m.check_integrity([req, *others])
    return hits


def test_allocate_rounds_up_to_blocks_and_grows() -> None:
    m = KVCacheManager(8, BS, enable_caching=True)
    req = make("a", list(range(9)))
    added = m.allocate_slots(req, 9)
    assert added == req.block_ids and len(added) == 3
    req.num_computed_tokens = 9
    assert m.allocate_slots(req, 3) == []  # 12 tokens still fit in 3 blocks
    assert len(m.allocate_slots(req, 4)) == 1  # 13 tokens need a 4th
    assert m.num_free_blocks == 4
    m.check_integrity([req])


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    m = KVCacheManager(3, BS, enable_caching=False)
    req = make("a", list(range(13)))
    assert m.allocate_slots(req, 13) is None
    assert req.block_ids == [] and m.num_free_blocks == 3
    m.check_integrity([req])


def test_prefix_hit_stops_at_first_miss_and_never_covers_the_last_token() -> None:
    m = KVCacheManager(16, BS, enable_caching=True)
    first = make("a", list(range(12)))
    run_prefill(m, first)
    m.free(first)
    # An identical prompt of exactly 3 blocks: only 2 may hit, the last token must be computed.
    again = make("b", list(range(12)))
    hits, n = m.get_computed_blocks(again)
    assert n == 8 and hits == first_blocks(m, list(range(12)))[:2]
    # A prompt diverging in block 1 hits block 0 only.
    other = make("c", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert m.get_computed_blocks(other)[1] == 4
    assert m.prefix_cache_queries == 12 + 12 + 13 and m.prefix_cache_hits == 0 + 8 + 4


def first_blocks(m: KVCacheManager, tokens: list[int]) -> list[int | None]:
    return [m.pool.lookup(h) for h in request_block_hashes(tokens, BS, None)]


def test_hits_are_shared_and_reference_counted() -> None:
    m = KVCacheManager(16, BS, enable_caching=True)
    a = make("a", list(range(10)))
    run_prefill(m, a)  # blocks 0, 1 full and cached; block 2 partial
    b = make("b", list(range(8)) + [50, 51, 52])
    hits = run_prefill(m, b, a)
    assert hits == a.block_ids[:2] and b.block_ids[:2] == hits
    assert all(m.pool.ref_count(x) == 2 for x in hits)
    m.check_integrity([a, b])
    m.free(a)
    m.check_integrity([b])
    m.free(b)
    m.check_integrity([])
    assert m.num_free_blocks == 16


def test_free_cached_hits_count_against_free_space() -> None:
    m = KVCacheManager(3, BS, enable_caching=True)
    a = make("a", list(range(8)))
    run_prefill(m, a)  # 2 blocks, block 0 cached (block 1 holds the uncomputable last token)
    a.num_computed_tokens = 8
    m.cache_full_blocks(a)
    m.free(a)  # 3 free, 2 of them cached
    b = make("b", list(range(8)) + [1, 2, 3, 4, 5])  # 13 tokens: 4 blocks
    hits, n = m.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    # 2 hits + 2 fresh blocks needed, but the hits themselves are 2 of the 3 free blocks.
    assert m.allocate_slots(b, 5, hits) is None
    assert all(m.pool.ref_count(x) == 0 for x in hits) and m.num_free_blocks == 3
    m.check_integrity([b])


def test_salt_separates_prefixes() -> None:
    m = KVCacheManager(16, BS, enable_caching=True)
    a = make("a", list(range(12)), salt="alice")
    run_prefill(m, a)
    assert m.get_computed_blocks(make("b", list(range(12)), salt="bob"))[1] == 0
    assert m.get_computed_blocks(make("c", list(range(12))))[1] == 0
    assert m.get_computed_blocks(make("d", list(range(12)), salt="alice"))[1] == 8


def test_only_computed_full_blocks_are_cached() -> None:
    m = KVCacheManager(16, BS, enable_caching=True)
    a = make("a", list(range(12)))
    m.allocate_slots(a, 6)  # a chunk of 6 of 12 tokens
    a.num_computed_tokens = 6
    m.cache_full_blocks(a)
    assert first_blocks(m, list(range(12))) == [a.block_ids[0], None, None]
    m.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    m.cache_full_blocks(a)
    assert first_blocks(m, list(range(12))) == a.block_ids
    # Decode tokens extend the hash chain as they fill blocks.
    a.output_token_ids += [100, 101, 102, 103]
    m.allocate_slots(a, 4)
    a.num_computed_tokens = 16
    m.cache_full_blocks(a)
    assert len(a.block_hashes) == 4 and m.pool.lookup(a.block_hashes[3]) == a.block_ids[3]
    m.check_integrity([a])


def test_retries_are_counted_once_per_residency() -> None:
    m = KVCacheManager(16, BS, enable_caching=True)
    a = make("a", list(range(9)))
    m.get_computed_blocks(a)
    m.get_computed_blocks(a)  # e.g. the allocation failed and the scheduler tries again
    assert m.prefix_cache_queries == 9
    m.free(a)  # preempted: the next lookup counts again
    m.get_computed_blocks(a)
    assert m.prefix_cache_queries == 18


def test_disabled_caching_never_hits() -> None:
    m = KVCacheManager(16, BS, enable_caching=False)
    a = make("a", list(range(12)))
    run_prefill(m, a)
    m.free(a)
    assert m.get_computed_blocks(make("b", list(range(12)))) == ([], 0)
    assert m.prefix_cache_queries == 0


def test_integrity_catches_a_leak() -> None:
    m = KVCacheManager(4, BS, enable_caching=True)
    a = make("a", list(range(5)))
    m.allocate_slots(a, 5)
    with pytest.raises(AssertionError, match="live requests hold it"):
        m.check_integrity([])  # a's blocks are referenced but nobody live holds them


def test_hits_only_for_a_request_without_blocks() -> None:
    m = KVCacheManager(4, BS, enable_caching=True)
    a = make("a", list(range(5)))
    m.allocate_slots(a, 5)
    with pytest.raises(ValueError, match="new_computed_blocks"):
        m.allocate_slots(a, 1, [3])


@pytest.mark.parametrize("cached_blocks", [0, 1, 17, 40, 63])
def test_a_lazy_lookup_finds_the_same_hits_hashing_only_what_it_walks(cached_blocks) -> None:
    """A P/D arrival's lookup (`lazy`) hashes its blocks only as far as the walk goes (its
    prompt is hashed once its READs are posted), and finds the same hits as a full lookup;
    the hashes it made are the prompt's first ones, the rest appended later unchanged."""
    m = KVCacheManager(160, BS, enable_caching=True)
    prompt = list(range(64 * BS + 3))
    if cached_blocks:
        done = make("done", prompt[: cached_blocks * BS])
        run_prefill(m, done)
        m.free(done)
    eager, lazy = make("eager", prompt), make("lazy", prompt)
    want = m.get_computed_blocks(eager)
    assert m.get_computed_blocks(lazy, lazy=True) == want
    assert len(want[0]) == min(cached_blocks, 64)
    walked = len(lazy.block_hashes)
    assert len(want[0]) < walked <= 2 * len(want[0]) + 16  # doubling from 16 blocks
    assert lazy.block_hashes == eager.block_hashes[:walked]
    m.update_hashes(lazy)
    assert lazy.block_hashes == eager.block_hashes == request_block_hashes(prompt, BS, None)
    assert m.get_computed_blocks(lazy, lazy=True) == want  # hashed already: nothing more
