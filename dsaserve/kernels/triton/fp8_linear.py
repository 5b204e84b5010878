"""Weight-only FP8 GEMMs ("w8a16"): x · Wᵀ with W kept as block-FP8 bytes and fp32 scales.

The weight layout and the reference are kernels/fp8_weights.py. Every kernel here computes with
the weight value dtype(fp32(Wq) · S) — bit for bit what dequantizing at load gives — and
accumulates in fp32, so it differs from the dequantize-at-load model only in summation order:

    program (n tile, m tile, k split)
      for each BLOCK_K columns of its split:
        x  [BLOCK_M, BLOCK_K]   activation tile, x's dtype
        Wq [BLOCK_N, BLOCK_K]   e4m3 bytes, read once per m tile
        W  = dtype(fp32(Wq) · S[(n + n_off) // 128, (k + k_off) // 128])    in registers
        acc [BLOCK_M, BLOCK_N] += x · Wᵀ    fp32 (tl.dot with its accumulator)

Decode (M ≤ 64) is bound by the weight bytes: one m tile, so every weight byte is read once;
when the n tiles alone leave SMs idle the K range is split, each split writing fp32 partials
that the tile's last split to finish sums in split order (deterministic, unlike atomic adds
of the partials; no second launch). From 65 to 256 rows
(MTP3 verification up to b = 64) bf16 and fp16 activations take W8A8 (fp8_w8a8.py: FP8 tensor
cores, the weight read once), and above that (prefill) where cuBLAS's block-scaled GEMM takes
the shape (whole 128 blocks, no shard offset); otherwise, and for fp32 activations (test
models), the weight is dequantized into a transient copy and cuBLAS multiplies, exactly
(WEIGHT_ONLY_MAX_M, W8A8_MAX_M, takes_w8a8).

`grouped_linear` is the MoE form (moe_compute's grouped path): rows sorted by expert, group
ends on the device, never read on the host, so one launch with a grid fixed by (P, N, E) serves
any routing and is capturable in a CUDA graph. The same kernel takes FP8 experts (`fp8_grouped`:
the FP8 counterpart of torch._grouped_mm, at every batch size) or bf16 ones (HAS_SCALE off:
moe_compute routes decode-sized groups to it, where torch._grouped_mm streams the experts at
~42 % of the copy rate, docs/decode.md), and may fuse silu(gate) · up into the first
projection (GLU).

No autotuning: tiles are chosen by a pure function of (M, N, K, SMs) — nothing is timed at
start-up or during graph capture. benchmarks/fp8_linear.py --sweep times the alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels.fp8_weights import FP8_BLOCK, check_weight, grouped_row_tiles
from dsaserve.kernels.triton import fp8_w8a8
from dsaserve.kernels.triton.grouped_tiles import tile_rows

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Launch shape of the FP8 GEMMs. Block sizes are powers of two ≥ 16; BLOCK_K divides 128
    (a k tile then spans at most two scale blocks, one when k_off = 0)."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int | None = None  # None: chosen from the grid size and the SM count (fp8_linear)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8LinearConfig.{name}: a power of two >= 16, got {v}")
        if FP8_BLOCK % self.block_k:
            raise ValueError(f"Fp8LinearConfig.block_k: must divide {FP8_BLOCK}, "
                             f"got {self.block_k}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"Fp8LinearConfig.split_k: must be >= 1, got {self.split_k}")


# Above this many rows `fp8_linear` leaves the weight-only kernel. Measured on an H100 at
# GLM-5.3's projections (docs/fp8_weights.md): the dequantized copy + cuBLAS was faster than
# this kernel at M = 256 for 10 of the 11 shapes (1.54× in sum) and ~1.8× at M ≥ 4096
# (cuBLAS's tensor-core pipeline against a kernel that dequantizes each weight tile once per m
# tile); at M = 64 this kernel is 1.29× faster in sum (one byte per weight, read once). The
# 64 < M ≤ 256 and M > 256 tile shapes the kernel had are deleted.
WEIGHT_ONLY_MAX_M = 64
# Up to this many rows bf16 / fp16 activations then take W8A8 (where it fills the device:
# fp8_w8a8.fills_device); above it W8A8 only where cuBLAS's block-scaled GEMM takes the shape,
# else the dequantized copy + cuBLAS. Measured on an H100 (docs/fp8_weights.md): at 16 layers,
# b = 64 with MTP3 (256 verify rows) W8A8 took the step from 20.3 to 17.7 ms; at 4,096 rows
# the Triton W8A8 kernel reaches 545–610 TFLOP/s and is 0.80–0.95× the dequantized copy +
# cuBLAS (0.44× on kv_a), cuBLAS's block-scaled GEMM 745–1,014 TFLOP/s (1.35–1.73× Triton's).
W8A8_MAX_M = 256


def choose_config(m: int, n: int, k: int) -> Fp8LinearConfig:
    """Tiles by M bucket (M ≤ WEIGHT_ONLY_MAX_M): one m tile (the weight streamed once) and
    narrow n tiles (more programs). Larger M reach the kernel only with an explicit config
    (benchmarks/fp8_linear.py --sweep); they get the largest bucket's tiles here."""
    if m <= 16:
        return Fp8LinearConfig(16, 64)
    if m <= 32:
        return Fp8LinearConfig(32, 64)
    return Fp8LinearConfig(64, 64)


