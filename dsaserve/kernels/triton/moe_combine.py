"""The routed experts' outputs summed back per token, in one pass: the grouped MoE's combine.

The grouped GEMMs leave one output row per (token, choice) pair, sorted by expert ([P, H],
P = N · k). PyTorch's combine was `out.index_add_(0, token_of, y.float() * w[:, None])`: an
fp32 copy of y, its product with the weights (another [P, H] fp32 tensor) and atomic adds into
[N, H] — at a 16K-token prefill chunk of GLM-5.3 (k = 8, H = 6144) ~3 GB of fp32 written and
read again per layer, and float atomics whose order (so whose rounding) changes from run to run.

Here a program takes one token's columns, reads its k rows where the sort put them and adds
them in fp32 in the router's choice order, and writes the sum once: y read once, out written
once, the same bits every run.

    pos [N, k]: the sorted row of each of token t's pairs (moe_compute.pair_positions)
    out[t, c] = Σ_j w[t, j] · y[pos[t, j], c]     over j with pos[t, j] < limit
    (rows at or past `limit`: pairs of experts held on another rank, never written)
    [+ shared[t, c], then cast to shared's dtype: the MoE's output in one pass]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024  # columns per program (GLM-5.3's 6144: 6 programs per token)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_combine_kernel(
    y_ptr,  # [P, H], rows stride_y apart, unit last stride
    pos_ptr,  # [N, K] int64, contiguous
    w_ptr,  # [N, K] fp32, contiguous
    limit_ptr,  # [1] int (a device value): rows at or past it are not read; unused without
    shared_ptr,  # [N, H] contiguous: the shared experts' output, added; unused without
    out_ptr,  # [N, H] contiguous: fp32, or the shared output's dtype
    num_tokens, H, stride_y,
    K: tl.constexpr, BLOCK: tl.constexpr, LIMITED: tl.constexpr, SHARED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if LIMITED:
        limit = tl.load(limit_ptr).to(tl.int64)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        held = live
        if LIMITED:
            held = live & (p < limit)
        row = tl.load(y_ptr + p * stride_y + cols, mask=held, other=0.0).to(tl.float32)
        acc += w * row
    if SHARED:
        acc += tl.load(shared_ptr + t * H + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def moe_combine(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                limit: torch.Tensor | None = None,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """y [P, H] (rows in expert order, last dim contiguous), pos [N, k] int64 and w [N, k]
    fp32, limit [1] (rows ≥ limit[0] skipped) or None, shared [N, H] (the shared experts'
    output, added in fp32) or None → [N, H] fp32, or in shared's dtype when given. No host
    sync; the contract of `moe_compute.combine_reference`."""
    n, k = pos.shape
    h = y.shape[1]
    out = torch.empty(n, h, dtype=torch.float32 if shared is None else shared.dtype,
                      device=y.device)
    if n == 0 or h == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    pos, w = (t if t.is_contiguous() else t.contiguous() for t in (pos, w))
    if shared is not None and not shared.is_contiguous():
        shared = shared.contiguous()
    grid = (n, triton.cdiv(h, BLOCK_H))
    _moe_combine_kernel[grid](
        y, pos, w, pos if limit is None else limit, out if shared is None else shared, out,
        n, h, y.stride(0), K=k, BLOCK=BLOCK_H, LIMITED=limit is not None,
        SHARED=shared is not None, num_warps=4,
    )
    return out
