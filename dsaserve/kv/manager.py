"""The KV cache manager: per-request block lists on top of the block pool and the prefix cache.

One per engine. It is DCP-aware only through its block size, the scheduler block S = B·N: every
count here (tokens per block, hash unit) is in scheduler blocks, shared by all ranks.

    request.block_ids   [ b0 | b1 | b2 | b3 ]          S tokens each; the last may be partial
    tokens              |--- computed ---|- new -|      num_computed_tokens + num_new_tokens
    prefix-cached       [ b0 | b1 ]                      full *and* computed blocks get a hash

A request's blocks live in `request.block_ids`; the manager keeps only how many of them it has
already registered in the prefix cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from dsaserve.core import Request
from dsaserve.kv.block_pool import BlockPool
from dsaserve.kv.prefix_cache import extend_block_hashes

LOOKUP_BLOCKS = 16  # a lazy lookup's first blocks hashed (`get_computed_blocks`)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 drop_last_hit: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size  # the scheduler block, B·N tokens
        self.enable_caching = enable_caching
        # MTP: the MTP layer's key at a block's last position was computed from the *next*
        # token, which the block's hash does not cover. A hit block is trusted only when the
        # block after it matched too, so the last matched block is recomputed (as vLLM does
        # for EAGLE-style drafters).
        self.drop_last_hit = drop_last_hit
        self.pool = BlockPool(num_blocks, enable_caching)
        self._num_cached_blocks: dict[str, int] = {}  # request id → leading blocks with a hash
        self._queried: set[str] = set()  # requests counted in the stats since their last free()
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found cached
        # Told of every block a request lets go of, after the pool dropped its reference (the
        # HiSparse MLA page map gives back the pages of blocks that became free).
        self.on_free: Callable[[Sequence[int]], None] | None = None

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- the request's life: lookup → allocate (repeatedly) → cache → free ----------------------
    def get_computed_blocks(self, request: Request,
                            usable: Callable[[int], bool] | None = None, *,
                            lazy: bool = False) -> tuple[list[int], int]:
        """The longest cached prefix of `request`'s full blocks: (block ids, tokens they hold);
        with `usable`, up to the first cached block it refuses (HiSparse: a spilled one the
        caller will not restore). `lazy`: the request's blocks are hashed only as far as the
        walk goes (a P/D arrival, whose prompt is hashed once its READs are posted, while they
        are in flight: a 128K prompt's 2,048 blocks are 4–5 ms before the READ otherwise); the
        same hits either way.

        Never the whole token list: at least one token must be computed so that the last
        position's logits exist, so a block ending at the last token is not a hit. The blocks are
        not yet referenced; pass them to `allocate_slots`. A request is counted in the stats
        once per residency (its first lookup after arrival or preemption), so retries of a
        request that could not be allocated do not inflate the hit rate.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if not lazy:
            self.update_hashes(request)
        hits: list[int] = []
        while len(hits) < max_hit_blocks:
            i = len(hits)
            if i == len(hashes):
                if not lazy:
                    break
                # the next blocks, doubling: a walk to the k-th block hashes < 2k + 16 blocks
                self.update_hashes(request, min(2 * i + LOOKUP_BLOCKS, max_hit_blocks))
                if i == len(hashes):
                    break
            block_id = self.pool.lookup(hashes[i])
            if block_id is None or (usable is not None and not usable(block_id)):
                break
            hits.append(block_id)
        if self.drop_last_hit and hits:
            hits.pop()
        num_hit_tokens = len(hits) * self.block_size
        if request.request_id not in self._queried:
            self._queried.add(request.request_id)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_computed_tokens + len(new_computed_blocks)·S + num_new_tokens` tokens.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` (only for a request that
        holds no blocks yet); they are touched (ref++) and come first in the block list. Returns
        the block ids appended to `request.block_ids` (hits, then fresh blocks), or None — with
        nothing changed — when the free queue is too short. Free hit blocks count against the
        free space: touching them takes them out of the free queue.
        """
        hits = list(new_computed_blocks)
        num_new_blocks = self.num_new_blocks(request, num_new_tokens, len(hits))
        if not hits and not num_new_blocks:
            return []  # most decode steps: the request's last block has room
        if hits and request.block_ids:
            raise ValueError(
                f"new_computed_blocks: request {request.request_id!r} already holds blocks"
            )
        num_free_hits = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(hits)
        # ascending: the free queue hands a freed request's blocks back in reverse table order,
        # and a table in descending ids has no two adjacent pages, so a P/D READ into it would
        # post a descriptor per block and tensor (thousands at 128K) where it posts a few
        new_blocks = sorted(self.pool.allocate(num_new_blocks))
        request.block_ids.extend(hits)
        request.block_ids.extend(new_blocks)
        if hits:
            self._num_cached_blocks[request.request_id] = len(hits)
        return hits + new_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int, num_hits: int = 0) -> int:
        """Blocks `allocate_slots` takes from the free queue for these tokens and hits."""
        num_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        return max(cdiv(num_tokens, self.block_size) - len(request.block_ids) - num_hits, 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are now full and computed, so later
        requests (and this one after a preemption) find them."""
        if not self.enable_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return  # most steps: no block filled up
        if request.num_output_placeholders:
            # async scheduling: a computed position may hold a placeholder (its step is in
            # flight): only blocks of known tokens
            num_known = request.num_tokens - request.num_output_placeholders
            num_full = min(num_full, num_known // self.block_size)
            if num_full <= start:
                return
        self.update_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free_blocks_after(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past the first cdiv(num_tokens, S) (speculative decoding:
        slots of rejected drafts and unused lookahead); returns how many blocks it keeps. Such
        blocks hold no computed token, so none of them was registered in the prefix cache."""
        keep = cdiv(num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            assert self._num_cached_blocks.get(request.request_id, 0) <= keep
            freed = request.block_ids[keep:]
            self.pool.free(freed)
            del request.block_ids[keep:]
            if self.on_free is not None:
                self.on_free(freed)
        return len(request.block_ids)

    def free(self, request: Request) -> None:
        """Release every block of the request (ref−−). Cached blocks stay findable until reused."""
        self.pool.free(request.block_ids)
        if self.on_free is not None:
            self.on_free(request.block_ids)
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)
        self._queried.discard(request.request_id)

    def update_hashes(self, request: Request, max_blocks: int | None = None) -> None:
        """The hashes of the request's full blocks of known tokens (a no-op once they are
        there), or of its first `max_blocks` of them: the scheduler hashes a prompt when it
        arrives, so that a long one's hashing is not in the step that admits it (a 128K
        prompt: 2,048 SHA-256 blocks, 4–9 ms); a P/D arrival's once its READs are posted."""
        if not self.enable_caching:
            return
        # Only tokens known on the host: an async step's placeholder is never hashed.
        num_known = request.num_tokens - request.num_output_placeholders
        if max_blocks is not None:
            num_known = min(num_known, max_blocks * self.block_size)
        # Cheap test first: building all_token_ids copies the whole token list.
        if num_known // self.block_size > len(request.block_hashes):
            if num_known <= request.num_prompt_tokens:
                tokens = request.prompt_token_ids
                if num_known < len(tokens):
                    tokens = tokens[:num_known]
            else:
                tokens = request.all_token_ids
                del tokens[num_known:]
            extend_block_hashes(request.block_hashes, tokens, self.block_size,
                                request.cache_salt)

    # ---- invariants -----------------------------------------------------------------------------
    def check_integrity(self, live_requests: Iterable[Request] | None = None,
                        held: Counter[int] | None = None) -> None:
        """Pool invariants; given every live request, also that each block's reference count is
        exactly the number of live requests holding it plus `held` (references of in-flight
        host-tier copies): nothing leaked, nothing over-freed."""
        self.pool.check_integrity()
        if live_requests is None:
            return
        live = list(live_requests)
        holders: Counter[int] = Counter(held or {})
        for req in live:
            if len(set(req.block_ids)) != len(req.block_ids):
                raise AssertionError(f"kv manager: request {req.request_id!r} lists a block twice")
            holders.update(req.block_ids)
        for block_id in range(self.pool.num_blocks):
            if self.pool.ref_count(block_id) != holders[block_id]:
                raise AssertionError(
                    f"kv manager: block {block_id} has ref {self.pool.ref_count(block_id)} but "
                    f"{holders[block_id]} live requests hold it (copy jobs included)"
                )
        by_id = {req.request_id: req for req in live}
        for request_id, n in self._num_cached_blocks.items():
            if request_id not in by_id:
                raise AssertionError(f"kv manager: state kept for ended request {request_id!r}")
            if n > len(by_id[request_id].block_ids):
                raise AssertionError(
                    f"kv manager: {request_id!r} has {n} cached blocks of "
                    f"{len(by_id[request_id].block_ids)}"
                )
        stale = self._queried - by_id.keys()
        if stale:
            raise AssertionError(f"kv manager: lookup state kept for ended {sorted(stale)}")
