"""Rotary embedding in one pass: model/rope.py's `apply_rope` on the GPU.

In PyTorch a rotation is about ten kernels (the fp32 copy, four products, two sums, the
interleave, the cast), and the indexer's, which rotates only the first columns of its
vectors, a concatenation more; a decode step of the two-layer GLM-5.3-shaped model launched
some 235 kernels, of which the rotations and norms were a good part. Here a program loads
its token's rows once (each value and its pair partner), rotates the first R columns in fp32,
copies the others, and writes the rows once.

Pairs (MODEL_SPEC.md §2.2) of rotated column j < R, by angle i:
    interleaved (GPT-J):  (2i, 2i + 1)          partner j ^ 1,              i = j // 2
    NeoX (half-split):    (i, i + R/2)          partner j ± R/2,            i = j mod R/2
    first of a pair:  x·cos − partner·sin;  second:  x·cos + partner·sin
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Token counts change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kernel(
    x_ptr,  # [N, H, D], strides (stride_xt, stride_xh, 1)
    cos_ptr,  # [N, R/2] fp32
    sin_ptr,  # [N, R/2] fp32
    out_ptr,  # [N, H, D], strides (stride_ot, stride_oh, 1)
    num_tokens, heads, stride_xt, stride_xh, stride_ot, stride_oh,
    D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_D)
    live = (h < heads)[:, None] & (j < D)[None, :]
    rows = x_ptr + t * stride_xt + h.to(tl.int64)[:, None] * stride_xh  # [BLOCK_H, 1]
    rotated = j < R
    if INTERLEAVED:
        angle, partner, first = j // 2, j ^ 1, j % 2 == 0
    else:
        first = j < R // 2
        angle = j % (R // 2)
        partner = tl.where(first, j + R // 2, j - R // 2)
    angle = tl.where(rotated, angle, 0)
    partner = tl.where(rotated, partner, j)
    x = tl.load(rows + j[None, :], mask=live, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=live, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * (R // 2) + angle, mask=rotated, other=1.0)
    s = tl.load(sin_ptr + t * (R // 2) + angle, mask=rotated, other=0.0)
    s = tl.where(first, -s, s)
    out = tl.where(rotated[None, :], x * c[None, :] + xp * s[None, :], x)
    dst = out_ptr + t * stride_ot + h.to(tl.int64)[:, None] * stride_oh + j[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=live)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, ..., D] (rows may be strided, the last dimension contiguous), cos / sin [N, R/2]
    fp32 → x with its first R columns rotated (the rest copied), in x's dtype: into `out` (x's
    shape and dtype, rows may be strided, the last dimension contiguous; e.g. the RoPE part
    of a wider tensor, which then needs no copy of its own), else a new contiguous tensor."""
    num_tokens, dim = x.shape[0], x.shape[-1]
    rope = 2 * cos.shape[-1]
    if rope > dim:
        raise ValueError(f"rotary: {rope} rotated columns do not fit rows of {dim}")
    # rows [N, heads, D] with their strides; a [N, D] tensor is one head (no reshape: each
    # host op is a few µs of an eager step)
    x3 = x if x.dim() in (2, 3) else x.reshape(num_tokens, -1, dim)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"rotary: out must be {tuple(x.shape)} {x.dtype} with unit last "
                         f"stride, got {tuple(out.shape)} {out.dtype} {out.stride()}")
    heads = x3.shape[1] if x3.dim() == 3 else 1
    stride_h = x3.stride(1) if x3.dim() == 3 else dim
    stride_oh = out.stride(1) if out.dim() == 3 else dim
    if num_tokens and heads:
        block_d = triton.next_power_of_2(dim)
        block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
        _rotary_kernel[(num_tokens, triton.cdiv(heads, block_h))](
            x3, cos.contiguous(), sin.contiguous(), out, num_tokens, heads,
            x3.stride(0), stride_h, out.stride(0), stride_oh,
            D=dim, R=rope, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=4,
        )
    return out
