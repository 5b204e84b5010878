"""The grouped MoE's pair layout and combine kernels (kernels/triton/moe_pairs.py,
moe_combine.py) run by Triton's CPU interpreter against their PyTorch paths: the pairs sorted by
expert (stable) with their tokens, places and group ends exactly as PyTorch's sort gives them,
with experts held elsewhere (EP) and without; tokens' rows found where the sort put them, pairs
of experts held elsewhere (rows past the limit, filled with NaN here as never-written memory may
be) adding nothing, columns past a program's block, strided rows; and the grouped path through
both equal to the PyTorch path. tests/gpu covers the compiled kernels.

The interpreter runs the kernel's fp32 adds in the reference's order without fused
multiply-adds, so the two agree bit for bit here in fp32; on the GPU an FMA may round
differently by an ulp. A bf16 output (the MoE's, with the shared experts added) is within one
bf16 step: Triton 3.6's interpreter truncates an fp32 → bf16 cast where the GPU and torch round
to nearest.

Like tests/unit/test_fp8_linear_interp.py, triton is imported in a fixture with
TRITON_INTERPRET=1, never at collection.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interp import interpreted

from dsaserve.model import moe_compute


@pytest.fixture(scope="module")
def mc():
    yield from interpreted("dsaserve.kernels.triton.moe_pairs",
                           "dsaserve.kernels.triton.moe_combine")


def _case(n: int, k: int, experts: int, held: int, hidden: int, dtype: torch.dtype, seed: int):
    """Sorted pair rows y [P, hidden] as the grouped GEMMs leave them (rows of experts held
    elsewhere NaN), and the positions, weights and limit the combine reads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    order, ends = moe_compute._sort_pairs(ids, 0, held, held_all=held == experts)
    y = torch.randn(n * k, hidden, generator=g).to(dtype)
    y[int(ends[-1]):] = float("nan")
    pos = moe_compute.pair_positions(order, weights.shape)
    return y, pos, weights, (None if held == experts else ends[-1:])


@pytest.mark.parametrize("n,k,experts,held,hidden", [
    (1, 1, 4, 4, 8), (7, 3, 8, 8, 1030), (33, 8, 16, 16, 64),  # every expert here
    (9, 3, 8, 3, 1030), (16, 8, 16, 5, 40),  # EP: rows of experts held elsewhere skipped
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(mc, n, k, experts, held, hidden, dtype):
    y, pos, w, limit = _case(n, k, experts, held, hidden, dtype, seed=n + k)
    want = moe_compute.combine_reference(y, pos, w, limit)
    assert torch.isfinite(want).all()
    got = mc.moe_combine(y, pos, w, limit)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # rows of a wider buffer (strided), and no tokens at all
    wide = torch.cat((y, y), dim=1)[:, hidden:]
    assert torch.equal(mc.moe_combine(wide, pos, w, limit), want)
    assert mc.moe_combine(y, pos[:0], w[:0], limit).shape == (0, hidden)


@pytest.mark.parametrize("n,k,experts,held,first", [
    (1, 1, 4, 4, 0), (1, 8, 256, 256, 0), (64, 8, 256, 256, 0), (512, 8, 256, 256, 0),
    (37, 2, 8, 8, 0), (9, 3, 8, 3, 2), (64, 8, 256, 32, 224),  # EP: the last rank's experts
    (5, 6, 16, 4, 0), (0, 8, 256, 256, 0),
])
def test_pair_layout_kernel_equals_the_sort(mc, n, k, experts, held, first):
    from dsaserve.kernels.triton import moe_pairs

    g = torch.Generator().manual_seed(n + k + held)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]) \
        if n else torch.zeros(0, k, dtype=torch.int64)
    token, pos, ends = moe_pairs.moe_pairs(ids, first, held)
    want = moe_compute.pair_layout_reference(ids, first, held, held_all=held == experts)
    assert torch.equal(token, want[0])
    assert torch.equal(pos, want[1])
    assert ends.dtype == torch.int32 and torch.equal(ends, want[2])


def test_pair_layout_refuses_a_prefill_batch(mc):
    from dsaserve.kernels.triton import moe_pairs

    ids = torch.zeros(moe_pairs.MAX_PAIRS // 8 + 1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="pairs"):
        moe_pairs.moe_pairs(ids, 0, 256)
    # moe_compute sorts it in PyTorch instead
    token, pos, ends = moe_compute.pair_layout(ids, 0, 256, held_all=True)
    assert token.shape == (ids.numel(),) and int(ends[-1]) == ids.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("held", [16, 5])
def test_kernel_adds_the_shared_output_and_casts(mc, dtype, held):
    """The MoE's output in one pass: the routed sum plus the shared experts' output, in fp32,
    cast to the shared output's dtype — the reference's bits (MoE.forward's order)."""
    y, pos, w, limit = _case(13, 8, 16, held, 1030, torch.bfloat16, seed=held)
    shared = torch.randn(13, 1030, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = moe_compute.combine_reference(y, pos, w, limit, shared)
    assert want.dtype == dtype
    assert torch.equal(want, (moe_compute.combine_reference(y, pos, w, limit)
                              + shared.float()).to(dtype))
    got = mc.moe_combine(y, pos, w, limit, shared)
    assert got.dtype == dtype
    _assert_within_a_step(got, want)


def test_positions_of_each_tokens_pairs():
    ids = torch.tensor([[3, 1], [1, 7], [2, 3]])  # local experts 0..2 (first = 1, count 3)
    order, ends = moe_compute._sort_pairs(ids, 1, 3, held_all=False)
    # sorted pairs: (t0, e1) (t1, e1) (t2, e2) (t0, e3) (t2, e3) | (t1, e7) held elsewhere
    assert moe_compute.pair_positions(order, ids.shape).tolist() == [[3, 0], [1, 5], [2, 4]]
    assert ends.tolist() == [2, 3, 5]


@pytest.mark.parametrize("held,first", [(8, 0), (3, 2)])
def test_grouped_path_through_the_kernel(mc, held, first):
    """grouped_experts with the kernel (use_kernels: TRITON_INTERPRET=1) gives the reference
    combine's bits, and both the per-pair sum."""
    g = torch.Generator().manual_seed(held)
    n, k, hidden, inter = 11, 3, 32, 16
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(held, 2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(held, hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    shared = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    got = moe_compute.grouped_experts(x, w13, w2, ids, weights, first)
    got_plus = moe_compute.grouped_experts(x, w13, w2, ids, weights, first, shared=shared)
    os.environ["TRITON_INTERPRET"] = "0"  # the reference combine
    try:
        want = moe_compute.grouped_experts(x, w13, w2, ids, weights, first)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert torch.equal(got, want)
    _assert_within_a_step(got_plus, (want + shared.float()).to(torch.bfloat16))


def _assert_within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal in fp32; in bf16 within one step (the interpreter truncates its casts)."""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-30)