# A split of the K range: at least this many k tiles, and the fp32 partials (written and read
# back: 8 bytes per output element per split) at most 1/8 of the weight bytes or, where that
# is more, L2_PARTIAL_BYTES: partials that small are summed from L2 (50 MB on an H100 or H200)
# right after they are written, so they cost little HBM traffic. Measured on an H100 (q_a,
# M = 64, docs/fp8_weights.md): the 1/8 cap alone allowed no split, 39.5 µs; 4 splits (2 MiB
# of partials) 14.7 µs, 8 splits 15.0 µs, against bf16 cuBLAS's 15.3 µs.
MIN_K_TILES_PER_SPLIT = 4
MAX_PARTIAL_FRACTION = 1 / 8
L2_PARTIAL_BYTES = 8 << 20


def choose_split_k(m: int, n: int, k: int, cfg: Fp8LinearConfig, num_sms: int) -> int:
    """Splits of the K range for decode (one m tile: m ≤ block_m ≤ 64) so that the grid gives
    every SM about two programs (a memory-bound kernel wants several tiles' loads in flight per
    SM); 1 when the n tiles already do, or when the partials would cost more than a fraction
    of the weight bytes and exceed what L2 keeps. Counted at the bucket's largest M
    (block_m), so that every M of a bucket launches the same compiled kernel (a new split
    count would compile mid-serving)."""
    if m > cfg.block_m or cfg.block_m > 64:
        return 1
    tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    if tiles >= 2 * num_sms:
        return 1
    by_sms = triton.cdiv(2 * num_sms, tiles)
    by_k = k_tiles // MIN_K_TILES_PER_SPLIT
    by_bytes = max(int(MAX_PARTIAL_FRACTION * k / (8 * cfg.block_m)),
                   L2_PARTIAL_BYTES // (4 * cfg.block_m * n))
    splits = max(1, min(by_sms, by_k, by_bytes))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, splits))  # no empty split


