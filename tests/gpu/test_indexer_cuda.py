"""The CUDA indexer logits kernel (kernels/cuda/indexer_logits.cu, sm_90a) against the Triton one,
fresh random inputs every run, through indexer._logits (the same step plan and arguments).

Tolerances as in test_indexer_gluon.py: the same fp8 products of the same bytes (q quantized by
the same rule), only the fp32 order of the head sum differs, so logits and group maxima agree
within 1e-5 relative (plus 1e-5 · the largest |logit|), and −inf stands in the same places.
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


def _compare(q, w, cache, meta, shape: tuple[int, int, int], pages_per_prog: int,
             window=None) -> None:
    ref_cfg = indexer.IndexerConfig(gluon=False, cuda_logits=False)  # Triton: powers of two
    ref_logits, ref_gmax, _ = indexer._logits(q, w, cache, meta, ref_cfg, window)
    # Unwritten outputs would keep whatever the allocator hands back: make that NaN.
    torch.full((ref_logits.numel() * 2,), float("nan"), device=DEV)
    cfg = dataclasses.replace(ref_cfg, pages_per_prog=pages_per_prog, cuda_logits=True,
                              cuda_shape=shape)
    logits, gmax, _ = indexer._logits(q, w, cache, meta, cfg, window)
    gluon_tests._check_same(logits, ref_logits)
    gluon_tests._check_same(gmax, ref_gmax)


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
def test_cuda_logits_key_window(g, heads):
    """A window of the keys (indexer_topk's long-context path): block table and limits shifted."""
    meta, cache, q, w = base._indexer_case(g, heads)
    _compare(q, w, cache, meta, (3, 1, 128), 4, window=(1024, 1500))


@pytest.mark.parametrize("heads", [32, 64])
def test_cuda_is_the_prefill_default_and_topk_agrees(g, heads):
    """IndexerConfig() picks the CUDA kernel for steps whose longest query fills a block's
    consumers (the 300-token prefill here), not for one-token decode steps; indexer_topk
    through it selects what the Triton kernel's logits select."""
    meta, cache, q, w = base._indexer_case(g, heads)
    assert indexer._cuda_shape(q, cache, indexer.IndexerConfig(), meta) == \
        cuda_logits.PREFERRED[heads][0]
    decode = AttentionMetadata.for_requests([100, 200], [1, 1], meta.block_table[:2], BLOCK_SIZE)
    assert indexer._cuda_shape(q[:2], cache, indexer.IndexerConfig(), decode) is None
    cfg = indexer.IndexerConfig(list_len=base.TOPK)
    scores, pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, cfg)
    ref = dataclasses.replace(cfg, cuda_logits=False, gluon=False)
    ref_scores, ref_pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, ref)
    gluon_tests._check_same_selection(scores, pos, ref_scores, ref_pos)


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
