"""HiSparse's residency step in one launch: a program per region (hot request), the same outputs
as the PyTorch reference `kv/hisparse/residency.resolve`, entry for entry.

The reference is a chain of ~25 ops (sort, searchsorted, scatter, argsort, cumsum, ...) over
[R, W] and [R, S] tensors; at b = 64, top-k 2,048 and S = 4,096 it took 1.2–1.8 ms per layer on an
H100. Here each program keeps its region in registers and a little global scratch:

    1. its rows: scan row_region / row_rank for this region's rows (one per rank < MAX_ROWS)
    2. the union U: the rows' W = MAX_ROWS·K positions, tl.sort'ed as (position + 1) << log W | i,
       so each sorted entry remembers where it came from (row rank, column); duplicates are the
       entries equal to their left neighbour (read back from scratch), pads −1 sort first
    3. hits, slot by slot: a branchless binary search of each slot's token in the sorted union
       (scratch); a hit slot writes its index at the union entry (scratch) and takes stamp := now
    4. victims: tl.sort of (stamp + 1) << log S | slot — empty slots first, then LRU, ties by
       slot; the k-th miss in position order (a cumsum) takes the k-th victim
    5. the table, in place: the hits' stamps, then (after a barrier) the misses' positions
       scattered into their victims
    6. each selected entry's slot: the slot of the first entry of its run of equal positions
       (a running max of run starts), written at its row and column of hot_slots

A program reads and writes its region's row of the runtime's [C, S] tables in place (the row
`regions[g]`), so no gather before the launch or scatter after it: every read of the table
(phase 3) precedes every write. A region given twice (the trash region, for a padded step's
slots that read no hot buffer) has an empty union, so neither program writes its row.

Barriers (tl.debug_barrier) order the scratch writes and reads of one program: a program is one
thread block, and a block barrier makes its global writes visible to its own threads. Nothing is
synchronised with the host and every shape is fixed by the batch, so the launch can be captured.
Both sorts hold next_power_of_2(W) and next_power_of_2(S) int64 keys in registers (W ≤ 8,192 and
S ≤ 16,384 at MTP3's defaults); of the union only each entry's destination in hot_slots stays in
registers across the slot phase, the rest is read back from scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAXKEY = tl.constexpr(2**63 - 1)  # sorts after every real key
_PAST = tl.constexpr(2**62)  # the sorted union's padding: above every position


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _lower_bound(base_ptr, x, LOG: tl.constexpr):
    """Per element of x: the first index i of the sorted [2^LOG] array at base_ptr with
    array[i] ≥ x (2^LOG − 1 when every element is below x). Branchless: LOG gathers."""
    at = tl.zeros(x.shape, dtype=tl.int32)
    for b in tl.static_range(LOG - 1, -1, -1):
        v = tl.load(base_ptr + at + ((1 << b) - 1))
        at = tl.where(v < x, at + (1 << b), at)
    return at


@triton.jit(do_not_specialize=["num_rows"])
def _residency_kernel(
    topk_ptr, stride_topk,  # [T, K] positions (−1 pad), any integer dtype
    row_region_ptr, row_rank_ptr,  # [T] int64
    num_rows,  # T
    tok_ptr, stamp_ptr,  # [C, S] int64 the tables, region regions[g]'s row updated in place
    regions_ptr,  # [R] int64 program g's row of the tables
    now_ptr,  # [] int64 this step's stamp
    hot_ptr,  # [T, K] int64 out, filled with −1 (rows of other regions keep it)
    miss_pos_ptr, miss_slot_ptr,  # [R, W] int64 out
    num_miss_ptr,  # [R] int64 out
    u_ptr, at_ptr,  # [R, WB] int64 scratch: the sorted union; a slot per union entry
    vic_ptr,  # [R, SB] int32 scratch: the victims in order
    K: tl.constexpr, S: tl.constexpr, MAX_ROWS: tl.constexpr, W: tl.constexpr,
    WB: tl.constexpr, WLOG: tl.constexpr, SB: tl.constexpr, SLOG: tl.constexpr,
    TB: tl.constexpr,
):
    g = tl.program_id(0)
    now = tl.load(now_ptr)
    i = tl.arange(0, WB)  # union entry, in row-major (rank, column) order before the sort
    rank_i = i // K
    # 1. this region's row of each rank (−1: none)
    row_i = tl.full((WB,), -1, tl.int32)
    for t0 in range(0, num_rows, TB):
        t = t0 + tl.arange(0, TB)
        inside = t < num_rows
        reg = tl.load(row_region_ptr + t, mask=inside, other=-1)
        rnk = tl.load(row_rank_ptr + t, mask=inside, other=-1)
        for r in tl.static_range(MAX_ROWS):
            found = tl.max(tl.where((reg == g) & (rnk == r), t, -1), axis=0)
            row_i = tl.where(rank_i == r, tl.maximum(row_i, found), row_i)
    # 2. the union, sorted; each key carries its entry index
    live = (i < W) & (row_i >= 0)
    pos = tl.load(topk_ptr + row_i.to(tl.int64) * stride_topk + i % K, mask=live,
                  other=-1).to(tl.int64)
    key = tl.where(i < W, ((pos + 1) << WLOG) | i, _MAXKEY)
    key = tl.sort(key)
    j = i  # from here on: the index in sorted order
    # where the sorted entry goes in hot_slots (−1: padding or no such row); the only union
    # tensor kept in registers across the slot phase, the rest is read back from scratch
    entry = (key & (WB - 1)).to(tl.int32)
    rank_e = entry // K
    row_e = tl.full((WB,), -1, tl.int32)
    for r in tl.static_range(MAX_ROWS):
        row_r = tl.max(tl.where(rank_i == r, row_i, -1), axis=0)
        row_e = tl.where(rank_e == r, row_r, row_e)
    dest = tl.where((j < W) & (row_e >= 0), row_e * K + entry % K, -1)
    u_base = u_ptr + g.to(tl.int64) * WB
    at_base = at_ptr + g.to(tl.int64) * WB
    tl.store(u_base + j, tl.where(j < W, (key >> WLOG) - 1, _PAST))
    tl.store(at_base + j, tl.full((WB,), S, tl.int64))  # S: no hit
    tl.debug_barrier()
    # 3. hits, slot by slot (a token is in the union at most once as a wanted entry)
    s = tl.arange(0, SB)
    in_s = s < S
    s_base = tl.load(regions_ptr + g) * S
    tok = tl.load(tok_ptr + s_base + s, mask=in_s, other=-1)
    stamp = tl.load(stamp_ptr + s_base + s, mask=in_s, other=-1)
    lb = _lower_bound(u_base, tok, WLOG)
    hit_s = in_s & (tok >= 0) & (tl.load(u_base + lb) == tok)
    tl.store(at_base + lb, s.to(tl.int64), mask=hit_s)
    stamp = tl.where(hit_s, now, stamp)
    tl.store(stamp_ptr + s_base + s, stamp, mask=hit_s)  # the table's own row: hits only
    # 4. victims in (stamp, slot) order
    vkey = tl.where(in_s, ((stamp + 1) << SLOG) | s, _MAXKEY)
    vkey = tl.sort(vkey)
    vic_base = vic_ptr + g.to(tl.int64) * SB
    tl.store(vic_base + s, (vkey & (SB - 1)).to(tl.int32))
    tl.debug_barrier()
    u = tl.load(u_base + j)
    first = u != tl.load(u_base + j - 1, mask=j > 0, other=-2)
    wanted = first & (u >= 0) & (j < W)
    hit_slot = tl.load(at_base + j)
    hit = wanted & (hit_slot < S)
    miss = wanted & (hit_slot >= S)
    nth = tl.cumsum(miss.to(tl.int32), axis=0) - 1  # k-th miss → k-th victim
    victim = tl.load(vic_base + tl.minimum(tl.maximum(nth, 0), S - 1), mask=miss,
                     other=S).to(tl.int64)
    tl.store(miss_pos_ptr + g.to(tl.int64) * W + j, tl.where(miss, u, -1), mask=j < W)
    tl.store(miss_slot_ptr + g.to(tl.int64) * W + j, victim, mask=j < W)
    tl.store(num_miss_ptr + g, tl.sum(miss.to(tl.int64), axis=0))
    # 5. the misses into their victims (after the slot-wise copy above)
    tl.store(tok_ptr + s_base + victim, u, mask=miss)
    tl.store(stamp_ptr + s_base + victim, tl.zeros((WB,), tl.int64) + now, mask=miss)
    # 6. every entry takes its run's slot: the run's first entry is the wanted one
    slot = tl.where(hit, hit_slot, victim)
    tl.debug_barrier()  # every hit_slot above is read before the scratch is reused
    tl.store(at_base + j, slot, mask=wanted)
    tl.debug_barrier()
    start = tl.associative_scan(tl.where(first, j, 0), 0, _max)
    run_slot = tl.load(at_base + start)
    tl.store(hot_ptr + dest.to(tl.int64), tl.where(u >= 0, run_slot, -1), mask=dest >= 0)


def _num_warps(width: int) -> int:
    """Threads for the larger sort of `width` int64 keys. Built for sm_90
    (benchmarks/sm90_resources.py): 4,096 keys on 16 warps do not spill (on 8 they take 222
    registers); MTP's 8,192 or 16,384 keys spill 72–688 stack bytes on 16 warps, more on 32
    (64 registers a thread). Not tuned on a GPU yet."""
    return max(4, min(16, width // 256))


def resolve_triton(topk: torch.Tensor, row_region: torch.Tensor, row_rank: torch.Tensor,
                   slot_token: torch.Tensor, slot_stamp: torch.Tensor, stamp: torch.Tensor,
                   max_rows: int, regions: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """As `kv/hisparse/residency.resolve`, in one launch: the fields of its `Residency`
    (hot_slots, miss_pos, miss_slot, slot_token, slot_stamp, num_misses) in order.
    topk [T, K] (−1 pad); row_region, row_rank [T] int64; stamp [] int64 on the same device,
    > every stamp in the tables. Without `regions`, slot_token, slot_stamp [R, S] int64 are
    not modified and the tables returned are new; with regions [R] int64, they are the
    runtime's [C, S] tables, whose rows `regions` are resolved and updated in place (and
    returned, whole). Outputs equal the reference's when the union of a region's rows fits its
    slots (|U| ≤ S, which the configuration guarantees)."""
    num_rows, k = topk.shape
    dev = topk.device
    if regions is None:
        slot_token, slot_stamp = slot_token.clone(), slot_stamp.clone()
        regions = torch.arange(slot_token.shape[0], device=dev)
    if not (slot_token.is_contiguous() and slot_stamp.is_contiguous()):
        raise ValueError("residency: the slot tables must be contiguous (updated in place)")
    num_regions, size = regions.numel(), slot_token.shape[1]
    width = max_rows * k
    wb, sb = triton.next_power_of_2(width), triton.next_power_of_2(size)
    i64 = torch.int64
    hot_slots = torch.full((num_rows, k), -1, dtype=i64, device=dev)
    miss_pos = torch.empty((num_regions, width), dtype=i64, device=dev)
    miss_slot = torch.empty_like(miss_pos)
    num_misses = torch.empty((num_regions,), dtype=i64, device=dev)
    if num_regions == 0:
        return hot_slots, miss_pos, miss_slot, slot_token, slot_stamp, num_misses
    u = torch.empty((num_regions, wb), dtype=i64, device=dev)
    at = torch.empty_like(u)
    vic = torch.empty((num_regions, sb), dtype=torch.int32, device=dev)
    topk = topk if topk.stride(1) == 1 else topk.contiguous()
    _residency_kernel[(num_regions,)](
        topk, topk.stride(0), row_region.contiguous(), row_rank.contiguous(), num_rows,
        slot_token, slot_stamp, regions.contiguous(), stamp.reshape(()).to(i64),
        hot_slots, miss_pos, miss_slot, num_misses, u, at, vic,
        K=k, S=size, MAX_ROWS=max_rows, W=width, WB=wb, WLOG=wb.bit_length() - 1, SB=sb,
        SLOG=sb.bit_length() - 1, TB=min(1024, triton.next_power_of_2(max(num_rows, 1))),
        num_warps=_num_warps(max(wb, sb)))
    return hot_slots, miss_pos, miss_slot, slot_token, slot_stamp, num_misses
