"""The block pool: reference-counted KV blocks, an LRU free queue and the prefix-cache hash map.

    state of a block     ref   in free queue   may hold a hash
    in use               ≥ 1   no              yes (findable: a prefix hit touches it, ref++)
    free, cached         0     yes             yes (findable until allocation reuses it)
    free, empty          0     yes             no

Allocation pops the free queue's head (least recently freed) and evicts that block's hash, if any.
Freeing appends to the tail. Invariants (check_integrity): free + in use = total; ref > 0 exactly
for blocks outside the free queue; the hash map and the per-block hashes agree.

`events` (a KVEventSink, a no-op unless KV events are enabled) hears every hash that becomes
findable (stored) and every hash that allocation evicts (removed: one call per allocation, its
hashes in free-queue order, as many single allocations would report them one by one): a router
replays them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from dsaserve.kv.events import NULL_SINK, KVEventSink


class OutOfBlocksError(RuntimeError):
    """`allocate` was asked for more blocks than are free; callers check `num_free_blocks` first."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool,
                 events: KVEventSink = NULL_SINK) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events  # set before the engine steps (kv.events.attach_kv_event_publishers)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash → block id
        # Keys in LRU order (head = evicted next); an OrderedDict gives O(1) removal on touch.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Told of every block whose hash goes (allocation reuses it, or `uncache`): HiSparse
        # gives back the host rows it kept for a spilled cached block (kv/hisparse/mla_pages.py)
        self.on_evict: Callable[[int], None] | None = None

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by a hash, in use or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash`, in use or free; None if not cached."""
        return self._cached.get(block_hash)

    # ---- paired verbs: allocate / free, touch / free --------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (ref 0 → 1), evicting their hashes:
        the same blocks, order, events and state as `n` calls of `allocate(1)`.

        Raises OutOfBlocksError when fewer than `n` are free (nothing is taken then).
        """
        free = self._free
        if n > len(free):
            raise OutOfBlocksError(f"allocate: need {n} blocks, only {len(free)} free")
        # In bulk (a P/D READ's 2,048 blocks at 128K, each evicting a cached one, took ~2 ms on
        # an H200's host one at a time): the head's ids read at once, each unlinked by a `del`
        # (no popitem call per block), the hashes evicted and reported in one pass.
        block_ids = list(islice(free, max(n, 0)))
        for block_id in block_ids:
            del free[block_id]
        self._evict_all(block_ids)
        ref = self._ref
        for block_id in block_ids:
            ref[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more reference on each block (a prefix hit); a free one leaves the free queue."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each of a request's blocks (given in table order).

        Blocks reaching ref 0 go to the free queue's tail in *reverse* table order, so a request's
        tail blocks are evicted before its head blocks: the head (a shared prefix) is the part
        most likely to be hit again.
        """
        for block_id in block_ids:  # check first: a bad call changes nothing
            if self._ref[block_id] <= 0:
                raise ValueError(f"free: block {block_id} is already free")
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    # ---- prefix cache ---------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Make an in-use, full, computed block findable by `block_hash`.

        Returns False (and changes nothing) when caching is disabled or another block already
        holds the same content under that hash; re-caching a block under its own hash is a no-op.
        """
        if not self.enable_caching:
            return False
        if self._ref[block_id] <= 0:
            raise ValueError(f"cache_block: block {block_id} is free; only in-use ones are cached")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"cache_block: block {block_id} already holds another hash")
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        self.events.stored([block_hash])
        return True

    def uncache(self, block_id: int) -> None:
        """Make the block unfindable (its contents are going away: HiSparse spilled its MLA
        page); a block without a hash is left as it is."""
        self._evict_all((block_id,))

    def _evict_all(self, block_ids: Sequence[int]) -> None:
        """Drop the hashes of those of `block_ids` that hold one, in order: one `removed`
        event for all of them (the hashes in that order), then `on_evict` per block."""
        if not self._cached:
            return  # nothing is findable (caching off, or a cold pool): nothing to evict
        hashes, cached = self._hash, self._cached
        evicted = [block_id for block_id in block_ids if hashes[block_id] is not None]
        if not evicted:
            return
        removed = []
        for block_id in evicted:
            block_hash = hashes[block_id]
            del cached[block_hash]
            hashes[block_id] = None
            removed.append(block_hash)
        self.events.removed(removed)
        if self.on_evict is not None:
            for block_id in evicted:
                self.on_evict(block_id)

    # ---- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first violated invariant."""
        in_use = sum(1 for r in self._ref if r > 0)
        if in_use + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"block pool: {len(self._free)} free + {in_use} in use != {self.num_blocks} total"
            )
        for block_id, ref in enumerate(self._ref):
            if ref < 0:
                raise AssertionError(f"block pool: block {block_id} has ref {ref} < 0")
            if (ref == 0) != (block_id in self._free):
                where = "in" if block_id in self._free else "not in"
                raise AssertionError(
                    f"block pool: block {block_id} has ref {ref} but is {where} the free queue"
                )
        for block_hash, block_id in self._cached.items():
            if self._hash[block_id] != block_hash:
                raise AssertionError(
                    f"block pool: hash map names block {block_id}, which holds another hash"
                )
        num_hashed = sum(1 for h in self._hash if h is not None)
        if num_hashed != len(self._cached):
            raise AssertionError(
                f"block pool: {num_hashed} blocks hold a hash but the map has {len(self._cached)}"
            )
        if not self.enable_caching and self._cached:
            raise AssertionError("block pool: caching is disabled but hashes are registered")
