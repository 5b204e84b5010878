"""The Gluon indexer logits kernel (sm_90 only) against the Triton one, fresh random inputs every
run, through the same step plan (indexer._step_plan) and launch arguments as indexer._logits.

Tolerances: both kernels run the same fp8 wgmma on the same bytes; only the order of the fp32
sum over heads differs, so each logit and group maximum agrees within 1e-5 relative (plus
1e-5 · the largest |logit| of the tensor, for sums that cancel to near 0), and −inf stands in
exactly the same places. Covers 32 and 64 heads, tiles of 1 to 256 / H tokens, several requests
with irregular lengths, contexts shorter than a page, chunks of 4 and 16 pages (whole chunks
past every token's limit) and a key window. Run on the device machine:
`pytest -m gpu tests/gpu/test_indexer_gluon.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sm90_suite import require_sm90

pytestmark = [pytest.mark.gpu]
require_sm90("the Gluon indexer kernel")
triton = pytest.importorskip("triton")

import test_kernels_gpu as base  # noqa: E402  (its helpers, reused; `g` is in conftest.py)

from dsaserve.kernels import formats  # noqa: E402
from dsaserve.kernels.metadata import AttentionMetadata, scattered_block_table  # noqa: E402
from dsaserve.kernels.triton import index_cache, indexer, indexer_gluon  # noqa: E402
from dsaserve.kv import layout  # noqa: E402

DEV = base.DEV
BLOCK_SIZE, HEAD_DIM = 64, 128


def _short_case(g, heads: int):
    """Contexts around one page (1, 5, 63, 64, 65 keys) and a longer one, decode and prefill
    rows mixed: pages partly written, tiles whose tokens see different page counts."""
    return _case(g, heads, (1, 5, 63, 64, 65, 700), (1, 5, 2, 64, 1, 37))


def _case(g, heads: int, seq_lens: tuple[int, ...], new: tuple[int, ...]):
    """Requests with these context lengths and new tokens: keys written at their slots of a
    scattered block table, random queries and weights."""
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    table = scattered_block_table(need, g, DEV)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, BLOCK_SIZE)
    cache = torch.zeros(formats.index_cache_shape(sum(need), BLOCK_SIZE, True, HEAD_DIM),
                        dtype=torch.uint8, device=DEV)
    for r, s in enumerate(seq_lens):
        slots, _ = layout.context_slots(s, table[r], BLOCK_SIZE)
        keys = torch.randn(len(slots), HEAD_DIM, device=DEV, generator=g).bfloat16()
        index_cache.write_index_cache(cache, slots, keys)
    q = torch.randn(meta.num_tokens, heads, HEAD_DIM, device=DEV, generator=g).bfloat16()
    w = torch.randn(meta.num_tokens, heads, device=DEV, generator=g) * heads**-0.5 * 128**-0.5
    return meta, cache, q, w


def _check_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 summation order; −inf exactly where the reference has it."""
    assert not bool(ours.isnan().any()), "unwritten or NaN outputs"
    assert torch.equal(ours.isneginf(), ref.isneginf())
    finite = ref.isfinite()
    if bool(finite.any()):
        scale = float(ref[finite].abs().max())
        torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-5, atol=1e-5 * scale)


def _check_same_selection(scores, pos, ref_scores, ref_pos) -> None:
    """Two indexer_topk results from logits equal up to fp32 order: the same rows have keys, and
    the chosen scores, sorted, agree as _check_same's do."""
    assert torch.equal(pos >= 0, ref_pos >= 0)
    ours = scores.sort(dim=1, descending=True).values
    theirs = ref_scores.sort(dim=1, descending=True).values
    finite = theirs.isfinite()
    assert torch.equal(ours.isfinite(), finite)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-5,
                               atol=1e-5 * float(theirs[finite].abs().max()))


def _compare(q, w, cache, meta, config, pages_per_prog, window=None) -> None:
    """indexer._logits with the Triton kernel against the same call with the Gluon one."""
    triton_cfg = dataclasses.replace(config, pages_per_prog=pages_per_prog, gluon=False)
    ref_logits, ref_gmax, _ = indexer._logits(q, w, cache, meta, triton_cfg, window)
    # Unwritten outputs would keep whatever the allocator hands back: make that NaN.
    torch.full((ref_logits.numel() * 2,), float("nan"), device=DEV)
    gluon_cfg = dataclasses.replace(triton_cfg, gluon=True)
    logits, gmax, _ = indexer._logits(q, w, cache, meta, gluon_cfg, window)
    _check_same(logits, ref_logits)
    _check_same(gmax, ref_gmax)


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("rows_per_tile", [256, 128, 64])
@pytest.mark.parametrize("pages_per_prog", [4, 16])
def test_gluon_logits_match_triton(g, heads, rows_per_tile, pages_per_prog):
    """base._indexer_case: a 300-token prefill over 4000 keys and decode rows with s_q 1..4."""
    meta, cache, q, w = base._indexer_case(g, heads)
    _compare(q, w, cache, meta, indexer.IndexerConfig(rows_per_tile=rows_per_tile),
             pages_per_prog)


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("pages_per_prog", [1, 2, 16])
def test_gluon_logits_short_contexts(g, heads, pages_per_prog):
    meta, cache, q, w = _short_case(g, heads)
    _compare(q, w, cache, meta, indexer.IndexerConfig(), pages_per_prog)


