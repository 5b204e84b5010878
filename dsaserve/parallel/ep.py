"""Expert parallelism: routed experts sharded over the engine's ranks, tokens dispatched to them.

Dispatch and combine as two collectives over the EP group (every rank of the engine):

    all-gather rows  [W, P, hidden]  → every rank routes every row and runs the experts it holds
    reduce-scatter   [W·P, hidden]   → rank i receives the summed expert output of its own rows

P is the largest row count of any rank (exchanged first, so shapes agree on every rank); padding
rows are zeros and their results are dropped. A token's top-k experts may live on several ranks:
the reduce-scatter adds their contributions.
"""

from __future__ import annotations

import torch

from dsaserve.parallel.groups import Group


def dispatch_combine(x: torch.Tensor, gate, experts, group: Group) -> torch.Tensor:
    """x [n, hidden] this rank's rows → Σ_k w_k·expert_k(x) [n, hidden] fp32."""
    n = x.shape[0]
    sizes = group.all_gather(torch.tensor([n], device=x.device))  # [W, 1]
    padded = int(sizes.max())
    if padded == 0:  # no rank has rows (DP + EP lock-step: every replica idle in this call)
        return x.new_zeros((0, x.shape[1]), dtype=torch.float32)
    rows = x.new_zeros((padded, x.shape[1]))
    rows[:n] = x
    everyone = group.all_gather(rows).flatten(0, 1)  # [W·P, hidden]
    ids, weights = gate(everyone)
    partial = experts(everyone, ids, weights)  # [W·P, hidden] fp32, experts held here only
    return group.reduce_scatter(partial)[:n]
