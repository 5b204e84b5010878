"""Sigmoid noaux_tc routing (MODEL_SPEC.md §2.6) after the router's GEMM, in one launch.

In PyTorch the routing of a token is a chain of small kernels over its [E] logits: the
sigmoid, the bias, (grouped models) each group's top-2 sum, the top groups, a mask, its
repeat and fill, then the top-k, the gather of the chosen scores, their sum and the two
scalings — 8 launches per MoE layer, 15 with groups, each a few µs whatever the batch: at
decode batches that is most of the routing's time (docs/decode.md, "the small kernels of a
layer"). Here a program routes one token: its logits in registers, the same arithmetic in fp32,
the ids and weights written once.

    scores  = sigmoid(logits)                          [E]   (the weights come from these)
    choice  = scores + bias                            [E]   (the bias steers selection only)
    groups (G > 1): group score = sum of its top 2 choices; the topk_group best groups kept,
                    the other groups' choices −inf
    ids     = the k best choices, best first (ties: the lower expert id)
    weights = scores[ids] / (Σ scores[ids] + 1e-20) · scale   (the division only when
                                                                norm_topk_prob)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr,  # [N, E] fp32 contiguous: the router GEMM's output
    bias_ptr,  # [E] fp32: e_score_correction_bias
    ids_ptr,  # [N, K] int64 out
    weights_ptr,  # [N, K] fp32 out
    num_tokens, scale,
    E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    live = e < E
    logit = tl.load(logits_ptr + t * E + e, mask=live, other=0.0)
    scores = tl.sigmoid(logit)
    choice = tl.where(live, scores + tl.load(bias_ptr + e, mask=live, other=0.0), float("-inf"))
    if GROUPS > 1:
        size: tl.constexpr = E // GROUPS
        group = e // size
        # each group's score: the sum of its two best choices
        gsum = tl.zeros([BLOCK_E], dtype=tl.float32)  # every expert holds its group's score
        for g in tl.static_range(GROUPS):
            member = live & (group == g)
            vals = tl.where(member, choice, float("-inf"))
            first = tl.argmax(vals, axis=0)
            best = tl.max(vals, axis=0)
            second = tl.max(tl.where(e == first, float("-inf"), vals), axis=0)
            gsum = tl.where(member, best + second, gsum)
        # the TOPK_GROUPS best groups (ties: the lower group), one expert standing for each
        lead = tl.where(live & (e % size == 0), gsum, float("-inf"))
        kept = e < 0
        for _ in tl.static_range(TOPK_GROUPS):
            g = tl.argmax(lead, axis=0) // size
            kept = kept | (group == g)
            lead = tl.where(group == g, float("-inf"), lead)
        choice = tl.where(kept, choice, float("-inf"))
    j = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.argmax(choice, axis=0)
        ids = tl.where(j == i, best.to(tl.int64), ids)
        chosen = tl.where(j == i, tl.sum(tl.where(e == best, scores, 0.0), axis=0), chosen)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        chosen = chosen / (tl.sum(chosen, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + j, ids, mask=j < K)
    tl.store(weights_ptr + t * K + j, chosen * scale, mask=j < K)


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_groups: int,
          norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 (the router GEMM's output), bias [E] fp32 → (ids [N, k] int64,
    weights [N, k] fp32): model/dsa.py `Router`'s routing, one program per token; `groups`
    ≤ 1 routes without groups (topk_groups unused), as the model's config says. No host
    sync."""
    n, e = logits.shape
    if groups <= 1:
        groups = topk_groups = 1
    if e % groups or not 0 < topk_groups <= groups or not 0 < k <= e:
        raise ValueError(f"route: {e} experts, {groups} groups, {topk_groups} kept, k = {k}")
    if not logits.is_contiguous():
        logits = logits.contiguous()
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits, bias, ids, weights, n, scale,
            E=e, BLOCK_E=triton.next_power_of_2(e), K=k, BLOCK_K=triton.next_power_of_2(k),
            GROUPS=groups, TOPK_GROUPS=topk_groups, NORM=norm, num_warps=4 if e > 128 else 1,
        )
    return ids, weights
