"""W8A8 block-FP8 GEMMs (kernels/triton/fp8_w8a8.py) run by Triton's CPU interpreter against
their PyTorch reference (kernels/fp8_weights.py: quantize_activations, w8a8_reference), and the
reference against the definition it stands for. Skipped when triton is not installed.

What the interpreter cannot do is checked on the GPU (tests/gpu/test_fp8_linear_gpu.py):
- FP8 MMAs: it holds FP8 operands as bytes, so there the kernel multiplies them as fp32 (exact:
  a product of two e4m3 values fits in fp32); the groups on the weight's scale grid, the
  scaling of each group's product and the tiles are the same code;
- Triton's own fp32 → e4m3 conversion (it truncates in the interpreter, −127 → −64): act_quant
  rounds to the e4m3 grid itself first, so its bytes equal the reference's here and there.
Activations are fp16 here (the interpreter's bf16 dot is broken, test_fp8_linear_interp.py).
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import FP8_KERNELS, interpreted

from dsaserve.kernels import fp8_weights as fw
from dsaserve.kernels.fp8_weights import quantize_blocks

B = fw.FP8_BLOCK


@pytest.fixture(scope="module")
def w8():
    yield from interpreted(*FP8_KERNELS[:2])


@pytest.fixture(scope="module")
def fl():
    yield from interpreted(*FP8_KERNELS)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shard(n: int, k: int, n_off: int, k_off: int, seed: int = 0):
    g = _gen(100 + seed)
    w = torch.randn(n + n_off, k + k_off, generator=g) * torch.rand(n + n_off, 1, generator=g)
    wq, scale = quantize_blocks(w)
    return wq[n_off:, k_off:].contiguous(), scale


def _activations(m: int, k: int, dtype=torch.float16) -> torch.Tensor:
    g = _gen(m + k)
    # rows of very different scales, a zero row and a zero group: every scale path
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g))
    x[m // 2] = 0
    x[0, : min(k, 100)] = 0
    return x.to(dtype)


def test_quantize_activations_rounds_each_group_once():
    """Groups on the weight's scale grid (the first 128 − k_off wide): each value's error is
    at most half an e4m3 step of its group's scale; zero groups give zeros, finite scales."""
    k_off = 37
    x = _activations(9, 300, torch.float32)
    xq, xs = fw.quantize_activations(x, k_off)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (9, fw.num_blocks(300, k_off))
    group = (torch.arange(300) + k_off) // B  # [K] each column's group
    back = xq.float() * xs[:, group]
    err = (back - x).abs()
    # 3 mantissa bits: 2^-4 relative for normals; subnormals (below 2^-6 · scale) 2^-10 · scale
    assert (err <= 2.0**-4 * x.abs() + 2.0**-10 * xs[:, group] * (1 + 1e-6)).all()
    for g in range(xs.shape[1]):  # each group's largest value maps to ±448 exactly
        cols = group == g
        amax = x[:, cols].abs().amax(1)
        live = amax > 0
        assert torch.equal(xq[live][:, cols].float().abs().amax(1),
                           torch.full((int(live.sum()),), 448.0))
    assert torch.isfinite(xs).all() and (xq[9 // 2].float() == 0).all()


def test_w8a8_reference_is_the_product_of_the_quantized_values():
    n, k, n_off, k_off = 150, 260, 64, 37
    wq, scale = _shard(n, k, n_off, k_off)
    x = _activations(11, k, torch.float32)
    xq, xs = fw.quantize_activations(x, k_off)
    col_group = (torch.arange(k) + k_off) // B
    row_block = (torch.arange(n) + n_off) // B
    xd = xq.float() * xs[:, col_group]
    wd = wq.float() * scale[row_block][:, col_group]
    want = xd.double() @ wd.double().T
    got = fw.w8a8_reference(x, wq, scale, n_off, k_off)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    # and close to the dequantized model's product: activation rounding only
    exact = fw.linear_reference(x, wq, scale, n_off, k_off)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("m,k,k_off", [(5, 300, 0), (40, 260, 37), (17, 128, 0), (3, 90, 100)])
def test_act_quant_equals_reference(w8, m, k, k_off):
    x = _activations(m, k + 11)[:, 11:]  # rows of a wider buffer
    xq, xs = w8.act_quant(x, k_off)
    want_q, want_s = fw.quantize_activations(x, k_off)
    assert torch.equal(xs, want_s)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))


