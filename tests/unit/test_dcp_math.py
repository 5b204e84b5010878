"""LSE merge and the distributed top-k against single-shard references."""

from __future__ import annotations

import torch

from dsaserve.parallel.dcp import local_topk_candidates, lse_merge, merge_topk_candidates


def _attend(q, k, v):
    s = q @ k.T  # [T, S]
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_lse_merge_equals_attention_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64), \
        torch.randn(12, 4, dtype=torch.float64)
    full_o, full_lse = _attend(q, k, v)
    owner = torch.arange(12) % 3
    parts = [_attend(q, k[owner == r], v[owner == r]) for r in range(3)]
    o = torch.stack([p[0] for p in parts])[:, :, None]  # [N, T, 1, D]
    lse = torch.stack([p[1] for p in parts])[:, :, None]
    mo, ml = lse_merge(o, lse)
    torch.testing.assert_close(mo[:, 0].double(), full_o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ml[:, 0].double(), full_lse, atol=1e-6, rtol=1e-6)


def test_lse_merge_empty_shards_never_nan():
    o = torch.randn(3, 2, 1, 4, generator=torch.Generator().manual_seed(0))
    lse = torch.tensor([[[-float("inf")], [float("nan")]], [[0.5], [float("inf")]],
                        [[-float("inf")], [-float("inf")]]])
    mo, ml = lse_merge(o, lse)
    assert not torch.isnan(mo).any() and not torch.isnan(ml).any()
    torch.testing.assert_close(mo[0, 0], o[1, 0, 0])
    assert ml[0, 0] == 0.5
    assert ml[1, 0] == -float("inf") and (mo[1] == 0).all()


def test_distributed_topk_is_exact():
    torch.manual_seed(1)
    for n in (1, 2, 3, 4):
        scores = torch.randn(6, 40)
        scores[:, 30:] = -float("inf")  # ineligible keys (future positions)
        k = 8
        ref = scores.topk(k, dim=-1).indices.sort(-1).values
        owner = torch.arange(40) % n
        cands = [local_topk_candidates(scores[:, owner == r], torch.nonzero(owner == r)[:, 0], k)
                 for r in range(n)]
        got = merge_topk_candidates(torch.stack([c[0] for c in cands]),
                                    torch.stack([c[1] for c in cands]), k)
        assert torch.equal(got.long().sort(-1).values, ref)


def test_distributed_topk_pads_and_breaks_ties_by_id():
    scores = torch.tensor([[1.0, 1.0, 1.0, -float("inf")]])
    owner = torch.tensor([1, 0, 1, 0])
    cands = [local_topk_candidates(scores[:, owner == r], torch.nonzero(owner == r)[:, 0], 3)
             for r in range(2)]
    got = merge_topk_candidates(torch.stack([c[0] for c in cands]),
                                torch.stack([c[1] for c in cands]), 4)
    assert got.tolist() == [[0, 1, 2, -1]]
