"""The residency step: which hot-buffer slot holds each row the indexer selected, and which rows
must be fetched first. `resolve` is the pure, batched PyTorch reference (no host sync: no
`.item()`, no data-dependent shapes); `resolve_step` dispatches it: on CUDA one Triton launch
with the same outputs, entry for entry (`kernels/triton/residency.py`), on the CPU the reference
(what CI runs; the tests' entry), as `fetch.fetch_misses` dispatches the fetch. `resolve_tables`,
what the runtime calls, resolves rows of the runtime's whole tables and updates them in place
(on CUDA inside the launch: no gather of the regions' rows before it, no scatter after).

One hot buffer ("region") per request, S slots, each slot holding one token's MLA row:

    slot_token [G, S]  token position held by each slot (−1: empty)
    slot_stamp [G, S]  step stamp of its last use (−1: empty; stamps grow every call)

A step's query rows of one request select top-k positions each; their union U is resolved:

    U sorted, duplicates masked  ──►  hit: the slot already holding it, stamp := now
                                 └─►  miss: the next victim, victims taken in order of
                                      (stamp, slot) ascending (empty slots first, then LRU)

Misses are assigned to victims in ascending position order. Because the stamps of this step's
hits are the largest, victims never evict a row this step needs as long as |U| ≤ S, which the
configuration guarantees (S ≥ query rows × top-k). Index S of a region is a trash slot: masked
writes go there instead of being filtered out (which would need a data-dependent shape).

The stamp is a device tensor ([] int64, the runtime adds 1 after each call), so a step keeps no
host state per layer and the kernel path captures into a graph as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Residency:
    """The outcome of one residency step over R regions (the step's hot requests)."""

    hot_slots: torch.Tensor  # [T, K] int64 slot in its request's region (−1: pad or not hot)
    miss_pos: torch.Tensor  # [R, W] int64 token position to fetch (−1: no fetch)
    miss_slot: torch.Tensor  # [R, W] int64 slot to fill (S = the trash slot: no fetch)
    slot_token: torch.Tensor  # [R, S] int64 the regions' tables after the step
    slot_stamp: torch.Tensor  # [R, S] int64
    num_misses: torch.Tensor  # [R] int64 rows fetched per region (a device count, not synced)


def union_positions(topk: torch.Tensor, row_region: torch.Tensor, row_rank: torch.Tensor,
                    num_regions: int, max_rows: int) -> torch.Tensor:
    """topk [T, K] positions (−1 pad), row_region [T] (−1: row not hot), row_rank [T] (the row's
    index among its request's rows, < max_rows for hot rows) → [R, max_rows·K] every hot row's
    selection laid side by side per region, −1 padded (duplicates kept)."""
    t, k = topk.shape
    width = max_rows * k
    out = torch.full((num_regions + 1, width), -1, dtype=torch.int64, device=topk.device)
    hot = row_region >= 0
    region = torch.where(hot, row_region, num_regions)  # not hot → trash row
    # a prefill chunk's rows (not hot) rank past max_rows: they all land in column 0 of the trash
    rank = torch.where(hot, row_rank, 0)
    col = rank[:, None] * k + torch.arange(k, device=topk.device)  # [T, K]
    out[region[:, None].expand(t, k), col] = topk.long()
    return out[:num_regions]


def resolve(topk: torch.Tensor, row_region: torch.Tensor, row_rank: torch.Tensor,
            slot_token: torch.Tensor, slot_stamp: torch.Tensor, stamp: torch.Tensor | int,
            max_rows: int) -> Residency:
    """One residency step (the reference).

    topk [T, K] request-local positions (−1 pad); row_region [T] index into the R regions given
    (−1: the row reads the paged cache); row_rank [T] < max_rows; slot_token / slot_stamp [R, S]
    the regions' tables (not modified); stamp [] int64 on the device (or an int) > every stamp
    in slot_stamp.
    """
    num_regions, size = slot_token.shape
    dev = topk.device
    union = union_positions(topk, row_region, row_rank, num_regions, max_rows)  # [R, W]
    # 1. the union: sorted, each position once
    union, _ = union.sort(dim=1)
    first = torch.ones_like(union, dtype=torch.bool)
    first[:, 1:] = union[:, 1:] != union[:, :-1]
    wanted = first & (union >= 0)  # [R, W]
    # 2. hits: binary search in each region's sorted table
    held, held_slot = slot_token.sort(dim=1)  # [R, S]
    at = torch.searchsorted(held, union).clamp(max=size - 1)  # [R, W]
    hit = wanted & (held.gather(1, at) == union)
    miss = wanted & ~hit
    trash = torch.full_like(union, size)
    # 3. hits are touched (stamp := now); the trash column absorbs masked writes
    tokens = torch.cat([slot_token, torch.full((num_regions, 1), -1, dtype=torch.int64,
                                                device=dev)], dim=1)  # [R, S+1]
    stamps = torch.cat([slot_stamp, torch.full((num_regions, 1), -1, dtype=torch.int64,
                                               device=dev)], dim=1)
    now = torch.zeros_like(union) + stamp  # [R, W] (a device stamp: no sync)
    stamps.scatter_(1, torch.where(hit, held_slot.gather(1, at), trash), now)
    # 4. victims in (stamp, slot) order: empty slots, then least recently used
    order_key = stamps[:, :size] * (size + 1) + torch.arange(size, device=dev)
    victims = order_key.argsort(dim=1)  # [R, S]
    rank = (miss.long().cumsum(dim=1) - 1).clamp(0, size - 1)  # k-th miss → k-th victim
    miss_slot = torch.where(miss, victims.gather(1, rank), trash)  # [R, W]
    tokens.scatter_(1, miss_slot, union)
    stamps.scatter_(1, miss_slot, now)
    tokens, stamps = tokens[:, :size], stamps[:, :size]
    # 5. each selected row's slot: search the updated tables per query row
    new_held, new_slot = tokens.sort(dim=1)
    region = row_region.clamp(min=0)
    row_held = new_held[region]  # [T, S]
    at_row = torch.searchsorted(row_held, topk.long()).clamp(max=size - 1)  # [T, K]
    slots = new_slot[region].gather(1, at_row)
    hot = (topk >= 0) & (row_region >= 0)[:, None]
    hot_slots = torch.where(hot, slots, -1)
    return Residency(hot_slots=hot_slots, miss_pos=torch.where(miss, union, -1),
                     miss_slot=miss_slot, slot_token=tokens, slot_stamp=stamps,
                     num_misses=miss.sum(dim=1))


def resolve_step(topk: torch.Tensor, row_region: torch.Tensor, row_rank: torch.Tensor,
                 slot_token: torch.Tensor, slot_stamp: torch.Tensor, stamp: torch.Tensor,
                 max_rows: int) -> Residency:
    """As `resolve`; on CUDA the one-launch Triton kernel (stamp must then be a device tensor)."""
    if topk.is_cuda:
        from dsaserve.kernels.triton.residency import resolve_triton  # triton only where CUDA is

        return Residency(*resolve_triton(topk, row_region, row_rank, slot_token, slot_stamp,
                                         stamp, max_rows))
    return resolve(topk, row_region, row_rank, slot_token, slot_stamp, stamp, max_rows)


def resolve_tables(topk: torch.Tensor, row_region: torch.Tensor, row_rank: torch.Tensor,
                   slot_token: torch.Tensor, slot_stamp: torch.Tensor, regions: torch.Tensor,
                   stamp: torch.Tensor, max_rows: int) -> Residency:
    """As `resolve_step` over the rows `regions` [R] of the tables slot_token / slot_stamp
    [C, S], which it updates in place; the Residency's slot_token / slot_stamp are those whole
    tables. A region given twice must resolve an empty union (a padded step's trash region).
    On CUDA the kernel reads and writes the rows in place; on the CPU the reference, then a
    scatter of its rows."""
    if topk.is_cuda:
        from dsaserve.kernels.triton.residency import resolve_triton  # triton only where CUDA is

        return Residency(*resolve_triton(topk, row_region, row_rank, slot_token, slot_stamp,
                                         stamp, max_rows, regions=regions))
    res = resolve(topk, row_region, row_rank, slot_token[regions], slot_stamp[regions], stamp,
                  max_rows)
    slot_token[regions] = res.slot_token
    slot_stamp[regions] = res.slot_stamp
    return Residency(hot_slots=res.hot_slots, miss_pos=res.miss_pos, miss_slot=res.miss_slot,
                     slot_token=slot_token, slot_stamp=slot_stamp, num_misses=res.num_misses)
