"""How sparse_mla_gluon.py's kernel shares a batch between its CTAs (the kernel computes the
same on the fly; this is the host's choice of grid and the picture, for the tests).

The work is rows × blocks: row r = token · head_blocks + head block (64 heads), each row's index
row cut into blocks_per_row blocks of BN positions. A CTA takes a contiguous range of blocks in
row order, and streams through it without a break (its gather runs on into the next row while
the current one finishes):

    many rows (rows ≥ SMs): whole rows, the fewest CTAs that keep the most rows per CTA
      rows   |-- r0 --|-- r1 --|-- r2 --|-- r3 --|-- r4 --|-- r5 --|-- r6 --|-- r7 --|
      CTAs   |----- c0 (2 rows) -------|----- c1 --------|----- c2 --------|-- c3 ..
    few rows: each row cut into `splits` pieces of a CTA each, merged afterwards
      rows   |------------ r0 ------------|------------ r1 ------------|
      CTAs   |-- c0 --|-- c1 --|-- c2 --|-- c3 --|-- c4 --|-- c5 --| ...   (splits = 3)

Why not an even share of the blocks with rows cut anywhere (FlashMLA's decode schedule)?
Measured on an H200, FP8 decode b = 128, s_q = 4 (512 rows, 132 SMs): one CTA per row (512
CTAs in waves) 471–475 µs, whole rows (128 CTAs × 4) 463–472 µs, an even share over 132 CTAs
(rows cut at every CTA boundary, pieces merged) 467–472 µs, of which the merge took 7–9 µs and
the pieces' partial stores most of the rest of the 3% of work it saves (docs/kernels.md).
"""

from __future__ import annotations

import triton

from dsaserve.kernels.triton import sparse_mla

# The kernel splits whole rows in 32-bit arithmetic (c · (rows % G) < G² must fit).
MAX_CTAS = 1 << 15
# Beyond this many rows per SM, one CTA per row (see choose_grid).
MAX_WAVES = 4


def cta_blocks(cta: int, num_ctas: int, rows: int, blocks_per_row: int,
               splits: int) -> tuple[int, int]:
    """Global blocks [start, end) of CTA `cta` (row r's blocks are r · blocks_per_row + j):
    whole rows [c · rows // G, (c + 1) · rows // G) with splits = 1, else (G = rows · splits)
    split s = c % splits of row c // splits, blocks [s · nb // splits, (s + 1) · nb // splits)."""
    nb = blocks_per_row
    if splits == 1:
        return cta * rows // num_ctas * nb, (cta + 1) * rows // num_ctas * nb
    row, split = divmod(cta, splits)
    return row * nb + split * nb // splits, row * nb + (split + 1) * nb // splits


def whole_row_ctas(rows: int, num_sms: int) -> int:
    """The fewest CTAs with the most rows per CTA of one CTA per SM (512 rows on 132 SMs: 128
    CTAs of 4 rows)."""
    return triton.cdiv(rows, triton.cdiv(rows, num_sms))


def choose_grid(rows: int, blocks_per_row: int, num_sms: int, splits: int | None = None,
                num_ctas: int | None = None) -> tuple[int, int]:
    """(num_ctas, splits) for `rows` rows of blocks_per_row blocks of 32 index positions.

    splits (None: as for the other kernels, sparse_mla.choose_num_splits: a power of two that
    fills the SMs once, 1 for rows ≥ SMs) is capped at blocks_per_row, so no split is empty;
    with splits > 1 the grid is rows · splits. With whole rows, num_ctas (None: whole_row_ctas;
    one CTA per row past MAX_WAVES rows per SM) is capped at the row count.

    Why one CTA per row for many rows: a CTA's rows are fixed in advance, so rows that take
    longer than others (more L2 misses) are not evened out the way the hardware evens out many
    short CTAs. Measured on an H200, an fp8 prefill of T = 4096 rows: 128 CTAs of 32 rows 1.2%
    faster than one CTA per row with uniform index draws, 4% slower with FlashMLA's (rows that
    hit L2 unevenly); FP8 decode of 512 rows: 2.5–3% faster (docs/kernels.md)."""
    if splits is None:
        splits = sparse_mla.choose_num_splits(rows, triton.cdiv(blocks_per_row, 2), num_sms)
    splits = max(1, min(splits, blocks_per_row))
    if splits > 1:
        return rows * splits, splits
    if num_ctas is None and rows > MAX_WAVES * num_sms:
        num_ctas = rows  # many short CTAs: the hardware's own scheduling balances them
    elif num_ctas is None:
        num_ctas = whole_row_ctas(rows, num_sms)
    return max(1, min(num_ctas, rows, MAX_CTAS)), 1
