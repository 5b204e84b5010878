"""Which backend holds which prefix-cache blocks: two sources of the same answer.

- ApproximateIndex: the hashes the router itself sent to each backend, LRU-bounded per backend.
  Needs nothing from the engines; wrong after an engine evicts (it still claims the blocks) and
  right only for blocks the engine really cached (prompt blocks it computed).
- PreciseIndex: replays the engines' KV events (BlockStored / BlockRemoved, per replica and
  medium), so it holds exactly what each engine's pool holds, a network hop late.

Both answer `holds(backend, hash)`; scoring.longest_prefix_match turns that into a match length.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable

from dsaserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class ApproximateIndex:
    """Per backend, an LRU set of the block hashes routed there (at most `capacity` each)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[bytes, None]] = defaultdict(OrderedDict)

    def record(self, backend: str, block_hashes: Iterable[bytes]) -> None:
        """The request with these hashes was routed to `backend`: they become its most recent."""
        lru = self._blocks[backend]
        for h in block_hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def holds(self, backend: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(backend, ())

    def num_blocks(self, backend: str) -> int:
        return len(self._blocks.get(backend, ()))

    def forget(self, backend: str) -> None:
        """The backend restarted or was removed: whatever it held is gone."""
        self._blocks.pop(backend, None)


class PreciseIndex:
    """Per backend, the hashes its engine reports as cached, by (replica, medium).

    A backend holds a hash if any of its replicas holds it on any medium: a DP server routes a
    request to one replica by its own load balancing, so the router's view is the union.
    """

    def __init__(self) -> None:
        # backend → (replica, medium) → hashes
        self._blocks: dict[str, dict[tuple[int, str], set[bytes]]] = defaultdict(dict)
        self.num_events = 0

    def apply(self, backend: str, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.num_events += 1
            key = (batch.data_parallel_rank, event.medium)
            blocks = self._blocks[backend].setdefault(key, set())
            if isinstance(event, BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def holds(self, backend: str, block_hash: bytes) -> bool:
        return any(block_hash in s for s in self._blocks.get(backend, {}).values())

    def num_blocks(self, backend: str) -> int:
        return sum(len(s) for s in self._blocks.get(backend, {}).values())

    def forget(self, backend: str) -> None:
        """Events were lost (a sequence gap) or the backend restarted: its view starts over."""
        self._blocks.pop(backend, None)
