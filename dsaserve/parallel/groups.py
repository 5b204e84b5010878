"""Process groups of one engine, built once at start-up and asked for by name.

Rank layout of an engine with world = PCP × TP (DP replicas are separate engines):

    rank = pcp_rank · TP + tp_rank

    PCP=2, TP=2:   rank 0 (pcp 0, tp 0)  rank 1 (pcp 0, tp 1)
                   rank 2 (pcp 1, tp 0)  rank 3 (pcp 1, tp 1)
    tp groups  {0,1} {2,3}    pcp groups {0,2} {1,3}    ep: every rank

DCP is a view, never extra ranks: the PCP group when PCP > 1 (dcp = pcp), else the TP group (tp =
dcp). Layers receive a `ParallelGroups` and never read environment variables or globals.

DP + EP (`ParallelConfig.ep_spans_replicas`): the replicas' ranks form one process group of
DP × world ranks, replica i's ranks numbered i·world + rank; TP, PCP and DCP groups stay within a
replica and EP spans them all (the experts of every replica's ranks, vLLM's DP + EP layout).
`ParallelGroups.rank` and `world_size` stay the replica's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsaserve.config import ParallelConfig


@dataclass
class Group:
    """One process group as seen from this rank (size 1 groups never communicate)."""

    name: str
    ranks: tuple[int, ...]
    rank_in_group: int
    pg: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, ...] on every rank → [size, n, ...] (rank-major). Shapes must be rank-invariant."""
        if self.size == 1:
            return x[None]
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x.contiguous(), group=self.pg)
        return torch.stack(out)

    def all_gather_async(self, x: torch.Tensor) -> PendingGather:
        """Start an all-gather of x [n, ...]; `.wait()` gives [size, n, ...] (rank-major)."""
        if self.size == 1:
            return PendingGather([x], None)
        out = [torch.empty_like(x) for _ in range(self.size)]
        return PendingGather(out, dist.all_gather(out, x.contiguous(), group=self.pg,
                                                  async_op=True))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.pg)
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [size·n, ...] → this rank's summed slice [n, ...]."""
        if self.size == 1:
            return x
        n = x.shape[0] // self.size
        if x.device.type == "cpu":  # gloo has no reduce_scatter: all-reduce, then slice
            x = x.clone()
            dist.all_reduce(x, group=self.pg)
            return x[self.rank_in_group * n : (self.rank_in_group + 1) * n]
        out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.pg)
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, n, ...] (row i goes to rank i) → [size, n, ...] (row i came from rank i)."""
        if self.size == 1:
            return x
        if x.device.type == "cpu":  # gloo lacks all_to_all: gather everything, keep our column
            return self.all_gather(x)[:, self.rank_in_group]
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.pg)
        return out


class PendingGather:
    def __init__(self, parts: list[torch.Tensor], work) -> None:
        self._parts, self._work = parts, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return torch.stack(self._parts)


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    pcp: Group
    tp: Group
    dcp: Group
    ep: Group
    # The same ranks as `dcp` on a communicator of their own, so that context prefetches (large,
    # asynchronous) do not queue in front of the layer's own collectives.
    dcp_prefetch: Group | None = None

    @staticmethod
    def single() -> ParallelGroups:
        one = Group("single", (0,), 0, None)
        return ParallelGroups(0, 1, one, one, one, one, one)

    @staticmethod
    def build(p: ParallelConfig, rank: int, replica: int = 0) -> ParallelGroups:
        """Call on every rank after dist.init_process_group(world = pcp × tp, or dp × pcp × tp
        where EP spans the replicas: `global_rank`); `rank` is the rank within `replica`."""
        pcp, tp = p.prefill_context_parallel_size, p.tensor_parallel_size
        world = pcp * tp
        replicas = p.data_parallel_size if p.ep_spans_replicas else 1
        me = global_rank(p, rank, replica)
        mine: dict[str, Group] = {}

        def within(base: int) -> dict[str, list[tuple[int, ...]]]:
            return {"tp": [tuple(base + a * tp + b for b in range(tp)) for a in range(pcp)],
                    "pcp": [tuple(base + a * tp + b for a in range(pcp)) for b in range(tp)]}

        # new_group must be called by every rank for every group, in the same order.
        layouts: dict[str, list[tuple[int, ...]]] = {"tp": [], "pcp": []}
        for i in range(replicas):
            for name, groups in within(i * world).items():
                layouts[name] += groups
        layouts["ep"] = [tuple(range(replicas * world))]
        for name, groups in layouts.items():
            for ranks in groups:
                pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
                if me in ranks:
                    mine[name] = Group(name, ranks, ranks.index(me), pg)
        single = Group("dcp", (me,), 0, None)
        dcp, prefetch = single, single
        if p.decode_context_parallel_size > 1:
            dcp = mine["pcp"] if pcp > 1 else mine["tp"]
            for ranks in layouts["pcp" if pcp > 1 else "tp"]:
                pg = dist.new_group(list(ranks))
                if me in ranks:
                    prefetch = Group("dcp_prefetch", ranks, ranks.index(me), pg)
        return ParallelGroups(rank, world, mine["pcp"], mine["tp"], dcp, mine["ep"], prefetch)


def global_rank(p: ParallelConfig, rank: int, replica: int) -> int:
    """Rank `rank` of replica `replica` in the process group its workers join: its own rank
    unless EP spans the replicas (one group of DP × world ranks, replica-major)."""
    return replica * p.world_size + rank if p.ep_spans_replicas else rank


def process_group_size(p: ParallelConfig) -> int:
    """Ranks in the process group a replica's workers join (dist.init_process_group's world)."""
    return p.world_size * (p.data_parallel_size if p.ep_spans_replicas else 1)
