"""The row tiles of a grouped GEMM over rows sorted by group (the routed experts' pairs), found on
the device from the groups' ends, so that a launch's grid depends on host sizes only and a CUDA
graph replays with any routing. fp8_weights.grouped_tiles lists the same map on the host; the
grid's size is fp8_weights.grouped_row_tiles."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_rows(ends_ptr, t, P, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tile t's group and rows, found on the device (fp8_weights.grouped_tiles lists the
    same map): group e owns tiles cum[e] − tiles[e] .. cum[e] − 1 (tiles[e] = ⌈rows of e /
    BLOCK_M⌉, cum their running sum); tiles past cum[E − 1] cover the rows past the last
    group, e = E (written 0); tiles past those have no rows (first row ≥ end row = P).
    → (e, first row, end row)."""
    ex = tl.arange(0, E_P2)
    ex_live = ex < E
    ends = tl.load(ends_ptr + ex, mask=ex_live, other=0)  # [E_P2]
    starts = tl.load(ends_ptr + ex - 1, mask=ex_live & (ex > 0), other=0)
    tiles = tl.where(ex_live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)  # [E_P2] tile end of each group
    e = tl.sum((ex_live & (cum <= t)).to(tl.int32), axis=0)  # groups wholly before tile t
    mine = ex == e
    if e < E:
        first_row = (tl.sum(tl.where(mine, starts, 0), axis=0)
                     + (t - tl.sum(tl.where(mine, cum - tiles, 0), axis=0)) * BLOCK_M)
        end_row = tl.sum(tl.where(mine, ends, 0), axis=0)
    else:  # rows past the last group (pairs of experts held elsewhere)
        last = tl.sum(tl.where(ex == E - 1, ends, 0), axis=0)
        first_row = last + (t - tl.sum(tiles, axis=0)) * BLOCK_M
        end_row = P
    return e, first_row, end_row
