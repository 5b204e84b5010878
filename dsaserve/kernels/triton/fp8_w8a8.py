"""W8A8 block-FP8 GEMMs: the activations quantized per row and 128 columns, FP8 tensor cores.

From 65 to 256 rows (MTP3 verification of batches up to 64) the weight-only kernel of
fp8_linear.py dequantized each matrix into a transient bf16 copy for cuBLAS: 1 byte read, 2
written and 2 read again per weight. Here the weight is read once as stored and multiplied on
FP8 tensor cores:

    act_quant      x [M, K] bf16 → xq [M, K] e4m3, xs [M, Kb] fp32 (one scale per row and
                   128-column group on the weight's scale grid; fp8_weights.quantize_activations)
    w8a8_matmul    program (m tile, n tile), swizzled in GROUP_M row bands for L2 reuse:
                     for each 128-column group kb (one weight scale block):
                       part [BLOCK_M, BLOCK_N] = xq[:, kb] · Wq[:, kb]ᵀ   FP8 MMA, fp32 result
                       acc += part · xs[:, kb] · S[n // 128, kb]          fp32, in registers
                   y = dtype(acc)

Each group's product is scaled into an fp32 accumulator before the next (DeepSeek-V3's
recipe: FP8 MMAs accumulate at reduced precision, so partial sums are promoted every 128 K
elements). This is how DeepSeek's reference inference, vLLM, SGLang and transformers'
FineGrainedFP8 run block-FP8 checkpoints; the reference is fp8_weights.w8a8_reference. The
activations' rounding to e4m3 makes the product differ from the dequantized model's by
~2^-5 of a row's scale per group, so fp8_linear keeps the exact weight-only kernel where it is
as fast (decode, M ≤ 64) and for fp32 activations (test models compared bit for bit).

Where cuBLAS's block-scaled FP8 GEMM takes the shape (`cublas_takes`: CUDA, whole scale
blocks; rows padded to a multiple of 4) w8a8_linear hands it the same quantized activations
instead, their scales laid out group-major (PyTorch's scaled_mm, 1 × 128 and 128 × 128
scales). Measured on an H100 (benchmarks/fp8_cublas_blockwise.py, docs/fp8_weights.md) it is
1.23–1.70× this kernel at 256 rows for q_b, o_proj and the shared down projection, 0.95–0.99×
for the 2,048–4,096-wide ones, and 1.35–1.73× at 1,024–4,096 rows. The Triton kernel stays
for the rest: shards starting inside a block (TP), widths ending inside one (model/fused.py
pads q_a + wk + kv_a's 2,752 rows to whole blocks so that cuBLAS takes them).

Above 256 rows (prefill) this kernel is slower than the dequantized copy + cuBLAS (545–610
TFLOP/s at 4,096 rows on an H100: each group's product waits for its scaling before the next
MMA), so fp8_linear takes W8A8 there only where cuBLAS takes the shape (745–1,014 TFLOP/s),
else the dequantized copy (fp8_linear.takes_w8a8). No autotuning: tiles are a pure function
of (M, N, SMs) (benchmarks/fp8_linear.py --sweep).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsaserve.kernels.device import sm_count
from dsaserve.kernels.fp8_weights import (
    ACT_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_E4M3_MAX,
    check_weight,
    grouped_row_tiles,
    num_blocks,
)
from dsaserve.kernels.triton.grouped_tiles import tile_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class W8a8Config:
    """Launch shape of w8a8_linear: BLOCK_K is one scale group (128)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8  # m tiles of one band, run before the band's next n tile (L2 reuse)

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"W8a8Config.{name}: a power of two >= 16, got {v}")
        if self.group_m < 1:
            raise ValueError(f"W8a8Config.group_m: must be >= 1, got {self.group_m}")


# Candidate tiles, widest first. Each thread holds the fp32 accumulator and one group's product
# (two [BLOCK_M, BLOCK_N] tiles): 64 × 128 per warpgroup takes 234 registers without spills in
# the sm_90 build (benchmarks/sm90_resources.py --only w8a8), 128 × 128 on 8 warps spills.
TILES = (W8a8Config(64, 128, 4, 4), W8a8Config(64, 64, 4, 4))
# The experts' tiles at 16–64 rows per expert: one 64-row tile per expert's rows, the dense
# kernel's narrow tile (many programs: each expert's weight is a small share of the work).
GROUPED_TILES = W8a8Config(64, 64, 4, 4)


