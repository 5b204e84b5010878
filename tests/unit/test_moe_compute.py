"""The three formulations of the routed experts (model/moe_compute.py) against a per-pair
reference, with and without experts held on other ranks (EP), and the dense path free of host
syncs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsaserve.engine.syncs import SyncCounter
from dsaserve.model import moe_compute


def _reference(x, w13, w2, ids, weights, first):
    """Σ over (token, choice) pairs of w · expert(x), one pair at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e].float() @ x[t].float()).split(inter)
                out[t] += weights[t, j] * (w2[e].float() @ (F.silu(gate) * up))
    return out


def _case(n, experts, held, first, k=3, hidden=32, inter=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w13 = (torch.randn(held, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(held, hidden, inter, generator=g) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    return x, w13, w2, ids, weights, first


@pytest.mark.parametrize("path", [moe_compute.dense_experts, moe_compute.looped_experts,
                                  moe_compute.grouped_experts])
@pytest.mark.parametrize("n,experts,held,first", [
    (1, 8, 8, 0), (7, 8, 8, 0), (33, 8, 8, 0),  # every expert here
    (9, 8, 3, 2), (16, 8, 3, 5), (5, 16, 2, 0),  # EP: a slice of the experts, pairs dropped
])
def test_formulations_match_reference(path, n, experts, held, first):
    dtype = torch.bfloat16 if path is moe_compute.grouped_experts else torch.float32
    case = _case(n, experts, held, first, dtype=dtype)
    want = _reference(*case)
    x, w13, w2, rest = case[0], case[1], case[2], case[3:]
    got = path(*case) if path is moe_compute.grouped_experts else path(x, (w13, w2), *rest)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1, 7, 33])
def test_grouped_held_all_is_the_masked_path(n):
    """Every expert held (no EP): the grouped path without the masks of experts held elsewhere
    gives the same bits as with them (fewer host ops, not other arithmetic)."""
    case = _case(n, 8, 8, 0, dtype=torch.bfloat16)
    want = moe_compute.grouped_experts(*case)
    assert torch.equal(moe_compute.grouped_experts(*case, held_all=True), want)


def test_sorted_pairs_groups_by_expert():
    ids = torch.tensor([[3, 1], [1, 7], [2, 3]])  # experts 1..3 held (first=1, count=3)
    weights = torch.arange(6, dtype=torch.float32).view(3, 2)
    token_of, w, ends = moe_compute.sorted_pairs(ids, weights, first=1, count=3)
    assert ends.tolist() == [2, 3, 5]  # local 0: two pairs, 1: one, 2: two; expert 7 last
    assert token_of[:5].tolist() == [0, 1, 2, 0, 2]
    assert w[:5].tolist() == [1.0, 2.0, 4.0, 0.0, 5.0]


def test_decode_sized_batch_reads_nothing_on_the_host():
    case = _case(4, 8, 8, 0)
    x, w13, w2, rest = case[0], case[1], case[2], case[3:]
    with SyncCounter() as syncs:
        moe_compute.routed_experts(x, (w13, w2), *rest)
    assert syncs.count == 0, syncs.report()


def _fp8_experts(w13, w2, inter_range=None):
    """Quantize stacked experts as an FP8 checkpoint stores them (each projection on its own
    128-block grid) → (Fp8Experts, the dequantized w13 and w2 the model would use)."""
    from dsaserve.kernels.fp8_weights import quantize_blocks
    from dsaserve.model.fp8 import BlockRange, Fp8Experts

    inter = w2.shape[2]
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (gq, gs), (uq, us) = (quantize_blocks(w13[e, :inter].float()),
                              quantize_blocks(w13[e, inter:].float()))
        q13.append(torch.cat((gq, uq)))
        s13.append(torch.cat((gs, us)))
        dq, ds = quantize_blocks(w2[e].float())
        q2.append(dq)
        s2.append(ds)
    experts = Fp8Experts(torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2),
                         inter_range or BlockRange(0, inter))
    return experts, *experts.dequantized(w13.dtype)


@pytest.mark.parametrize("path", [moe_compute.dense_experts, moe_compute.looped_experts,
                                  moe_compute.routed_experts])
