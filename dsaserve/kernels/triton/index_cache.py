"""Indexer key writer: quantize + store indexer keys at their slots (FP8 pages or float rows).

FP8 pages hold block_size keys of D e4m3 values, then their block_size fp32 scales (one
power-of-two scale per key); bytes as dsaserve.kernels.formats.write_index_cache. A −1 slot is
skipped, so the launch needs no host sync and no compaction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats
from dsaserve.kernels.triton.mla_cache import pow2_ceil, to_e4m3


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["n"])
def _write_index_fp8_kernel(
    cache_ptr,  # fp8 view of the uint8 pages, flat [num_blocks · BS · (D + 4)]
    slots_ptr,  # [N] int64, −1 = skip
    k_ptr,  # [N, D]
    n, stride_k,
    D: tl.constexpr, BS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    TOKENS: tl.constexpr,
):
    # TOKENS keys per program: one 132-byte key is too little work for a program to keep the
    # memory system busy (0.6 TB/s at one key per program).
    i = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    slot = tl.load(slots_ptr + i, mask=i < n, other=-1)
    ok = slot >= 0
    page = cache_ptr + (tl.maximum(slot, 0) // BS) * (BS * (D + 4))  # [TOKENS]
    offset = tl.maximum(slot, 0) % BS
    d = tl.arange(0, D)
    k = tl.load(k_ptr + i[:, None] * stride_k + d[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)  # [TOKENS, D]
    scale = pow2_ceil(tl.maximum(tl.max(tl.abs(k), axis=1), MIN_AMAX) / FP8_MAX)  # [TOKENS]
    k8 = to_e4m3(k / scale[:, None], FP8_MAX)
    tl.store((page + offset * D)[:, None] + d[None, :], k8, mask=ok[:, None])
    tl.store((page + BS * D + offset * 4).to(tl.pointer_type(tl.float32)), scale, mask=ok)


@triton.jit
def _write_index_float_kernel(cache_ptr, slots_ptr, k_ptr, stride_k, D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    if slot < 0:
        return
    k = tl.load(k_ptr + i * stride_k + tl.arange(0, D))
    tl.store(cache_ptr + slot * D + tl.arange(0, D), k.to(cache_ptr.dtype.element_ty))


def write_index_cache(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Store indexer keys k [N, D] at slots [N] (−1: skip; valid slots distinct and in range).

    cache: uint8 pages [num_blocks, block_size·(D+4)] (values then scales, power-of-two scale
    per token) or float [num_blocks, block_size, D]; contiguous. Same bytes as
    formats.write_index_cache.
    """
    if k.dim() != 2:
        raise ValueError(f"write_index_cache: expected k [N, D], got {tuple(k.shape)}")
    n, head_dim = k.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"write_index_cache: head dim {head_dim} must be a power of two")
    if slots.shape != (n,) or slots.dtype.is_floating_point:
        raise ValueError(f"write_index_cache: slots must be integer [N={n}], "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if not cache.is_contiguous():
        raise ValueError("write_index_cache: cache must be contiguous")
    if n == 0:
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    slots = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    if cache.dtype == torch.uint8:
        token_bytes = formats.index_token_bytes(head_dim)
        if cache.dim() != 2 or cache.shape[1] % token_bytes:
            raise ValueError(f"write_index_cache: fp8 cache must be [num_blocks, "
                             f"block_size*{token_bytes}], got {tuple(cache.shape)}")
        tokens = 16
        _write_index_fp8_kernel[(triton.cdiv(n, tokens),)](
            cache.view(torch.float8_e4m3fn), slots, k, n, k.stride(0),
            D=head_dim, BS=cache.shape[1] // token_bytes, FP8_MAX=formats.FP8_MAX,
            MIN_AMAX=formats.INDEX_MIN_AMAX, TOKENS=tokens, num_warps=4,
        )
    elif cache.dtype.is_floating_point:
        if cache.dim() != 3 or cache.shape[2] != head_dim:
            raise ValueError(f"write_index_cache: float cache must be [num_blocks, block_size, "
                             f"{head_dim}], got {tuple(cache.shape)}")
        _write_index_float_kernel[(n,)](cache, slots, k, k.stride(0), D=head_dim, num_warps=1)
    else:
        raise ValueError(f"write_index_cache: cache dtype must be uint8 or float, "
                         f"got {cache.dtype}")
