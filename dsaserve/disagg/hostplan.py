"""P/D into a HiSparse decode rank with spilling: which received rows go to the host pool and
which to GPU pages (pure functions).

A spilling decode rank keeps three address spaces per request (docs/hisparse.md):

    indexer keys   block id  b        slot = block_ids[p // B]·B + p % B     (always on the GPU)
    MLA, GPU       MLA page  g        slot = mla_pages[p // B]·B + p % B     (−1: spilled)
    MLA, host      host block h       row  = host_blocks[p // B]·B + p % B   (the durable copy)

so a received position p moves its indexer key to the indexer pages, as in any P/D transfer,
and its MLA row to exactly one place: the GPU page when its block has one, else the host pool.
Each row crosses the link once; the runner mirrors the rows that landed in GPU pages (the write
tail, and nothing else for a long request) into the host pool on arrival, as for a prefix hit.

    position      |  cached on D  | received .................................. | last |
    block         |  b0     b1    |  b2     b3     b4     b5     b6    | b7 (tail)       |
    MLA page      |  9      4     |  -      -      -      -      -     | 12              |
    MLA rows →    |  (not moved)  |  host pool (host_blocks[2..6])     | GPU page 12     |
    index keys →  |  (not moved)  |  indexer pages b2 .. b7 (all received positions)     |

The host pool is one more destination `KVLayout` (one rank, the engine's page size, the
request's host window as its table), so `relayout` computes every run (from the pieces where
a destination's positions are one range, as a long request's are: host below its tail, GPU
pages from it); the decode rank of a HiSparse engine has no DCP (refused at start-up), so its
target rank is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsaserve.disagg.relayout import KVLayout, TransferPlan, plan_positions, plan_transfer
from dsaserve.kv.hisparse.mla_pages import SPILLED


@dataclass(frozen=True)
class HostDest:
    """Where a spilling HiSparse decode rank puts one received request's MLA rows."""

    host_blocks: tuple[int, ...]  # the request's host window: host pool blocks, position order
    mla_pages: tuple[int, ...]  # per scheduler block of the request: its MLA page, or SPILLED


@dataclass(frozen=True)
class HiSparsePlan:
    """The three plans of one received request (each over the same source layout)."""

    index: TransferPlan  # indexer keys → indexer pages (block ids), every received position
    gpu: TransferPlan  # MLA rows → GPU MLA pages, the positions whose block has a page
    host: TransferPlan  # MLA rows → the host pool, the positions whose block is spilled

    @property
    def num_rows(self) -> int:
        """Positions received (per cache layer): each in exactly one of gpu / host."""
        return self.index.num_rows


def plan_into_hisparse(src: KVLayout, dst: KVLayout, dest: HostDest, num_cached_on_dst: int,
                       num_tokens: int) -> HiSparsePlan:
    """The copies that move positions [num_cached_on_dst, num_tokens) from `src` into a
    spilling HiSparse rank: `dst` is its indexer layout (block ids, one rank), `dest` its MLA
    pages and host window."""
    if dst.dcp_size != 1:
        raise ValueError(f"a HiSparse decode rank has no DCP (dcp_size {dst.dcp_size})")
    b = dst.block_size
    if len(dest.mla_pages) < len(dst.block_ids):
        raise ValueError(f"mla_pages: {len(dest.mla_pages)} entries for "
                         f"{len(dst.block_ids)} blocks")
    index = plan_transfer(src, dst, num_cached_on_dst, num_tokens)
    pos = torch.arange(num_cached_on_dst, num_tokens, dtype=torch.int64)  # [T]
    pages = torch.tensor(dest.mla_pages, dtype=torch.int64)  # [num_blocks]
    resident = pages[pos // b] != SPILLED if pos.numel() else pos.bool()  # [T]
    gpu = _plan_subset(src, KVLayout(dest.mla_pages, b), pos[resident], num_cached_on_dst,
                       num_tokens)
    host = _plan_subset(src, KVLayout(dest.host_blocks, b), pos[~resident], num_cached_on_dst,
                        num_tokens)
    return HiSparsePlan(index, gpu, host)


def _plan_subset(src: KVLayout, dst: KVLayout, pos: torch.Tensor, start: int,
                 end: int) -> TransferPlan:
    """`relayout.plan_positions` of `pos` [P] (sorted, within [start, end)); where they are one
    range, `plan_transfer`'s of that range (the same runs, from its pieces: a 1M-token
    arrival's host rows are one range)."""
    if pos.numel() and int(pos[-1]) - int(pos[0]) + 1 == pos.numel():
        return replace(plan_transfer(src, dst, int(pos[0]), int(pos[-1]) + 1),
                       start=start, end=end)
    return plan_positions(src, dst, pos, start, end)
