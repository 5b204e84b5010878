"""The FP8-weight GEMMs (kernels/triton/fp8_linear.py, fp8_w8a8.py) on the GPU at GLM-5.3 shapes,
against the PyTorch references (kernels/fp8_weights.py: cuBLAS on the dequantized weight; where
fp8_linear.takes_w8a8 — above WEIGHT_ONLY_MAX_M rows of bf16 / fp16, up to W8A8_MAX_M where the
Triton kernel fills the device and above it where cuBLAS's block-scaled GEMM takes the shape —
the W8A8 product of the quantized activations).

Tolerances, from the output magnitude: both sides compute with the same weight values
(dtype(fp32(wq) · scale), checked bit for bit below) and accumulate in fp32, so they differ by
the summation order (≈ 2^-20 of the output's scale, the tensor cores' fp32 accumulation
included) and by the final rounding of two nearby fp32 sums to the activation dtype (at most
one step: 2^-7 relative in bf16): rtol one step of the dtype, atol 2^-10 of the largest
|output| for the elements near 0. A wrong scale block or a lost k tile moves outputs by
O(1) relative, far outside. W8A8 against its reference: the same FP8 values and scales, the
FP8 MMAs' own accumulation of each 128-column group (below fp32, far below the bf16 step).

Run on the device machine: `pytest -m gpu tests/gpu/test_fp8_linear_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsaserve.kernels import fp8_weights as fw
from dsaserve.model.moe_compute import sorted_pairs
from dsaserve.model.presets import GLM_5_3

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine the interpreter tests need to be the
    # first to import it.
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from dsaserve.kernels.triton import fp8_linear as fl  # noqa: E402

DEV = "cuda"
_C = GLM_5_3
_HEADS = _C["num_attention_heads"]
# (name, N, K) of GLM-5.3's FP8 projections (one GPU, no TP)
SHAPES = [
    ("q_a", _C["q_lora_rank"], _C["hidden_size"]),
    ("q_b", _HEADS * (_C["qk_nope_head_dim"] + _C["qk_rope_head_dim"]), _C["q_lora_rank"]),
    ("kv_a", _C["kv_lora_rank"] + _C["qk_rope_head_dim"], _C["hidden_size"]),  # 576: 4.5 blocks
    ("o_proj", _C["hidden_size"], _HEADS * _C["v_head_dim"]),
    ("wk", _C["index_head_dim"], _C["hidden_size"]),
    ("shared_gate_up", 2 * _C["moe_intermediate_size"], _C["hidden_size"]),
    ("shared_down", _C["hidden_size"], _C["moe_intermediate_size"]),
]
SHAPE_IDS = [s[0] for s in SHAPES]


def _weight(n: int, k: int, g: torch.Generator, batch: tuple[int, ...] = ()):
    """Random e4m3 bytes (finite, both signs, subnormals included) and scales spread over four
    octaves, so that neighbouring blocks differ."""
    wq = (torch.randn(*batch, n, k, generator=g, device=DEV) * 64).clamp(-448, 448)
    wq = wq.to(torch.float8_e4m3fn)
    nb, kb = fw.num_blocks(n), fw.num_blocks(k)
    scale = torch.exp2(torch.rand(*batch, nb, kb, generator=g, device=DEV) * 4 - 14)
    return wq, scale


def _want(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
          k_off: int = 0) -> torch.Tensor:
    """What fp8_linear computes: W8A8 where it takes it (bf16 / fp16 between the thresholds
    where the Triton kernel fills the device, above them where cuBLAS takes the shape), else
    the product with the dequantized weight."""
    if fl.takes_w8a8(x, wq.shape[0], wq.shape[1], n_off, k_off):
        return fw.w8a8_reference(x, wq, scale, n_off, k_off)
    return fw.linear_reference(x, wq, scale, n_off, k_off)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}
    big = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=step[want.dtype],
                               atol=2.0**-10 * big)


@pytest.mark.parametrize("m", [1, 16, 64, 256, 1001, 4096])
@pytest.mark.parametrize("name,n,k", SHAPES, ids=SHAPE_IDS)
def test_fp8_linear_matches_reference(g, name, n, k, m):
    wq, scale = _weight(n, k, g)
    x = torch.randn(m, k, generator=g, device=DEV).bfloat16()
    _assert_close(fl.fp8_linear(x, wq, scale), _want(x, wq, scale))


@pytest.mark.parametrize("m,k_off", [(300, 0), (4096, 100)])
def test_act_quant_bytes_equal_reference(g, m, k_off):
    """The GPU's rounding to e4m3 is the reference's (round to nearest even, saturating
    quotients clamped first); the scales are IEEE quotients on both sides."""
    from dsaserve.kernels.triton import fp8_w8a8

    x = torch.randn(m, 3000, generator=g, device=DEV).bfloat16()
    x[0] = 0
    x[1, :500] *= 1e-6  # subnormal quotients
    xq, xs = fp8_w8a8.act_quant(x, k_off)
    want_q, want_s = fw.quantize_activations(x, k_off)
    assert torch.equal(xs, want_s)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 300])
def test_fp8_linear_other_dtypes(g, dtype, m):
    wq, scale = _weight(576, 6144, g)
    x = torch.randn(m, 6144, generator=g, device=DEV).to(dtype)
    _assert_close(fl.fp8_linear(x, wq, scale), _want(x, wq, scale))


@pytest.mark.parametrize("m", [1, 64, 4096])
def test_fp8_linear_tp_shard(g, m):
    """A tensor-parallel shard starting mid-block: rows 192 .. 192 + 1000 of q_a and columns
    100 .. 100 + 3000 (n_off 64, k_off 100), against the same rows of the full product."""
    wq, scale = _weight(2048, 6144, g)
    s, n_off = fw.shard_scale(scale, 0, 192, 1192)
    s, k_off = fw.shard_scale(s, 1, 100, 3100)
    shard = wq[192:1192, 100:3100].contiguous()
    x = torch.randn(m, 3000, generator=g, device=DEV).bfloat16()
    want = _want(x, shard, s.contiguous(), n_off, k_off)
    _assert_close(fl.fp8_linear(x, shard, s.contiguous(), n_off, k_off), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weight_values_bit_exact(g, dtype):
    """One-hot rows pick single weight columns: each output is one product, the weight value
    itself, so it must equal dtype(fp32(wq) · scale) bit for bit (a truncating cast or a scale
    of the wrong block shows here even where the tolerance above would hide it)."""
    n, k = 576, 1000
    wq, scale = _weight(n, k, g)
    cols = torch.randperm(k, generator=g, device=DEV)[:64]
    x = torch.zeros(64, k, device=DEV, dtype=dtype)
    x[torch.arange(64, device=DEV), cols] = 1
    want = fw.dequantize(wq, scale, dtype)[:, cols].T  # [64, N]
    assert torch.equal(fl.fp8_linear(x, wq, scale), want)
    for split in (1, 3):  # the split path sums exact partials: exact too
        cfg = fl.Fp8LinearConfig(64, 64, split_k=split)
        assert torch.equal(fl.fp8_linear(x[:5], wq, scale, config=cfg), want[:5])
    assert torch.equal(fl.fp8_dequantize(wq, scale, dtype), fw.dequantize(wq, scale, dtype))


@pytest.mark.parametrize("p,e", [(64 * 8, 32), (4096 * 8, 32)], ids=["decode", "prefill"])
@pytest.mark.parametrize("proj", ["w13", "w2"])
def test_fp8_grouped_matches_reference(g, p, e, proj):
    """Routed experts of one EP8 rank (32 of 256): the pairs of experts held elsewhere past the
    last group."""
    h, inter = _C["hidden_size"], _C["moe_intermediate_size"]
    n, k = (2 * inter, h) if proj == "w13" else (h, inter)
    wq, scale = _weight(n, k, g, batch=(e,))
    ids = torch.randint(0, 8 * e, (p // 8, 8), generator=g, device=DEV)
    weights = torch.rand(p // 8, 8, generator=g, device=DEV)
    token_of, _, ends = sorted_pairs(ids, weights, first=e, count=e)
    xs = torch.randn(p // 8, k, generator=g, device=DEV).bfloat16()[token_of]
    got = fl.fp8_grouped(xs, wq, scale, ends)
    want = fw.grouped_reference(xs, wq, scale, ends)
    _assert_close(got, want)
    assert (got[int(ends[-1]):] == 0).all()


@pytest.mark.parametrize("tokens", [4, 64, 2048, 8192], ids=["b4", "decode", "w8a8", "prefill"])
def test_moe_fp8_experts_match_their_dequantized_weights(g, tokens):
    """model/moe_compute.py's grouped path on FP8 experts aligned to the block grid (GLM-5.3's
    I = 2048): both FP8 grouped products, SiLU between (fused into the first at 4 and 64
    tokens: the 32 held experts take ~4 and ~64 of the 32 and 512 pairs, moe_compute.held_pairs),
    the routing weights, the experts held elsewhere (EP8 rank 1) adding nothing — against
    grouped_experts on the dequantized weights, within bf16 rounding of the intermediate. At
    2048 tokens (64 pairs per held expert) the path is W8A8: against the same sum of the W8A8
    references (_w8a8_moe_reference)."""
    from dsaserve.model import moe_compute
    from dsaserve.model.fp8 import BlockRange, Fp8Experts

    h, inter, e = _C["hidden_size"], _C["moe_intermediate_size"], 32
    w13, s13 = _weight(2 * inter, h, g, batch=(e,))
    w2, s2 = _weight(h, inter, g, batch=(e,))
    experts = Fp8Experts(w13, w2, s13, s2, BlockRange(0, inter))
    assert experts.aligned
    x = (torch.randn(tokens, h, generator=g, device=DEV) * 0.1).bfloat16()
    ids = torch.randint(0, 8 * e, (tokens, 8), generator=g, device=DEV)
    weights = torch.rand(tokens, 8, generator=g, device=DEV)
    got = moe_compute.routed_experts(x, experts, ids, weights, first=e, num_experts=8 * e)
    held = moe_compute.held_pairs(ids.numel(), e, 8 * e)
    assert moe_compute.w8a8_experts(held, e, x.dtype) == (tokens == 2048)
    if tokens == 2048:
        want = _w8a8_moe_reference(x, experts, ids, weights, first=e)
    else:
        d13, d2 = experts.dequantized(torch.bfloat16)
        want = moe_compute.grouped_experts(x, d13, d2, ids, weights, first=e)
    big = want.abs().max().item()
    if tokens != 2048:
        torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-8 * big)
        return
    # W8A8: the kernel's bf16 intermediate and the reference's differ by a rounding now and
    # then, and so may one e4m3 code of silu(gate) · up (a step of 2^-3 of that element): a
    # few outputs move by more than the bound above (519 of 12.6M on an H100, by ≤ 2.6× it).
    # A wrong group, scale or tile moves most of them, by O(1).
    close = torch.isclose(got, want, rtol=2.0**-6, atol=2.0**-8 * big)
    assert close.float().mean() > 0.999
    assert (got - want).abs().max() <= 2.0**-5 * big


def _w8a8_moe_reference(x: torch.Tensor, experts, ids: torch.Tensor, weights: torch.Tensor,
                        first: int) -> torch.Tensor:
    """The routed experts in W8A8 from the PyTorch references: each projection through
    fp8_weights.grouped_reference with w8a8_reference, F.silu(gate) * up between, the same
    combine."""
    from dsaserve.model import moe_compute

    token_of, pos, ends = moe_compute.pair_layout(ids, first, experts.num_experts, False)
    h13 = fw.grouped_reference(x[token_of], experts.w13, experts.s13, ends, fw.w8a8_reference)
    gate, up = h13.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    y = fw.grouped_reference(act, experts.w2, experts.s2, ends, fw.w8a8_reference)
    return moe_compute.combine(y, pos, weights, ends, False, None)


@pytest.mark.parametrize("glu", [False, True], ids=["w13", "w13+act"])
def test_fp8_grouped_split_k_at_b1(g, glu):
    """b = 1 of the benchmark model's experts (8, top 2): two tiles' rows, so the K range is
    split (fp8_linear.choose_grouped_split); the reference's result, and a second call (the
    tile counters reset by the first) gives the same bits."""
    e = 8
    h, inter = _C["hidden_size"], _C["moe_intermediate_size"]
    wq, scale = _weight(2 * inter, h, g, batch=(e,))
    ids = torch.tensor([[1, 5]], device=DEV)
    token_of, _, ends = sorted_pairs(ids, torch.rand(1, 2, generator=g, device=DEV), first=0,
                                     count=e)
    xs = torch.randn(1, h, generator=g, device=DEV).bfloat16()[token_of]
    n = inter if glu else 2 * inter
    cfg = fl.choose_grouped_config(2, n, h, e)
    assert fl.choose_grouped_split(2, n, h, e, cfg, fl.fp8_w8a8.device_sms(xs.device)) > 1
    got = fl.fp8_grouped(xs, wq, scale, ends, glu=glu)
    want = fw.grouped_reference(xs, wq, scale, ends)
    if glu:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    _assert_close(got, want)
    assert torch.equal(got, fl.fp8_grouped(xs, wq, scale, ends, glu=glu))


@pytest.mark.parametrize("e,tokens,k_top", [(32, 64, 8), (8, 1, 2)], ids=["decode", "b1"])
def test_fp8_grouped_replays_in_a_cuda_graph(g, e, tokens, k_top):
    """Captured once with one routing, replayed with others written into the same inputs:
    the grid does not depend on the routing and `ends` is never read on the host (b1: the K
    range split, the split-K counters reset by every replay)."""
    h, inter = _C["hidden_size"], _C["moe_intermediate_size"]
    wq, scale = _weight(2 * inter, h, g, batch=(e,))
    x = torch.randn(tokens, h, generator=g, device=DEV).bfloat16()
    ids = torch.randint(0, 8 * e, (tokens, k_top), generator=g, device=DEV)
    weights = torch.rand(tokens, k_top, generator=g, device=DEV)

    def step():
        token_of, _, ends = sorted_pairs(ids, weights, first=e, count=e)
        return fl.fp8_grouped(x[token_of], wq, scale, ends), token_of, ends

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, token_of, ends = step()
    routings = [torch.randint(0, 8 * e, ids.shape, generator=g, device=DEV),
                torch.randint(e, 2 * e, ids.shape, generator=g, device=DEV),  # all local
                torch.randint(2 * e, 8 * e, ids.shape, generator=g, device=DEV),  # none local
                torch.full(ids.shape, e + 3, device=DEV)]  # one expert takes every pair
    for new in routings:
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = fw.grouped_reference(x[token_of], wq, scale, ends)
        _assert_close(out, want)
        eager, _, _ = step()
        assert torch.equal(out, eager)  # the same launch: the same sums


def test_fp8_linear_replays_in_a_cuda_graph(g):
    """A decode projection with split K (its fp32 partials allocated inside the capture, its
    tiles' counters at the eager call before), replayed: the counters reset by each call."""
    wq, scale = _weight(2048, 6144, g)  # q_a: 32 n tiles, split
    x = torch.randn(1, 6144, generator=g, device=DEV).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fl.fp8_linear(x, wq, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fl.fp8_linear(x, wq, scale)
    for _ in range(2):
        x.copy_(torch.randn(1, 6144, generator=g, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fl.fp8_linear(x, wq, scale))
        _assert_close(out, fw.linear_reference(x, wq, scale))


@pytest.mark.parametrize("tokens", [1, 4, 64], ids=["b1", "mtp3_b1", "b64"])
def test_bf16_grouped_matches_grouped_mm(g, tokens):
    """grouped_linear on bf16 experts (GLM-5.3-shaped: 8 experts, top 2), both projections and
    the fused silu(gate) · up, against torch._grouped_mm and the unfused activation (bf16
    rounding of the intermediates), rows past the last group 0; and moe_compute's grouped
    path through it (decode sizes) against torch._grouped_mm's."""
    from dsaserve.model import moe_compute

    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90")
    h, inter, e = _C["hidden_size"], _C["moe_intermediate_size"], 8
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=DEV) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g, device=DEV) / inter**0.5).bfloat16()
    ids = torch.randint(0, 2 * e, (tokens, 2), generator=g, device=DEV)  # half held here
    weights = torch.rand(tokens, 2, generator=g, device=DEV)
    token_of, _, ends = sorted_pairs(ids, weights, first=0, count=e)
    x = torch.randn(tokens, h, generator=g, device=DEV).bfloat16()
    xs = x[token_of]
    live = int(ends[-1])
    ref13 = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    got13 = fl.grouped_linear(xs, w13, ends)
    _assert_close(got13[:live], ref13[:live])
    assert (got13[live:] == 0).all()
    gate, up = got13.chunk(2, dim=-1)
    _assert_close(fl.grouped_linear(xs, w13, ends, glu=True), F.silu(gate) * up)
    act = (F.silu(gate) * up).contiguous()
    _assert_close(fl.grouped_linear(act, w2, ends)[:live],
                  torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)[:live])
    assert moe_compute.triton_grouped(2 * tokens, e) == (
        2 * tokens <= moe_compute.TRITON_GROUPED_MAX_MEAN_ROWS * e)
    got = moe_compute.routed_experts(x, (w13, w2), ids, weights, first=0, num_experts=2 * e)
    want = moe_compute.looped_experts(x, (w13, w2), ids, weights, first=0)
    big = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-8 * big)


