"""Row log-sum-exp in one read of the logits: the chosen tokens' log-probabilities without
a [rows, vocab] log_softmax.

A step reports each emitted token's log-probability, log_softmax(logits)[token] =
logits[token] − logsumexp(logits). PyTorch's log_softmax reads a row for its maximum, again
for its sum and again to write every log-probability (151,552 of them a row for GLM-5.3), and
the gather reads one back: at b = 64 with MTP3 the verify's 256 rows are ~155 MB of fp32
written and ~0.5 GB moved for 256 numbers. Here a program streams its row once, keeping a
running maximum and sum per lane (each rescaled when its maximum grows), and combines the
lanes at the end; the step gathers the tokens' logits beside it (engine/sampler.py:
chosen_logprobs). Rows whose top log-probabilities are asked for still take log_softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["V"])
def _row_lse_kernel(
    x_ptr,  # [R, V] fp32, rows stride_x apart, unit last stride
    out_ptr,  # [R] fp32
    V, stride_x,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    at = x_ptr + row * stride_x
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running maximum
    # each lane's Σ exp(x − shift), shift its maximum (0 while it has seen only −inf: −inf −
    # −inf would be NaN); a rescale factor above 1 only meets an empty sum, so it is clamped
    # (exp of a large difference would overflow, and 0 · inf is NaN)
    s = tl.zeros([BLOCK], tl.float32)
    shift = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(at + start + cols, mask=start + cols < V, other=float("-inf"))
        m = tl.maximum(m, x)
        new_shift = tl.where(m > float("-inf"), m, 0.0)
        s = s * tl.exp(tl.minimum(shift - new_shift, 0.0)) + tl.exp(x - new_shift)
        shift = new_shift
    top = tl.max(m, axis=0)
    top_shift = tl.where(top > float("-inf"), top, 0.0)
    total = tl.sum(s * tl.exp(tl.minimum(shift - top_shift, 0.0)), axis=0)
    tl.store(out_ptr + row, top + tl.log(total))


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] fp32 (rows may be strided, the last dimension contiguous) → log Σ_v exp(x[r, v])
    [R] fp32 (−inf for a row of −inf; NaN propagates)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"row_logsumexp: x must be fp32 [R, V] with unit last stride, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _row_lse_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=2048,
                                       num_warps=8)
    return out