def test_rounding_to_e4m3_ties_to_even(w8):
    """Every e4m3 value, the midpoints between neighbours (ties: to the even mantissa), and
    points just either side of them, subnormals included."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # [-448 .. 448]
    mid = (grid[1:] + grid[:-1]) / 2
    q = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])])
    x = q.view(-1, 1).repeat(1, 128).to(torch.float16)  # fp16 holds every one of them
    x[:, 0] = 448  # each row's scale 1: the quotients are the values themselves
    xq, xs = w8.act_quant(x)
    assert (xs == 1).all()
    want = x.float().to(torch.float8_e4m3fn)  # PyTorch: one rounding, ties to even
    assert torch.equal(xq.view(torch.uint8), want.view(torch.uint8))


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel and the reference multiply the same FP8 values and scale each group's
    product alike; they differ by fp32 summation order and the final fp16 rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    big = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-10, atol=1e-5 * big)


@pytest.mark.parametrize("m,n,k,n_off,k_off", [
    (1, 200, 300, 0, 0),
    (70, 130, 260, 64, 0),  # a shard of rows from the middle of a block
    (130, 40, 200, 5, 100),  # of columns: the first group 28 wide
    (65, 257, 129, 0, 0),  # partial tiles and groups everywhere
])
def test_w8a8_linear_matches_reference(w8, m, n, k, n_off, k_off):
    wq, scale = _shard(n, k, n_off, k_off)
    x = _activations(m, k)
    got = w8.w8a8_matmul(*fw.quantize_activations(x, k_off), wq, scale, x.dtype, n_off, k_off)
    _assert_close(got, fw.w8a8_reference(x, wq, scale, n_off, k_off))


def test_w8a8_bands_of_m_tiles(w8):
    """Small forced tiles: 10 m tiles in bands of 3 (the last band 1 tile) × 5 n tiles, every
    program id mapped to one (m, n) tile."""
    wq, scale = _shard(80, 200, 0, 0)
    x = _activations(150, 200)
    cfg = w8.W8a8Config(16, 16, group_m=3)
    got = w8.w8a8_matmul(*fw.quantize_activations(x), wq, scale, x.dtype, config=cfg)
    _assert_close(got, fw.w8a8_reference(x, wq, scale))


def test_tiles_fill_the_device(w8):
    assert w8.choose_config(256, 16384, 132) == w8.W8a8Config(64, 128, 4, 4)  # q_b at verify
    assert w8.choose_config(256, 2048, 132).block_n == 64  # q_a: 64 programs at 128 columns
    assert w8.choose_config(256, 576, 132).block_n == 64  # kv_a: nothing fills 132 SMs
    assert w8.fills_device(256, 2048, 132)  # q_a: 128 programs
    assert not w8.fills_device(256, 576, 132)  # kv_a: 36 programs


def test_fp8_linear_takes_w8a8_above_the_threshold(fl):
    """fp16 / bf16 activations from WEIGHT_ONLY_MAX_M + 1 to W8A8_MAX_M rows: W8A8; above, and
    fp32 (test models) at any size: the dequantized product."""
    wq, scale = _shard(300, 200, 5, 100)  # 5 n tiles: the interpreter's 8 SMs filled
    for m in (fl.WEIGHT_ONLY_MAX_M + 1, fl.W8A8_MAX_M):
        x = _activations(m, 200)
        assert torch.equal(fl.fp8_linear(x, wq, scale, 5, 100),
                           fl.fp8_w8a8.w8a8_linear(x, wq, scale, 5, 100))
        x32 = x.float()
        assert torch.equal(fl.fp8_linear(x32, wq, scale, 5, 100),
                           fw.linear_reference(x32, wq, scale, 5, 100))
    x = _activations(fl.W8A8_MAX_M + 1, 200)
    assert torch.equal(fl.fp8_linear(x, wq, scale, 5, 100),
                       fw.linear_reference(x, wq, scale, 5, 100))
    narrow = _shard(40, 200, 5, 100)  # 2 programs at 65 rows: too few for W8A8
    x = _activations(fl.WEIGHT_ONLY_MAX_M + 1, 200)
    assert torch.equal(fl.fp8_linear(x, *narrow, 5, 100), fw.linear_reference(x, *narrow, 5, 100))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_act_quant_outer_scales_are_the_same_scales_group_major(w8):
    """cuBLAS reads 1 × 128 scales group-major: the same values, strides (1, M)."""
    x = _activations(37, 300)
    xq, xs = w8.act_quant(x)
    xq_o, xs_o = w8.act_quant(x, outer_scales=True)
    assert xs_o.shape == xs.shape and xs_o.stride() == (1, 37)
    assert torch.equal(xs_o, xs) and torch.equal(xq_o.view(torch.uint8), xq.view(torch.uint8))
    g_o = w8.act_quant(torch.cat((x, x), dim=1), glu=True, outer_scales=True)[1]
    assert torch.equal(g_o, w8.act_quant(torch.cat((x, x), dim=1), glu=True)[1])


def test_cublas_takes_whole_blocks_on_cuda_only(w8):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert w8.cublas_takes(16384, 2048, 0, 0, cuda) == hasattr(torch.nn.functional, "scaled_mm")
    assert not w8.cublas_takes(16384, 2048, 0, 0, cpu)
    assert not w8.cublas_takes(2752, 6144, 0, 0, cuda)  # N inside a block (fused q_a, kv_a)
    assert not w8.cublas_takes(4096, 2048, 64, 0, cuda)  # a TP shard inside a block
    assert not w8.cublas_takes(4096, 2048, 0, 100, cuda)
    assert not w8.cublas_takes(512, 128, 0, 0, cuda)  # K / 128 not a multiple of 4 (refused)
    assert not w8.cublas_takes(128, 256, 0, 0, cuda)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("glu", [False, True])
def test_w8a8_linear_hands_cublas_group_major_scales(w8, monkeypatch, glu):
    """Where cublas_takes the shape, w8a8_linear quantizes with group-major scales and calls
    block_scaled_mm (stood in for here by the product of the quantized values: a CPU has no
    block-scaled GEMM); the product is the W8A8 reference's."""
    wq, scale = _shard(256, 384, 0, 0)
    x = _activations(67, 2 * 384 if glu else 384)  # padded to 68 rows for cuBLAS
    seen = []

    def product(xq, xs, wq_, scale_, dtype):
        seen.append(xs.stride())
        m = xq.shape[0]
        xf = (xq.float().view(m, -1, B) * xs[:, :, None]).view(m, -1)
        return (xf @ fw.dequantize(wq_, scale_, torch.float32).T).to(dtype)

    monkeypatch.setattr(w8, "cublas_takes", lambda *shape: True)
    monkeypatch.setattr(w8, "block_scaled_mm", product)
    got = w8.w8a8_linear(x, wq, scale, glu=glu)
    assert seen == [(1, 68)] and got.shape == (67, 256) and got.is_contiguous()
    act = x
    if glu:
        gate, up = x.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
    want = fw.w8a8_reference(act, wq, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-9,
                               atol=2.0**-9 * want.float().abs().max().item())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_prefill_rows_take_w8a8_where_cublas_takes_the_shape(fl, monkeypatch, caplog):
    """Above W8A8_MAX_M rows (prefill) fp8_linear takes W8A8 only through cuBLAS's block-scaled
    GEMM (stood in for by the product of the quantized values): where cublas_takes the shape,
    fp16 rows only; a shape cuBLAS refused (its first call on the Triton kernel) goes back to
    the dequantized copy, as do shapes it does not take."""
    w8 = fl.fp8_w8a8
    wq, scale = _shard(256, 384, 0, 0)
    x = _activations(fl.W8A8_MAX_M + 3, 384)
    calls = []

    def product(xq, xs, wq_, scale_, dtype):
        calls.append(xq.shape[0])
        m = xq.shape[0]
        xf = (xq.float().view(m, -1, B) * xs[:, :, None]).view(m, -1)
        return (xf @ fw.dequantize(wq_, scale_, torch.float32).T).to(dtype)

    monkeypatch.setattr(w8, "cublas_takes", lambda n, k, n_off, k_off, device: not n_off)
    monkeypatch.setattr(w8, "block_scaled_mm", product)
    monkeypatch.setattr(w8, "_REFUSED", set())
    assert fl.takes_w8a8(x, 256, 384) and not fl.takes_w8a8(x.float(), 256, 384)
    assert torch.equal(fl.fp8_linear(x, wq, scale), w8.w8a8_linear(x, wq, scale))
    assert calls == [fl.W8A8_MAX_M + 4] * 2
    h = torch.cat((x, x), dim=1)
    assert torch.equal(fl.fp8_glu_linear(h, wq, scale), w8.w8a8_linear(h, wq, scale, glu=True))
    shard = _shard(300, 384, 5, 0)  # starts inside a block: not cuBLAS's
    assert torch.equal(fl.fp8_linear(x, *shard, 5), fw.linear_reference(x, *shard, 5))

    def refuse(*args):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(w8, "block_scaled_mm", refuse)
    wq2, scale2 = _shard(128, 384, 0, 0)  # a shape not tried yet
    with caplog.at_level("WARNING"):
        first = fl.fp8_linear(x, wq2, scale2)  # refused: the Triton W8A8 kernel this once
    assert "refused" in caplog.text
    assert torch.equal(first, w8.w8a8_matmul(*w8.act_quant(x), wq2, scale2, x.dtype))
    assert not fl.takes_w8a8(x, 128, 384)
    assert torch.equal(fl.fp8_linear(x, wq2, scale2), fw.linear_reference(x, wq2, scale2))