def fills_device(m: int, n: int, num_sms: int) -> bool:
    """Whether an [m, n] product has programs for at least half the SMs at the narrowest
    tiles. Below that the K loop's latency, not the bytes, sets the time, and the dequantized
    copy + cuBLAS is faster: kv_a (576 × 6144) at 256 rows, 36 programs on 132 SMs, took 24.2
    µs against 15.5 (q_a, 128 programs: 24.4 against 29.4; docs/fp8_weights.md)."""
    narrow = TILES[-1]
    return 2 * triton.cdiv(m, narrow.block_m) * triton.cdiv(n, narrow.block_n) >= num_sms


def choose_config(m: int, n: int, num_sms: int) -> W8a8Config:
    """The widest tiles that still give every SM a program: 64 × 128, else 64 × 64 (narrow
    projections such as q_a and kv_a at 256 rows)."""
    for cfg in TILES:
        if triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) >= num_sms:
            return cfg
    return TILES[-1]


def device_sms(device: torch.device) -> int:
    """The SMs of a CUDA device (cached); 8 elsewhere (interpreter runs: small, but past one
    tile)."""
    return sm_count(device, 8)


@triton.jit
def _round_to_e4m3(q):
    """q (fp32, |q| ≤ 448) rounded to the nearest e4m3 value, ties to even, in fp32
    arithmetic: the step at q's binade (3 mantissa bits; 2^-9 below the smallest normal
    2^-6); v = |q| / step (≤ 16, exact: a power of two), v + 1.5·2^23 − 1.5·2^23 rounds it to
    an integer, and q's sign bit goes back on (−0 stays −0, as PyTorch's cast keeps it). The
    cast to e4m3 after it is then exact, also in Triton's CPU interpreter, whose own conversion
    truncates where rounding carries into the exponent (−127 → −64) and flushes subnormals (on
    the GPU the conversion itself rounds once, as PyTorch's cast does: measured equal)."""
    bits = q.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # the step's exponent (zeros: −9)
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)  # exact: no division
    r = ((tl.abs(q) * inv_step + 12582912.0) - 12582912.0) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(
    x_ptr,  # [M, K] (GLU: [M, 2K], gate columns then up columns), rows stride_x apart
    q_ptr,  # [M, K] e4m3, contiguous
    s_ptr,  # [M, Kb] fp32: row r's group g at r · stride_sr + g · stride_sg
    M, K, stride_x, k_off, stride_sr, stride_sg,
    BLOCK_R: tl.constexpr, AMAX_FLOOR: tl.constexpr, QMAX: tl.constexpr, GLU: tl.constexpr,
):
    """One 128-column group of BLOCK_R rows: scale = max(amax, floor) / 448, q = x / scale;
    with GLU x = silu(gate) · up first, each rounded to x's dtype as the unfused ops round."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    ks = g * 128 - k_off + tl.arange(0, 128)
    row_live = rows < M
    live = row_live[:, None] & ((ks >= 0) & (ks < K))[None, :]
    rows64 = rows.to(tl.int64)
    at = x_ptr + rows64[:, None] * stride_x + ks[None, :]
    x = tl.load(at, mask=live, other=0.0)
    if GLU:
        dtype = x_ptr.dtype.element_ty
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu
        x = act * tl.load(at + K, mask=live, other=0.0).to(tl.float32)
        x = x.to(dtype)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), AMAX_FLOOR)  # [BLOCK_R]
    s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    q = tl.clamp(tl.math.div_rn(x, s[:, None]), -QMAX, QMAX)  # IEEE division: the reference's
    q = _round_to_e4m3(q)
    tl.store(q_ptr + rows64[:, None] * K + ks[None, :], q.to(q_ptr.dtype.element_ty), mask=live)
    tl.store(s_ptr + rows64 * stride_sr + g * stride_sg, s, mask=row_live)


def act_quant(x: torch.Tensor, k_off: int = 0, glu: bool = False, outer_scales: bool = False,
              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_weights.quantize_activations on the GPU: x [M, K] (unit last stride) → (xq [M, K]
    e4m3, xs [M, Kb] fp32). glu: x is [M, 2K] (gate, then up) and what is quantized is
    silu(gate) · up, the MoE's activation between its two projections (k_off 0).
    outer_scales: xs laid out group-major (strides (1, M)), as cuBLAS's block-scaled GEMM
    reads 1 × 128 scales; else row-major (the Triton kernels'). rows (≥ M): the outputs are
    allocated with that many rows, those past M left unwritten (a GEMM's padding rows: each
    output row reads its own input row only)."""
    m, k = x.shape
    if glu:
        if k % 2 or k_off:
            raise ValueError(f"act_quant: glu needs an even width and k_off 0, got {k}, {k_off}")
        k //= 2
    kb = num_blocks(k, k_off)
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"act_quant: rows = {rows} < the {m} rows of x")
    xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    if outer_scales:
        xs = torch.empty(kb, rows, dtype=torch.float32, device=x.device).t()  # [rows, Kb]
    else:
        xs = torch.empty(rows, kb, dtype=torch.float32, device=x.device)
    if m and k:
        block_r = 16
        _act_quant_kernel[(triton.cdiv(m, block_r), kb)](
            x, xq, xs, m, k, x.stride(0), k_off, xs.stride(0), xs.stride(1), BLOCK_R=block_r,
            AMAX_FLOOR=ACT_AMAX_FLOOR, QMAX=FP8_E4M3_MAX, GLU=glu, num_warps=4)
    return xq, xs


