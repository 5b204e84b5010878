"""The grouped MoE's pairs laid out by expert in one launch, for decode-sized batches.

Before its grouped GEMMs the MoE sorts the (token, choice) pairs by the expert they go to: in
PyTorch the local expert ids (a subtraction and a select under EP), a stable argsort, a gather
of the sorted ids, an arange and a searchsorted for the group ends, their cast, the pairs'
tokens, and the inverse permutation the combine reads (an empty, an arange, a scatter) — ten
launches per MoE layer, a few µs each whatever the batch (docs/decode.md, "the small kernels of
a layer"). Here one program does it for up to MAX_PAIRS pairs, the keys in registers:

    local[p] = ids[p] − first, or `count` for an expert held elsewhere    p < P = N · k
    key[p]   = local[p] · BLOCK + p          (sorted ascending: by expert, then by pair: stable)
    order    = the sorted keys' pairs        token[i] = order[i] // k, pos[order[i]] = i
    ends[e]  = #pairs with local ≤ e         (a histogram of local, then its running sum)

Larger batches (prefill) keep PyTorch's sort, whose work the chunk's GEMMs dwarf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 4096  # a decode batch of 512 tokens at 8 experts each


@triton.jit(do_not_specialize=["num_pairs", "first", "count"])
def _moe_pairs_kernel(
    ids_ptr,  # [P] int64: each pair's expert (the model's numbering), contiguous
    token_ptr,  # [P] int64 out: the token of each sorted pair
    pos_ptr,  # [P] int64 out: where each pair sits in the sorted order
    ends_ptr,  # [count] int32 out: group ends
    num_pairs, first, count,
    K: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    p = tl.arange(0, BLOCK)
    live = p < num_pairs
    local = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int32) - first
    held = (local >= 0) & (local < count)
    local = tl.where(live, tl.where(held, local, count), count + 1)  # padding sorts last
    key = tl.sort(local * BLOCK + p)
    order = key % BLOCK
    tl.store(token_ptr + p, (order // K).to(tl.int64), mask=live)
    tl.store(pos_ptr + order, p.to(tl.int64), mask=live)
    ends = tl.cumsum(tl.histogram(local, BINS), 0)
    e = tl.arange(0, BINS)
    tl.store(ends_ptr + e, ends, mask=e < count)


def moe_pairs(ids: torch.Tensor, first: int, count: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, k] (the router's) → (token of each sorted pair [P] int64, each pair's place in
    the sorted order [N, k] int64, group ends [count] int32) for the `count` experts from
    `first` held here; pairs of experts held elsewhere sort last, past ends[-1]. The contract of
    `moe_compute.pair_layout_reference`; N · k ≤ MAX_PAIRS. No host sync."""
    n, k = ids.shape
    pairs = n * k
    if pairs > MAX_PAIRS:
        raise ValueError(f"moe_pairs: {pairs} pairs, at most {MAX_PAIRS}")
    token = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    pos = torch.empty(n, k, dtype=torch.int64, device=ids.device)
    ends = torch.empty(count, dtype=torch.int32, device=ids.device)
    if pairs:
        block = max(triton.next_power_of_2(pairs), 16)
        _moe_pairs_kernel[(1,)](
            ids if ids.is_contiguous() else ids.contiguous(), token, pos, ends, pairs, first,
            count, K=k, BLOCK=block, BINS=triton.next_power_of_2(count + 2),
            num_warps=max(1, min(8, block // 256)),
        )
    else:
        ends.zero_()
    return token, pos, ends