def test_a_shape_cublas_refuses_falls_back_to_triton_once(w8, monkeypatch, caplog):
    """A refusal at cuBLAS's checks (an older cuBLAS, another GPU) is warned about once and
    that shape takes the Triton kernel from then on: the same product as forcing it."""
    wq, scale = _shard(256, 384, 0, 0)
    x = _activations(68, 384)
    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(w8, "cublas_takes", lambda *shape: True)
    monkeypatch.setattr(w8, "block_scaled_mm", refuse)
    monkeypatch.setattr(w8, "_REFUSED", set())
    forced = w8.w8a8_linear(x, wq, scale, config=w8.TILES[-1])
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert torch.equal(w8.w8a8_linear(x, wq, scale), forced)
    assert len(calls) == 1 and "refused" in caplog.text


def test_bad_input_is_named(w8):
    wq, scale = _shard(40, 200, 0, 0)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        w8.w8a8_linear(torch.zeros(3, 200), wq, scale)
    with pytest.raises(ValueError, match="K = 100"):
        w8.w8a8_linear(torch.zeros(3, 100, dtype=torch.float16), wq, scale)
    xq, xs = fw.quantize_activations(torch.zeros(3, 200))
    with pytest.raises(ValueError, match="groups disagree"):
        w8.w8a8_matmul(xq, xs[:, :1].contiguous(), wq, scale, torch.float16)


