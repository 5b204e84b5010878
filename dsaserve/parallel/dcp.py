"""Decode context parallelism maths: log-sum-exp merge of partial attention and the exact
distributed top-k of the indexer. Pure functions over tensors; the collectives live in the callers.

LSE merge of N shard partials (o_i, lse_i) of one (token, head):

    m   = max_i lse_i                      (0 when every shard is empty)
    lse = m + log Σ_i exp(lse_i − m)
    o   = Σ_i exp(lse_i − lse) · o_i       (an empty shard has lse_i = −inf and weight 0, never NaN)

Distributed top-k: a key in the global top-k has at most k−1 keys above it anywhere, hence at most
k−1 on its owner's shard, so it is in its owner's local top-k. Merging the N local top-k lists
(score, global id) and taking the top k of the union is therefore exact.
"""

from __future__ import annotations

import torch


def lse_merge(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [N, T, H, D], lse [N, T, H] (natural log; −inf or NaN/+inf = empty shard)
    → merged o [T, H, D] fp32, lse [T, H] fp32 (−inf where every shard was empty)."""
    lse = lse.float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    m = lse.max(dim=0).values  # [T, H]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # [N, T, H]; exactly 0 for empty shards
    total = w.sum(dim=0)  # [T, H]
    merged_lse = torch.where(
        total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf"))
    )
    weights = torch.where(total > 0, w / total.clamp_min(1e-30), torch.zeros_like(w))
    merged_o = (weights[..., None] * torch.nan_to_num(o.float())).sum(dim=0)
    return merged_o, merged_lse


def local_topk_candidates(
    scores: torch.Tensor, key_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, S_local] (−inf = ineligible), key_ids [S_local] global ids of the local keys
    → (scores [T, k], ids [T, k] int64), padded with (−inf, −1); ready to all-gather and merge."""
    t, s = scores.shape
    kk = min(k, s)
    out_s = torch.full((t, k), float("-inf"), dtype=torch.float32, device=scores.device)
    out_i = torch.full((t, k), -1, dtype=torch.int64, device=scores.device)
    if kk:
        vals, idx = scores.float().topk(kk, dim=-1)
        ids = key_ids.to(scores.device)[idx]
        ok = torch.isfinite(vals)
        out_s[:, :kk] = vals
        out_i[:, :kk] = torch.where(ok, ids, -1)
    return out_s, out_i


def merge_topk_candidates(scores: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """scores, ids [N, T, k] gathered from every shard → global top-k ids [T, k] int32 (−1 padded).

    Ties are broken by the smaller global id so that every rank picks the same set."""
    n, t, kk = scores.shape
    s = scores.permute(1, 0, 2).reshape(t, n * kk).float()
    i = ids.permute(1, 0, 2).reshape(t, n * kk)
    s = torch.where(i < 0, float("-inf"), s)
    # Sort by id first, then stably by score: equal scores stay in ascending-id order.
    order = i.argsort(dim=-1, stable=True)
    s, i = s.gather(1, order), i.gather(1, order)
    order = s.argsort(dim=-1, descending=True, stable=True)[:, :k]
    top_s, top_i = s.gather(1, order), i.gather(1, order)
    return torch.where(torch.isfinite(top_s), top_i, -1).to(torch.int32)
