"""FP8 lightning-indexer logits in Gluon for Hopper: indexer._indexer_logits_kernel's maths with
two math warpgroups that take alternate key pages, so that one's epilogue runs while the
other's MMA keeps the tensor cores busy.

Why (docs/kernels.md, "Where targets are missed"): the Triton kernel is one warpgroup per CTA
that issues wgmma for a page, waits for it, then runs the epilogue (ReLU · w, Σ heads, · k_scale,
mask, stores) with the tensor cores idle; at 255 registers it spills and fits 1–2 CTAs per SM.
Here the two warpgroups of one CTA never wait for each other after the prologue, so the warp
schedulers interleave them as DeepGEMM's sm90 fp8_mqa_logits does with its math warpgroups.

    CTA (tile i, page chunk c)          grid = (num_tiles, ceil(S_out / (BS · PAGES_PER_PROG)))
      prologue (warpgroup 0, before the split):
        TMA the first NUM_BUF live pages of each warpgroup's ring into shared memory
        Q [N = BLOCK_T·H, D] bf16 → fp8 with one power-of-two scale per row (as _load_q) →
          shared [N, D] (128-byte swizzle: wgmma's B operand, K-major); w · q_scale → shared [N]
      gl.warp_specialize: warpgroup g ∈ {0, 1} takes the chunk's live pages g, g + 2, g + 4, …
        wait ready[g, s] → S = K·Qᵀ: wgmma m64nNk32 × 4 (async), keys as M = 64, N = BLOCK_T·H
        → k_scale [64] from shared → wait → refill slot s with its page NUM_BUF later (TMA)
        → ReLU · w, Σ over each token's H heads (in-thread, then 2 lane shuffles), · k_scale,
          −inf at and past each token's limit → logits [64 keys, BLOCK_T] and the max of every
          GROUP keys, stored
      pages of the chunk past every token's limit: −inf, shared between the warpgroups alike

There is no producer warp (not tried): registers are handed out per warpgroup, so a third
one would start every thread at ≤ 168 registers (384 threads share 64K) and leave the math
warpgroups' 128 accumulator + 64 weight registers of an N = 256 tile to setmaxnreg. Instead
each warpgroup refills its own ring (one elected thread issues the TMA once the MMA that read
the slot has completed), so no barrier is shared between the warpgroups and neither ever waits
on the other. Registers (registers_per_thread): tiles of 128 and 256 columns take 255 per
thread, one CTA of 8 warps per SM; tiles of ≤ 64 columns (decode) take 128, two CTAs per SM.
Shared memory: Q 32 KB + 2 rings × NUM_BUF × 8.25 KB ≈ 100 KB at N = 256.

The prologue runs with the tensor cores idle (~2.7K instructions per warp at N = 256, about
five pages' epilogues): larger chunks (pages_per_prog) amortize it.

Page bytes (index_cache.py): block_size·D e4m3 values, then block_size fp32 scales; with
D = 128 a page is (block_size + 4·block_size/D) rows of D bytes, so the values of block b are
the [BS, D] box at row b·PAGE_ROWS of the cache viewed as [num_blocks·PAGE_ROWS, D] fp8, and its
scales the [1, BS] box at column BS·D/4 of row b of the cache viewed as [num_blocks, PAGE_ROWS·D/4]
fp32.
"""

# No `from __future__ import annotations`: the aggregate below checks its fields against real types.
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from dsaserve.kernels import formats
from dsaserve.kernels.triton import row_topk

NUM_BUF = 4  # key pages in flight per warpgroup (8.25 KB each)
Q_CHUNK = gl.constexpr(64)  # query rows quantized at a time in the prologue (64 values per thread)
SUPPORTED_HEADS = (32, 64)