@pytest.mark.parametrize("heads", [32, 64])
def test_gluon_logits_decode_batch(g, heads):
    """One token per request (tiles of one token: N = H, the two-CTAs-per-SM build)."""
    seq_lens = (3001, 1, 64, 129, 2000, 4095, 77)
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    table = scattered_block_table(need, g, DEV)
    meta = AttentionMetadata.for_requests(seq_lens, [1] * len(seq_lens), table, BLOCK_SIZE)
    cache = torch.randint(0, 256, formats.index_cache_shape(sum(need), BLOCK_SIZE, True),
                          dtype=torch.uint8, device=DEV, generator=g)
    for r, s in enumerate(seq_lens):  # real scales (random bytes could be NaN or huge)
        slots, _ = layout.context_slots(s, table[r], BLOCK_SIZE)
        keys = torch.randn(len(slots), HEAD_DIM, device=DEV, generator=g).bfloat16()
        index_cache.write_index_cache(cache, slots, keys)
    q = torch.randn(len(seq_lens), heads, HEAD_DIM, device=DEV, generator=g).bfloat16()
    w = torch.randn(len(seq_lens), heads, device=DEV, generator=g)
    _compare(q, w, cache, meta, indexer.IndexerConfig(), 16)


@pytest.mark.parametrize("heads", [32, 64])
def test_gluon_logits_key_window(g, heads):
    """A window of the keys (indexer_topk's long-context path): block table and limits shifted."""
    meta, cache, q, w = base._indexer_case(g, heads)
    _compare(q, w, cache, meta, indexer.IndexerConfig(), 4, window=(1024, 1500))


@pytest.mark.parametrize("heads", [32, 64])
def test_gluon_is_the_decode_default_and_topk_agrees(g, heads):
    """IndexerConfig() picks the Gluon kernel for one-token tiles (not for 256-row ones);
    indexer_topk through it selects what the Triton kernel's logits select (the same scores up
    to fp32 order)."""
    meta, cache, q, w = base._indexer_case(g, heads)
    assert indexer._use_gluon(q, cache, indexer.IndexerConfig(), heads, BLOCK_SIZE)
    assert not indexer._use_gluon(q, cache, indexer.IndexerConfig(), 256, BLOCK_SIZE)
    rows_cfg = indexer.IndexerConfig(rows_per_tile=heads, list_len=base.TOPK)  # one-token tiles
    scores, pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, rows_cfg)
    ref_scores, ref_pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK,
                                               dataclasses.replace(rows_cfg, gluon=False))
    _check_same_selection(scores, pos, ref_scores, ref_pos)


def test_gluon_logits_unsupported_shapes():
    q = torch.zeros(2, 64, 128, device=DEV, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8, device=DEV)
    assert indexer_gluon.gluon_logits_supported(q, cache, 64, 128, 64)
    assert not indexer_gluon.gluon_logits_supported(q, cache, 128, 128, 64)
    assert not indexer_gluon.gluon_logits_supported(q.float(), cache, 64, 128, 64)
    assert not indexer_gluon.gluon_logits_supported(q, cache.bfloat16(), 64, 128, 64)
    assert not indexer_gluon.gluon_logits_supported(q, cache, 64, 128, 32)


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("pages_per_prog", [2, 4, 16, 64])
def test_gluon_pages_in_pairs_give_the_same_bits(g, heads, pages_per_prog):
    """IndexerConfig(gluon_pairs=True): each warpgroup takes its pages two at a time (and an
    odd last one alone); every page's maths is unchanged, so logits and group maxima are
    bit-identical to the default Gluon kernel's, and so is the top-k chosen from them."""
    # One token per request over irregular contexts (1 to 4,095 keys): chunks whose live page
    # counts are odd and even, and chunks past every token's limit.
    seq_lens = (3001, 1, 64, 129, 2000, 4095, 77, 1500)
    meta, cache, q, w = _case(g, heads, seq_lens, (1,) * len(seq_lens))
    plain = indexer.IndexerConfig(gluon=True, cuda_logits=False, pages_per_prog=pages_per_prog)
    pairs = dataclasses.replace(plain, gluon_pairs=True)
    ref_logits, ref_gmax, _ = indexer._logits(q, w, cache, meta, plain)
    torch.full((ref_logits.numel() * 2,), float("nan"), device=DEV)  # unwritten would be NaN
    logits, gmax, _ = indexer._logits(q, w, cache, meta, pairs)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(gmax, ref_gmax)
    scores, pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, pairs)
    ref_scores, ref_pos = indexer.indexer_topk(q, w, cache, meta, base.TOPK, plain)
    assert torch.equal(pos.sort(1).values, ref_pos.sort(1).values)
    assert torch.equal(scores.sort(1).values, ref_scores.sort(1).values)


def test_gluon_pages_in_pairs_reject_wide_tiles(g):
    """Two accumulators fit 128 registers for tiles of one token only: a prefill step's tiles
    get an error naming the option."""
    meta, cache, q, w = base._indexer_case(g, 64)  # a 300-token prefill: 256-row tiles
    with pytest.raises(ValueError, match="gluon_pairs"):
        indexer._logits(q, w, cache, meta, indexer.IndexerConfig(gluon=True, cuda_logits=False,
                                                                 gluon_pairs=True))