def _k_splits(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, k tiles per split) of a K range asked to split `split` ways: as even as the
    k tiles allow, with no empty split."""
    k_tiles = triton.cdiv(k, block_k)
    per_split = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, per_split), per_split


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 x: full-precision products


# --------------------------------------------------------------------------------------------
# Dense: fp8_linear
# --------------------------------------------------------------------------------------------
@triton.jit
def _dequant_tile(w_ptr, s_ptr, cols, col_live, k0, K, n_off, k_off, num_kb,
                  dtype: tl.constexpr, BLOCK_K: tl.constexpr, K_ALIGNED: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k0 .. k0 + BLOCK_K of rows `cols`, in
    `dtype`: fp32(Wq) · its block's scale, rounded once. Masked elements are 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    live = col_live[:, None] & (ks < K)[None, :]
    wq = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=live, other=0.0)
    s_row = s_ptr + ((cols + n_off) // 128) * num_kb  # [BLOCK_N] scale row of each weight row
    kb = (k0 + k_off) // 128
    s_lo = tl.load(s_row + kb, mask=col_live, other=0.0)  # [BLOCK_N]
    if K_ALIGNED:  # the tile lies in one scale block
        s = s_lo[:, None]
    else:  # it may cross into the next one
        s_hi = tl.load(s_row + kb + 1, mask=col_live & (kb + 1 < num_kb), other=0.0)
        s = tl.where(((ks + k_off) // 128 == kb)[None, :], s_lo[:, None], s_hi[:, None])
    return (wq.to(tl.float32) * s).to(dtype)


# The row count changes from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr,  # [M, K], rows stride_x apart, unit last stride
    w_ptr,  # [N, K] e4m3, contiguous
    s_ptr,  # [Nb, Kb] fp32, contiguous
    out_ptr,  # [M, N] in x's dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1 (else unused)
    count_ptr,  # [tiles] int32, zero between calls: the splits of each (m, n) tile done
    M, N, K, stride_x, n_off, k_off, num_kb,
    k_tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_ALIGNED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows = output columns
    row_live = rows < M
    col_live = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * k_tiles_per_split
    last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    for kt in range(first, last):
        k0 = kt * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_live[:, None] & (ks < K)[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _dequant_tile(w_ptr, s_ptr, cols, col_live, k0, K, n_off, k_off, num_kb, dtype,
                          BLOCK_K, K_ALIGNED)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out = rows.to(tl.int64)[:, None] * N + cols[None, :]
    live = row_live[:, None] & col_live[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=live)
    else:
        # Each split stores its fp32 partial; the tile's last split to finish sums them all
        # in split order (the same sum every run, whichever finishes last) and resets the
        # tile's counter for the next call. The barrier and the counter's acq_rel order every
        # thread's partial before the count, and the count before the sum's loads.
        tl.store(part_ptr + split * M * N + out, acc, mask=live)
        tl.debug_barrier()
        tile = count_ptr + pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + out, mask=live, other=0.0,
                                 cache_modifier=".cg")  # from L2: other SMs wrote them
            tl.store(out_ptr + out, total.to(out_ptr.dtype.element_ty), mask=live)
            tl.atomic_xchg(tile, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Counters outgrown by a larger grid: kept, never freed, since a CUDA graph captured before
# the growth replays with the old buffer's address (freed, its memory would be another
# tensor's, and that graph's last-split test would read garbage).
_OUTGROWN: list[torch.Tensor] = []


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K kernels' per-tile counters on `device`: zero between calls (each call's
    last split resets its tile's), kept for the process (a CUDA graph replays with them).
    One compute stream uses them at a time, as the engine's forward does."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made in a graph's pool, they would outlive it: graphs are captured after an
            # eager warm-up (engine/cudagraph.capture), which makes them
            raise RuntimeError("fp8_linear: its split-K counters are made at the first "
                               "eager call; run it once before capturing a CUDA graph")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _check_weight(what: str, x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                  n_off: int = 0, k_off: int = 0) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what}: x must be [M, K] with unit last stride, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{what}: x must be bf16, fp16 or fp32, got {x.dtype}")
    if wq.dtype != torch.float8_e4m3fn or not wq.is_contiguous():
        raise ValueError(f"{what}: the weight must be contiguous float8_e4m3fn, got {wq.dtype}")
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"{what}: the scale must be contiguous fp32, got {scale.dtype}")
    if wq.shape[-1] != x.shape[1]:
        raise ValueError(f"{what}: x has K = {x.shape[1]}, the weight {wq.shape[-1]}")
    check_weight(wq, scale, n_off, k_off, what)


def takes_w8a8(x: torch.Tensor, n: int, k: int, n_off: int = 0, k_off: int = 0) -> bool:
    """Whether the product of x's rows [M, k] with an [n, k] weight takes W8A8, not the
    weight-only kernel (M ≤ WEIGHT_ONLY_MAX_M) or the dequantized copy: bf16 / fp16 rows, up
    to W8A8_MAX_M where the Triton kernel fills the device (or cuBLAS takes the shape inside
    w8a8_linear), above it where cuBLAS's block-scaled GEMM takes the shape (prefill)."""
    m = x.shape[0]
    if m <= WEIGHT_ONLY_MAX_M or x.dtype == torch.float32:
        return False
    if m <= W8A8_MAX_M:
        return fp8_w8a8.fills_device(m, n, fp8_w8a8.device_sms(x.device))
    return fp8_w8a8.cublas_ready(n, k, n_off, k_off, x)


