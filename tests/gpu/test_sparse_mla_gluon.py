"""The Gluon sparse MLA kernels (sm_90 only) against the PyTorch reference, fresh random inputs
every run; tolerances as in test_kernels_gpu.py (`_check_attention`). bf16 rows run the
ping-pong kernel (sparse_mla_pingpong.py), fp8_ds_mla rows sparse_mla_gluon.py's.

Covers 64 and 128 heads, bf16 and fp8_ds_mla caches, an irregular row count, index rows of 2048
and of 100 slots, −1 holes, slots past the cache (skipped like −1), rows with no valid slot;
for the ping-pong kernel the split + merge path (uneven splits, a split count that is not a
power of two, splits left empty); for the 32-row kernel its splits (uneven ones, capped at the
block count) and grids whose CTAs run many rows back to back, with rows of 64 blocks checked
block by block and head tile by head tile. Failure messages name the case, the worst
row and the worst group of 16 heads. Run on the device machine:
`pytest -m gpu tests/gpu/test_sparse_mla_gluon.py`.
"""

from __future__ import annotations

import pytest
import torch
from sm90_suite import require_sm90

pytestmark = [pytest.mark.gpu]
require_sm90("the Gluon sparse MLA kernels")
triton = pytest.importorskip("triton")

import test_kernels_gpu as base  # noqa: E402  (its helpers, reused; `g` is in conftest.py)

from dsaserve.kernels import reference  # noqa: E402
from dsaserve.kernels.triton import sparse_mla_gluon  # noqa: E402

DEV, L, R, SCALE, TOPK = base.DEV, base.L, base.R, base.SCALE, base.TOPK


def _past_the_cache(g, idx: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """idx with some of its −1 holes replaced by slots past the end of the cache, which the
    kernel must skip the same way (the reference is given the −1s). The bound is the cache's
    own slot count (num_blocks · block_size), not the number of slots a test filled: an fp8
    cache of 6007 slots in pages of 64 has 6016 rows, and slots 6007..6015 are real rows that
    the kernel rightly reads while the reference would skip them (a relative error of ≈ 0.45
    on the fp8 prefill cases from a correct kernel)."""
    total = cache.shape[0] * cache.shape[1]
    far = torch.randint(total, 2 * total + 7, idx.shape, device=DEV, generator=g)
    pick = (idx < 0) & (torch.rand(idx.shape, device=DEV, generator=g) < 0.5)
    return torch.where(pick, far.int(), idx)


def _check(label: str, o, lse, ref_o, ref_lse, idx) -> None:
    """`base._check_attention` (same tolerances) with messages naming the case, the worst row
    and the worst group of 16 heads (one warp's rows of the wgmma tile)."""
    assert not bool(o.isnan().any()) and not bool(lse.isnan().any()), f"{label}: NaN"
    empty = (idx < 0).all(dim=1)
    live = ~empty
    diff = (o.float() - ref_o)[live]
    rel = float(diff.norm() / ref_o[live].norm().clamp_min(1e-30))
    row_err = diff.flatten(1).norm(dim=1) / ref_o[live].flatten(1).norm(dim=1).clamp_min(1e-30)
    heads = o.shape[1]
    group_err = [float(diff[:, h:h + 16].norm() / ref_o[live][:, h:h + 16].norm().clamp_min(1e-30))
                 for h in range(0, heads, 16)]
    rows = torch.nonzero(live).flatten()
    worst = int(row_err.argmax()) if len(rows) else 0
    where = (f"worst row {int(rows[worst])} ({float(row_err[worst]):.3g}, "
             f"{int((idx[rows[worst]] >= 0).sum())} valid slots); heads by 16: "
             + ", ".join(f"{e:.2g}" for e in group_err)) if len(rows) else "no live row"
    assert rel <= 1e-2, f"{label}: o relative error {rel:.3g} > 1e-2; {where}"
    err = (lse[live] - ref_lse[live]).abs() / ref_lse[live].abs().clamp_min(1.0)
    err_lse = float(err.max()) if err.numel() else 0.0
    assert err_lse <= 1e-2, f"{label}: lse relative error {err_lse:.3g} > 1e-2; {where}"
    assert bool((o[empty] == 0).all()), f"{label}: rows with no valid slot must give o = 0"
    assert bool((lse[empty] == float("-inf")).all()), f"{label}: ... and lse = -inf"


def _run(label, g, q, cache, idx, num_splits=None, num_ctas=None, pingpong_fp8=False):
    ours = _past_the_cache(g, idx, cache)
    assert sparse_mla_gluon.gluon_supported(q, cache)
    o, lse = sparse_mla_gluon.sparse_mla_fwd_gluon(q, cache, ours, SCALE, L,
                                                   num_splits=num_splits, num_ctas=num_ctas,
                                                   pingpong_fp8=pingpong_fp8)
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, SCALE, L, R)
    assert o.dtype == torch.bfloat16 and o.shape == (q.shape[0], q.shape[1], L)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    _check(label, o, lse, ref_o, ref_lse, idx)


