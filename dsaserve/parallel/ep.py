"""Expert parallelism: routed experts sharded over the engine's ranks, tokens dispatched to them.

Dispatch and combine as two collectives over the EP group (every rank of the engine):

    all-gather rows  [W, P, hidden]  → every rank routes every row and runs the experts it holds
    reduce-scatter   [W·P, hidden]   → rank i receives the summed expert output of its own rows

P is the largest row count of any rank, so that shapes agree on every rank: exchanged first (an
all-gather of the counts, read on the host), or given by the caller where every rank's count is
known (DP + EP decode steps padded to one size on every replica, engine/dp.py: no host read, so
the dispatch can be captured in a CUDA graph). Padding rows are zeros and their results are
dropped: the gate and the experts work row by row (routing, expert GEMMs, the combine's sum over
a row's experts), so a padding row changes no other row's output.
"""

from __future__ import annotations

import torch

from dsaserve.parallel.groups import Group


def dispatch_combine(x: torch.Tensor, gate, experts, group: Group,
                     rows_per_rank: int | None = None) -> torch.Tensor:
    """x [n, hidden] this rank's rows → Σ_k w_k·expert_k(x) [n, hidden] fp32. `rows_per_rank`:
    P, the same on every rank of the group (n ≤ P); None: exchanged."""
    n = x.shape[0]
    if rows_per_rank is None:
        sizes = group.all_gather(torch.tensor([n], device=x.device))  # [W, 1]
        padded = int(sizes.max())
    else:
        assert n <= rows_per_rank, f"dispatch: {n} rows on a rank given {rows_per_rank}"
        padded = rows_per_rank
    if padded == 0:  # no rank has rows (DP + EP lock-step: every replica idle in this call)
        return x.new_zeros((0, x.shape[1]), dtype=torch.float32)
    rows = x
    if n < padded:
        rows = x.new_zeros((padded, x.shape[1]))
        rows[:n] = x
    everyone = group.all_gather(rows).flatten(0, 1)  # [W·P, hidden]
    ids, weights = gate(everyone)
    partial = experts(everyone, ids, weights)  # [W·P, hidden] fp32, experts held here only
    return group.reduce_scatter(partial)[:n]