@pytest.mark.parametrize("m", [1, 64, 256, 4096])
def test_fp8_glu_linear_equals_the_unfused_ops(g, m):
    """The shared experts' down projection of silu(gate) · up, h = [gate | up] as the fused
    gate_up gives it: on the W8A8 rows the activation is formed while quantized (its silu may
    put a byte one e4m3 code away: within the W8A8 tolerance), elsewhere the unfused ops."""
    inter, hidden = _C["moe_intermediate_size"], _C["hidden_size"]
    wq, scale = _weight(hidden, inter, g)
    h = torch.randn(m, 2 * inter, generator=g, device=DEV).bfloat16()
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    got = fl.fp8_glu_linear(h, wq, scale)
    if fl.takes_w8a8(h, hidden, h.shape[1] // 2):
        _assert_close(got, fw.w8a8_reference(act, wq, scale))
    else:
        assert torch.equal(got, fl.fp8_linear(act, wq, scale))


@pytest.mark.parametrize("m", [1, 64, 256, 4096])
@pytest.mark.parametrize("whole_blocks", [False, True], ids=["apart", "whole-blocks"])
def test_fused_projections_equal_their_members(g, m, whole_blocks):
    """q_a, kv_a and the indexer's wk of one input as one matrix (model/fused.py): each member's
    columns of the one product against the member alone, at GLM-5.3's shapes (the fused
    product takes W8A8 at 256 rows where kv_a and wk alone would not: their references
    follow the fused product's path); with whole_blocks (the engine's) padded to 2,816 rows,
    which cuBLAS's block-scaled GEMM takes at prefill rows."""
    from dsaserve.model import fp8, fused

    hidden = _C["hidden_size"]
    members = []
    for name in ("q_a", "kv_a", "wk"):
        n = dict((s[0], s[1]) for s in SHAPES)[name]
        layer = fp8.Fp8Linear(hidden, n).to(DEV)
        layer.weight.data, layer.weight_scale_inv.data = _weight(n, hidden, g)
        members.append(layer)
    x = torch.randn(m, hidden, generator=g, device=DEV).bfloat16()
    wants = []
    merged_n = sum(mm.weight.shape[0] for mm in members)
    if whole_blocks:
        merged_n = -(-merged_n // 128) * 128
    for layer in members:
        if fl.takes_w8a8(x, merged_n, x.shape[1]):
            wants.append(fw.w8a8_reference(x, layer.weight, layer.weight_scale_inv))
        else:
            wants.append(fw.linear_reference(x, layer.weight, layer.weight_scale_inv))
    group = fused.fuse(members, whole_blocks=whole_blocks)
    assert group is not None and group.merged.weight.shape[0] == merged_n
    for got, want in zip(group(x), wants, strict=True):
        _assert_close(got.contiguous(), want)
