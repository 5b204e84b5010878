"""The CUDA indexer logits kernel (kernels/cuda/indexer_logits.cu, sm_90a) against the Triton one,
fresh random inputs every run, through indexer._logits (the same step plan and arguments).

Tolerances as in test_indexer_gluon.py: the same fp8 products of the same bytes (q quantized by
the same rule), only the fp32 order of the head sum differs, so logits and group maxima agree
within 1e-5 relative (plus 1e-5 · the largest |logit|), and −inf stands in the same places.
The linear shapes (ReLU(x) = (x + |x|) / 2, the linear half on the tensor cores) differ by at
most indexer_logits.LINEAR_REL_ERROR of the same logits computed from |q|, |w| and |k|
(indexer_logits.abs_inputs), plus that 1e-5, and their top-k scores agree within the row's
largest such bound.
Covers 32 and 64 heads, every block shape (indexer_logits.SHAPES), tiles cut at every request
boundary (prefill and decode rows with s_q 1..4), contexts shorter than a page, chunks of 1 to
128 pages (odd and even tails of the two-pages-in-flight loop; the page ring wraps many times;
whole chunks past every token's limit) and a key window. Run on the device machine:
`pytest -m gpu tests/gpu/test_indexer_cuda.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sm90_suite import require_sm90

pytestmark = [pytest.mark.gpu]
require_sm90("the CUDA indexer kernel")
triton = pytest.importorskip("triton")

import test_indexer_gluon as gluon_tests  # noqa: E402  (its cases and checks)
import test_kernels_gpu as base  # noqa: E402

from dsaserve.kernels.cuda import build  # noqa: E402
from dsaserve.kernels.cuda import indexer_logits as cuda_logits  # noqa: E402
from dsaserve.kernels.metadata import AttentionMetadata  # noqa: E402
from dsaserve.kernels.triton import indexer  # noqa: E402

if build.build() is not None:
    pytest.skip(f"the CUDA kernels did not build: {build.build()}", allow_module_level=True)

DEV = base.DEV
BLOCK_SIZE = 64


REF = indexer.IndexerConfig(gluon=False, cuda_logits=False)  # Triton: powers of two


def _linear_bound(q, w, cache, meta, window=None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the linear shapes may differ by: LINEAR_REL_ERROR · the logits (and group maxima)
    of |q|, |w|, |k|."""
    logits, gmax, _ = indexer._logits(*cuda_logits.abs_inputs(q, w, cache), meta, REF, window)
    return logits * cuda_logits.LINEAR_REL_ERROR, gmax * cuda_logits.LINEAR_REL_ERROR