@pytest.mark.parametrize("topk", [TOPK, 100])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8 ping-pong"])
def test_gluon_prefill_matches_reference(g, heads, kind, topk):
    num_tokens, num_slots = 37, 6007
    fp8 = kind.startswith("fp8")
    cache = base._random_cache(g, num_slots, 64 if fp8 else num_slots, fp8)
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    contexts[:7] = torch.tensor([1, 5, 100, 2047, 2048, 2049, 0], device=DEV)
    idx = base._random_indices(g, num_tokens, contexts, num_slots)[:, :topk].contiguous()
    idx[9] = -1  # a row with no valid index, whatever topk is
    q = torch.randn(num_tokens, heads, L + R, device=DEV, generator=g).bfloat16()
    _run(f"prefill {kind} H={heads} K={topk}", g, q, cache, idx, num_splits=1,
         pingpong_fp8=kind == "fp8 ping-pong")


@pytest.mark.parametrize("batch,s_q,topk,num_splits,num_ctas,pingpong", [
    (8, 1, TOPK, None, None, False),  # the default grid: 8 splits per row, merged
    (3, 2, TOPK, 3, None, False),  # uneven splits (21, 21, 22 blocks)
    (5, 1, 100, 16, None, False),  # 4 blocks per row: the splits capped at 4, none empty
    (16, 4, TOPK, 1, 7, False),  # 64 whole rows over 7 CTAs: 9 or 10 each, back to back
    (4, 4, TOPK, 1, None, False),  # one CTA per row
    (8, 1, TOPK, None, None, True),  # ping-pong: its default splits (8 of two pairs each)
    (3, 2, TOPK, 3, None, True),  # uneven splits of pairs (6, 6, 4)
    (5, 1, 100, 16, None, True),  # one pair per row: splits past it left empty
    (4, 4, TOPK, 1, None, True),  # whole rows
])
def test_gluon_fp8_decode_matches_reference(g, batch, s_q, topk, num_splits, num_ctas,
                                            pingpong):
    block_size, max_ctx, heads = 64, 5000, 64
    contexts = torch.randint(1, max_ctx, (batch,), device=DEV, generator=g)
    contexts[0] = 3  # fewer keys than TOPK
    blocks_per_req = -(-max_ctx // block_size)
    table = torch.randperm(batch * blocks_per_req, device=DEV, generator=g).view(batch, -1)
    num_slots = batch * blocks_per_req * block_size
    cache = base._random_cache(g, num_slots, block_size, True)
    rows = torch.arange(batch, device=DEV).repeat_interleave(s_q)  # [T] request of each row

    def slot_of(pos):  # request-local positions → physical slots
        return table[rows[:, None], pos // block_size] * block_size + pos % block_size

    idx = base._random_indices(g, batch * s_q, contexts[rows], max_ctx, slot_of)[:, :topk]
    idx = idx.contiguous()
    idx[-1] = -1  # a decode row with nothing to attend to
    q = torch.randn(batch * s_q, heads, L + R, device=DEV, generator=g).bfloat16()
    _run(f"fp8 decode b={batch} s_q={s_q} K={topk} splits={num_splits} CTAs={num_ctas} "
         f"ping-pong={pingpong}", g, q, cache, idx, num_splits=num_splits, num_ctas=num_ctas,
         pingpong_fp8=pingpong)


@pytest.mark.parametrize("num_splits,topk", [(3, TOPK), (16, 300), (2, 64)])
def test_pingpong_bf16_splits_match_reference(g, num_splits, topk):
    """The ping-pong kernel (bf16 rows) on the split + merge path: uneven splits, splits left
    empty, and an index row shorter than one pair of blocks; 128 heads."""
    num_tokens, num_slots, heads = 6, 5000, 128
    cache = base._random_cache(g, num_slots, num_slots, False)
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    contexts[0] = 2
    idx = base._random_indices(g, num_tokens, contexts, num_slots)[:, :topk].contiguous()
    idx[3] = -1
    q = torch.randn(num_tokens, heads, L + R, device=DEV, generator=g).bfloat16()
    _run(f"ping-pong bf16 splits={num_splits} K={topk}", g, q, cache, idx,
         num_splits=num_splits)


def test_pingpong_matches_32_row_gluon_kernel(g):
    """bf16 rows through both Gluon kernels (ping-pong, and sparse_mla_gluon.py's with 32-row
    blocks): they agree to bf16 rounding."""
    from dsaserve.kernels.triton import sparse_mla

    num_tokens, num_slots = 64, 4096
    cache = base._random_cache(g, num_slots, num_slots, False)
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    idx = base._random_indices(g, num_tokens, contexts, num_slots)
    q = torch.randn(num_tokens, 64, L + R, device=DEV, generator=g).bfloat16()
    o, lse = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L,
                                       sparse_mla.SparseMlaConfig(gluon=True, num_splits=1))
    o32, lse32 = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L, sparse_mla.SparseMlaConfig(
        gluon=True, pingpong=False, num_splits=1))
    _check("ping-pong vs 32-row Gluon kernel, bf16 rows", o, lse, o32.float(), lse32, idx)


