"""Block-FP8 weight maths (kernels/fp8_weights.py): dequantization against the loader's, the
offsets and scale slices of shards that start mid-block, the grouped reference, and the row-tile
map of the grouped kernel. Matrices whose blocks all have distinct scales make a wrong block
index change the result."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dsaserve.kernels import fp8_weights as fw
from dsaserve.kernels.fp8_weights import quantize_blocks
from dsaserve.model.loader import dequantize_fp8_blocks

B = fw.FP8_BLOCK


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix through the checkpoint maker's quantizer: (wq, scale)."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    return quantize_blocks(w)


def _distinct(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wq = 1 everywhere and scale[i, j] = 1 + i·Kb + j: every element is its block's scale."""
    nb, kb = -(-n // B), -(-k // B)
    scale = 1.0 + torch.arange(nb * kb, dtype=torch.float32).view(nb, kb)
    return torch.ones(n, k).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("n,k", [(128, 128), (300, 200), (576, 6144 // 16), (1, 129)])
def test_dequantize_matches_loader(n, k):
    wq, scale = _weight(n, k)
    want = dequantize_fp8_blocks(wq, scale)  # fp32
    assert torch.equal(fw.dequantize(wq, scale, torch.float32), want)
    for dtype in (torch.bfloat16, torch.float16):  # the value rounded once, from fp32
        got = fw.dequantize(wq, scale, dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_dequantize_batched_matches_each_matrix():
    pairs = [_weight(200, 300, seed) for seed in range(3)]
    wq, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    got = fw.dequantize(wq, scale, torch.bfloat16)
    for e, (w, s) in enumerate(pairs):
        assert torch.equal(got[e], dequantize_fp8_blocks(w, s).bfloat16())


@pytest.mark.parametrize("n_off,k_off", [(0, 0), (64, 0), (0, 37), (127, 1)])
def test_dequantize_picks_each_elements_block(n_off, k_off):
    n, k = 300, 260
    _, scale = _distinct(n + n_off, k + k_off)
    wq = torch.ones(n, k).to(torch.float8_e4m3fn)
    got = fw.dequantize(wq, scale, torch.float32, n_off, k_off)
    r = (torch.arange(n) + n_off) // B
    c = (torch.arange(k) + k_off) // B
    assert torch.equal(got, scale[r[:, None], c[None, :]])


@pytest.mark.parametrize("start,stop,size", [
    (192, 384, 512),  # mid-block start (offset 64), ends on a block boundary
    (0, 128, 300),  # one whole block
    (127, 129, 300),  # two rows straddling a boundary
    (250, 300, 300),  # to the partial last block
    (128, 256, 256),  # aligned
])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_scale_dequantizes_like_the_full_matrix(start, stop, size, dim):
    n, k = (size, 200) if dim == 0 else (200, size)
    wq, scale = _weight(n, k)
    _, distinct = _distinct(n, k)
    for s in (scale, distinct):
        sub, off = fw.shard_scale(s, dim, start, stop)
        assert off == start % B and sub.shape[dim] == -(-stop // B) - start // B
        shard = wq.narrow(dim, start, stop - start)
        offs = (off, 0) if dim == 0 else (0, off)
        got = fw.dequantize(shard, sub, torch.float32, *offs)
        want = fw.dequantize(wq, s, torch.float32).narrow(dim, start, stop - start)
        assert torch.equal(got, want)


def test_shard_scale_both_dims():
    """A 2-D shard (rows 70 .. 250, columns 130 .. 390): slice the rows' blocks, then the
    columns' blocks of that."""
    wq, scale = _weight(300, 400)
    rows, n_off = fw.shard_scale(scale, 0, 70, 250)
    both, k_off = fw.shard_scale(rows, 1, 130, 390)
    assert (n_off, k_off) == (70, 2) and both.shape == (2, 3)
    got = fw.dequantize(wq[70:250, 130:390], both, torch.float32, n_off, k_off)
    assert torch.equal(got, dequantize_fp8_blocks(wq, scale)[70:250, 130:390])


def test_shard_scale_rejects_bad_ranges():
    scale = torch.ones(3, 2)
    for dim, start, stop in [(2, 0, 1), (0, 5, 5), (0, -1, 10), (0, 0, 3 * B + 1), (1, 0, 257)]:
        with pytest.raises(ValueError, match="shard_scale"):
            fw.shard_scale(scale, dim, start, stop)


def test_dequantize_rejects_mismatches():
    wq, scale = _weight(200, 300)
    with pytest.raises(ValueError, match="scale shape"):
        fw.dequantize(wq, scale[:1], torch.float32)
    with pytest.raises(ValueError, match="scale shape"):  # 200 rows from 64 in: 3 blocks
        fw.dequantize(wq, scale, torch.float32, n_off=64)
    with pytest.raises(ValueError, match="offsets"):
        fw.dequantize(wq, scale, torch.float32, k_off=B)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fw.dequantize(wq.float(), scale, torch.float32)


def test_linear_reference_is_the_dequantized_linear():
    wq, scale = _weight(130, 260)
    g = _gen(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 260, generator=g).to(dtype)
        want = F.linear(x, dequantize_fp8_blocks(wq, scale).to(dtype))
        got = fw.linear_reference(x, wq, scale)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("counts,tail", [
    ([3, 0, 5, 1], 4),  # an empty expert, rows past the end
    ([0, 0, 7, 0], 0),  # one expert only
    ([0, 0, 0, 0], 6),  # every row held elsewhere
    ([2, 2, 2, 2], 0),
])
def test_grouped_reference_matches_rowwise_loop(counts, tail):
    e, n, k = len(counts), 70, 150
    pairs = [_weight(n, k, seed) for seed in range(e)]
    wq, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    num_rows = sum(counts) + tail
    xs = torch.randn(num_rows, k, generator=_gen(2))
    got = fw.grouped_reference(xs, wq, scale, ends)
    assert got.shape == (num_rows, n) and got.dtype == xs.dtype
    for r in range(num_rows):  # the expert of row r: the first e with r < ends[e]
        expert = int(torch.searchsorted(ends, torch.tensor(r, dtype=torch.int32), right=True))
        want = (torch.zeros(n) if expert == e
                else xs[r] @ dequantize_fp8_blocks(*pairs[expert]).T)
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


def _device_search(ends: list[int], num_rows: int, block_m: int, t: int) -> tuple[int, int, int]:
    """fp8_grouped's kernel's search for tile t, in Python (the same vector formulas)."""
    starts = [0, *ends[:-1]]
    tiles = [-(-(b - a) // block_m) for a, b in zip(starts, ends, strict=True)]
    cum = list(itertools.accumulate(tiles))
    e = sum(c <= t for c in cum)
    if e < len(ends):
        first = starts[e] + (t - cum[e] + tiles[e]) * block_m
        return e, first, min(first + block_m, ends[e])
    first = ends[-1] + (t - cum[-1]) * block_m
    return -1, first, min(first + block_m, num_rows)


@pytest.mark.parametrize("block_m", [1, 2, 3, 4])
def test_grouped_tiles_cover_every_row_once_within_the_grid(block_m):
    """Every routing of up to 7 rows into up to 3 groups: the tiles cover the rows in order,
    each row under its own group (−1 past the last), the grid's row-tile count suffices, and
    the kernel's search finds the same tiles (and nothing past them)."""
    for num_groups, num_rows in itertools.product(range(1, 4), range(0, 8)):
        for ends in itertools.combinations_with_replacement(range(num_rows + 1), num_groups):
            tiles = fw.grouped_tiles(list(ends), num_rows, block_m)
            grid = fw.grouped_row_tiles(num_rows, num_groups, block_m)
            assert len(tiles) <= grid
            rows = [r for _, a, b in tiles for r in range(a, b)]
            assert rows == list(range(num_rows))
            for group, a, b in tiles:
                assert 0 < b - a <= block_m
                owner = next((i for i, end in enumerate(ends) if a < end), -1)
                assert group == owner and (group == -1 or b <= ends[group])
            for t in range(grid):
                found = _device_search(list(ends), num_rows, block_m, t)
                if t < len(tiles):
                    assert found == tiles[t]
                else:
                    assert found[1] >= found[2]  # no rows
