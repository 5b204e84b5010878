"""Scorers (pure): each maps the candidate backends to scores in [0, 1], higher = better, and the
pick is the weighted sum, as llm-d's endpoint picker does (Filter → Score → Pick).

    score(b) = w_prefix·prefix(b) + w_queue·queue(b) + w_kv·kv(b) + w_active·active(b)

    prefix  matched blocks / request blocks: the longest *consecutive* prefix of the request's
            block hashes the backend holds (llm-d's prefix-cache-scorer with prefixLengthWeight 0)
    queue   min-max over the candidates of waiting requests: (max − q) / (max − min), all 1 when
            equal (llm-d's queue-scorer)
    kv      1 − KV-cache usage (llm-d's kv-cache-utilization-scorer); unknown → 0.5
    active  min-max over the candidates of requests this router has in flight there (fresh,
            unlike scraped metrics: it sees a burst the backends have not reported yet); weight 0
            by default, the tie-break below uses the same counts

Stickiness without a session id comes from `prefix`: an agent's next turn re-sends its whole
history, so the replica that served the last turn matches nearly all of it and others match only
what they share. Balance comes from the load terms, which decide whenever prefixes tie (new
sessions) — and win over a weak prefix match when one replica is much busier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# llm-d's documented default profile (Red Hat): prefix 3, queue 2, kv-cache utilisation 2. The
# active-request scorer is off by default: min-max over small in-flight counts swings a whole point
# for a difference of one request, which moved agent sessions off their replica in the replay
# (docs/router.md); in-flight counts still break ties, which is what spreads new sessions.
DEFAULT_PREFIX_WEIGHT = 3.0
DEFAULT_QUEUE_WEIGHT = 2.0
DEFAULT_KV_WEIGHT = 2.0
DEFAULT_ACTIVE_WEIGHT = 0.0


@dataclass(frozen=True)
class ScoringWeights:
    prefix: float = DEFAULT_PREFIX_WEIGHT
    queue: float = DEFAULT_QUEUE_WEIGHT
    kv: float = DEFAULT_KV_WEIGHT
    active: float = DEFAULT_ACTIVE_WEIGHT


@dataclass(frozen=True)
class Candidate:
    """What the picker knows about one healthy backend for one request."""

    matched_blocks: int  # longest consecutive prefix of the request's hashes the backend holds
    num_waiting: float  # scraped vllm:num_requests_waiting (0 when unknown)
    kv_usage: float | None  # scraped vllm:kv_cache_usage_perc in [0, 1]; None when unknown
    num_active: int  # requests this router has in flight on the backend
    num_routed: int = 0  # requests routed there so far (the last tie-break)


def longest_prefix_match(block_hashes: Sequence[bytes], holds: Callable[[bytes], bool]) -> int:
    """How many leading hashes `holds` accepts: the first miss ends the match, because a block is
    only reusable when every block before it is (the hashes chain).

        hashes  h0  h1  h2  h3
        holds   ✓   ✓   ✗   ✓    → 2   (h3 alone is useless: h2 must be recomputed first)
    """
    n = 0
    for h in block_hashes:
        if not holds(h):
            break
        n += 1
    return n


def prefix_score(matched_blocks: int, total_blocks: int) -> float:
    """Matched fraction of the request's blocks; 0 for a request shorter than one block."""
    return matched_blocks / total_blocks if total_blocks > 0 else 0.0


def min_max_scores(values: Sequence[float]) -> list[float]:
    """(max − v) / (max − min) per value: the least loaded gets 1, the most loaded 0; all 1 when
    every value is equal (nothing to prefer)."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


def kv_score(usage: float | None) -> float:
    """1 − usage, clamped; an unknown usage scores the midpoint (neither preferred nor avoided)."""
    if usage is None:
        return 0.5
    return 1.0 - min(max(usage, 0.0), 1.0)


def score_candidates(candidates: Sequence[Candidate], total_blocks: int,
                     weights: ScoringWeights) -> list[float]:
    """The weighted sum for every candidate, in order."""
    queue = min_max_scores([c.num_waiting for c in candidates])
    active = min_max_scores([float(c.num_active) for c in candidates])
    return [weights.prefix * prefix_score(c.matched_blocks, total_blocks)
            + weights.queue * q + weights.kv * kv_score(c.kv_usage) + weights.active * a
            for c, q, a in zip(candidates, queue, active, strict=True)]


def pick(candidates: Sequence[Candidate], total_blocks: int, weights: ScoringWeights) -> int:
    """Index of the best candidate; ties go to fewer in flight, then fewer routed, then the lowest
    index (deterministic, and it spreads a cold start evenly). Raises ValueError when empty."""
    if not candidates:
        raise ValueError("pick: no candidates")
    scores = score_candidates(candidates, total_blocks, weights)
    # Scores within 1e-9 are ties (float sums of the same terms in another order).
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s >= best - 1e-9]
    return min(tied, key=lambda i: (candidates[i].num_active, candidates[i].num_routed, i))