@pytest.mark.parametrize("kind,num_splits,num_ctas",
                         [("fp8", 1, None), ("fp8", 1, 3), ("fp8", 5, None), ("bf16", 1, None),
                          ("fp8 ping-pong", 1, None), ("fp8 ping-pong", 3, None)])
def test_gluon_long_split_block_by_block(g, kind, num_splits, num_ctas):
    """Rows of 64 blocks (top-2048, 128 heads = two head tiles): a full row, then rows whose
    valid slots all lie in one block w (the others −1), for blocks at the start, around the ring
    wraps (K ring of 4) and at the end of the row. A ring index or phase error at block w shows
    up in its row alone; each head tile is checked on its own. fp8 rows: the 26 rows (13 tokens
    × 2 head tiles) one per CTA, 8 or 9 per CTA back to back (3 CTAs), and in 5 splits of 12
    or 13 blocks (the ring wraps elsewhere in each split); through the ping-pong kernel, whole
    rows and 3 splits of 10 or 12 pairs (its two buffers' halves change phase every pair)."""
    heads, num_slots = 128, 8192
    fp8 = kind.startswith("fp8")
    cache = base._random_cache(g, num_slots, 64 if fp8 else num_slots, fp8)
    windows = [0, 1, 2, 3, 4, 5, 6, 31, 32, 61, 62, 63]
    perm = torch.randperm(num_slots, device=DEV, generator=g)[:TOPK].int()
    idx = perm.repeat(1 + len(windows), 1)  # row 0: every slot valid
    pos = torch.arange(TOPK, device=DEV)
    for r, w in enumerate(windows, start=1):
        idx[r] = torch.where(pos // 32 == w, idx[r], -1)
    q = torch.randn(idx.shape[0], heads, L + R, device=DEV, generator=g).bfloat16()
    o, lse = sparse_mla_gluon.sparse_mla_fwd_gluon(q, cache, idx, SCALE, L,
                                                   num_splits=num_splits, num_ctas=num_ctas,
                                                   pingpong_fp8=kind == "fp8 ping-pong")
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, SCALE, L, R)
    for r, what in enumerate(["all blocks"] + [f"block {w} only" for w in windows]):
        for h in (0, 64):
            label = (f"{kind} splits={num_splits} CTAs={num_ctas}, row {r} ({what}), heads "
                     f"{h}..{h + 63}")
            _check(label, o[r:r + 1, h:h + 64], lse[r:r + 1, h:h + 64],
                   ref_o[r:r + 1, h:h + 64], ref_lse[r:r + 1, h:h + 64], idx[r:r + 1])


