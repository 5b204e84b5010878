"""The FP8-weight GEMMs (kernels/triton/fp8_linear.py) run by Triton's CPU interpreter against
the PyTorch reference (kernels/fp8_weights.py), on small irregular shapes: N and K not multiples
of 128 or of the tiles, shards starting mid-block, split K, grouped rows with empty experts and
rows past the last group. Skipped when triton is not installed.

Activations are fp32 and fp16 here: the interpreter's tl.dot multiplies bf16 operands as their
integer bit patterns (triton 3.6 stores bf16 as uint16 and matmuls the raw arrays), with or
without an accumulator; tests/gpu/test_fp8_linear_gpu.py covers bf16. fp16 does go through the
kernel's rounding of each weight to the activation dtype (numpy rounds to nearest even).

Tolerances, from the output magnitude: the kernel and the reference compute with the same
weight values and accumulate in fp32, so they differ by the fp32 summation order (≈ 1e-6 of
the output's scale) and, in fp16, by the final rounding of the two fp32 sums (≤ one fp16 step,
2^-10 relative): rtol one step of the dtype, atol a fraction of the largest output.

Like tests/unit/test_triton_interpret.py, triton is imported in a fixture (with
TRITON_INTERPRET=1, so that its own helpers are interpreted), never at collection.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interp import FP8_KERNELS, interpreted

from dsaserve.kernels import fp8_weights as fw
from dsaserve.kernels.fp8_weights import quantize_blocks

B = fw.FP8_BLOCK


@pytest.fixture(scope="module")
def fl():
    yield from interpreted(*FP8_KERNELS)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(100 + seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    return quantize_blocks(w)  # (wq [n, k] e4m3, scale [⌈n/128⌉, ⌈k/128⌉])


def _shard(n: int, k: int, n_off: int, k_off: int, seed: int = 0):
    """An [n, k] shard starting n_off rows and k_off columns into its first scale blocks."""
    wq, scale = _weight(n + n_off, k + k_off, seed)
    return wq[n_off:, k_off:].contiguous(), scale


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    step = {torch.float32: 2.0**-20, torch.float16: 2.0**-10}[want.dtype]
    big = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=max(step, 1e-5) * big)


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,n_off,k_off", [
    (1, 200, 300, 0, 0),
    (5, 130, 260, 64, 0),  # a shard of rows from the middle of a block
    (64, 70, 150, 0, 37),  # of columns: k tiles straddle two scale blocks
    (130, 40, 200, 5, 100),  # above WEIGHT_ONLY_MAX_M, too narrow for W8A8: dequantized
])
def test_fp8_linear_matches_reference(fl, dtype, m, n, k, n_off, k_off):
    """The weight-only paths (fp16 / bf16 in W8A8: tests/unit/test_fp8_w8a8_interp.py)."""
    wq, scale = _shard(n, k, n_off, k_off)
    x = torch.randn(m, k, generator=_gen(m)).to(dtype)
    _assert_close(fl.fp8_linear(x, wq, scale, n_off, k_off),
                  fw.linear_reference(x, wq, scale, n_off, k_off))


def test_kernel_above_the_dequantize_threshold(fl):
    """Above WEIGHT_ONLY_MAX_M the default is the dequantized matmul; the kernel still runs
    there with an explicit config (the benchmark's sweep), over several m tiles."""
    m = fl.WEIGHT_ONLY_MAX_M + 66
    wq, scale = _shard(40, 200, 5, 100)
    x = torch.randn(m, 200, generator=_gen(m))
    want = fw.linear_reference(x, wq, scale, 5, 100)
    _assert_close(fl.fp8_linear(x, wq, scale, 5, 100, config=fl.choose_config(m, 40, 200)), want)
    _assert_close(fl.fp8_linear(x, wq, scale, 5, 100), want)


def test_weight_values_are_rounded_once(fl):
    """One-hot rows pick single weight columns: each output is one product, the weight value
    itself, so it equals dtype(fp32(wq) · scale) bit for bit — in fp16, a rounding of the fp32
    product (scales of the checkpoint maker: not powers of two), straddled blocks included."""
    wq, scale = _shard(150, 200, 64, 37)
    cols = torch.randperm(200, generator=_gen())[:20]
    for dtype in DTYPES:
        x = torch.zeros(20, 200, dtype=dtype)
        x[torch.arange(20), cols] = 1
        want = fw.dequantize(wq, scale, dtype, 64, 37)[:, cols].T  # [20, N]
        assert torch.equal(fl.fp8_linear(x, wq, scale, 64, 37), want)


def test_fp8_linear_split_k_and_strided_rows(fl):
    """K split on its own (few n tiles; the interpreter counts 8 SMs), and forced into three
    splits, over rows of a wider buffer (a slice of a fused projection's output)."""
    n, k = 40, 2200
    wq, scale = _weight(n, k)
    x = torch.randn(3, k + 9, generator=_gen())[:, 9:]
    cfg = fl.choose_config(3, n, k)
    assert fl.choose_split_k(3, n, k, cfg, num_sms=8) == 4
    want = fw.linear_reference(x.contiguous(), wq, scale)
    _assert_close(fl.fp8_linear(x, wq, scale), want)
    forced = fl.Fp8LinearConfig(16, 32, 64, split_k=3)
    once = fl.fp8_linear(x, wq, scale, config=forced)
    _assert_close(once, want)
    # each tile's last split summed the partials and reset its counter: the next call's
    # last split is found again, and sums in the same order
    assert not fl._tile_counters(x.device, 1).any()
    assert torch.equal(fl.fp8_linear(x, wq, scale, config=forced), once)


def test_split_k_counters_outgrown_are_kept(fl, monkeypatch):
    """A grid larger than the counters replaces them, but the old buffer stays alive: a CUDA
    graph captured before replays with its address, which must not become another tensor's."""
    device = torch.device("cpu")
    monkeypatch.setattr(fl, "_COUNTERS", {})
    monkeypatch.setattr(fl, "_OUTGROWN", [])
    small = fl._tile_counters(device, 10)
    assert small.numel() == 4096 and fl._tile_counters(device, 4096) is small
    big = fl._tile_counters(device, 5000)
    assert big.numel() == 5000 and not big.any()
    assert len(fl._OUTGROWN) == 1 and fl._OUTGROWN[0] is small
    assert fl._tile_counters(device, 100) is big


def test_split_k_choice(fl):
    cfg = fl.Fp8LinearConfig(16, 64)
    # enough n tiles for two programs per SM: no split
    assert fl.choose_split_k(1, 2 * 132 * 64, 2048, cfg, num_sms=132) == 1
    assert fl.choose_split_k(1, 2 * 132 * 64 - 64, 2048, cfg, num_sms=132) == 2
    # q_a-like (32 n tiles): ~2 programs per SM (9 splits → 8 without an empty one), ≥ 4 k
    # tiles per split; 2 MiB of partials at M = 64 stay in L2
    assert fl.choose_split_k(1, 2048, 6144, cfg, num_sms=132) == 8
    assert fl.choose_split_k(64, 2048, 6144, fl.Fp8LinearConfig(64, 64), num_sms=132) == 8
    # the same for every M of the bucket (one compiled kernel)
    assert {fl.choose_split_k(m, 2048, 6144, cfg, num_sms=132) for m in range(1, 17)} == {8}
    assert fl.choose_split_k(1, 576, 512, cfg, num_sms=132) == 1  # 4 k tiles: one split
    # partials beyond both caps: 1/8 of the weight bytes (a 64-row tile over K = 2048 allows
    # none) and L2_PARTIAL_BYTES (8 MiB: one split of 64 rows × 32K columns)
    wide = fl.L2_PARTIAL_BYTES // (4 * 64)  # columns
    assert fl.choose_split_k(64, wide // 2, 2048, fl.Fp8LinearConfig(64, 64), num_sms=1024) == 2
    assert fl.choose_split_k(64, wide, 2048, fl.Fp8LinearConfig(64, 64), num_sms=1024) == 1
    assert fl.choose_split_k(16, 576, 6144, cfg, num_sms=132) == 12  # 4 k tiles each
    # prefill buckets never split (their m tiles vary with M)
    assert fl.choose_split_k(100, 576, 6144, fl.choose_config(100, 576, 6144), 132) == 1
    for m, n, k in [(1, 576, 6144), (16, 2048, 6144), (7, 100, 1000)]:
        splits = fl.choose_split_k(m, n, k, cfg, num_sms=132)
        k_tiles = -(-k // cfg.block_k)
        per = -(-k_tiles // splits)
        assert splits >= 1 and per >= fl.MIN_K_TILES_PER_SPLIT or splits == 1
        assert -(-k_tiles // per) == splits  # no empty split


def test_fp8_dequantize_is_exact(fl):
    wq, scale = _shard(150, 200, 64, 37)
    for dtype in DTYPES:
        got = fl.fp8_dequantize(wq, scale, dtype, 64, 37)
        assert torch.equal(got, fw.dequantize(wq, scale, dtype, 64, 37))
    stacked = [_weight(130, 140, seed) for seed in range(3)]
    wq3, s3 = torch.stack([p[0] for p in stacked]), torch.stack([p[1] for p in stacked])
    out = torch.full(wq3.shape, float("nan"), dtype=torch.float16)
    assert fl.fp8_dequantize(wq3, s3, torch.float16, out=out) is out
    assert torch.equal(out, fw.dequantize(wq3, s3, torch.float16))


def _experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [_weight(n, k, seed) for seed in range(e)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("counts,tail", [
    ([3, 0, 20, 1, 0], 13),  # empty experts, a group over two tiles, rows past the end
    ([0, 0, 0, 0, 0], 6),  # every row held elsewhere
    ([40, 0, 0, 0, 7], 0),  # P not a multiple of the tile, nothing past the end
    ([17, 1, 1, 33, 1], 1),  # every run one row into a new tile: the grid's last tile used
])
def test_fp8_grouped_matches_reference(fl, dtype, counts, tail):
    wq, scale = _experts(len(counts), 150, 200)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    p = sum(counts) + tail
    xs = torch.randn(p, 200, generator=_gen(p)).to(dtype)
    out = torch.full((p, 150), float("nan"), dtype=dtype)  # every element must be written
    got = fl.fp8_grouped(xs, wq, scale, ends, out=out)
    assert got is out
    _assert_close(got, fw.grouped_reference(xs, wq, scale, ends))
    assert (got[sum(counts):] == 0).all()


def test_fp8_grouped_tiles_and_one_expert(fl):
    """Forced 16-row tiles over 37 rows of a single expert (three tiles, the last partial),
    and the default tile for 5 pairs per expert on average."""
    wq, scale = _experts(1, 70, 130)
    xs = torch.randn(37, 130, generator=_gen())
    ends = torch.tensor([37], dtype=torch.int32)
    cfg = fl.Fp8LinearConfig(16, 32)
    _assert_close(fl.fp8_grouped(xs, wq, scale, ends, config=cfg),
                  fw.grouped_reference(xs, wq, scale, ends))
    assert fl.choose_grouped_config(64 * 8, 4096, 6144, 32).block_m == 32  # decode: 16 / expert
    assert fl.choose_grouped_config(16384 * 8, 4096, 6144, 32).block_m == 128  # prefill


def _dense_grouped_reference(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
                             glu: bool) -> torch.Tensor:
    """grouped_reference on unquantized experts w [E, W, K] (xs's dtype); with glu, F.silu(gate)
    · up of its two halves, each rounded to the dtype as moe_compute's unfused path does."""
    out = torch.zeros(xs.shape[0], w.shape[1], dtype=xs.dtype)  # [P, W]
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = F.linear(xs[start:end], w[e])
        start = max(start, end)
    if not glu:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("counts,tail", [
    ([3, 0, 20, 1, 0], 13),  # empty experts, a group over two tiles, rows past the end
    ([0, 0, 0, 0, 0], 6),  # every row held elsewhere
    ([1, 0, 0, 1, 0], 0),  # decode: one row per active expert, P not a multiple of the tile
])
def test_grouped_linear_unquantized_matches_reference(fl, dtype, glu, counts, tail):
    """The bf16-experts form (no scales; fp32 and fp16 here, see the module docstring) over
    the same irregular groups as the FP8 form, plain and with silu(gate) · up fused."""
    e, n, k = len(counts), 48, 72
    w = (torch.randn(e, 2 * n if glu else n, k, generator=_gen(1)) / k**0.5).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    p = sum(counts) + tail
    xs = torch.randn(p, k, generator=_gen(p)).to(dtype)
    out = torch.full((p, n), float("nan"), dtype=dtype)  # every element must be written
    got = fl.grouped_linear(xs, w, ends, glu=glu, out=out)
    assert got is out
    want = _dense_grouped_reference(xs, w, ends, glu)
    if glu and dtype == torch.float16:  # silu through another exp: within an fp16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-9, atol=1e-3)
    else:
        _assert_close(got, want)
    assert (got[sum(counts):] == 0).all()


def test_grouped_linear_tiles_and_fp8_glu(fl):
    """Forced narrow tiles (16 columns, three k tiles of 32, 16-row tiles over a 37-row
    group) on unquantized experts, and silu(gate) · up fused on FP8 experts (up's scale rows
    start mid-matrix), against the unfused FP8 reference."""
    counts = [37, 0, 2]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(41, 80, generator=_gen())
    w = torch.randn(3, 40, 80, generator=_gen(2)) / 9
    cfg = fl.Fp8LinearConfig(16, 16, 32)
    _assert_close(fl.grouped_linear(xs, w, ends, config=cfg),
                  _dense_grouped_reference(xs, w, ends, glu=False))
    wq, scale = _experts(3, 2 * 130, 80)  # gate rows 0..129, up rows 130..259
    gate, up = fw.grouped_reference(xs, wq, scale, ends).chunk(2, dim=-1)
    _assert_close(fl.fp8_grouped(xs, wq, scale, ends, glu=True), F.silu(gate) * up)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-form", "fp8"])
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
def test_grouped_split_k_matches_reference_and_repeats(fl, fp8, glu):
    """The K range split over three programs per tile (seven k tiles of 32: 3 + 3 + 1), each
    tile's last split summing the partials: the reference's result, over empty experts, a
    group over two row tiles and rows past the last group; a second call (the tile counters
    reset by the first) gives the same bits."""
    counts, tail = [3, 0, 20, 1, 0], 5
    e, n, k = len(counts), 40, 200
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    p = sum(counts) + tail
    xs = torch.randn(p, k, generator=_gen(p)) / k**0.5  # gates of order 1: no exp overflow
    cfg = fl.Fp8LinearConfig(16, 16, 32, split_k=3)
    if fp8:
        wq, scale = _experts(e, 2 * n if glu else n, k)
        got = fl.fp8_grouped(xs, wq, scale, ends, config=cfg, glu=glu)
        again = fl.fp8_grouped(xs, wq, scale, ends, config=cfg, glu=glu)
        want = fw.grouped_reference(xs, wq, scale, ends)
        if glu:
            gate, up = want.chunk(2, dim=-1)
            want = F.silu(gate) * up
    else:
        w = torch.randn(e, 2 * n if glu else n, k, generator=_gen(1)) / k**0.5
        got = fl.grouped_linear(xs, w, ends, glu=glu, config=cfg)
        again = fl.grouped_linear(xs, w, ends, glu=glu, config=cfg)
        want = _dense_grouped_reference(xs, w, ends, glu)
    _assert_close(got, want)
    assert torch.equal(got, again)
    assert (got[sum(counts):] == 0).all()
    assert not fl._tile_counters(xs.device, 1).any()  # every tile's counter back at zero


def test_grouped_split_choice(fl):
    """Decode-sized groups split K for about GROUPED_PROGRAMS_PER_SM streaming programs per
    SM: GLM-5.3's experts at b = 1 (2 pairs over 8 experts, 132 SMs): w13 + silu's 2 × 64 n
    tiles → 5 splits of its 48 k tiles, w2's 2 × 192 → 2; at b = 64 (16 per expert) 3; none
    above 16 pairs per expert, and never under MIN_K_TILES_PER_SPLIT k tiles a split."""
    w13 = fl.choose_grouped_config(2, 2048, 6144, 8)
    assert fl.choose_grouped_split(2, 2048, 6144, 8, w13, 132) == 5
    w2 = fl.choose_grouped_config(2, 6144, 2048, 8)
    assert fl.choose_grouped_split(2, 6144, 2048, 8, w2, 132) == 2
    b64 = fl.choose_grouped_config(128, 2048, 6144, 8)
    assert fl.choose_grouped_split(128, 2048, 6144, 8, b64, 132) == 3  # b = 64: 8 × 32 tiles
    verify = fl.choose_grouped_config(512, 2048, 6144, 8)
    assert fl.choose_grouped_split(512, 2048, 6144, 8, verify, 132) == 1
    assert fl.choose_grouped_split(2, 2048, 256, 8, w13, 132) == 1  # 2 k tiles


def test_grouped_config_choice(fl):
    """Experts at decode (≤ 8 rows per expert): narrow n tiles and deeper pipelining (FP8 one
    stage deeper); larger groups keep their tiles."""
    bf16 = fl.choose_grouped_config(2, 2048, 6144, 8, weight_bytes=2)
    assert (bf16.block_m, bf16.block_n) == (16, 32)
    assert fl.choose_grouped_config(64, 6144, 2048, 8, weight_bytes=2).block_n == 32
    assert fl.choose_grouped_config(2, 2048, 6144, 8) == fl.Fp8LinearConfig(16, 32, 128, 4, 6)
    assert fl.choose_grouped_config(128, 2048, 6144, 8) == fl.Fp8LinearConfig(32, 64)
    # 64 rows: tiles whose 4-stage pipeline fits an SM's shared memory (bf16) and whose
    # accumulators fit its registers (FP8; benchmarks/sm90_resources.py --only moe checks both)
    for weight_bytes in (1, 2):
        wide = fl.choose_grouped_config(512, 6144, 2048, 8, weight_bytes=weight_bytes)
        assert wide.block_m == 64 and wide.block_n * wide.block_k <= 64 * 64


def test_arguments_are_checked(fl):
    wq, scale = _weight(200, 300)
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match="scale shape"):
        fl.fp8_linear(x, wq, scale, n_off=100)
    with pytest.raises(ValueError, match="K = 299"):
        fl.fp8_linear(torch.randn(2, 299), wq, scale)
    with pytest.raises(ValueError, match="unit last stride"):
        fl.fp8_linear(x.t().contiguous().t(), wq, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fl.fp8_linear(x, wq.float(), scale)
    w3, s3 = wq[None], scale[None]
    with pytest.raises(ValueError, match="ends"):
        fl.fp8_grouped(x, w3, s3, torch.tensor([2]))  # int64 ends
    with pytest.raises(ValueError, match="contiguous w"):
        fl.grouped_linear(x, w3.float().half(), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="N even"):
        fl.grouped_linear(x, torch.randn(1, 3, 300), torch.tensor([2], dtype=torch.int32),
                          glu=True)
    with pytest.raises(ValueError, match="block_k"):
        fl.Fp8LinearConfig(16, 64, 256)


@pytest.mark.parametrize("tokens,total", [(2, 4), (160, 4), (160, 16)],
                         ids=["decode-fused", "larger-unfused", "ep-fused"])
def test_fp8_experts_path_matches_dequantized(fl, tokens, total):
    """moe_compute.grouped_fp8_experts on block-aligned FP8 experts (I = 128) through the
    interpreted kernel: at decode sizes (≤ TRITON_GROUPED_MAX_MEAN_ROWS pairs per held expert,
    moe_compute.held_pairs) the activation is fused into the first projection, above it the
    first projection's halves are activated apart; both give the looped reference on the same
    experts dequantized (fp32, top 2; 4 experts held of `total`: with 16, EP, 320 pairs of
    which the 4 held take ~80, fused, where 320 over 4 would not be)."""
    from dsaserve.model import moe_compute
    from dsaserve.model.fp8 import BlockRange, Fp8Experts

    e, hidden, inter, top = 4, 64, B, 2
    g = _gen(7)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(total, generator=g)[:top] for _ in range(tokens)])
    weights = torch.rand(tokens, top, generator=g)
    halves = [quantize_blocks(w13[i, h * inter:(h + 1) * inter]) for i in range(e)
              for h in (0, 1)]
    down = [quantize_blocks(w2[i]) for i in range(e)]
    experts = Fp8Experts(
        torch.stack([torch.cat((halves[2 * i][0], halves[2 * i + 1][0])) for i in range(e)]),
        torch.stack([q for q, _ in down]),
        torch.stack([torch.cat((halves[2 * i][1], halves[2 * i + 1][1])) for i in range(e)]),
        torch.stack([s for _, s in down]), BlockRange(0, inter))
    assert experts.aligned
    held = moe_compute.held_pairs(tokens * top, e, total)
    assert moe_compute.triton_grouped(held, e) == (tokens == 2 or total > e)
    got = moe_compute.grouped_fp8_experts(x, experts, ids, weights, 0, held_all=total == e,
                                          num_experts=total)
    want = moe_compute.looped_experts(x, experts.dequantized(x.dtype), ids, weights, 0)
    _assert_close(got, want)
    if tokens == 160 and total == e:
        # fp16 at 16–64 pairs per expert: W8A8 (each token quantized once, its bytes gathered
        # per pair) against the products of the quantized values, per expert
        from dsaserve.kernels import fp8_weights as fw

        x16 = x[:64].half()
        assert moe_compute.w8a8_experts(128, e, x16.dtype)
        got = moe_compute.grouped_fp8_experts(x16, experts, ids[:64], weights[:64], 0,
                                              held_all=True, num_experts=e)
        want = torch.zeros(64, hidden)
        for t in range(64):
            for j in range(top):
                i = int(ids[t, j])
                h = fw.w8a8_reference(x16[t:t + 1], experts.w13[i], experts.s13[i])
                act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                y = fw.w8a8_reference(act, experts.w2[i], experts.s2[i])
                want[t] += weights[t, j] * y[0].float()
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