# --------------------------------------------------------------------------------------------
# Quantizer: indexer._load_q's maths (mla_cache.pow2_ceil, mla_cache.to_e4m3), in Gluon
# --------------------------------------------------------------------------------------------
@gluon.jit
def _pow2_ceil(x):
    """2^ceil(log2(x)) for positive normal fp32 x (mla_cache.pow2_ceil)."""
    bits = x.to(gl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent += ((bits & 0x7FFFFF) != 0).to(gl.int32)
    return (exponent << 23).to(gl.float32, bitcast=True)


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _acc_layout(N):
    """wgmma accumulator of S [64 keys, N]: one warpgroup, one m64nNk32 instruction per K step."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])


@gluon.constexpr_function
def _head_split_layout(BS, BLOCK_T, H):
    """The accumulator's layout seen as [BS keys, BLOCK_T tokens, H heads] (column n = token
    n // H, head n % H). Per thread: rows lane/4 + {0, 8} + 16·warp; columns 2·(lane % 4) +
    {0, 1} + 8·i. Σ over heads is then in-thread plus the 2 lane bits of the quad.
    convert_layout(..., assert_trivial=True) checks it against the compiler's own."""
    n = BLOCK_T * H

    def col(c):
        return [0, c // H, 0] if c >= H else [0, 0, c]

    reg = [col(1), [8, 0, 0]] + [col(8 << i) for i in range((n // 8).bit_length() - 1)]
    lane = [col(2), col(4), [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16, 0, 0], [32, 0, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BS, BLOCK_T, H])


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@aggregate
class _Args:
    """What both math warpgroups share: buffers, barriers, descriptors and the tile's scalars
    (partitions other than the default one take no distributed tensors)."""

    q_smem: gl.shared_memory_descriptor  # [N, D] fp8, quantized queries
    w_smem: gl.shared_memory_descriptor  # [N] fp32, w · q_scale
    k_bufs: gl.shared_memory_descriptor  # [2·NUM_BUF, BS, D] fp8, key pages
    ks_bufs: gl.shared_memory_descriptor  # [2·NUM_BUF, 1, BS] fp32, key scales
    ready: gl.shared_memory_descriptor  # [2·NUM_BUF, 1] mbarriers: slot filled
    k_desc: tma.tensor_descriptor
    ks_desc: tma.tensor_descriptor
    bt_ptr: gl.tensor  # block table row of the tile's request, from the chunk's first page
    limit_ptr: gl.tensor
    out_ptr: gl.tensor
    gmax_ptr: gl.tensor
    tok0: gl.tensor  # first token of the tile (int64)
    ntok: gl.tensor  # tokens in the tile
    first: gl.tensor  # first page of the chunk
    num_live: gl.tensor  # pages of the chunk some token of the tile can see
    stride_out: gl.tensor
    stride_gmax: gl.tensor
    s_out: gl.tensor
    H: gl.constexpr
    BLOCK_T: gl.constexpr
    BS: gl.constexpr
    D: gl.constexpr
    NB: gl.constexpr
    PAGES_PER_PROG: gl.constexpr
    GROUP: gl.constexpr
    PAGE_ROWS: gl.constexpr
    SCALE_COL: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_smem, w_smem, k_bufs, ks_bufs, ready, k_desc, ks_desc, bt_ptr, limit_ptr,
                 out_ptr, gmax_ptr, tok0, ntok, first, num_live, stride_out, stride_gmax, s_out,
                 H, BLOCK_T, BS, D, NB, PAGES_PER_PROG, GROUP, PAGE_ROWS, SCALE_COL):
        self.q_smem, self.w_smem, self.k_bufs, self.ks_bufs = q_smem, w_smem, k_bufs, ks_bufs
        self.ready, self.k_desc, self.ks_desc = ready, k_desc, ks_desc
        self.bt_ptr, self.limit_ptr, self.out_ptr, self.gmax_ptr = (bt_ptr, limit_ptr, out_ptr,
                                                                    gmax_ptr)
        self.tok0, self.ntok, self.first, self.num_live = tok0, ntok, first, num_live
        self.stride_out, self.stride_gmax, self.s_out = stride_out, stride_gmax, s_out
        self.H, self.BLOCK_T, self.BS, self.D = (gl.constexpr(H), gl.constexpr(BLOCK_T),
                                                 gl.constexpr(BS), gl.constexpr(D))
        self.NB, self.PAGES_PER_PROG = gl.constexpr(NB), gl.constexpr(PAGES_PER_PROG)
        self.GROUP, self.PAGE_ROWS = gl.constexpr(GROUP), gl.constexpr(PAGE_ROWS)
        self.SCALE_COL = gl.constexpr(SCALE_COL)


@gluon.jit
def _issue_page(a: _Args, p, slot, pred):
    """TMA page p of the chunk (values and scales) into slot `slot`, arriving on ready[slot]."""
    block = gl.load(a.bt_ptr + p, mask=pred, other=0)
    bar = a.ready.index(slot)
    mbarrier.expect(bar, a.BS * a.D + a.BS * 4, pred=pred)
    tma.async_copy_global_to_shared(a.k_desc, [block * a.PAGE_ROWS, 0], bar, a.k_bufs.index(slot),
                                    pred=pred)
    tma.async_copy_global_to_shared(a.ks_desc, [block, a.SCALE_COL], bar, a.ks_bufs.index(slot),
                                    pred=pred)


@gluon.jit
def _quantize_q(a: _Args, q_ptr, w_ptr, FP8_MAX: gl.constexpr, MIN_AMAX: gl.constexpr):
    """Q rows of the tile → fp8 in q_smem and w · q_scale in w_smem (indexer._load_q's maths:
    the scale is a power of two > 0, so it moves out of the ReLU into the head weight).
    Rows of tokens past the tile's length are 0 (w = 0)."""
    N: gl.constexpr = a.BLOCK_T * a.H
    QCH: gl.constexpr = Q_CHUNK if Q_CHUNK < N else N
    # 8 bf16 (16 bytes) per thread along D, 16 threads per 128-wide row.
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    d = gl.arange(0, a.D, layout=gl.SliceLayout(0, ql))
    row0 = a.tok0 * a.H
    for c in gl.static_range(N // QCH):
        r = c * QCH + gl.arange(0, QCH, layout=gl.SliceLayout(1, ql))  # [QCH] rows of the tile
        ok = r // a.H < a.ntok
        q = gl.load(q_ptr + (row0 + r)[:, None] * a.D + d[None, :], mask=ok[:, None],
                    other=0.0).to(gl.float32)  # [QCH, D]
        amax = gl.max(gl.abs(q), axis=1)
        q_scale = _pow2_ceil(gl.maximum(amax, MIN_AMAX) / FP8_MAX)  # [QCH]
        # Exact: q · 2^-k is what q / 2^k rounds to, and |q / q_scale| ≤ FP8_MAX. The cast is
        # cvt.rn.satfinite (round to nearest even, saturated), the rounding mla_cache.to_e4m3
        # spells out in integer ops for Triton's interpreter: same bytes, a few instructions
        # per value instead of ~20 (the prologue runs with the tensor cores idle).
        q8 = (q * (1.0 / q_scale)[:, None]).to(gl.float8e4nv)
        a.q_smem.slice(c * QCH, QCH).store(q8)
        w = gl.load(w_ptr + row0 + r, mask=ok, other=0.0)
        a.w_smem.slice(c * QCH, QCH).store(w * q_scale)


@gluon.jit
def _store_page(acc, w, k_scale, p, a: _Args):
    """S [BS, N] of chunk page p → logits [BS, BLOCK_T] and group maxima [BS / GROUP, BLOCK_T],
    stored; −inf at and past each token's limit (also unwritten slots of the last page)."""
    L3: gl.constexpr = _head_split_layout(a.BS, a.BLOCK_T, a.H)
    L: gl.constexpr = gl.SliceLayout(2, L3)
    NG: gl.constexpr = a.BS // a.GROUP
    x = gl.maximum(acc, 0.0) * w[None, :]
    x = gl.convert_layout(gl.reshape(x, [a.BS, a.BLOCK_T, a.H]), L3, assert_trivial=True)
    logits = gl.sum(x, axis=2) * k_scale[:, None]  # [BS, BLOCK_T]
    t = gl.arange(0, a.BLOCK_T, layout=gl.SliceLayout(0, L))
    tok_ok = t < a.ntok
    limit = gl.load(a.limit_ptr + a.tok0 + t, mask=tok_ok, other=0)
    j = (a.first + p) * a.BS + gl.arange(0, a.BS, layout=gl.SliceLayout(1, L))
    logits = gl.where(j[:, None] < limit[None, :], logits, float("-inf"))
    gl.store(a.out_ptr + (a.tok0 + t)[None, :] * a.stride_out + j[:, None], logits,
             mask=tok_ok[None, :] & (j[:, None] < a.s_out))
    group_max = gl.max(gl.reshape(logits, [NG, a.GROUP, a.BLOCK_T]), axis=1)  # [NG, BLOCK_T]
    GL: gl.constexpr = group_max.type.layout
    tg = gl.arange(0, a.BLOCK_T, layout=gl.SliceLayout(0, GL))
    g = (a.first + p) * NG + gl.arange(0, NG, layout=gl.SliceLayout(1, GL))
    gl.store(a.gmax_ptr + (a.tok0 + tg)[None, :] * a.stride_gmax + g[:, None], group_max,
             mask=(tg < a.ntok)[None, :] & (g[:, None] < gl.cdiv(a.s_out, a.GROUP)))


@gluon.jit
def _store_dead_page(p, a: _Args):
    """Chunk page p, past every token's limit: −inf logits and group maxima."""
    NG: gl.constexpr = a.BS // a.GROUP
    dl: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])
    t = gl.arange(0, a.BLOCK_T, layout=gl.SliceLayout(0, dl))
    tok_ok = t < a.ntok
    j = (a.first + p) * a.BS + gl.arange(0, a.BS, layout=gl.SliceLayout(1, dl))
    gl.store(a.out_ptr + (a.tok0 + t)[None, :] * a.stride_out + j[:, None],
             gl.full([a.BS, a.BLOCK_T], float("-inf"), gl.float32, dl),
             mask=tok_ok[None, :] & (j[:, None] < a.s_out))
    g = (a.first + p) * NG + gl.arange(0, NG, layout=gl.SliceLayout(1, dl))
    gl.store(a.gmax_ptr + (a.tok0 + t)[None, :] * a.stride_gmax + g[:, None],
             gl.full([NG, a.BLOCK_T], float("-inf"), gl.float32, dl),
             mask=tok_ok[None, :] & (g[:, None] < gl.cdiv(a.s_out, a.GROUP)))


@gluon.jit
def _math_warpgroup(a: _Args, WG: gl.constexpr):
    """Warpgroup WG's pages of the chunk: live ones WG, WG + 2, … through its ring of NB slots
    (slots WG·NB …), then its share of the dead ones."""
    N: gl.constexpr = a.BLOCK_T * a.H
    acc_layout: gl.constexpr = _acc_layout(N)
    L: gl.constexpr = gl.SliceLayout(2, _head_split_layout(a.BS, a.BLOCK_T, a.H))
    w = a.w_smem.load(gl.SliceLayout(0, acc_layout))  # [N], in registers for the whole chunk
    # Scales as plain rows (the TMA wrote them unswizzled) to read them in the logits' layout.
    ks_rows = a.ks_bufs._reinterpret(gl.float32, [2 * a.NB, a.BS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_t = a.q_smem.permute((1, 0))  # [D, N], K-major
    acc = gl.zeros([a.BS, N], gl.float32, acc_layout)
    num_mine = (a.num_live - WG + 1) // 2
    for i in range(num_mine):
        s = i % a.NB
        slot = WG * a.NB + s
        mbarrier.wait(a.ready.index(slot), (i // a.NB) & 1)
        k = a.k_bufs.index(slot)  # [BS, D]
        # use_acc=False: the previous page's registers are overwritten, nothing to zero.
        acc = warpgroup_mma(k, q_t, acc, use_acc=False, is_async=True)
        k_scale = ks_rows.index(slot).load(gl.SliceLayout(1, L))  # [BS], under the MMA
        acc, k = warpgroup_mma_wait(0, deps=(acc, k))
        # Every warp's MMA and scale reads of the slot are done: order them before the TMA
        # (async proxy) that refills it, then let one thread issue it.
        fence_async_shared()
        gl.thread_barrier()
        _issue_page(a, 2 * (i + a.NB) + WG, slot, i + a.NB < num_mine)
        _store_page(acc, w, k_scale, 2 * i + WG, a)
    # Dead pages p ≥ num_live with p % 2 == WG.
    for p in range(a.num_live + ((a.num_live + WG) & 1), a.PAGES_PER_PROG, 2):
        _store_dead_page(p, a)


@gluon.jit
def _math_warpgroup_pairs(a: _Args, WG: gl.constexpr):
    """_math_warpgroup taking its pages two at a time: both pages' MMAs issued, then both
    epilogues, which are independent, so each warp has two instruction streams to interleave
    where _math_warpgroup has one dependent chain per page (NB even; an odd last page alone)."""
    N: gl.constexpr = a.BLOCK_T * a.H
    acc_layout: gl.constexpr = _acc_layout(N)
    L: gl.constexpr = gl.SliceLayout(2, _head_split_layout(a.BS, a.BLOCK_T, a.H))
    gl.static_assert(a.NB % 2 == 0, "pairs of pages share a ring round")
    w = a.w_smem.load(gl.SliceLayout(0, acc_layout))
    ks_rows = a.ks_bufs._reinterpret(gl.float32, [2 * a.NB, a.BS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_t = a.q_smem.permute((1, 0))
    acc0 = gl.zeros([a.BS, N], gl.float32, acc_layout)
    acc1 = gl.zeros([a.BS, N], gl.float32, acc_layout)
    num_mine = (a.num_live - WG + 1) // 2
    for j in range(num_mine // 2):
        i = 2 * j
        slot0 = WG * a.NB + i % a.NB
        slot1 = slot0 + 1
        mbarrier.wait(a.ready.index(slot0), (i // a.NB) & 1)
        k0 = a.k_bufs.index(slot0)
        acc0 = warpgroup_mma(k0, q_t, acc0, use_acc=False, is_async=True)
        mbarrier.wait(a.ready.index(slot1), (i // a.NB) & 1)
        k1 = a.k_bufs.index(slot1)
        acc1 = warpgroup_mma(k1, q_t, acc1, use_acc=False, is_async=True)
        ks0 = ks_rows.index(slot0).load(gl.SliceLayout(1, L))
        ks1 = ks_rows.index(slot1).load(gl.SliceLayout(1, L))
        acc0, acc1, k0, k1 = warpgroup_mma_wait(0, deps=(acc0, acc1, k0, k1))
        fence_async_shared()
        gl.thread_barrier()
        _issue_page(a, 2 * (i + a.NB) + WG, slot0, i + a.NB < num_mine)
        _issue_page(a, 2 * (i + 1 + a.NB) + WG, slot1, i + 1 + a.NB < num_mine)
        _store_page(acc0, w, ks0, 2 * i + WG, a)
        _store_page(acc1, w, ks1, 2 * (i + 1) + WG, a)
    for i in range(num_mine // 2 * 2, num_mine):  # the odd last page
        slot = WG * a.NB + i % a.NB
        mbarrier.wait(a.ready.index(slot), (i // a.NB) & 1)
        k = a.k_bufs.index(slot)
        acc0 = warpgroup_mma(k, q_t, acc0, use_acc=False, is_async=True)
        ks0 = ks_rows.index(slot).load(gl.SliceLayout(1, L))
        acc0, k = warpgroup_mma_wait(0, deps=(acc0, k))
        _store_page(acc0, w, ks0, 2 * i + WG, a)  # the last page: no refill
    for p in range(a.num_live + ((a.num_live + WG) & 1), a.PAGES_PER_PROG, 2):
        _store_dead_page(p, a)


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@gluon.jit(do_not_specialize=["stride_bt", "s_out"])
def _indexer_logits_gluon_kernel(
    q_ptr,  # [T·H, D] bf16
    w_ptr,  # [T·H] fp32
    k_desc,  # TMA: cache as [num_blocks·PAGE_ROWS, D] fp8, box [BS, D]
    ks_desc,  # TMA: cache as [num_blocks, PAGE_ROWS·D/4] fp32, box [1, BS]
    block_table_ptr,  # [R, max_blocks] int32
    tile_req_ptr, tile_tok_ptr, tile_len_ptr,  # [num_tiles] int32
    limit_ptr,  # [T] int32
    out_ptr,  # [T, S_out] fp32
    gmax_ptr,  # [T, ceil(S_out / GROUP)] fp32
    stride_bt, stride_out, stride_gmax, s_out,
    H: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, BLOCK_T: gl.constexpr,
    PAGES_PER_PROG: gl.constexpr, GROUP: gl.constexpr, NB: gl.constexpr,
    FP8_MAX: gl.constexpr, MIN_AMAX: gl.constexpr, REGS: gl.constexpr,
    PAIRS: gl.constexpr = False,  # _math_warpgroup_pairs instead of _math_warpgroup
):
    gl.static_assert(BS == 64, "one page is one wgmma M of 64 keys")
    N: gl.constexpr = BLOCK_T * H
    gl.static_assert(N <= 256, "the tile is one wgmma N")
    PAGE_ROWS: gl.constexpr = BS + BS * 4 // D
    tile = gl.program_id(0)
    chunk = gl.program_id(1)
    req = gl.load(tile_req_ptr + tile).to(gl.int64)
    tok0 = gl.load(tile_tok_ptr + tile).to(gl.int64)
    ntok = gl.load(tile_len_ptr + tile)
    first = chunk * PAGES_PER_PROG
    ll: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    tt = gl.arange(0, BLOCK_T, layout=ll)
    max_limit = gl.max(gl.load(limit_ptr + tok0 + tt, mask=tt < ntok, other=0), axis=0)
    num_live = gl.minimum(gl.maximum(gl.cdiv(max_limit, BS) - first, 0), PAGES_PER_PROG)

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, D],
                                       gl.NVMMASharedLayout.get_default_for([N, D], gl.float8e4nv))
    w_smem = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * NB, BS, D], k_desc.layout)
    ks_bufs = gl.allocate_shared_memory(gl.float32, [2 * NB, 1, BS], ks_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * NB, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2 * NB):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()  # barrier initialisation visible to the TMA unit

    # gl.to_tensor: the JIT turns integer arguments equal to 1 into constexprs.
    a = _Args(q_smem, w_smem, k_bufs, ks_bufs, ready, k_desc, ks_desc,
              block_table_ptr + req * stride_bt + first, limit_ptr, out_ptr, gmax_ptr,
              tok0, gl.to_tensor(ntok), gl.to_tensor(first), num_live,
              gl.to_tensor(stride_out), gl.to_tensor(stride_gmax), gl.to_tensor(s_out),
              H, BLOCK_T, BS, D, NB, PAGES_PER_PROG, GROUP, PAGE_ROWS, BS * D // 4)
    # The first pages of both rings load while the queries are quantized.
    for s in gl.static_range(NB):
        for wg in gl.static_range(2):
            _issue_page(a, 2 * s + wg, wg * NB + s, 2 * s + wg < num_live)
    _quantize_q(a, q_ptr, w_ptr, FP8_MAX, MIN_AMAX)
    fence_async_shared()  # generic-proxy stores of Q before the wgmma (async proxy) reads them
    gl.thread_barrier()
    if PAIRS:
        gl.warp_specialize([(_math_warpgroup_pairs, (a, 0)), (_math_warpgroup_pairs, (a, 1))],
                           [4], [REGS])
    else:
        gl.warp_specialize([(_math_warpgroup, (a, 0)), (_math_warpgroup, (a, 1))], [4], [REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def gluon_logits_supported(q: torch.Tensor, cache: torch.Tensor, num_heads: int, head_dim: int,
                           block_size: int) -> bool:
    """Shapes this kernel covers: an H100/H200 (sm_90), an FP8 index cache (uint8, or its
    float8_e4m3fn view), bf16 queries, D = 128, pages of 64 keys, 32 or 64 heads."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)
            and cache.dtype in (torch.uint8, torch.float8_e4m3fn) and q.dtype == torch.bfloat16
            and head_dim == 128 and block_size == 64 and num_heads in SUPPORTED_HEADS)


def registers_per_thread(num_heads: int, block_t: int) -> int:
    """Register budget of every thread (both warpgroups): tiles of 128 or 256 columns take all
    255 (an N = 256 tile holds 128 accumulator + 64 weight registers; N = 128 spills at 128),
    one CTA per SM; tiles of ≤ 64 columns (decode: one token) fit in 128, so that two CTAs
    share an SM and one's pipeline fill hides under the other's pages."""
    return 256 if num_heads * block_t > 64 else 128


def page_descriptors(cache: torch.Tensor, head_dim: int, block_size: int,
                     ) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the paged FP8 cache [num_blocks, block_size·(D + 4)] bytes: values
    (box [block_size, D] fp8 at row block·PAGE_ROWS) and scales (box [1, block_size] fp32 at
    column block_size·D/4 of row block); the cache must be contiguous."""
    page_rows = block_size + block_size * 4 // head_dim
    cache = cache.view(torch.uint8)  # [num_blocks, page bytes]
    values = cache.view(torch.float8_e4m3fn).view(-1, head_dim)  # [num_blocks·PAGE_ROWS, D]
    scales = cache.view(torch.float32)  # [num_blocks, page bytes / 4]
    k_desc = TensorDescriptor(values, [values.shape[0], head_dim], [head_dim, 1],
                              [block_size, head_dim], gl.NVMMASharedLayout(128, 8))
    ks_desc = TensorDescriptor(scales, [scales.shape[0], page_rows * head_dim // 4],
                               [page_rows * head_dim // 4, 1], [1, block_size],
                               gl.NVMMASharedLayout(0, 32))
    return k_desc, ks_desc


def launch_logits_gluon(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                        block_table: torch.Tensor, tiles: torch.Tensor, limits_i32: torch.Tensor,
                        logits: torch.Tensor, group_max: torch.Tensor, *, num_heads: int,
                        head_dim: int, block_size: int, block_t: int, pages_per_prog: int,
                        pairs: bool = False) -> None:
    """What indexer._logits's `_indexer_logits_kernel[grid](...)` launch does for an FP8 cache:
    q [T·H, D] bf16, w [T·H] fp32, cache the index cache as float8_e4m3fn (or uint8)
    [num_blocks, block_size·(D + 4)], block_table [R, max_blocks] int32, tiles [3, num_tiles]
    int32 (request, first token, tokens ≤ block_t), limits_i32 [T] → logits [T, S_out] and
    group_max [T, ceil(S_out / GROUP)] fp32, −inf at and past each token's limit. pairs: the
    warpgroups take their pages two at a time (_math_warpgroup_pairs; tiles of one token, whose
    two accumulators fit the 128 registers of two CTAs per SM: two tokens of 32 heads spill)."""
    if pairs and block_t != 1:
        raise ValueError(f"indexer: gluon_pairs needs tiles of one token (decode steps of one "
                         f"query per request), got tiles of {block_t}")
    num_tiles, s_out = tiles.shape[1], logits.shape[1]
    if num_tiles == 0 or s_out == 0:
        return
    k_desc, ks_desc = page_descriptors(cache, head_dim, block_size)
    regs = registers_per_thread(num_heads, block_t)
    grid = (num_tiles, triton.cdiv(s_out, block_size * pages_per_prog))
    _indexer_logits_gluon_kernel[grid](
        q, w, k_desc, ks_desc, block_table, tiles[0], tiles[1], tiles[2], limits_i32, logits,
        group_max, block_table.stride(0), logits.stride(0), group_max.stride(0), s_out,
        H=num_heads, D=head_dim, BS=block_size, BLOCK_T=block_t, PAGES_PER_PROG=pages_per_prog,
        GROUP=row_topk.GROUP, NB=NUM_BUF, FP8_MAX=formats.FP8_MAX,
        MIN_AMAX=formats.INDEX_MIN_AMAX, REGS=regs, PAIRS=pairs, num_warps=4,
        maxnreg=None if regs == 256 else regs,
    )
