"""The grouped MoE's pair layout and combine kernels (kernels/triton/moe_pairs.py,
moe_combine.py) compiled on the GPU, at GLM-5.3's k = 8 and H = 6144: the layout equal to
PyTorch's stable sort (tokens, places, group ends), every expert here or an EP8 rank's; the
combine against its PyTorch reference (`moe_compute.combine_reference`, the same fp32 sum in
the same order; the kernel may fuse a multiply-add, an ulp apart), with experts held elsewhere
(EP: rows past the limit never read, NaN here), the same bits run to run (no atomics), and
captured in a CUDA graph then replayed with another routing.

Run on the device machine: `pytest -m gpu tests/gpu/test_moe_combine_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.model import moe_compute

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine the interpreter tests need to be the
    # first to import it.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from dsaserve.kernels.triton import moe_combine, moe_pairs  # noqa: E402

DEV = "cuda"
K, H, EXPERTS = 8, 6144, 256


def _routing(n: int, held: int, first: int, g: torch.Generator):
    ids = torch.argsort(torch.rand(n, EXPERTS, generator=g, device=DEV), dim=1)[:, :K]
    weights = torch.rand(n, K, generator=g, device=DEV)
    order, ends = moe_compute._sort_pairs(ids, first, held, held_all=held == EXPERTS)
    pos = moe_compute.pair_positions(order, weights.shape)
    return pos, weights, (None if held == EXPERTS else ends[-1:]), ends


@pytest.mark.parametrize("n", [1, 64, 256, 4096])
@pytest.mark.parametrize("held,first", [(EXPERTS, 0), (32, 32)], ids=["all", "ep8"])
def test_kernel_matches_reference(n, held, first):
    g = torch.Generator(device=DEV).manual_seed(n + held)
    pos, weights, limit, ends = _routing(n, held, first, g)
    y = torch.randn(n * K, H, generator=g, device=DEV).bfloat16()
    y[int(ends[-1]):] = float("nan")  # never written by the grouped GEMMs
    want = moe_compute.combine_reference(y, pos, weights, limit)
    got = moe_combine.moe_combine(y, pos, weights, limit)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(moe_combine.moe_combine(y, pos, weights, limit), got)  # run to run
    # the MoE's output in one pass: plus the shared experts', rounded to bf16 (to nearest, as
    # torch's cast: equal but where an FMA's ulp crosses a rounding boundary)
    shared = torch.randn(n, H, generator=g, device=DEV).bfloat16()
    plus = moe_combine.moe_combine(y, pos, weights, limit, shared)
    want = moe_compute.combine_reference(y, pos, weights, limit, shared)
    assert plus.dtype == torch.bfloat16
    assert (plus != want).float().mean() < 1e-3
    # one bf16 ulp of the value, plus the fp32 sum's own rounding (an ulp or two of the terms'
    # magnitudes, kept where the terms cancel to near zero: 3 of 25M elements at 4096 tokens
    # were 1e-7 apart, 0.8 of their value)
    mag = moe_compute.combine_reference(y.abs(), pos, weights.abs(), limit, shared.abs())
    gap = (plus.float() - want.float()).abs()
    assert (gap <= 2.0**-7 * want.float().abs() + 1e-6 * mag.float()).all()


@pytest.mark.parametrize("n", [1, 64, 512])
@pytest.mark.parametrize("held,first", [(EXPERTS, 0), (32, 224)], ids=["all", "ep8"])
def test_pair_layout_equals_the_sort(n, held, first):
    g = torch.Generator(device=DEV).manual_seed(n)
    ids = torch.argsort(torch.rand(n, EXPERTS, generator=g, device=DEV), dim=1)[:, :K]
    token, pos, ends = moe_pairs.moe_pairs(ids, first, held)
    want = moe_compute.pair_layout_reference(ids, first, held, held_all=held == EXPERTS)
    assert torch.equal(token, want[0])
    assert torch.equal(pos, want[1])
    assert torch.equal(ends, want[2])


def test_replays_in_a_cuda_graph():
    g = torch.Generator(device=DEV).manual_seed(0)
    n = 64
    pos, weights, _, _ = _routing(n, EXPERTS, 0, g)
    y = torch.randn(n * K, H, generator=g, device=DEV).bfloat16()
    moe_combine.moe_combine(y, pos, weights)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_combine.moe_combine(y, pos, weights)
    pos2, weights2, _, _ = _routing(n, EXPERTS, 0, g)
    pos.copy_(pos2)
    weights.copy_(weights2)
    y.copy_(torch.randn(n * K, H, generator=g, device=DEV))
    graph.replay()
    torch.testing.assert_close(out, moe_compute.combine_reference(y, pos, weights),
                               rtol=1e-6, atol=1e-6)
