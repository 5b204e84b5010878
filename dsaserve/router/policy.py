"""The routing decision: which healthy backend gets a request, given its block hashes.

    prefix       weighted sum of the prefix scorer (approximate or precise index) and the load
                 scorers (scoring.py)
    load         the same sum with the prefix weight at 0
    round-robin  the next healthy backend in turn (the baseline the prefix policy is measured
                 against)

Hashes depend on the backend's block size (B·DCP), so the caller hashes once per distinct size and
passes a map; a backend whose size is unknown yet matches nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dsaserve.router.backends import Backend
from dsaserve.router.config import RouterConfig
from dsaserve.router.prefix_index import ApproximateIndex, PreciseIndex
from dsaserve.router.scoring import Candidate, longest_prefix_match, pick


@dataclass(frozen=True)
class Decision:
    backend: Backend
    matched_blocks: int  # the prefix the chosen backend was scored with
    total_blocks: int
    block_size: int | None


class Picker:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.approximate = ApproximateIndex(config.prefix_index_capacity)
        self.precise = PreciseIndex()
        self._next = 0  # round-robin cursor

    def uses_precise(self, backend: Backend) -> bool:
        return self.config.prefix_index == "precise" and bool(backend.kv_events_endpoints)

    def matched_blocks(self, backend: Backend, hashes: Sequence[bytes]) -> int:
        """Longest consecutive prefix of `hashes` that `backend` holds, from the configured index
        (precise where the backend publishes events, approximate otherwise)."""
        index = self.precise if self.uses_precise(backend) else self.approximate
        return longest_prefix_match(hashes, lambda h: index.holds(backend.url, h))

    def choose(self, backends: Sequence[Backend], hashes_by_size: Mapping[int, Sequence[bytes]],
               exclude: Collection[str] = ()) -> Decision | None:
        """The backend for one request among the healthy ones not in `exclude` (None: none)."""
        candidates = [b for b in backends if b.healthy and b.url not in exclude]
        if not candidates:
            return None
        policy = self.config.policy

        def hashes_of(b: Backend) -> Sequence[bytes]:
            return hashes_by_size.get(b.block_size, ()) if b.block_size else ()

        if policy == "round-robin":
            order = [b for b in backends if b.url not in exclude]
            for _ in range(len(order)):
                b = order[self._next % len(order)]
                self._next += 1
                if b.healthy:
                    return Decision(b, self.matched_blocks(b, hashes_of(b)), len(hashes_of(b)),
                                    b.block_size)
            return None
        weights = self.config.weights
        matched = [self.matched_blocks(b, hashes_of(b)) if policy == "prefix" else 0
                   for b in candidates]
        # One request, one fraction: the denominator is the longest hash list among candidates
        # (equal unless block sizes differ).
        total = max((len(hashes_of(b)) for b in candidates), default=0)
        scored = [Candidate(m, b.load.num_waiting, b.load.kv_usage, b.num_active, b.num_routed)
                  for b, m in zip(candidates, matched, strict=True)]
        i = pick(scored, total, weights if policy == "prefix" else
                 type(weights)(prefix=0.0, queue=weights.queue, kv=weights.kv,
                               active=weights.active))
        chosen = candidates[i]
        return Decision(chosen, matched[i], len(hashes_of(chosen)), chosen.block_size)

    def record(self, decision: Decision, hashes_by_size: Mapping[int, Sequence[bytes]]) -> None:
        """The request went to decision.backend: the approximate index now credits it with the
        request's blocks."""
        b = decision.backend
        if b.block_size and b.block_size in hashes_by_size:
            self.approximate.record(b.url, hashes_by_size[b.block_size])

    def forget(self, backend: Backend) -> None:
        """The backend came back from being down: assume its cache is empty."""
        self.approximate.forget(backend.url)
        self.precise.forget(backend.url)