@pytest.mark.parametrize("inter", [16, 128])  # halves inside one block; on the block grid
def test_fp8_experts_equal_their_dequantized_weights(path, inter):
    """FP8-kept experts (model/fp8.py) give the bits of the same experts dequantized first: each
    gate/up half on its own block grid (I = 16 puts both halves in one 128-row block)."""
    x, w13, w2, ids, weights, first = _case(9, 8, 3, 2, inter=inter)
    experts, d13, d2 = _fp8_experts(w13, w2)
    assert experts.aligned == (inter == 128)
    assert torch.equal(path(x, experts, ids, weights, first), path(x, (d13, d2), ids, weights,
                                                                    first))


def test_unaligned_fp8_experts_take_the_dequantized_grouped_path():
    """Halves that do not start on a block (I = 16): the grouped path dequantizes first and
    gives grouped_experts' bits. (The aligned case runs the FP8 grouped kernel: CUDA only,
    tests/gpu/test_fp8_linear_gpu.py.)"""
    x, w13, w2, ids, weights, first = _case(9, 8, 3, 2, inter=16, dtype=torch.bfloat16)
    experts, d13, d2 = _fp8_experts(w13, w2)
    want = moe_compute.grouped_experts(x, d13, d2, ids, weights, first)
    assert torch.equal(moe_compute.grouped_fp8_experts(x, experts, ids, weights, first), want)


def test_triton_grouped_takes_decode_sized_groups():
    """bf16 experts: the Triton grouped kernel for ≤ TRITON_GROUPED_MAX_MEAN_ROWS pairs per
    held expert on average (b = 1 and 64 and their MTP3 verifies at 8 experts, top 2),
    torch._grouped_mm above (prefill chunks)."""
    limit = moe_compute.TRITON_GROUPED_MAX_MEAN_ROWS
    assert moe_compute.triton_grouped(2, 8) and moe_compute.triton_grouped(8, 8)
    assert moe_compute.triton_grouped(limit * 8, 8)
    assert not moe_compute.triton_grouped(limit * 8 + 1, 8)
    assert moe_compute.triton_grouped(512, 8) and not moe_compute.triton_grouped(16384, 8)
    assert moe_compute.triton_grouped(0, 0) and not moe_compute.triton_grouped(limit + 1, 0)


def test_w8a8_takes_the_fp8_experts_at_verify_sizes():
    """FP8 experts in W8A8 above W8A8_GROUPED_MIN_MEAN_ROWS pairs per held expert up to the
    Triton kernel's bound (b = 64's MTP3 verify: 512 pairs over 8 experts), bf16 / fp16 only;
    b = 64 itself (128 pairs, 16 per expert) keeps the weight-only kernel."""
    bf16 = torch.bfloat16
    assert moe_compute.w8a8_experts(512, 8, bf16) and moe_compute.w8a8_experts(129, 8, bf16)
    assert not moe_compute.w8a8_experts(128, 8, bf16)  # b = 64: 16 per expert
    assert not moe_compute.w8a8_experts(513, 8, bf16)  # past the Triton kernel: prefill
    assert not moe_compute.w8a8_experts(512, 8, torch.float32)


def test_held_pairs_under_expert_parallelism():
    """The pairs a rank's experts take, from host sizes: all of them without EP; their share
    under EP (EP8 at b = 64, top 8 of 256: 64 of 512, so the Triton kernel at 2 per expert),
    rounded up."""
    assert moe_compute.held_pairs(512, 32, None) == 512
    assert moe_compute.held_pairs(512, 32, 32) == 512
    assert moe_compute.held_pairs(512, 32, 256) == 64
    assert moe_compute.triton_grouped(moe_compute.held_pairs(512, 32, 256), 32)
    assert moe_compute.triton_grouped(moe_compute.held_pairs(4096, 32, 256), 32)
    assert not moe_compute.triton_grouped(4096, 32)  # b = 512, all pairs over the held
    assert moe_compute.held_pairs(8, 32, 256) == 1 and moe_compute.held_pairs(0, 32, 256) == 0