def test_gluon_matches_triton_kernel(g):
    """Same inputs through both kernels: they agree to bf16 rounding."""
    from dsaserve.kernels.triton import sparse_mla

    num_tokens, num_slots = 64, 4096
    cache = base._random_cache(g, num_slots, 64, True)
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    idx = base._random_indices(g, num_tokens, contexts, num_slots)
    q = torch.randn(num_tokens, 64, L + R, device=DEV, generator=g).bfloat16()
    o, lse = sparse_mla_gluon.sparse_mla_fwd_gluon(q, cache, idx, SCALE, L)
    t_o, t_lse = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L,
                                           sparse_mla.SparseMlaConfig(gluon=False))
    _check("gluon vs triton, fp8 cache, default grid", o, lse, t_o.float(), t_lse, idx)


def test_gluon_rejects_unsupported_shapes():
    q = torch.zeros(4, 32, L + R, device=DEV, dtype=torch.bfloat16)  # 32 heads
    cache = torch.zeros(1, 64, L + R, device=DEV, dtype=torch.bfloat16)
    idx = torch.zeros(4, 8, device=DEV, dtype=torch.int32)
    assert not sparse_mla_gluon.gluon_supported(q, cache)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse_mla_gluon.sparse_mla_fwd_gluon(q, cache, idx, SCALE, L)
    with pytest.raises(ValueError, match="int32"):  # the checks shared with the Triton kernel
        sparse_mla_gluon.sparse_mla_fwd_gluon(q.repeat(1, 2, 1), cache, idx.long(), SCALE, L)


@pytest.mark.parametrize("num_splits,num_ctas", [(1, None), (3, None), (1, 7)])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_l2_prefetch_gives_the_same_bits(g, kind, num_splits, num_ctas):
    """SparseMlaConfig(l2_copies="prefetch"): the Gluon kernels (ping-pong for bf16 rows, the
    32-row one for fp8_ds_mla) with their copies rewritten (l2_hint) change how rows reach L2,
    not what is computed: bit-identical o and lse. (Both are also built with the other
    setting, whichever the default is.)"""
    from dsaserve.kernels.triton import sparse_mla

    num_tokens, num_slots = 40, 4096
    cache = base._random_cache(g, num_slots, num_slots, kind == "fp8")
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    idx = base._random_indices(g, num_tokens, contexts, num_slots)
    idx[5] = -1
    q = torch.randn(num_tokens, 64, L + R, device=DEV, generator=g).bfloat16()
    plain = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L, sparse_mla.SparseMlaConfig(
        gluon=True, num_splits=num_splits, num_ctas=num_ctas, l2_copies="plain"))
    hinted = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L, sparse_mla.SparseMlaConfig(
        gluon=True, num_splits=num_splits, num_ctas=num_ctas, l2_copies="prefetch"))
    assert torch.equal(plain[0].view(torch.int16), hinted[0].view(torch.int16))  # bits
    assert torch.equal(plain[1].view(torch.int32), hinted[1].view(torch.int32))
