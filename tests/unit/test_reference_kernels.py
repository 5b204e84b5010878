"""Reference kernels against independent oracles: dense masked fp64 attention, explicit loops,
sort-based top-k."""

from __future__ import annotations

import math

import pytest
import torch

from dsaserve.kernels import formats as F
from dsaserve.kernels import reference as ref

L, R = 512, 64
DQK = L + R
SCALE = 192**-0.5

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _random_indices(g: torch.Generator, t: int, s: int, k: int) -> torch.Tensor:
    """[t, k] distinct rows of [0, s) per query, with −1 holes; row 0 has no valid index."""
    idx = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)])  # [t, k]
    holes = torch.rand(t, k, generator=g) < 0.3
    idx[holes] = -1
    idx[0] = -1
    return idx


def _dense_oracle(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                  v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over all S rows in fp64, mask built from the indices."""
    t, s = indices.shape[0], kv.shape[0]
    mask = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        for j in indices[i].tolist():
            if j >= 0:
                mask[i, j] = True
    logits = torch.einsum("thd,sd->ths", q.double(), kv.double()) * scale  # [t, H, s]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [t, H]
    p = torch.where(mask[:, None, :], torch.softmax(logits, dim=-1), 0.0).nan_to_num(0.0)
    o = p @ kv[:, :v_dim].double()  # [t, H, v_dim]
    return o, lse


# --------------------------------------------------------------------------------------------
# Sparse MLA
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads", [1, 8])
@pytest.mark.parametrize("num_tokens", [1, 7, 13])
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_mla_fwd_matches_dense_masked_softmax(num_heads: int, num_tokens: int,
                                                     device: str) -> None:
    g = torch.Generator().manual_seed(num_heads * 100 + num_tokens)
    s, k = 37, 16
    q = torch.randn(num_tokens, num_heads, DQK, generator=g)
    kv = torch.randn(s, DQK, generator=g)
    indices = _random_indices(g, num_tokens, s, k)
    o, lse = ref.sparse_mla_fwd(q.to(device), kv.to(device), indices.to(device), SCALE,
                                chunk_tokens=3)
    assert o.shape == (num_tokens, num_heads, L) and o.dtype == torch.float32
    assert lse.shape == (num_tokens, num_heads) and lse.dtype == torch.float32
    o_ref, lse_ref = _dense_oracle(q, kv, indices, SCALE, L)
    torch.testing.assert_close(o.cpu().double(), o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), lse_ref, atol=2e-5, rtol=1e-5)
    # Row 0 has no valid index: o = 0 and lse = −inf, never NaN.
    assert torch.equal(o[0].cpu(), torch.zeros(num_heads, L))
    assert torch.all(lse[0].cpu() == float("-inf"))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


def test_sparse_mla_fwd_bf16_inputs_and_chunking() -> None:
    g = torch.Generator().manual_seed(7)
    t, h, s, k = 9, 4, 50, 24
    q = torch.randn(t, h, DQK, generator=g).to(torch.bfloat16)
    kv = torch.randn(s, DQK, generator=g).to(torch.bfloat16)
    indices = _random_indices(g, t, s, k).to(torch.int32)
    o_ref, lse_ref = _dense_oracle(q.float(), kv.float(), indices.long(), SCALE, 256)
    whole = ref.sparse_mla_fwd(q, kv, indices, SCALE, v_dim=256)
    for out in (whole, ref.sparse_mla_fwd(q, kv, indices, SCALE, v_dim=256, chunk_tokens=1)):
        torch.testing.assert_close(out[0].double(), o_ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out[1].double(), lse_ref, atol=2e-5, rtol=1e-5)


def test_sparse_mla_lse_is_natural_log() -> None:
    """One query over two rows with logits 0 and log 3: lse = log 4, o = (1/4, 3/4) mix."""
    kv = torch.zeros(2, DQK)
    kv[0, 0], kv[1, 0], kv[1, 1] = 0.0, 1.0, 1.0
    q = torch.zeros(1, 1, DQK)
    q[0, 0, 0] = math.log(3.0)
    o, lse = ref.sparse_mla_fwd(q, kv, torch.tensor([[1, -1, 0]]), 1.0)
    assert lse.item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert o[0, 0, 0].item() == pytest.approx(0.75, abs=1e-6)
    assert o[0, 0, 1].item() == pytest.approx(0.75, abs=1e-6)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_mla_paged_equals_fwd_on_dequantized_rows(fp8: bool, device: str) -> None:
    g = torch.Generator().manual_seed(11)
    t, h, s, k = 6, 8, 40, 12
    num_blocks, block_size = 16, 4
    c, k_pe = torch.randn(s, L, generator=g), torch.randn(s, R, generator=g)
    cache = torch.zeros(F.mla_cache_shape(num_blocks, block_size, fp8), device=device,
                        dtype=torch.uint8 if fp8 else torch.bfloat16)
    slot_of_row = torch.randperm(num_blocks * block_size, generator=g)[:s]  # row → slot
    F.write_mla_cache(cache, slot_of_row.to(device), c.to(device), k_pe.to(device))
    kv_rows = F.read_mla_cache(cache, slot_of_row.to(device))  # [s, L+R] dequantized
    if fp8:
        want_rows = F.dequantize_mla_rows(F.quantize_mla_rows(c, k_pe))
        torch.testing.assert_close(kv_rows.cpu(), want_rows)
    indices = _random_indices(g, t, s, k)  # rows of kv_rows
    slot_indices = torch.where(indices >= 0, slot_of_row[indices.clamp_min(0)], -1)
    q = torch.randn(t, h, DQK, generator=g).to(device)
    o, lse = ref.sparse_mla_paged(q, cache, slot_indices.to(device), SCALE, chunk_tokens=4)
    o_want, lse_want = ref.sparse_mla_fwd(q, kv_rows, indices.to(device), SCALE)
    torch.testing.assert_close(o, o_want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_want, atol=1e-6, rtol=1e-6)
    assert torch.all(lse[0] == float("-inf")) and torch.all(o[0] == 0)


def test_sparse_mla_bad_shapes_name_the_tensor() -> None:
    q = torch.zeros(2, 1, DQK)
    with pytest.raises(ValueError, match="indices"):
        ref.sparse_mla_fwd(q, torch.zeros(4, DQK), torch.zeros(3, 2, dtype=torch.long), SCALE)
    with pytest.raises(ValueError, match="kv"):
        ref.sparse_mla_fwd(q, torch.zeros(4, 100), torch.zeros(2, 2, dtype=torch.long), SCALE)
    with pytest.raises(ValueError, match="L\\+R"):
        ref.sparse_mla_paged(torch.zeros(2, 1, 100), torch.zeros(1, 4, 656, dtype=torch.uint8),
                             torch.zeros(2, 2, dtype=torch.long), SCALE)


# --------------------------------------------------------------------------------------------
# Indexer logits
# --------------------------------------------------------------------------------------------
def test_indexer_logits_matches_explicit_loop() -> None:
    g = torch.Generator().manual_seed(21)
    t, h, s, d = 5, 4, 7, 16
    q, k = torch.randn(t, h, d, generator=g), torch.randn(s, d, generator=g)
    w = torch.randn(t, h, generator=g)  # signed weights
    want = torch.zeros(t, s, dtype=torch.float64)
    for i in range(t):
        for j in range(s):
            for head in range(h):
                dot = sum(float(q[i, head, e]) * float(k[j, e]) for e in range(d))
                want[i, j] += float(w[i, head]) * max(dot, 0.0)
    for chunk in (None, 2):
        got = ref.indexer_logits(q, w, k, chunk_tokens=chunk)
        assert got.shape == (t, s) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    got16 = ref.indexer_logits(q.to(torch.bfloat16), w, k.to(torch.bfloat16))
    torch.testing.assert_close(got16, ref.indexer_logits(q.to(torch.bfloat16).float(), w,
                                                         k.to(torch.bfloat16).float()))


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_logits_fp8_equals_dequantized_logits(device: str) -> None:
    g = torch.Generator().manual_seed(22)
    t, h, s, d = 6, 16, 33, 128
    q = (torch.randn(t, h, d, generator=g) * 3).to(device)
    k = torch.randn(s, d, generator=g).to(device)
    w = torch.randn(t, h, generator=g).to(device) * h**-0.5 * d**-0.5
    q8, qs = F.quantize_index_q(q)
    k8, ks = F.quantize_index_k(k)
    got = ref.indexer_logits_fp8(q8, qs, w, k8, ks)
    want = ref.indexer_logits(F.dequantize_index(q8, qs), w, F.dequantize_index(k8, ks))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # And close to the unquantized scores: per-element relative error ≤ 2^-4 on q and on k.
    exact = ref.indexer_logits(q, w, k)
    bound = torch.einsum("th,thd,sd->ts", w.abs(), q.abs(), k.abs()) * ((1 + 2**-4) ** 2 - 1)
    assert torch.all((got - exact).abs() <= bound + 1e-5)


# --------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------
def _topk_oracle(logits: torch.Tensor, limits: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for t in range(logits.shape[0]):
        n = max(0, min(int(limits[t]), logits.shape[1]))
        order = sorted(range(n), key=lambda s: -float(logits[t, s]))[:k]
        out[t, : len(order)] = torch.tensor(order, dtype=torch.int32)
    return out


@pytest.mark.parametrize("num_keys,k", [(20, 6), (5, 8), (64, 64)])
@pytest.mark.parametrize("device", DEVICES)
def test_topk_causal_matches_sort_oracle(num_keys: int, k: int, device: str) -> None:
    g = torch.Generator().manual_seed(num_keys + k)
    t = 9
    # Distinct scores (a permutation) so the order is fully determined.
    logits = torch.stack([torch.randperm(num_keys, generator=g) for _ in range(t)]).float() - 7.5
    limits = torch.tensor([0, 1, 3, k - 1, k, k + 1, num_keys, num_keys + 5, -2])
    got = ref.topk_causal(logits.to(device), limits.to(device), k).cpu()
    assert got.dtype == torch.int32 and got.shape == (t, k)
    assert torch.equal(got, _topk_oracle(logits, limits, k))
    assert torch.all(got[0] == -1) and torch.all(got[-1] == -1)  # limit 0 and negative


def test_topk_causal_eligible_minus_inf_beats_padding() -> None:
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), 5.0, 9.0]])
    got = ref.topk_causal(logits, torch.tensor([3]), 4)
    assert got[0, 0].item() == 1 and sorted(got[0, 1:3].tolist()) == [0, 2]
    assert got[0, 3].item() == -1
    assert ref.topk_causal(logits, torch.tensor([5]), 0).shape == (1, 0)