# (N, K, dtype) of products cuBLAS refused on this process's GPU (an older cuBLAS, another
# architecture): the Triton kernel takes them from then on, warned about once.
_REFUSED: set[tuple[int, int, torch.dtype]] = set()


# cuBLASLt's block-scaled GEMM takes M in multiples of this (its 1 × 128 scales' leading
# dimension): other row counts are padded to it (act_quant's rows, the output sliced back).
# Its 128 × 128 weight scales need K / 128 a multiple of it too (PyTorch 2.11 on an H200
# refused [128, 128], [512, 128] and [128, 256] weights: "scale_b must have shape 4 x 1"):
# GLM-5.3's and DeepSeek-V3.2's K (2,048 … 18,432) all are.
CUBLAS_ROWS = 4


def cublas_takes(n: int, k: int, n_off: int, k_off: int, device: torch.device) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM (PyTorch's scaled_mm with DeepSeek's 1 × 128
    activation and 128 × 128 weight scales, CUDA 12.9+) takes an [m, k] · [n, k]ᵀ product:
    on CUDA, whole scale blocks (no shard starting inside one, N a multiple of 128, K of
    4 × 128); any M (padded to CUBLAS_ROWS). Elsewhere the Triton kernel below."""
    return (device.type == "cuda" and not n_off and not k_off and n % FP8_BLOCK == 0
            and k % (CUBLAS_ROWS * FP8_BLOCK) == 0 and hasattr(F, "scaled_mm"))


def cublas_ready(n: int, k: int, n_off: int, k_off: int, x: torch.Tensor) -> bool:
    """cublas_takes the product of x's rows and the shape was not refused before."""
    return ((n, k, x.dtype) not in _REFUSED
            and cublas_takes(n, k, n_off, k_off, x.device))


