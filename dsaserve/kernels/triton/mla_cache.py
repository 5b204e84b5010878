"""MLA cache writer: quantize + store fp8_ds_mla rows (or plain float rows) at their slots.

One program per token row; a −1 slot returns at once, so the launch needs no host sync and no
compaction. Byte layout and scale rule: dsaserve.kernels.formats.quantize_mla_rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats


@triton.jit
def pow2_ceil(x):
    """2^ceil(log2(x)) for positive normal fp32 x, exact: bump the exponent field unless the
    mantissa is zero (x already a power of two). Same result as formats.pow2_ceil."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent += ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, FP8_MAX: tl.constexpr):
    """fp32 → float8_e4m3fn, saturated at ±FP8_MAX, round to nearest even: the value is rounded
    in fp32 arithmetic first, so the cast is exact whatever rounding it applies (Triton's
    interpreter does not round to nearest even). Same bytes as formats._to_e4m3."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    # Normal range (|x| ≥ 2^-6): keep 3 of the 23 mantissa bits, ties to even; a carry moves
    # into the exponent, as it should.
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    # Subnormal range: multiples of 2^-9, rounded by the 1.5·2^23 trick on |x|; the sign bit is
    # put back by hand (Triton's negation is 0 − x, which turns −0.0 into +0.0).
    sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) >= 0.015625, normal.to(tl.float32, bitcast=True),
                    sub).to(tl.float8e4nv)


@triton.jit
def _write_mla_fp8_kernel(
    cache_ptr,  # fp8 view of the uint8 cache, flat [num_slots · ROW_BYTES]
    slots_ptr,  # [N] int64, −1 = skip
    c_ptr,  # [N, L]
    k_pe_ptr,  # [N, R]
    stride_c, stride_k_pe,
    L: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, ROW_BYTES: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    if slot < 0:
        return
    NUM_TILES: tl.constexpr = L // TILE
    row = cache_ptr + slot * ROW_BYTES
    c = tl.load(c_ptr + i * stride_c + tl.arange(0, L)).to(tl.float32)  # [L]
    c = tl.reshape(c, [NUM_TILES, TILE])
    amax = tl.max(tl.abs(c), axis=1)  # [NUM_TILES]
    scale = pow2_ceil(tl.maximum(amax / FP8_MAX, MIN_SCALE))  # [NUM_TILES], powers of two
    c8 = to_e4m3(c / scale[:, None], FP8_MAX)
    tl.store(row + tl.arange(0, L), tl.reshape(c8, [L]))
    scale_ptr = (row + L).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr + tl.arange(0, NUM_TILES), scale)
    k_pe = tl.load(k_pe_ptr + i * stride_k_pe + tl.arange(0, R)).to(tl.bfloat16)  # [R]
    k_pe_out = (row + L + 4 * NUM_TILES).to(tl.pointer_type(tl.bfloat16))
    tl.store(k_pe_out + tl.arange(0, R), k_pe)


@triton.jit
def _write_mla_float_kernel(
    cache_ptr,  # flat [num_slots · (L + R)] float
    slots_ptr, c_ptr, k_pe_ptr, stride_c, stride_k_pe,
    L: tl.constexpr, R: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    if slot < 0:
        return
    row = cache_ptr + slot * (L + R)
    dtype = cache_ptr.dtype.element_ty
    tl.store(row + tl.arange(0, L), tl.load(c_ptr + i * stride_c + tl.arange(0, L)).to(dtype))
    k_pe = tl.load(k_pe_ptr + i * stride_k_pe + tl.arange(0, R))
    tl.store(row + L + tl.arange(0, R), k_pe.to(dtype))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def write_mla_cache(cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor,
                    k_pe: torch.Tensor) -> None:
    """Store c [N, L] and k_pe [N, R] at slots [N] (−1: skip; valid slots distinct and in range).

    cache: [num_blocks, block_size, 656] uint8 (fp8_ds_mla, quantized here with power-of-two
    scales) or [num_blocks, block_size, L + R] float; contiguous. Same bytes as
    formats.write_mla_cache. Slots are not range-checked (that would sync with the device).
    """
    if cache.dim() != 3 or not cache.is_contiguous():
        raise ValueError(f"write_mla_cache: cache must be contiguous 3-D, got {tuple(cache.shape)}")
    if c.dim() != 2 or k_pe.dim() != 2 or c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"write_mla_cache: expected c [N, L] and k_pe [N, R], "
            f"got c {tuple(c.shape)} and k_pe {tuple(k_pe.shape)}"
        )
    if slots.shape != (c.shape[0],) or slots.dtype.is_floating_point:
        raise ValueError(f"write_mla_cache: slots must be integer [N={c.shape[0]}], "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    lora, rope = c.shape[1], k_pe.shape[1]
    if not (_is_pow2(lora) and _is_pow2(rope)):
        raise ValueError(f"write_mla_cache: L={lora} and R={rope} must be powers of two")
    n = c.shape[0]
    if n == 0:
        return
    c = c if c.stride(1) == 1 else c.contiguous()
    k_pe = k_pe if k_pe.stride(1) == 1 else k_pe.contiguous()
    slots = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    if cache.dtype == torch.uint8:
        row_bytes = formats.mla_row_bytes(lora, rope)
        if cache.shape[2] != row_bytes:
            raise ValueError(f"write_mla_cache: fp8 cache rows are {cache.shape[2]} bytes, "
                             f"L={lora}, R={rope} need {row_bytes}")
        _write_mla_fp8_kernel[(n,)](
            cache.view(torch.float8_e4m3fn), slots, c, k_pe, c.stride(0), k_pe.stride(0),
            L=lora, R=rope, TILE=formats.MLA_TILE, ROW_BYTES=row_bytes,
            FP8_MAX=formats.FP8_MAX, MIN_SCALE=formats.MLA_MIN_SCALE, num_warps=4,
        )
    elif cache.dtype.is_floating_point:
        if cache.shape[2] != lora + rope:
            raise ValueError(f"write_mla_cache: float cache rows are {cache.shape[2]} wide, "
                             f"L+R = {lora + rope}")
        _write_mla_float_kernel[(n,)](
            cache, slots, c, k_pe, c.stride(0), k_pe.stride(0), L=lora, R=rope, num_warps=4,
        )
    else:
        raise ValueError(f"write_mla_cache: cache dtype must be uint8 or float, got {cache.dtype}")