# silu(gate) = gate / (1 + exp(−gate)): exp overflows to inf for gate ≪ 0 and the quotient is
# −0, as it should be; the interpreter's numpy warns about it
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_act_quant_of_the_moe_activation(w8):
    """glu: silu(gate) · up of [M, 2K] rows (each rounded to the dtype, as F.silu and the
    product round) quantized: against the reference of F.silu(gate) * up. The kernel's silu
    (1 / (1 + exp)) may round an fp16 value one step away from F.silu's: then that byte may
    differ by one e4m3 code, never more, and rarely."""
    h = _activations(40, 2 * 260)
    gate, up = h.chunk(2, dim=-1)
    xq, xs = w8.act_quant(h, glu=True)
    want_q, want_s = fw.quantize_activations(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(xs, want_s, rtol=2.0**-10, atol=0)
    codes = (xq.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    assert codes.max() <= 1 and (codes > 0).float().mean() < 0.01
    with pytest.raises(ValueError, match="even width"):
        w8.act_quant(h[:, :-1], glu=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_fp8_glu_linear_forms_the_activation_while_quantizing(fl):
    """An MLP's fused [gate | up] through down: on the W8A8 path act_quant's GLU feeds the GEMM
    (the product of its bytes, which may differ from the unfused ops' by one e4m3 code, rarely);
    elsewhere (decode rows, fp32, a shard starting inside a block) the unfused ops."""
    wq, scale = _shard(300, 260, 0, 0)
    h = _activations(fl.WEIGHT_ONLY_MAX_M + 1, 2 * 260)
    gate, up = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    got = fl.fp8_glu_linear(h, wq, scale)
    assert torch.equal(got, fl.fp8_w8a8.w8a8_matmul(*fl.fp8_w8a8.act_quant(h, glu=True), wq,
                                                    scale, h.dtype))
    torch.testing.assert_close(got.float(), fw.w8a8_reference(act, wq, scale).float(),
                               rtol=0.02, atol=0.02 * got.float().abs().max().item())
    for rows in (h[:8], h.float()):  # the weight-only kernel's rows, fp32: the unfused ops
        g, u = rows.chunk(2, dim=-1)
        assert torch.equal(fl.fp8_glu_linear(rows, wq, scale),
                           fl.fp8_linear(torch.nn.functional.silu(g) * u, wq, scale))
    wq_s, scale_s = _shard(300, 260, 0, 30)
    g, u = h.chunk(2, dim=-1)
    assert torch.equal(fl.fp8_glu_linear(h, wq_s, scale_s, 0, 30),
                       fl.fp8_linear(torch.nn.functional.silu(g) * u, wq_s, scale_s, 0, 30))


@pytest.mark.parametrize("counts,tail", [
    ([3, 0, 70, 1, 0], 13),  # empty experts, a group over two tiles, rows past the end
    ([0, 0, 0, 0, 0], 6),  # every row held elsewhere
    ([65, 64, 0, 1, 7], 0),  # groups one row into a new tile, nothing past the end
])
def test_w8a8_grouped_matches_reference(w8, counts, tail):
    experts = [_shard(130, 200, 0, 0, seed) for seed in range(len(counts))]
    wq = torch.stack([q for q, _ in experts])
    scale = torch.stack([s for _, s in experts])
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _activations(sum(counts) + tail, 200)
    got = w8.w8a8_grouped(*fw.quantize_activations(x), wq, scale, ends, x.dtype)
    _assert_close(got, fw.grouped_reference(x, wq, scale, ends, fw.w8a8_reference))
    assert (got[sum(counts):] == 0).all()