def fp8_glu_linear(h: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
                   k_off: int = 0) -> torch.Tensor:
    """silu(gate) · up through the projection: h [M, 2K] = [gate | up] (unit last stride) →
    fp8_linear(silu(gate) · up) [M, N]. On the W8A8 path the activation is formed while it is
    quantized (fp8_w8a8.act_quant's GLU, rounded as the unfused ops round; its silu may put a
    byte one e4m3 code away, rarely): no [M, K] intermediate and two elementwise launches
    fewer; elsewhere the unfused ops."""
    if (k_off == 0 and h.stride(-1) == 1 and h.shape[1] % 2 == 0
            and takes_w8a8(h, wq.shape[0], h.shape[1] // 2, n_off)):
        return fp8_w8a8.w8a8_linear(h, wq, scale, n_off, glu=True)
    gate, up = h.chunk(2, dim=-1)
    return fp8_linear(torch.nn.functional.silu(gate) * up, wq, scale, n_off, k_off)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
               k_off: int = 0, config: Fp8LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32; rows may be strided), wq [N, K] e4m3, scale [Nb, Kb] fp32
    (fp8_weights.dequantize's layout, offsets included) → x · Wᵀ [M, N] in x's dtype.

    config: the launch shape (default: choose_config by M, split_k by the grid and SMs; above
    WEIGHT_ONLY_MAX_M rows W8A8 where takes_w8a8, else the weight dequantized into a transient
    copy and cuBLAS).
    No host sync; allocates its output (and fp32 partials when the K range is split)."""
    _check_weight("fp8_linear", x, wq, scale, n_off, k_off)
    m, k = x.shape
    n = wq.shape[0]
    if config is None and m > WEIGHT_ONLY_MAX_M:
        if takes_w8a8(x, n, k, n_off, k_off):
            return fp8_w8a8.w8a8_linear(x, wq, scale, n_off, k_off)  # FP8 tensor cores
        # the same weight values (dtype(fp32(wq) · scale)), an fp32-accumulated product
        return torch.nn.functional.linear(x, fp8_dequantize(wq, scale, x.dtype, n_off, k_off))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_config(m, n, k)
    split = cfg.split_k or choose_split_k(m, n, k, cfg, fp8_w8a8.device_sms(x.device))
    split, per_split = _k_splits(k, cfg.block_k, split)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    if split == 1:
        part = counters = out  # (not read: SPLIT_K 1 compiles without them)
    else:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, grid[0] * grid[1])
    _fp8_linear_kernel[grid](
        x, wq, scale, out, part, counters, m, n, k, x.stride(0), n_off, k_off, scale.shape[1],
        per_split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, K_ALIGNED=k_off == 0, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# Dequantization (a copy in the activation dtype: fp8_linear above WEIGHT_ONLY_MAX_M rows)
# --------------------------------------------------------------------------------------------
@triton.jit
def _dequantize_kernel(
    w_ptr,  # [B, N, K] e4m3, contiguous
    s_ptr,  # [B, Nb, Kb] fp32, contiguous
    out_ptr,  # [B, N, K], contiguous
    N, K, n_off, k_off, num_nb, num_kb,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ALIGNED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < N
    k0 = pid_k * BLOCK_K
    w = _dequant_tile(w_ptr + b * N * K, s_ptr + b * num_nb * num_kb, cols, col_live, k0, K,
                      n_off, k_off, num_kb, out_ptr.dtype.element_ty, BLOCK_K, K_ALIGNED)
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + b * N * K + cols.to(tl.int64)[:, None] * K + ks[None, :], w,
             mask=col_live[:, None] & (ks < K)[None, :])


def fp8_dequantize(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, n_off: int = 0,
                   k_off: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_weights.dequantize on the GPU: wq [..., N, K] e4m3, scale [..., Nb, Kb] fp32 →
    [..., N, K] dtype (into `out` when given: a scratch buffer reused across layers)."""
    probe = torch.empty(0, wq.shape[-1], dtype=dtype, device=wq.device)
    _check_weight("fp8_dequantize", probe, wq, scale, n_off, k_off)
    n, k = wq.shape[-2:]
    if out is None:
        out = torch.empty(wq.shape, dtype=dtype, device=wq.device)
    elif out.shape != wq.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"fp8_dequantize: out must be contiguous {list(wq.shape)} {dtype}, got "
                         f"{list(out.shape)} {out.dtype}")
    batch = wq.numel() // max(1, n * k)
    if out.numel():
        block_n, block_k = 32, 128
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), batch)
        _dequantize_kernel[grid](wq, scale, out, n, k, n_off, k_off, scale.shape[-2],
                                 scale.shape[-1], BLOCK_N=block_n, BLOCK_K=block_k,
                                 K_ALIGNED=k_off == 0, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# Grouped (MoE): grouped_linear (bf16 or FP8 experts), fp8_grouped
# --------------------------------------------------------------------------------------------
def choose_grouped_config(p: int, n: int, k: int, e: int, weight_bytes: int = 1
                          ) -> Fp8LinearConfig:
    """Rows per tile near twice the mean rows per expert (most groups fit in one tile, so most
    experts' weights are read once), between 16 and 64 in decode; prefill-sized groups take
    the dense kernel's large tiles. With ≤ 8 rows per expert on average the kernel only streams
    weights, so its n tiles are narrow (32 rows: at b = 1 and GLM-5.3's w13, 2 experts × 128
    tiles ≈ 2 programs per SM) with more loads in flight: 5 stages for bf16 experts
    (weight_bytes 2), 6 for FP8. `benchmarks/moe_grouped.py --sweep` on an H100 (docs/decode.md,
    2026-12-07): the FP8 experts' w13 + activation and w2 at 2 and 8 pairs over 8 experts take
    176 µs in sum with these tiles against 220 with the 64-column tiles they had (the best of
    30 tiles: 175)."""
    mean = p / max(1, e)
    if mean > 128:
        return Fp8LinearConfig(128, 128, 64, num_warps=8, num_stages=3)
    block_m = min(64, max(16, triton.next_power_of_2(int(2 * mean))))
    if mean <= 8:
        return Fp8LinearConfig(block_m, 32, 128, num_warps=4, num_stages=5 if weight_bytes > 1
                               else 6)
    if block_m >= 64:
        # 64 × 128 × 128 tiles over 4 stages: bf16 asked 320 KB of shared memory (an H100 SM
        # has 227 KB; the launch failed at P = 512 over 8 experts), FP8 spilled (255 registers
        # and a stack, sm90_resources.py; 30 % of the copy rate at 512 pairs)
        return Fp8LinearConfig(block_m, 64, 64)
    return Fp8LinearConfig(block_m, 64)


# Decode-sized groups (at most this many pairs per expert on average: W8A8 takes more,
# moe_compute.W8A8_GROUPED_MIN_MEAN_ROWS) only stream weights, and few tiles have rows: at
# b = 1 and GLM-5.3's w13, 2 experts × 64 n tiles for 132 SMs, one program each, which ran at
# ~27 % of the copy rate on an H200 (part 50: 1.03 ms of a 4.36 ms step for 1.13 GB of
# experts). Their K range is split for about GROUPED_PROGRAMS_PER_SM streaming programs per SM.
GROUPED_SPLIT_MAX_MEAN_ROWS = 16
GROUPED_PROGRAMS_PER_SM = 4


def choose_grouped_split(p: int, n: int, k: int, e: int, cfg: Fp8LinearConfig,
                         num_sms: int) -> int:
    """Splits of the K range of a grouped GEMM of p pairs over e experts (host sizes only: a
    CUDA graph of a batch size always launches the same grid). The tiles with rows are at most
    min(p, e) experts' n tiles (a decode group fits one row tile); split so that they give
    every SM about GROUPED_PROGRAMS_PER_SM programs, each at least MIN_K_TILES_PER_SPLIT k
    tiles long; 1 above GROUPED_SPLIT_MAX_MEAN_ROWS pairs per expert."""
    if p > GROUPED_SPLIT_MAX_MEAN_ROWS * max(1, e):
        return 1
    streaming = min(p, e) * triton.cdiv(n, cfg.block_n)
    by_sms = triton.cdiv(GROUPED_PROGRAMS_PER_SM * num_sms, streaming)
    by_k = triton.cdiv(k, cfg.block_k) // MIN_K_TILES_PER_SPLIT
    return max(1, min(by_sms, by_k))


@triton.jit
def _weight_tile(w_ptr, s_ptr, cols, col_live, k0, K, num_kb, dtype: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Weight rows `cols` of one expert, columns k0 .. k0 + BLOCK_K, in `dtype`: FP8 bytes
    times their block scale (HAS_SCALE), else the stored values (already `dtype`)."""
    if HAS_SCALE:
        w = _dequant_tile(w_ptr, s_ptr, cols, col_live, k0, K, 0, 0, num_kb, dtype, BLOCK_K,
                          True)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=col_live[:, None] & (ks < K)[None, :], other=0.0)
    return w


@triton.jit
def _grouped_store(acc, acc_up, out, live, dtype: tl.constexpr, GLU: tl.constexpr):
    """A tile's product (fp32 sums) into out: with GLU silu(gate) · up, each product rounded
    to x's dtype first, as moe_compute's unfused path rounds them."""
    if GLU:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu
        acc = act * acc_up.to(dtype).to(tl.float32)
    tl.store(out, acc.to(out.dtype.element_ty), mask=live)


# The row count changes from step to step: not specialized on.
@triton.jit(do_not_specialize=["P"])
def _grouped_kernel(
    x_ptr,  # [P, K] rows sorted by expert, rows stride_x apart, unit last stride
    w_ptr,  # [E, W, K] contiguous: e4m3 (HAS_SCALE) or x's dtype; W = 2N with GLU, else N
    s_ptr,  # [E, Nb, Kb] fp32, contiguous (HAS_SCALE; else unused)
    ends_ptr,  # [E] int32: rows of expert e are ends[e − 1] .. ends[e] (ends[−1] = 0)
    out_ptr,  # [P, N] in x's dtype
    part_ptr,  # [SPLIT_K, 1 + GLU, P, N] fp32 partials when SPLIT_K > 1 (else unused)
    count_ptr,  # [row tiles · n tiles] int32, zero between calls: the splits of a tile done
    P, N, K, stride_x, num_nb, num_kb, E, k_tiles_per_split,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, GLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (row tile t, n tile, K split): out[rows, cols] = x[rows] · W_e[cols]ᵀ, or with
    GLU silu(x · W_e[cols]ᵀ) · (x · W_e[N + cols]ᵀ) (W_e's gate rows then its up rows). With
    the K range split (decode: few tiles have rows, so more programs stream the weights), each
    split stores its fp32 sums and the tile's last split to finish adds them in split order
    (the same sum every run), as _fp8_linear_kernel does."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    e, first_row, end_row = tile_rows(ends_ptr, t, P, E, E_P2, BLOCK_M)
    rows = first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_live = rows < end_row
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    col_live = cols < N
    at = rows.to(tl.int64)[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] in [P, N]
    out = out_ptr + at
    live = row_live[:, None] & col_live[None, :]
    if e < E:
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        w_rows = N  # weight rows per expert
        if GLU:
            w_rows = 2 * N
        w_e = w_ptr + e.to(tl.int64) * w_rows * K
        s_e = s_ptr + e * num_nb * num_kb
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GLU only
        first = split * k_tiles_per_split
        last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
        for kt in range(first, last):
            k0 = kt * BLOCK_K
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_live[:, None] & (ks < K)[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = _weight_tile(w_e, s_e, cols, col_live, k0, K, num_kb, dtype, BLOCK_K,
                             HAS_SCALE)  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
            if GLU:
                w_up = _weight_tile(w_e, s_e, cols + N, col_live, k0, K, num_kb, dtype,
                                    BLOCK_K, HAS_SCALE)  # [BLOCK_N, BLOCK_K]
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
        if SPLIT_K == 1:
            _grouped_store(acc, acc_up, out, live, dtype, GLU)
        else:
            # the barrier and the counter's acq_rel order every thread's partial before the
            # count, and the count before the last split's loads (from L2: other SMs wrote)
            part = part_ptr + at
            per_split = P * N
            if GLU:
                per_split = 2 * P * N
            tl.store(part + split * per_split, acc, mask=live)
            if GLU:
                tl.store(part + split * per_split + P * N, acc_up, mask=live)
            tl.debug_barrier()
            tile = count_ptr + t * tl.num_programs(1) + pid_n
            done = tl.atomic_add(tile, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT_K):
                    acc += tl.load(part + s * per_split, mask=live, other=0.0,
                                   cache_modifier=".cg")
                    if GLU:
                        acc_up += tl.load(part + s * per_split + P * N, mask=live, other=0.0,
                                          cache_modifier=".cg")
                _grouped_store(acc, acc_up, out, live, dtype, GLU)
                tl.atomic_xchg(tile, 0)
    elif split == 0:  # rows past the last group (pairs of experts held elsewhere): zeros
        tl.store(out, tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=live)


def grouped_linear(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
                   scale: torch.Tensor | None = None, glu: bool = False,
                   config: Fp8LinearConfig | None = None, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The routed experts' grouped GEMM. xs [P, K] rows sorted by expert; w [E, W, K]: xs's
    dtype, or e4m3 with scale [E, Nb, Kb] fp32 (one byte per weight); ends [E] int32 on the
    device (non-decreasing, ≤ P: moe_compute's group ends) → [P, N] in xs's dtype, N = W, or
    with glu N = W / 2 and out = silu(xs · gateᵀ) · (xs · upᵀ) (gate: rows [0, N) of each
    expert, up: rows [N, 2N); the first projection and its activation in one pass). Rows past
    ends[E − 1] are 0 (fp8_weights.grouped_reference).

    `ends` is never read on the host: the grid (and the K split, choose_grouped_split)
    depends on (P, N, K, E) only, so a CUDA graph captured once replays with any routing.
    out: a contiguous [P, N] buffer to write (every element is written), else a new one; a
    split K range also allocates its fp32 partials and uses the split-K tile counters."""
    what = "grouped_linear"
    if scale is not None:
        _check_weight(what, xs, w, scale)
    elif (xs.dim() != 2 or xs.stride(-1) != 1 or xs.dtype not in _DTYPES or w.dtype != xs.dtype
          or not w.is_contiguous() or w.shape[-1] != xs.shape[-1]):
        raise ValueError(f"{what}: need xs [P, K] (unit last stride) and contiguous w [E, N, K] "
                         f"of its dtype, got xs {list(xs.shape)} {xs.dtype}, w {list(w.shape)} "
                         f"{w.dtype}")
    if w.dim() != 3 or w.shape[0] < 1 or ends.shape != (w.shape[0],) \
            or ends.dtype != torch.int32 or glu and w.shape[1] % 2:
        raise ValueError(f"{what}: need w [E, N, K] (N even with glu) and ends [E] int32, got "
                         f"w {list(w.shape)}, ends {list(ends.shape)} {ends.dtype}")
    p, k = xs.shape
    e, n = w.shape[0], w.shape[1] // 2 if glu else w.shape[1]
    if out is None:
        out = torch.empty(p, n, dtype=xs.dtype, device=xs.device)
    elif out.shape != (p, n) or out.dtype != xs.dtype or not out.is_contiguous():
        raise ValueError(f"{what}: out must be contiguous [{p}, {n}] {xs.dtype}, got "
                         f"{list(out.shape)} {out.dtype}")
    if p == 0 or n == 0:
        return out
    cfg = config or choose_grouped_config(p, n, k, e, 1 if scale is not None else 2)
    split = cfg.split_k or choose_grouped_split(p, n, k, e, cfg, fp8_w8a8.device_sms(xs.device))
    split, per_split = _k_splits(k, cfg.block_k, split)
    grid = (grouped_row_tiles(p, e, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    if split == 1:
        part = counters = out  # (not read: SPLIT_K 1 compiles without them)
    else:
        part = torch.empty(split, 1 + glu, p, n, dtype=torch.float32, device=xs.device)
        counters = _tile_counters(xs.device, grid[0] * grid[1])
    s = scale if scale is not None else w  # not read without HAS_SCALE
    num_nb, num_kb = scale.shape[1:] if scale is not None else (1, 1)
    _grouped_kernel[grid](
        xs, w, s, ends, out, part, counters, p, n, k, xs.stride(0), num_nb, num_kb, e,
        per_split, E_P2=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, HAS_SCALE=scale is not None, GLU=glu,
        DOT_PRECISION=_dot_precision(xs.dtype), SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_grouped(xs: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor,
                config: Fp8LinearConfig | None = None, out: torch.Tensor | None = None,
                glu: bool = False) -> torch.Tensor:
    """grouped_linear on FP8 experts: wq [E, N, K] e4m3, scale [E, Nb, Kb] fp32 (the FP8
    counterpart of moe_compute's torch._grouped_mm; same contract)."""
    return grouped_linear(xs, wq, ends, scale, glu, config, out)
