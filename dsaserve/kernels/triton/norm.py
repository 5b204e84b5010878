"""RMSNorm in one pass: the model's `RMSNorm` on the GPU.

In PyTorch the norm is six kernels over the rows (the fp32 copy, its square, the mean, the
rsqrt, the product, the cast) and the weight's product a seventh; on a 16K-token prefill chunk
of a 6144-wide model, the five hidden-state norms of a two-layer step made some thirty passes
over [16384, 6144] tensors (an H200 profile: 15 copies of 3.5 ms and 10 products of 2.8 ms in
68 ms of GPU time). Here a program reads its row once, keeps it in registers and writes
the result once; in decode the same norm is one launch instead of seven.

The arithmetic is the PyTorch module's, in its order: x in fp32, x · rsqrt(mean(x²) + eps)
rounded to x's dtype, then times the weight, rounded to the product's dtype (torch's type
promotion of weight and x). Only the sum's order differs (fp32 rounding).

With a residual (`add_rms_norm`), the residual stream's add comes into the same pass: h + d
rounded to h's dtype (PyTorch's add), written as the new stream, then normed. A decoder layer's
two adds were two more launches per layer, and at a prefill chunk two more passes over [N,
hidden] each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Row counts change from step to step: not specialized on (a new value divisible by 16 would
# compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,  # [num_rows, dim], rows stride_x apart, unit last stride
    w_ptr,  # [dim]
    out_ptr,  # [num_rows, dim] contiguous
    d_ptr,  # ADD: [num_rows, dim] contiguous, added to x first
    sum_ptr,  # ADD: [num_rows, dim] contiguous, x + d in x's dtype
    num_rows, dim, stride_x, eps,
    BLOCK: tl.constexpr,  # ≥ dim, a power of two
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    if ADD:  # PyTorch's add: in fp32, rounded to x's dtype
        d = tl.load(d_ptr + row * dim + cols, mask=live, other=0.0).to(tl.float32)
        h = (x + d).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * dim + cols, h, mask=live)
        x = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF order: cast, then scale
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * y).to(out_ptr.dtype.element_ty), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] (rows may be strided, the last dimension contiguous), weight [dim] →
    RMSNorm(x) · weight, [..., dim] in torch.result_type(weight, x)."""
    dim = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # torch.result_type of two dimensioned tensors (a host op of every norm; so is
    # promote_types: asked only when the dtypes differ)
    dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if rows.shape[0]:
        _launch(rows, weight, out, None, None, eps)
    return out


def add_rms_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, d [N, dim] of one dtype → (RMSNorm(h + d) · weight, h + d): the residual stream's
    add and the next norm in one pass; the sum is new (h is not written)."""
    if d.dtype != h.dtype or d.shape != h.shape or h.dim() != 2:
        raise ValueError(f"add_rms_norm: h and d [N, dim] of one dtype, got {h.dtype} "
                         f"{list(h.shape)} and {d.dtype} {list(d.shape)}")
    if not h.is_contiguous():  # (a check, not a dispatched op: one host call fewer)
        h = h.contiguous()
    if not d.is_contiguous():
        d = d.contiguous()
    dtype = h.dtype if weight.dtype == h.dtype else torch.promote_types(weight.dtype, h.dtype)
    out = torch.empty(h.shape, dtype=dtype, device=h.device)
    total = torch.empty_like(h)
    if h.shape[0]:
        _launch(h, weight, out, d, total, eps)
    return out, total


def _launch(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
            d: torch.Tensor | None, total: torch.Tensor | None, eps: float) -> None:
    block = triton.next_power_of_2(rows.shape[1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows if d is None else d, out if total is None else total,
        rows.shape[0], rows.shape[1], rows.stride(0), eps,
        BLOCK=block, ADD=d is not None, num_warps=max(1, min(16, block // 512)),
    )