def block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3 with xs [M, Kb] group-major (act_quant(outer_scales=True)), wq [N, K]
    e4m3 with scale [Nb, Kb] → [M, N] in `dtype` through cuBLAS (cublas_takes says where);
    each 128-column group's product scaled in fp32, as the Triton kernel's."""
    return F.scaled_mm(xq, wq.t(), xs, F.ScalingType.BlockWise1x128, scale.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=dtype)


@triton.jit
def _scaled_products(xq_ptr, xs_ptr, w_ptr, s_row, rows64, row_live, cols64, col_live, K, k_off,
                     num_kb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     K_ALIGNED: tl.constexpr, FP8_DOT: tl.constexpr):
    """Σ over the 128-column groups kb of xq[rows, kb] · W[cols, kb]ᵀ · xs[rows, kb] ·
    S[cols, kb] → [BLOCK_M, BLOCK_N] fp32; s_row [BLOCK_N]: each column's row of scales."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, num_kb):
        if K_ALIGNED:  # k_off = 0, left out of the addresses: the loads stay vectorized
            ks = kb * 128 + tl.arange(0, 128)
            k_live = ks < K
        else:  # group kb's columns (the first 128 − k_off wide)
            ks = kb * 128 - k_off + tl.arange(0, 128)
            k_live = (ks >= 0) & (ks < K)
        a = tl.load(xq_ptr + rows64[:, None] * K + ks[None, :],
                    mask=row_live[:, None] & k_live[None, :], other=0.0)  # [BLOCK_M, 128]
        b = tl.load(w_ptr + cols64[:, None] * K + ks[None, :],
                    mask=col_live[:, None] & k_live[None, :], other=0.0)  # [BLOCK_N, 128]
        if FP8_DOT:
            part = tl.dot(a, tl.trans(b))
        else:  # Triton's CPU interpreter multiplies FP8 operands as raw bytes: exact fp32
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        xs = tl.load(xs_ptr + rows64 * num_kb + kb, mask=row_live, other=0.0)  # [BLOCK_M]
        ws = tl.load(s_row + kb, mask=col_live, other=0.0)  # [BLOCK_N]
        acc += part * xs[:, None] * ws[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    xq_ptr,  # [M, K] e4m3, contiguous
    xs_ptr,  # [M, Kb] fp32, contiguous
    w_ptr,  # [N, K] e4m3, contiguous
    s_ptr,  # [Nb, Kb] fp32, contiguous
    out_ptr,  # [M, N]
    M, N, K, n_off, k_off, num_kb,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    K_ALIGNED: tl.constexpr, FP8_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n  # programs of one band of GROUP_M m tiles
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    row_live = rows < M
    col_live = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    s_row = s_ptr + ((cols + n_off) // 128) * num_kb  # [BLOCK_N] each column's scale row
    acc = _scaled_products(xq_ptr, xs_ptr, w_ptr, s_row, rows64, row_live, cols64, col_live, K,
                           k_off, num_kb, BLOCK_M, BLOCK_N, K_ALIGNED, FP8_DOT)
    out = rows64[:, None] * N + cols[None, :]
    tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & col_live[None, :])


def w8a8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
                k_off: int = 0, config: W8a8Config | None = None, glu: bool = False
                ) -> torch.Tensor:
    """x [M, K] (bf16 or fp16, unit last stride), wq [N, K] e4m3, scale [Nb, Kb] fp32 (offsets
    as in fp8_weights) → [M, N] in x's dtype: fp8_weights.w8a8_reference's product. glu: x
    is [M, 2K] = [gate | up] and the product is silu(gate) · up's (act_quant's GLU). cuBLAS
    where it takes the shape (cublas_takes; config: the Triton kernel's tiles, forcing it).
    No host sync; allocates xq, xs and the output."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w8a8_linear: x must be bf16 or fp16 [M, K] with unit last stride, "
                         f"got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1] // 2 if glu else x.shape[1]
    if wq.shape[-1] != k:
        raise ValueError(f"w8a8_linear: x has K = {k}, the weight {wq.shape[-1]}")
    if config is None and cublas_ready(wq.shape[0], k, n_off, k_off, x):
        check_weight(wq, scale, n_off, k_off, "w8a8_linear")
        m = x.shape[0]
        xq, xs = act_quant(x, glu=glu, outer_scales=True,
                           rows=-(-m // CUBLAS_ROWS) * CUBLAS_ROWS)
        try:
            return block_scaled_mm(xq, xs, wq, scale, x.dtype)[:m]
        except (RuntimeError, ValueError, NotImplementedError) as e:
            # refused at its checks: an eager call (the warm-up before any capture) learns it
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise
            logger.warning("cuBLAS's block-scaled FP8 GEMM refused [%d, %d] x [%d, %d]ᵀ "
                           "(%s); the Triton W8A8 kernel takes this shape", x.shape[0], k,
                           wq.shape[0], k, str(e).splitlines()[0] if str(e) else type(e))
            _REFUSED.add((wq.shape[0], k, x.dtype))  # cublas_ready's key
    return w8a8_matmul(*act_quant(x, k_off, glu), wq, scale, x.dtype, n_off, k_off, config)


def w8a8_matmul(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                dtype: torch.dtype, n_off: int = 0, k_off: int = 0,
                config: W8a8Config | None = None) -> torch.Tensor:
    """The product of quantized activations (act_quant's xq [M, K] e4m3, xs [M, Kb] fp32) and
    the weight → [M, N] in `dtype`."""
    check_weight(wq, scale, n_off, k_off, "w8a8_matmul")
    m, k = xq.shape
    n = wq.shape[0]
    if (wq.shape[1] != k or xs.shape != (m, scale.shape[1])
            or not all(t.is_contiguous() for t in (xq, xs, wq, scale))):
        raise ValueError(f"w8a8_matmul: xq {list(xq.shape)}, xs {list(xs.shape)}, weight "
                         f"{list(wq.shape)}, scale {list(scale.shape)}: K or the groups "
                         "disagree, or one is not contiguous")
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_config(m, n, device_sms(xq.device))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w8a8_kernel[grid](
        xq, xs, wq, scale, out, m, n, k, n_off, k_off, scale.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        K_ALIGNED=k_off == 0, FP8_DOT=xq.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# Grouped (MoE experts at MTP3-verify sizes): w8a8_grouped
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["P"])
def _grouped_w8a8_kernel(
    xq_ptr,  # [P, K] e4m3, rows sorted by expert, contiguous
    xs_ptr,  # [P, Kb] fp32, contiguous
    w_ptr,  # [E, N, K] e4m3, contiguous
    s_ptr,  # [E, Nb, Kb] fp32, contiguous
    ends_ptr,  # [E] int32: rows of expert e are ends[e − 1] .. ends[e] (ends[−1] = 0)
    out_ptr,  # [P, N]
    P, N, K, num_nb, num_kb, E,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """Program (row tile t of one expert, n tile): out[rows, cols] = the W8A8 product of the
    rows' quantized activations with expert e's weight rows `cols`; rows past the last group
    (pairs of experts held elsewhere) are 0."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first_row, end_row = tile_rows(ends_ptr, t, P, E, E_P2, BLOCK_M)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_live = rows < end_row
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < N
    rows64 = rows.to(tl.int64)
    out = out_ptr + rows64[:, None] * N + cols[None, :]
    live = row_live[:, None] & col_live[None, :]
    if e < E:
        w_e = w_ptr + e.to(tl.int64) * N * K
        s_row = s_ptr + (e * num_nb + cols // 128) * num_kb  # [BLOCK_N]
        acc = _scaled_products(xq_ptr, xs_ptr, w_e, s_row, rows64, row_live, cols.to(tl.int64),
                               col_live, K, 0, num_kb, BLOCK_M, BLOCK_N, True, FP8_DOT)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(out, tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=live)


def w8a8_grouped(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                 ends: torch.Tensor, dtype: torch.dtype, config: W8a8Config | None = None
                 ) -> torch.Tensor:
    """The routed experts' grouped GEMM in W8A8: act_quant's xq [P, K] e4m3 and xs [P, Kb] of
    rows sorted by expert, wq [E, N, K] e4m3 with scale [E, Nb, Kb] fp32 (on the block grid),
    ends [E] int32 on the device → [P, N] in `dtype` (fp8_weights.grouped_reference with
    w8a8_reference). `ends` is never read on the host: the grid depends on (P, N, E), so a
    CUDA graph replays with any routing."""
    check_weight(wq, scale, 0, 0, "w8a8_grouped")
    p, k = xq.shape
    e, n = wq.shape[0], wq.shape[1]
    if (wq.dim() != 3 or wq.shape[2] != k or xs.shape != (p, scale.shape[2])
            or ends.shape != (e,) or ends.dtype != torch.int32
            or not all(t.is_contiguous() for t in (xq, xs, wq, scale))):
        raise ValueError(f"w8a8_grouped: xq {list(xq.shape)}, xs {list(xs.shape)}, weight "
                         f"{list(wq.shape)}, scale {list(scale.shape)}, ends {list(ends.shape)} "
                         f"{ends.dtype}: shapes disagree or one is not contiguous")
    out = torch.empty(p, n, dtype=dtype, device=xq.device)
    if p == 0 or n == 0:
        return out
    cfg = config or GROUPED_TILES
    grid = (grouped_row_tiles(p, e, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _grouped_w8a8_kernel[grid](
        xq, xs, wq, scale, ends, out, p, n, k, scale.shape[1], scale.shape[2], e,
        E_P2=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        FP8_DOT=xq.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


assert FP8_BLOCK == 128, "the kernels' groups are 128 columns wide"
