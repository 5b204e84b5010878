"""Block-FP8 weights ("w8a16", and "w8a8" at MTP3-verify sizes): the layout maths and the
PyTorch references.

DeepSeek-V3.2 / GLM-5.x checkpoints store a matrix W [N, K] (out × in) as float8_e4m3fn bytes Wq
with one fp32 scale per 128 × 128 block, `weight_scale_inv` S [⌈N/128⌉, ⌈K/128⌉]:

         k →  0 .. 127 | 128 .. 255 | 256 .. K-1
    n 0      ┌────────┬────────────┬──────┐        W[n, k] ≈ Wq[n, k] · S[n // 128, k // 128]
      ..     │ S[0,0] │   S[0,1]   │S[0,2]│
      127    ├────────┼────────────┼──────┤        the last block row / column may be partial
      128    │ S[1,0] │   S[1,1]   │S[1,2]│
             └────────┴────────────┴──────┘

The weight value the weight-only paths compute with is dtype(fp32(Wq) · S) — the same value
loading the checkpoint dequantized in fp32 and casting it to the model dtype gives — and
activations stay in their own dtype; products accumulate in fp32. At 65–256 rows of bf16 / fp16
activations (17–64 per expert for the MoE) the GPU runs W8A8 instead
(kernels/triton/fp8_w8a8.py): the activations quantized per row and 128 columns
(`quantize_activations`), FP8 products scaled per group (`w8a8_reference`), as DeepSeek-V3's
own inference and the serving engines run these models.

A tensor-parallel shard of W may start inside a block: rows 192 .. 383 of a 128-blocked matrix
keep the scale rows of blocks 1 .. 2, and their row 0 is row 64 of block 1 (`n_off` = 64):

    full rows    0 ....... 127 | 128 ... 191 192 ....... 255 | 256 ...... 383 | 384 ..
    shard rows                            0 ........... 63 | 64 ....... 191 |
    scale rows   block 0       | block 1  (kept: row 0)      | block 2 (row 1) |
                                 ├─ n_off ─┤

Element (n, k) of a shard uses S_shard[(n + n_off) // 128, (k + k_off) // 128], 0 ≤ off < 128.
Pure PyTorch, runs anywhere; the Triton kernels (kernels/triton/fp8_linear.py, fp8_w8a8.py) are
tested against these functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_BLOCK = 128  # rows and columns sharing one scale
FP8_E4M3_MAX = 448.0  # the largest finite e4m3 value: a block's (or group's) maximum maps to it


def num_blocks(size: int, off: int = 0) -> int:
    """Scale blocks covering `size` elements that start `off` elements into their first block."""
    return -(-(size + off) // FP8_BLOCK)


def check_weight(wq: torch.Tensor, scale: torch.Tensor, n_off: int, k_off: int,
                 what: str = "fp8 weight") -> None:
    """ValueError (prefixed by `what`) unless wq is e4m3 and scale has the blocks covering it."""
    if wq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{what}: expected float8_e4m3fn, got {wq.dtype}")
    if not (0 <= n_off < FP8_BLOCK and 0 <= k_off < FP8_BLOCK):
        raise ValueError(f"{what}: offsets must be in [0, {FP8_BLOCK}), got n_off={n_off}, "
                         f"k_off={k_off}")
    n, k = wq.shape[-2:]
    want = (*wq.shape[:-2], num_blocks(n, n_off), num_blocks(k, k_off))
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {list(scale.shape)}, expected {list(want)} "
                         f"for weight {list(wq.shape)} with n_off={n_off}, k_off={k_off}")


def dequantize(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, n_off: int = 0,
               k_off: int = 0) -> torch.Tensor:
    """wq [..., N, K] e4m3, scale [..., Nb, Kb] fp32 → [..., N, K] dtype: element (n, k) is
    dtype(fp32(wq[n, k]) · scale[(n + n_off) // 128, (k + k_off) // 128]).

    With no offsets and dtype fp32 this is the loader's dequantize_fp8_blocks at 128 × 128."""
    check_weight(wq, scale, n_off, k_off)
    n, k = wq.shape[-2:]
    s = scale.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., n_off:n_off + n, :]
    s = s.repeat_interleave(FP8_BLOCK, dim=-1)[..., k_off:k_off + k]  # [..., N, K]
    return (wq.float() * s).to(dtype)


def shard_scale(scale: torch.Tensor, dim: int, start: int, stop: int
                ) -> tuple[torch.Tensor, int]:
    """The scale blocks covering elements [start, stop) of the weight along `dim` (0: rows,
    1: columns) and the offset of `start` inside its first block: the shard
    weight[start:stop] (or [:, start:stop]) with (scale_slice, offset) satisfies `dequantize`'s
    contract, the offset as n_off (dim 0) or k_off (dim 1).

        start = 192, stop = 384:  blocks 192 // 128 = 1 .. ⌈384 / 128⌉ = 3 (exclusive), offset 64
    """
    if dim not in (0, 1):
        raise ValueError(f"shard_scale: dim must be 0 (rows) or 1 (columns), got {dim}")
    if not 0 <= start < stop <= scale.shape[dim] * FP8_BLOCK:
        raise ValueError(f"shard_scale: need 0 <= start < stop <= {scale.shape[dim] * FP8_BLOCK}"
                         f" (scale dim {dim} has {scale.shape[dim]} blocks), got [{start}, {stop})")
    first, end = start // FP8_BLOCK, -(-stop // FP8_BLOCK)
    return scale.narrow(dim, first, end - first), start - first * FP8_BLOCK


def grouped_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Row tiles of a grouped GEMM's grid that suffice for any split of num_rows sorted rows
    into num_groups groups plus the rows past the last group: a group of c rows takes
    ⌈c / block_m⌉ tiles, and ⌈a / b⌉ + ⌈c / b⌉ ≤ ⌈(a + c) / b⌉ + 1, so the num_groups + 1 runs
    take at most ⌈num_rows / block_m⌉ + num_groups. Host-known sizes only (no routing)."""
    return -(-num_rows // block_m) + num_groups


def grouped_tiles(ends: list[int], num_rows: int, block_m: int) -> list[tuple[int, int, int]]:
    """The row tiles of a grouped GEMM, as the kernel finds them on the device, listed on the
    host: tile t → (group, first row, end row), group −1 for the rows past the last group
    (written 0). Tiles past these have no rows.

        tiles[e] = ⌈(ends[e] − ends[e−1]) / block_m⌉    cum = running sum of tiles
        tile t:  e = #{e : cum[e] ≤ t}                 groups wholly before t
                 e < E: rows ends[e−1] + (t − cum[e] + tiles[e])·block_m .. ≤ ends[e]
                 e = E: rows ends[E−1] + (t − cum[E−1])·block_m .. ≤ num_rows
    """
    out, start = [], 0
    for e, end in enumerate(ends):
        out += [(e, r, min(r + block_m, end)) for r in range(start, end, block_m)]
        start = end
    out += [(-1, r, min(r + block_m, num_rows)) for r in range(start, num_rows, block_m)]
    return out


def quantize_blocks(w: torch.Tensor, rows_per_pass: int = 8192
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a [out, in] matrix to float8_e4m3fn with one fp32 scale per 128 × 128 block
    (the checkpoints' layout above; the last block row / column may be partial):

        scale_inv[r // 128, c // 128] = max |w in the block| / 448,   w ≈ wq · scale_inv

    → (wq [out, in] e4m3, scale_inv [⌈out/128⌉, ⌈in/128⌉] fp32), on w's device. Works through
    `rows_per_pass` rows (a multiple of 128) at a time, so that quantizing a large matrix on a
    GPU (a 154,880-row lm_head) needs a transient fp32 copy of one pass, not of the matrix."""
    if rows_per_pass % FP8_BLOCK:
        raise ValueError(f"quantize_blocks: rows_per_pass must be a multiple of {FP8_BLOCK}, "
                         f"got {rows_per_pass}")
    out_dim, in_dim = w.shape
    cb = num_blocks(in_dim)
    wq = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(num_blocks(out_dim), cb, dtype=torch.float32, device=w.device)
    for r0 in range(0, out_dim, rows_per_pass):
        part = w[r0:r0 + rows_per_pass]
        rb = num_blocks(part.shape[0])
        padded = part.new_zeros(rb * FP8_BLOCK, cb * FP8_BLOCK, dtype=torch.float32)
        padded[:part.shape[0], :in_dim] = part.float()
        blocks = padded.view(rb, FP8_BLOCK, cb, FP8_BLOCK)  # [rb, 128, cb, 128]
        amax = blocks.abs().amax(dim=(1, 3))  # [rb, cb]
        s = (amax / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # all-zero blocks
        q = (blocks / s[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        wq[r0:r0 + part.shape[0]] = q.view(rb * FP8_BLOCK, -1)[:part.shape[0], :in_dim]
        scale[r0 // FP8_BLOCK:r0 // FP8_BLOCK + rb] = s
    return wq, scale


def linear_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
                     k_off: int = 0) -> torch.Tensor:
    """x [M, K], wq [N, K] e4m3, scale [Nb, Kb] fp32 → x · Wᵀ [M, N] in x's dtype, W
    dequantized to x's dtype first (what a dequantize-at-load model computes)."""
    return F.linear(x, dequantize(wq, scale, x.dtype, n_off, k_off))


# The smallest activation-group maximum a scale is made from: an all-zero group quantizes to
# zeros with a finite scale (the scale, not the quotient, would otherwise be 0 / 0).
ACT_AMAX_FLOOR = 1e-10


def quantize_activations(x: torch.Tensor, k_off: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8: x [M, K] → (xq [M, K] e4m3, xs [M, Kb] fp32), one scale per row and 128-column
    group, the groups on the weight's scale grid (group g: columns k with (k + k_off) // 128
    == g, so a shard's first group is 128 − k_off wide). xs = max(amax, floor) / 448 and
    xq = e4m3(fp32(x) / xs), rounded to nearest even: DeepSeek-V3's activation quantization
    (per token, 1 × 128), as vLLM, SGLang and transformers' FineGrainedFP8 run these models."""
    m, k = x.shape
    kb = num_blocks(k, k_off)
    padded = x.new_zeros(m, kb * FP8_BLOCK, dtype=torch.float32)
    padded[:, k_off : k_off + k] = x.float()
    groups = padded.view(m, kb, FP8_BLOCK)
    amax = groups.abs().amax(-1).clamp(min=ACT_AMAX_FLOOR)  # [M, Kb]
    # divided by a tensor: a CUDA tensor divided by a Python number is multiplied by its
    # rounded reciprocal instead (one ulp off in some rows); this is the IEEE quotient anywhere
    xs = amax / amax.new_tensor(FP8_E4M3_MAX)
    q = (groups / xs[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, kb * FP8_BLOCK)[:, k_off : k_off + k].contiguous(), xs


def w8a8_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, n_off: int = 0,
                   k_off: int = 0) -> torch.Tensor:
    """x [M, K], wq [N, K] e4m3, scale [Nb, Kb] fp32 → [M, N] in x's dtype: x quantized per
    row and 128-column group (`quantize_activations`), each group's product of the FP8 values
    scaled by its activation and weight scales, summed over the groups in fp32."""
    check_weight(wq, scale, n_off, k_off)
    xq, xs = quantize_activations(x, k_off)
    n, k = wq.shape
    acc = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    s_rows = scale[(torch.arange(n, device=x.device) + n_off) // FP8_BLOCK]  # [N, Kb]
    for g in range(xs.shape[1]):
        lo, hi = max(0, g * FP8_BLOCK - k_off), min(k, (g + 1) * FP8_BLOCK - k_off)
        part = xq[:, lo:hi].float() @ wq[:, lo:hi].float().T  # [M, N]
        acc += part * xs[:, g : g + 1] * s_rows[:, g]
    return acc.to(x.dtype)


def grouped_reference(xs: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                      ends: torch.Tensor, product=linear_reference) -> torch.Tensor:
    """xs [P, K] rows sorted by expert, wq [E, N, K] e4m3, scale [E, Nb, Kb] fp32, ends [E]
    int (non-decreasing, ≤ P) → [P, N] in xs's dtype, each expert's rows through `product`
    (linear_reference: the dequantized weight; w8a8_reference: W8A8, whose quantization is per
    row, so grouping does not change it).

        rows   0 ........ ends[0] ........ ends[1] ... ends[E-1] ........ P
               │ expert 0 │    expert 1    │  ...   │   zeros (no group) │

    Rows past ends[E-1] (pairs of experts held on another rank) are 0. Reads `ends` on the host:
    a reference, not a hot path."""
    check_weight(wq, scale, 0, 0)
    out = torch.zeros(xs.shape[0], wq.shape[1], dtype=xs.dtype, device=xs.device)  # [P, N]
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = product(xs[start:end], wq[e], scale[e])
        start = end
    return out
