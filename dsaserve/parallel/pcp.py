"""Prefill context parallelism: the load-balanced partition of a step's tokens over N ranks.

A prefill of q tokens is cut into 2N chunks of c = ceil(q / 2N) tokens; rank r takes chunks r and
2N−1−r, so every rank gets one cheap (early) and one expensive (late) chunk of the causal triangle:

    N = 2, q = 8:   chunks  | 0 1 | 2 3 | 4 5 | 6 7 |
                    rank    |  0  |  1  |  1  |  0  |

Tokens keep their true positions. A request is *replicated* (every rank computes all its tokens)
when it cannot fill 2N non-empty chunks — decode rows and short prefills — or when the caller asks
(--async-scheduling: rows that continue from the last step's samples, which every rank holds on
the device). The partition is a pure function of the global batch, so every rank computes the
same one without talking.

Each rank's rows are padded to the same length P (rank-invariant), so an all-gather of per-rank rows
gives a rank-major [N·P] layout; `restore_index` maps it back to the global order (a replicated
token is taken from rank 0's copy):

    global      [A B C D E F G]          (A, B: one request, replicated; C..G split)
    gathered    [A B . . | A B . .]  ...  restore_index picks one row per global token
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PcpPartition:
    num_ranks: int
    local_indices: tuple[tuple[int, ...], ...]  # per rank: global token indices, request-grouped
    padded_len: int  # P = max_r len(local_indices[r]); at least 1 so collectives never see 0 rows
    restore_index: torch.Tensor  # [num_tokens] int64 into the gathered [N·P] rows
    replicated: tuple[bool, ...]  # per request

    def local_index_tensor(self, rank: int) -> torch.Tensor:
        return torch.tensor(self.local_indices[rank], dtype=torch.int64)


def is_replicated(num_query_tokens: int, num_ranks: int) -> bool:
    """True when q tokens cannot fill 2N non-empty chunks of ceil(q / 2N) tokens."""
    if num_ranks == 1:
        return True
    c = -(-num_query_tokens // (2 * num_ranks))
    return (2 * num_ranks - 1) * c >= num_query_tokens


def partition(query_lens: list[int], num_ranks: int,
              replicate: Collection[int] = ()) -> PcpPartition:
    """query_lens [R] (tokens each request computes this step, in batch order) → the partition;
    the requests at `replicate` (batch indices) are replicated whatever their length."""
    n = num_ranks
    local: list[list[int]] = [[] for _ in range(n)]
    replicated: list[bool] = []
    start = 0
    for r, q in enumerate(query_lens):
        rep = r in replicate or is_replicated(q, n)
        replicated.append(rep)
        if rep:
            for r in range(n):
                local[r].extend(range(start, start + q))
        else:
            c = -(-q // (2 * n))
            for r in range(n):
                for chunk in (r, 2 * n - 1 - r):
                    lo, hi = start + chunk * c, min(start + (chunk + 1) * c, start + q)
                    local[r].extend(range(lo, hi))
        start += q
    padded = max(1, max(len(x) for x in local))
    restore = torch.full((start,), -1, dtype=torch.int64)
    for r in reversed(range(n)):  # reversed: rank 0's copy of a replicated token wins
        idx = torch.tensor(local[r], dtype=torch.int64)
        restore[idx] = r * padded + torch.arange(len(local[r]), dtype=torch.int64)
    assert start == 0 or bool((restore >= 0).all()), "every token must have a computing rank"
    return PcpPartition(n, tuple(tuple(x) for x in local), padded, restore, tuple(replicated))