def _check_within(ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """|ours − ref| ≤ bound + 1e-5 · the largest |ref|; −inf exactly where the reference has it."""
    assert not bool(ours.isnan().any()), "unwritten or NaN outputs"
    assert torch.equal(ours.isneginf(), ref.isneginf())
    finite = ref.isfinite()
    if bool(finite.any()):
        slack = 1e-5 * float(ref[finite].abs().max())
        excess = ((ours - ref)[finite].abs() - bound[finite]).max()
        assert float(excess) <= slack, f"beyond the bound by {float(excess)} (slack {slack})"


def _compare(q, w, cache, meta, shape: tuple, pages_per_prog: int, window=None) -> None:
    ref_logits, ref_gmax, _ = indexer._logits(q, w, cache, meta, REF, window)
    bound = _linear_bound(q, w, cache, meta, window) if cuda_logits.Shape(*shape).linear \
        else None
    # Unwritten outputs would keep whatever the allocator hands back: make that NaN.
    torch.full((ref_logits.numel() * 2,), float("nan"), device=DEV)
    cfg = dataclasses.replace(REF, pages_per_prog=pages_per_prog, cuda_logits=True,
                              cuda_shape=shape)
    logits, gmax, _ = indexer._logits(q, w, cache, meta, cfg, window)
    if bound is None:
        gluon_tests._check_same(logits, ref_logits)
        gluon_tests._check_same(gmax, ref_gmax)
    else:
        _check_within(logits, ref_logits, bound[0])
        _check_within(gmax, ref_gmax, bound[1])


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("shape", cuda_logits.SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pages_per_prog", [1, 2, 3, 4, 128])
def test_cuda_logits_match_triton(g, heads, shape, pages_per_prog):
    """base._indexer_case: a 300-token prefill over 4000 keys and decode rows with s_q 1..4;
    chunks of 1-4 pages (the pipelined loop's odd and even tails) and of all 63 pages."""
    meta, cache, q, w = base._indexer_case(g, heads)
    _compare(q, w, cache, meta, shape, pages_per_prog)


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("pages_per_prog", [1, 2, 16])
def test_cuda_logits_short_contexts(g, heads, pages_per_prog):
    meta, cache, q, w = gluon_tests._short_case(g, heads)
    _compare(q, w, cache, meta, (2, 2, 128), pages_per_prog)


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("linear", [False, True], ids=["relu", "linear"])
def test_cuda_logits_key_window(g, heads, linear):
    """A window of the keys (indexer_topk's long-context path): block table and limits shifted."""
    meta, cache, q, w = base._indexer_case(g, heads)
    _compare(q, w, cache, meta, (3, 1, 128, linear), 4, window=(1024, 1500))


@pytest.mark.parametrize("heads", [32, 64])
def test_cuda_is_the_prefill_default_and_topk_agrees(g, heads):
    """IndexerConfig() picks the CUDA kernel for steps whose longest query fills a block's
    consumers (the 300-token prefill here), not for one-token decode steps; indexer_topk
    through it selects what the Triton kernel's logits select (scores, sorted, within the
    row's largest bound where the preferred shape is a linear one: each score is within it of
    the reference score of the same key, so the k best are too)."""
    meta, cache, q, w = base._indexer_case(g, heads)
    assert indexer._cuda_shape(q, cache, indexer.IndexerConfig(), meta) == \
        cuda_logits.PREFERRED[heads][0]
    decode = AttentionMetadata.for_requests([100, 200], [1, 1], meta.block_table[:2], BLOCK_SIZE)
    assert indexer._cuda_shape(q[:2], cache, indexer.IndexerConfig(), decode) is None
    cfg = indexer.IndexerConfig(list_len=base.TOPK)
    scores, pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, cfg)
    ref = dataclasses.replace(cfg, cuda_logits=False, gluon=False)
    ref_scores, ref_pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, ref)
    if not cuda_logits.PREFERRED[heads][0].linear:
        gluon_tests._check_same_selection(scores, pos, ref_scores, ref_pos)
        return
    assert torch.equal(pos >= 0, ref_pos >= 0)
    bound = _linear_bound(q, w, cache, meta)[0]
    row_bound = bound.masked_fill(~bound.isfinite(), 0).amax(dim=1, keepdim=True)
    ours = scores.sort(dim=1, descending=True).values
    theirs = ref_scores.sort(dim=1, descending=True).values
    finite = theirs.isfinite()
    assert torch.equal(ours.isfinite(), finite)
    slack = 1e-5 * float(theirs[finite].abs().max())
    assert bool(((ours - theirs).abs() <= row_bound + slack)[finite].all())


def test_cuda_logits_unsupported_inputs(g):
    meta, cache, q, w = base._indexer_case(g, 64)
    assert cuda_logits.supported(q, cache, BLOCK_SIZE)
    assert not cuda_logits.supported(q.float(), cache, BLOCK_SIZE)
    assert not cuda_logits.supported(q[:, :16].contiguous(), cache, BLOCK_SIZE)
    assert not cuda_logits.supported(q, cache, 32)
    with pytest.raises(ValueError, match="SHAPES"):
        indexer._logits(q, w, cache, meta, indexer.IndexerConfig(cuda_shape=(3, 2, 128),
                                                                 cuda_logits=True))
    with pytest.raises(ValueError, match="shape"):
        cuda_logits.launch(q, w, cache, meta.block_table, torch.zeros(3, 1), meta.positions,
                           torch.empty(1, 1), torch.empty(1, 1), shape=(3, 2, 128),
                           pages_per_prog=1)
