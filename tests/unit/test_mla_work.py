"""The grid of sparse_mla_gluon.py's kernel (mla_work.py): which blocks each CTA runs, and the
host's choice of grid. The kernel computes the same ranges itself (its GPU tests check the
results); here the ranges are checked against the picture: they tile the rows' blocks exactly,
in order, whole rows or one split of one row per CTA, sizes as even as they can be."""

from __future__ import annotations

import pytest

from dsaserve.kernels.triton import mla_work


@pytest.mark.parametrize("rows,nb,num_ctas,splits", [
    (512, 64, 128, 1), (512, 64, 132, 1), (26, 64, 3, 1), (7, 4, 7, 1), (1, 64, 1, 1),
    (32, 64, 128, 4), (6, 64, 18, 3), (5, 4, 20, 4), (3, 7, 15, 5),
])
def test_cta_blocks_tile_the_rows(rows, nb, num_ctas, splits):
    ranges = [mla_work.cta_blocks(c, num_ctas, rows, nb, splits) for c in range(num_ctas)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows * nb
    # in order, no gap, no overlap
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [end - start for start, end in ranges]
    assert all(size > 0 for size in sizes)
    if splits == 1:  # whole rows, as even as possible
        assert all(start % nb == 0 and end % nb == 0 for start, end in ranges)
        assert max(sizes) - min(sizes) <= nb
    else:  # one split of one row each; splits of a row differ by at most one block
        assert num_ctas == rows * splits
        assert all(start // nb == (end - 1) // nb for start, end in ranges)
        assert max(sizes) - min(sizes) <= 1


def test_choose_grid():
    choose = mla_work.choose_grid
    # Many rows: whole rows, the fewest CTAs for the same most rows per CTA.
    assert choose(512, 64, 132) == (128, 1)  # b = 128, s_q = 4: 4 rows each
    assert choose(128, 64, 132) == (128, 1)  # one wave, one row each
    assert choose(151, 64, 132) == (76, 1)  # 2 rows per CTA at most either way
    assert choose(528, 64, 132) == (132, 1)  # 4 rows each
    assert choose(529, 64, 132) == (529, 1)  # past 4 rows per SM: one CTA per row
    assert choose(4096, 64, 132) == (4096, 1)
    # Few rows: splits as for the other kernels (a power of two filling the SMs once, at most 8
    # of top-2048, none under 8 blocks); a caller's count is capped at the blocks (none empty).
    assert choose(32, 64, 132) == (128, 4)
    assert choose(1, 64, 132) == (8, 8)
    assert choose(5, 4, 132) == (5, 1)  # 4 blocks: too few to split
    # What a caller asks for: splits capped at the blocks; CTAs at the rows.
    assert choose(6, 64, 132, splits=3) == (18, 3)
    assert choose(5, 4, 132, splits=16) == (20, 4)
    assert choose(64, 64, 132, splits=1, num_ctas=7) == (7, 1)
    assert choose(16, 64, 132, splits=1, num_ctas=100) == (16, 1)
    assert choose(16, 64, 132, splits=1) == (16, 1)
