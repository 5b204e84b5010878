"""Sparse MLA forward in Gluon for Hopper (sm_90): the contract of `sparse_mla.sparse_mla_fwd`,
restructured the way FlashMLA's sparse kernels are so that the row gathers, the tensor cores
and the softmax overlap instead of taking turns.

A row is one query token and 64 of its heads. A CTA takes either whole rows, run back to back
(its gather streams on into the next row while the current one finishes), or one split of one
row, whose partial (o, lse) sparse_mla.merge_splits merges (mla_work.py: which, and why). Per
block of BN index positions, three warp-specialized partitions of one warpgroup (4 warps) each:

    gather  (worker 1)   for block j: slots = idx[t, j·BN : (j+1)·BN]
                         bf16 rows: cp.async straight into K ring slot j % NBUF, each thread's
                           cp.async.mbarrier.arrive on k_ready fires when its copies land;
                         fp8_ds_mla: the raw 656-byte rows cp.async into the K ring slot
                           itself, 2 blocks ahead, then dequantized in place (e4m3 · 2^k,
                           exact in bf16; registers in between)
                                                           K [BN, 512 | 64] bf16 → k_ready
    softmax (default)    S = Q·Kᵀ [64, BN] (wgmma, Q and K from shared memory), mask, online
                         softmax in base 2; P (bf16) and α = 2^(m_old − m_new) → shared
                                                                              → p_ready
                         O[:, :128] = α·O + P·K[:, :128]   (P from shared memory)
    pv      (worker 0)   O[:, 128:] = α·O + P·K[:, 128:]   (P from shared memory)
    both consumers release the K slot and the P buffer once their P·K is done
                                                                   → k_empty, p_empty

Per block b the softmax warpgroup issues S of block b + 1 and its P·K of block b together,
waits for S only, does the softmax of b + 1 (beside P·K of b on the tensor cores) and hands its
P over, then waits for P·K of b, releases that K slot and rescales O by α(b + 1) with no wgmma
in flight. That order is FlashAttention-3's, and it matters beyond the overlap: a first build
issued S(b + 1), ran the softmax of b and rescaled O while S(b + 1) was in flight; an
instruction writing an accumulator register while a wgmma is in flight makes ptxas serialize
every wgmma of the kernel (its C7515 note: a wait after each of the 36 k-steps of S). On an
H200 that build took 4.44 ms for the prefill of docs/kernels.md and 154 µs for its FP8 decode
at b = 128; this order takes 3.43 ms and 122 µs.

Why this split: the accumulator O [64, 512] fp32 would take 256 registers per thread in one
warpgroup, so the two consumers share its columns; S, the row maxima and sums live in one
warpgroup, so no softmax statistic crosses warpgroups (the plain Triton kernel reduced them
through shared memory with CTA-wide barriers every block) and P crosses once. The price is an
uneven split of the tensor work, which the column split evens out in part: QK plus a quarter
of PV against three quarters of PV (GluonMlaBuild). Every hand-off is an mbarrier (phase
parity per ring slot); barriers inside a partition are named barriers of its 128 threads, none
is CTA-wide.

Shared memory, BN = 32: Q 72 KB, a K ring slot 36 KB, P 2 × 4 KB. bf16 rows: NBUF = 4, so the
gather runs up to 3 blocks ahead of the block being computed (225 KB). fp8 rows: the same
NBUF = 4 and no separate raw ring (a raw block, 20.5 KB, fits in the slot it dequantizes into),
so dequantizing block b + 2 overlaps the computation of block b. (A first build kept a raw ring
of 3 beside 2 K slots, 215 KB: the gather could then dequantize block b + 1 only once block
b − 1 was released, right before the softmax warpgroup waits for b + 1, so release,
dequantization, S, softmax and P·V formed one serial chain per block; measured on an H200,
FP8 decode b = 128: 203 µs against 154 µs in place, both with the serialized wgmmas.)
Invalid slots (< 0, ≥ num_slots, or past the index row) are never read: their cp.async is
predicated off and zero-fills, and their logits are −inf. Registers: 12 warps at maxnreg 168;
setmaxnreg gives the softmax warpgroup 184, the P·V one 240 and the gather 80 (no spills in
the sm_90 build; with 72 the gather's walk over several rows spilled one register).

Ring slots and barrier phases count the CTA's blocks, across rows. Between rows the softmax
warpgroup reloads Q (the previous row's S, its only reader, was waited for) and issues no S
past a row's last block (that ring slot may already hold the next row's block); 1 / l reaches
the P·V warpgroup through a buffer per row parity, handed back once read (fin / fin_empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsaserve.kernels import formats
from dsaserve.kernels.device import sm_count
from dsaserve.kernels.triton import l2_hint, mla_work, sparse_mla

# The kernels built with an L2_MARK carry l2_hint's marker; the PTX rewrite is in Triton's
# pipeline from here on (it leaves unmarked kernels alone).
l2_hint.install()

LOG2E = math.log2(math.e)
LN2 = gl.constexpr(math.log(2.0))
# Kernel-side shape constants (globals a Gluon kernel reads must be constexpr).
L = gl.constexpr(512)  # latent width (kv_lora_rank)
R = gl.constexpr(64)  # rope width
HEADS = gl.constexpr(64)  # heads per CTA: the wgmma M tile of one warpgroup
HALF = gl.constexpr(256)  # output columns per consumer warpgroup
ROW_BF16 = gl.constexpr(576)  # elements per bf16 cache row
NUM_TILES = gl.constexpr(4)  # fp8_ds_mla scale tiles (of 128 values) per row


# ----------------------------------------------------------------------------------------------
# Layouts (one warpgroup per partition)
# ----------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _mma_layout(n):
    """wgmma accumulator of [64, n] over 4 warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _row_layout(cols, vec):
    """Blocked layout of [rows, cols] with `vec`-element (16-byte) vectors along a row."""
    lanes_c = min(32, cols // vec)
    return gl.BlockedLayout([1, vec], [32 // lanes_c, lanes_c], [4, 1], [1, 0])


@gluon.constexpr_function
def _nvmma(shape):
    """Swizzled bf16 tile a wgmma reads from shared memory."""
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


@gluon.constexpr_function
def _plain_shared(rank):
    """Unswizzled row-major shared memory (staging the raw rows, per-head vectors)."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank))[::-1])


# ----------------------------------------------------------------------------------------------
# Partitions
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _block_slots(idx_row, pos0, topk, num_slots, BN: gl.constexpr, layout: gl.constexpr):
    """Slots of the index positions pos0 … pos0 + BN − 1 ([BN] int32 in `layout`; −1 from topk
    on) and whether each is a row to read."""
    n = pos0 + gl.arange(0, BN, layout)  # positions in the index row
    slot = gl.load(idx_row + n, mask=n < topk, other=-1)
    return slot, (slot >= 0) & (slot < num_slots)


@gluon.jit
def _segment(r, start, end, nb, head_blocks, BN: gl.constexpr):
    """Row r's segment of this CTA's blocks [start, end) (mla_work.py): its token, first head,
    first index position, block count, the block count before it (the ring position of its first
    block) and whether it is the whole row."""
    lo = gl.maximum(start, r * nb)
    hi = gl.minimum(end, (r + 1) * nb)
    t = r // head_blocks
    head0 = (r - t * head_blocks) * HEADS
    return t.to(gl.int64), head0, (lo - r * nb) * BN, hi - lo, lo - start, hi - lo == nb


@gluon.jit
def _out_row(whole, t, num_heads, head0, part_base):
    """First output row of a segment: row t · H + head0 of o, or of the partials [splits, T, H,
    L] (part_base = split · T) for a split of a row."""
    if whole:
        row = t * num_heads + head0
    else:
        row = (part_base + t) * num_heads + head0
    return row


@gluon.jit
def _softmax_partition(ptrs, args, smem, bars, BN: gl.constexpr, NBUF: gl.constexpr,
                       SCOLS: gl.constexpr):
    q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr = ptrs
    (part_base, start, end, nb, head_blocks, num_heads, num_slots, topk, stride_qt, stride_qh,
     stride_it, sm_scale_log2) = args
    q_smem, qpe_smem, k_smem, kpe_smem, p_smem, alpha_smem, inv_l_smem = smem
    k_ready, k_empty, p_ready, p_empty, fin, fin_empty = bars
    s_layout: gl.constexpr = _mma_layout(BN)  # S [64, BN]
    o_layout: gl.constexpr = _mma_layout(SCOLS)  # O [64, SCOLS]
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # [64] per head
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    key_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BN] per key
    q_ld: gl.constexpr = _row_layout(HALF, 8)
    qpe_ld: gl.constexpr = _row_layout(R, 8)
    zero_s = gl.zeros([HEADS, BN], gl.float32, s_layout)
    r_first = start // nb
    for r in range(r_first, (end - 1) // nb + 1):
        t, head0, first, n, base, whole = _segment(r, start, end, nb, head_blocks, BN)
        # Q [64, 512 | 64] of this row → shared memory (cp.async, waited for by this partition;
        # the previous row's S, the only reader, was waited for).
        h_q = gl.arange(0, HEADS, gl.SliceLayout(1, q_ld))
        q_rows = q_ptr + t * stride_qt + (head0 + h_q).to(gl.int64)[:, None] * stride_qh
        for half in gl.static_range(2):
            c = half * HALF + gl.arange(0, HALF, gl.SliceLayout(0, q_ld))
            async_copy.async_copy_global_to_shared(q_smem.index(half), q_rows + c[None, :])
        h_pe = gl.arange(0, HEADS, gl.SliceLayout(1, qpe_ld))
        pe_rows = q_ptr + t * stride_qt + (head0 + h_pe).to(gl.int64)[:, None] * stride_qh
        c_pe = L + gl.arange(0, R, gl.SliceLayout(0, qpe_ld))
        async_copy.async_copy_global_to_shared(qpe_smem, pe_rows + c_pe[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's Q copies landed (this partition's warps only)
        fence_async_shared()  # generic-proxy writes → wgmma (async proxy) reads

        idx_row = idx_ptr + t * stride_it
        m_i = gl.full([HEADS], float("-inf"), gl.float32, row_s)  # running max (base-2 logits)
        l_i = gl.zeros([HEADS], gl.float32, row_s)  # running Σ 2^(s − m)
        acc = gl.zeros([HEADS, SCOLS], gl.float32, o_layout)  # O[:, :SCOLS]

        # Prologue: S of the segment's block 0, its softmax, P handed over; α scales the zero
        # accumulator. Ring slots and phases count the CTA's blocks (base + b), not the row's.
        mbarrier.wait(k_ready.index(base % NBUF), (base // NBUF) & 1)
        fence_async_shared()
        s = _issue_qk(q_smem, qpe_smem, k_smem, kpe_smem, base % NBUF, zero_s)
        s = warpgroup_mma_wait(0, deps=(s,))
        _, valid = _block_slots(idx_row, first, topk, num_slots, BN, key_s)
        p16, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, sm_scale_log2)
        _hand_over(p16, alpha, base, p_smem, alpha_smem, p_ready, p_empty)
        for b in range(n - 1):
            gb = base + b
            ring = gb % NBUF
            pb = gb % 2
            nxt = gb + 1
            # 1. S of block b + 1 and O[:, :SCOLS] += P(b)·K(b)[:, :SCOLS] go to the tensor
            # cores together (S first); the softmax of b + 1 then runs beside P·K of b.
            mbarrier.wait(k_ready.index(nxt % NBUF), (nxt // NBUF) & 1)
            fence_async_shared()
            s = _issue_qk(q_smem, qpe_smem, k_smem, kpe_smem, nxt % NBUF, zero_s)
            acc = warpgroup_mma(p_smem.index(pb), k_smem.index(2 * ring).slice(0, SCOLS, dim=1),
                                acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            _, valid = _block_slots(idx_row, first + (b + 1) * BN, topk, num_slots, BN,
                                    key_s)
            p16, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, sm_scale_log2)
            _hand_over(p16, alpha, nxt, p_smem, alpha_smem, p_ready, p_empty)
            # 2. P·K of block b done: release its K slot and P buffer, then rescale O by
            # α(b + 1) with no wgmma in flight. (Rescaling while a wgmma runs, as the order
            # "issue S(b + 1), softmax(b), O·α, P·K" does, makes ptxas serialize every wgmma of
            # the kernel: C7515.)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(k_empty.index(ring))
            mbarrier.arrive(p_empty.index(pb))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        # The segment's last block: its P·K alone (no S past the segment: the slot after it may
        # already be refilled for the next row).
        gb = base + n - 1
        acc = warpgroup_mma(p_smem.index(gb % 2),
                            k_smem.index(2 * (gb % NBUF)).slice(0, SCOLS, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_empty.index(gb % NBUF))
        mbarrier.arrive(p_empty.index(gb % 2))

        empty = l_i == 0.0  # no valid slot: acc is 0, so o = 0
        inv_l = 1.0 / gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
        # 1 / l to the P·V warpgroup through a buffer of two (per segment parity), once it has
        # read what the segment two before left there.
        seg = r - r_first
        mbarrier.wait(fin_empty.index(seg % 2), ((seg // 2) & 1) ^ 1)
        inv_l_smem.index(seg % 2).store(inv_l)
        gl.thread_barrier()
        mbarrier.arrive(fin.index(seg % 2))
        heads = gl.arange(0, HEADS, row_s)
        row0 = _out_row(whole, t, num_heads, head0, part_base)
        o = acc * gl.convert_layout(inv_l, row_o)[:, None]
        if whole:
            gl.store(lse_ptr + row0 + heads, lse)
            _store_o(o_ptr, o, row0, 0, SCOLS, o_layout)
        else:
            gl.store(part_lse_ptr + row0 + heads, lse)
            _store_o(part_o_ptr, o, row0, 0, SCOLS, o_layout)


@gluon.jit
def _issue_qk(q_smem, qpe_smem, k_smem, kpe_smem, ring, zero_s):
    """S = Q_lat·K_latᵀ + Q_pe·K_peᵀ for the K tile in ring slot `ring`, asynchronously."""
    s = warpgroup_mma(qpe_smem, kpe_smem.index(ring).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma(q_smem.index(0), k_smem.index(2 * ring).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_smem.index(1), k_smem.index(2 * ring + 1).permute((1, 0)), s,
                         is_async=True)


@gluon.jit
def _softmax_step(s, valid, m_i, l_i, sm_scale_log2):
    """Online softmax (base 2) of one block: S [64, BN] fp32 and its keys' validity [BN] →
    P [64, BN] bf16, α = 2^(m_old − m_new) [64], and the updated running max and sum."""
    s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: no NaN
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p.to(gl.bfloat16), alpha, m_new, l_i


@gluon.jit
def _hand_over(p16, alpha, b, p_smem, alpha_smem, p_ready, p_empty):
    """P and α of the CTA's block b → P buffer b % 2 for both consumers (once both are done
    with block b − 2, whose P it held)."""
    pb = b % 2
    mbarrier.wait(p_empty.index(pb), ((b // 2) & 1) ^ 1)
    p_smem.index(pb).store(p16)
    alpha_smem.index(pb).store(alpha)
    fence_async_shared()
    gl.thread_barrier()  # all 128 threads stored before the single-thread arrive
    mbarrier.arrive(p_ready.index(pb))


@gluon.jit
def _store_o(o_ptr, o, row0, col0, COLS: gl.constexpr, layout: gl.constexpr):
    """o [64, COLS] fp32 in `layout` → rows row0 + h, columns col0 + c of o_ptr (rows of L)."""
    h = gl.arange(0, HEADS, gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, COLS, gl.SliceLayout(0, layout))
    row = row0 + h.to(gl.int64)
    gl.store(o_ptr + row[:, None] * L + c[None, :], o.to(o_ptr.dtype.element_ty))


@gluon.jit
def _pv_partition(ptrs, args, smem, bars, BN: gl.constexpr, NBUF: gl.constexpr,
                  SCOLS: gl.constexpr):
    """O[:, SCOLS:] = α·O + P·K[:, SCOLS:]: the latent half 1 always, and with SCOLS < 256 the
    columns SCOLS .. 255 of half 0 as a second accumulator (more of the P·V work here, where
    the softmax warpgroup also computes S)."""
    o_ptr, part_o_ptr = ptrs[3], ptrs[5]
    part_base, start, end, nb, head_blocks, num_heads = args[:6]
    q_smem, qpe_smem, k_smem, kpe_smem, p_smem, alpha_smem, inv_l_smem = smem
    k_ready, k_empty, p_ready, p_empty, fin, fin_empty = bars
    LO: gl.constexpr = HALF - SCOLS  # columns of half 0 taken here
    o_layout: gl.constexpr = _mma_layout(HALF)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if LO > 0:
        lo_layout: gl.constexpr = _mma_layout(LO)
        row_lo: gl.constexpr = gl.SliceLayout(1, lo_layout)
    r_first = start // nb
    for r in range(r_first, (end - 1) // nb + 1):
        t, head0, first, n, base, whole = _segment(r, start, end, nb, head_blocks, BN)
        acc = gl.zeros([HEADS, HALF], gl.float32, o_layout)  # O[:, 256:]
        if LO > 0:
            acc_lo = gl.zeros([HEADS, LO], gl.float32, lo_layout)  # O[:, SCOLS:256]
        for b in range(n):
            gb = base + b
            ring = gb % NBUF
            pb = gb % 2
            mbarrier.wait(p_ready.index(pb), (gb // 2) & 1)
            # Already complete (the softmax partition waited for it, and the slot cannot be
            # refilled before we release it); waited for again to order the cp.async writes.
            mbarrier.wait(k_ready.index(ring), (gb // NBUF) & 1)
            fence_async_shared()
            # Both accumulators are rescaled before either wgmma is issued (C7515, see above).
            acc = acc * alpha_smem.index(pb).load(row_o)[:, None]
            if LO > 0:
                acc_lo = acc_lo * alpha_smem.index(pb).load(row_lo)[:, None]
                acc_lo = warpgroup_mma(p_smem.index(pb),
                                       k_smem.index(2 * ring).slice(SCOLS, LO, dim=1), acc_lo,
                                       is_async=True)
            acc = warpgroup_mma(p_smem.index(pb), k_smem.index(2 * ring + 1), acc, is_async=True)
            # Released at once: holding K of block b into the next iteration would, with a
            # two-slot ring, wait on a block the gather cannot fill before the release.
            if LO > 0:
                acc, acc_lo = warpgroup_mma_wait(0, deps=(acc, acc_lo))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(p_empty.index(pb))
            mbarrier.arrive(k_empty.index(ring))
        # 1 / l of the segment from the softmax warpgroup; its buffer is handed back once
        # every thread has read it.
        seg = r - r_first
        mbarrier.wait(fin.index(seg % 2), (seg // 2) & 1)
        inv_l = inv_l_smem.index(seg % 2).load(row_o)
        if LO > 0:
            inv_lo = inv_l_smem.index(seg % 2).load(row_lo)
        gl.thread_barrier()
        mbarrier.arrive(fin_empty.index(seg % 2))
        row0 = _out_row(whole, t, num_heads, head0, part_base)
        if whole:
            _store_o(o_ptr, acc * inv_l[:, None], row0, HALF, HALF, o_layout)
            if LO > 0:
                _store_o(o_ptr, acc_lo * inv_lo[:, None], row0, SCOLS, LO, lo_layout)
        else:
            _store_o(part_o_ptr, acc * inv_l[:, None], row0, HALF, HALF, o_layout)
            if LO > 0:
                _store_o(part_o_ptr, acc_lo * inv_lo[:, None], row0, SCOLS, LO, lo_layout)


@gluon.jit
def _work_slots(idx_ptr, stride_it, g, end, nb, head_blocks, topk, num_slots,
                BN: gl.constexpr, layout: gl.constexpr):
    """Slots of the CTA's global block g ([BN] int32 in `layout`; −1 from `end` on) and whether
    each is a row to read."""
    r = g // nb
    row = idx_ptr + (r // head_blocks).to(gl.int64) * stride_it  # the token's index row
    return _block_slots(row, (g - r * nb) * BN, gl.where(g < end, topk, 0), num_slots, BN,
                        layout)


@gluon.jit
def _gather_bf16_partition(ptrs, args, smem, bars, BN: gl.constexpr, NBUF: gl.constexpr):
    """cp.async the rows of each of the CTA's blocks (rows after rows, no break between them)
    straight into the K ring; each thread's arrive on k_ready fires when its own copies have
    landed (cp.async.mbarrier.arrive.noinc)."""
    kv_ptr, idx_ptr = ptrs[1], ptrs[2]
    start, end, nb, head_blocks, num_heads, num_slots, topk = args[1:8]
    stride_it = args[10]
    k_smem, kpe_smem = smem[2], smem[3]
    k_ready, k_empty = bars[0], bars[1]
    lat: gl.constexpr = _row_layout(HALF, 8)
    pe: gl.constexpr = _row_layout(R, 8)
    c_lat = gl.arange(0, HALF, gl.SliceLayout(0, lat))
    c_pe = L + gl.arange(0, R, gl.SliceLayout(0, pe))
    # The slots of block j + 1 are loaded during block j: an index load waited for right
    # before its row copies put a global-memory round trip on every block (Nsight: a quarter
    # of this partition's time went to that wait).
    slot_n, valid_n = _work_slots(idx_ptr, stride_it, start, end, nb, head_blocks, topk,
                                  num_slots, BN, gl.SliceLayout(1, lat))
    slot_pe_n, valid_pe_n = _work_slots(idx_ptr, stride_it, start, end, nb, head_blocks, topk,
                                        num_slots, BN, gl.SliceLayout(1, pe))
    for j in range(end - start):
        ring = j % NBUF
        slot, valid, slot_pe, valid_pe = slot_n, valid_n, slot_pe_n, valid_pe_n
        slot_n, valid_n = _work_slots(idx_ptr, stride_it, start + j + 1, end, nb, head_blocks,
                                      topk, num_slots, BN, gl.SliceLayout(1, lat))
        slot_pe_n, valid_pe_n = _work_slots(idx_ptr, stride_it, start + j + 1, end, nb,
                                            head_blocks, topk, num_slots, BN,
                                            gl.SliceLayout(1, pe))
        rows = kv_ptr + gl.where(valid, slot, 0).to(gl.int64)[:, None] * ROW_BF16
        rows_pe = kv_ptr + gl.where(valid_pe, slot_pe, 0).to(gl.int64)[:, None] * ROW_BF16
        mbarrier.wait(k_empty.index(ring), ((j // NBUF) & 1) ^ 1)
        for half in gl.static_range(2):
            async_copy.async_copy_global_to_shared(k_smem.index(2 * ring + half),
                                                   rows + (half * HALF + c_lat)[None, :],
                                                   mask=valid[:, None])
        async_copy.async_copy_global_to_shared(kpe_smem.index(ring), rows_pe + c_pe[None, :],
                                               mask=valid_pe[:, None])
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(ring), increment_count=False)
    async_copy.wait_group(0)


@gluon.jit
def _copy_rows(kv_ptr, slot, num_slots, lat_tiles, lat_first, sc_dst, pe_dst,
               ROW: gl.constexpr, lat8: gl.constexpr, sc: gl.constexpr, pe: gl.constexpr):
    """cp.async the fp8_ds_mla rows of one block (slots `slot` [BN] in SliceLayout(1, lat8)):
    the 4 [BN, 128] e4m3 latent tiles to lat_tiles[lat_first + i], the 4 fp32 tile scales to
    sc_dst [BN, 4], the bf16 rope to pe_dst [BN, 64]. Invalid rows zero-fill (0 · 0 = 0)."""
    valid = (slot >= 0) & (slot < num_slots)
    rows = kv_ptr + gl.where(valid, slot, 0).to(gl.int64) * ROW  # [BN] row pointers
    c8 = gl.arange(0, 128, gl.SliceLayout(0, lat8))
    for i in gl.static_range(NUM_TILES):
        async_copy.async_copy_global_to_shared(lat_tiles.index(lat_first + i),
                                               rows[:, None] + (i * 128 + c8)[None, :],
                                               mask=valid[:, None])
    rows_s = gl.convert_layout(rows, gl.SliceLayout(1, sc)) + L
    valid_s = gl.convert_layout(valid, gl.SliceLayout(1, sc))
    c_s = gl.arange(0, NUM_TILES, gl.SliceLayout(0, sc))
    async_copy.async_copy_global_to_shared(
        sc_dst, rows_s.to(gl.pointer_type(gl.float32))[:, None] + c_s[None, :],
        mask=valid_s[:, None])
    rows_p = gl.convert_layout(rows, gl.SliceLayout(1, pe)) + (L + 4 * NUM_TILES)
    valid_p = gl.convert_layout(valid, gl.SliceLayout(1, pe))
    c_p = gl.arange(0, R, gl.SliceLayout(0, pe))
    async_copy.async_copy_global_to_shared(
        pe_dst, rows_p.to(gl.pointer_type(gl.bfloat16))[:, None] + c_p[None, :],
        mask=valid_p[:, None])


@gluon.jit
def _gather_fp8_in_slot_partition(ptrs, args, smem, bars, BN: gl.constexpr, NBUF: gl.constexpr):
    """fp8_ds_mla rows staged in the K ring slot itself (no raw ring): the raw bytes of a block
    land (cp.async) in the shared memory its bf16 tile will occupy, and are dequantized in place.

    A slot is 2 × [BN, 256] bf16 latent halves + [BN, 64] bf16 rope (36 KB at BN = 32); the raw
    block needs 20.5 KB of it: the 512 e4m3 latents of each row fill latent half 0 (viewed as
    4 [BN, 128] fp8 tiles), the 4 fp32 tile scales go to the start of latent half 1, and the
    rope, bf16 already, is copied straight into the swizzled rope tile (as the bf16 gather
    does), never touched again. In place: every thread loads its latents and scales of the
    block into registers (32 + 8 per thread), one barrier, then the bf16 stores.

    Schedule (AHEAD = NBUF − 2, iteration j): block j's copies were issued AHEAD iterations ago;
    wait_group(AHEAD − 1) + barrier → it landed; dequantize it in slot j % NBUF, hand it over
    (fence + barrier + one arrive on k_ready); then wait for the slot of block j + AHEAD to be
    released (block j + AHEAD − NBUF = j − 2: both consumers are past it once the softmax
    warpgroup is at block j − 1) and issue its copies. Dequantization comes before that wait,
    so it never waits on a release: the softmax warpgroup at block b releases b − 1 and waits
    for b + 1, which the gather converted as soon as b − 2 was released (one block earlier)
    and its copies (issued two blocks earlier) landed. While block j is dequantized the copies
    of j + 1 are in flight, then those of j + 2 join them."""
    kv_ptr, idx_ptr = ptrs[1], ptrs[2]
    start, end, nb, head_blocks, num_heads, num_slots, topk = args[1:8]
    stride_it = args[10]
    k_smem, kpe_smem = smem[2], smem[3]
    k_ready, k_empty = bars[0], bars[1]
    AHEAD: gl.constexpr = NBUF - 2
    ROW: gl.constexpr = L + 4 * NUM_TILES + 2 * R  # 656 bytes
    SC_PER: gl.constexpr = 2 * HALF // (4 * NUM_TILES)  # [BN, 4] fp32 views per latent half
    # Views of the K ring: latent half h of slot r is fp8 tiles 4h .. 4h + 3 (r-major), and
    # fp32 [BN, 4] views SC_PER·h .. SC_PER·(h + 1) − 1.
    raw8 = k_smem._reinterpret(gl.float8e4nv, [2 * NBUF * NUM_TILES, BN, 128], _plain_shared(2))
    rawsc = k_smem._reinterpret(gl.float32, [2 * NBUF * SC_PER, BN, NUM_TILES],
                                _plain_shared(2))
    lat8: gl.constexpr = _row_layout(128, 16)  # [BN, 128] fp8, 16-byte vectors
    sc: gl.constexpr = gl.BlockedLayout([1, NUM_TILES], [4, 8], [4, 1], [1, 0])  # rows as lat8
    pe: gl.constexpr = _row_layout(R, 8)
    rows_l: gl.constexpr = gl.SliceLayout(1, lat8)
    n_blocks = end - start  # the CTA's blocks, rows after rows
    # Prologue: blocks 0 .. AHEAD − 1 in flight (their slots are free), the slots of block
    # AHEAD in registers.
    for j in gl.static_range(AHEAD):
        slot, _ = _work_slots(idx_ptr, stride_it, start + j, end, nb, head_blocks, topk,
                              num_slots, BN, rows_l)
        _issue_in_slot(kv_ptr, slot, j, n_blocks, num_slots, raw8, rawsc, kpe_smem, NBUF,
                       SC_PER, ROW, lat8, sc, pe)
    slot_next, _ = _work_slots(idx_ptr, stride_it, start + AHEAD, end, nb, head_blocks, topk,
                               num_slots, BN, rows_l)
    tile = gl.arange(0, NUM_TILES, gl.SliceLayout(0, sc))
    for j in range(n_blocks):
        ring = j % NBUF
        async_copy.wait_group(AHEAD - 1)  # block j's group has landed (this thread's part)
        gl.thread_barrier()  # ... and every other thread's part
        scales = rawsc.index((2 * ring + 1) * SC_PER).load(sc)  # [BN, 4] fp32
        x0 = raw8.index(2 * ring * NUM_TILES + 0).load(lat8)  # [BN, 128] e4m3 each
        x1 = raw8.index(2 * ring * NUM_TILES + 1).load(lat8)
        x2 = raw8.index(2 * ring * NUM_TILES + 2).load(lat8)
        x3 = raw8.index(2 * ring * NUM_TILES + 3).load(lat8)
        gl.thread_barrier()  # every raw byte of the slot is in registers: overwrite it
        _store_tile(k_smem, ring, 0, x0, scales, tile, rows_l)
        _store_tile(k_smem, ring, 1, x1, scales, tile, rows_l)
        _store_tile(k_smem, ring, 2, x2, scales, tile, rows_l)
        _store_tile(k_smem, ring, 3, x3, scales, tile, rows_l)
        fence_async_shared()  # generic-proxy stores (and the rope's cp.async) → wgmma
        gl.thread_barrier()  # all stores done before the single-thread arrive
        mbarrier.arrive(k_ready.index(ring))
        # Copies of block j + AHEAD once its slot is released (block j − 2).
        nxt = j + AHEAD
        slot_issue = slot_next
        slot_next, _ = _work_slots(idx_ptr, stride_it, start + nxt + 1, end, nb, head_blocks,
                                   topk, num_slots, BN, rows_l)
        mbarrier.wait(k_empty.index(nxt % NBUF), ((nxt // NBUF) & 1) ^ 1, pred=nxt < n_blocks)
        _issue_in_slot(kv_ptr, slot_issue, nxt, n_blocks, num_slots, raw8, rawsc, kpe_smem,
                       NBUF, SC_PER, ROW, lat8, sc, pe)
    async_copy.wait_group(0)


@gluon.jit
def _store_tile(k_smem, ring, i: gl.constexpr, x, scales, tile, rows_l: gl.constexpr):
    """Scale tile i ([BN, 128] e4m3 in registers) by its rows' 2^k and store it as bf16 into
    columns 128·i .. 128·i + 127 of K ring slot `ring` (exact: power-of-two scales)."""
    s_i = gl.sum(gl.where(tile[None, :] == i, scales, 0.0), axis=1)  # in-thread
    s_i = gl.convert_layout(s_i, rows_l)  # same rows per thread: no data movement
    k_smem.index(2 * ring + i // 2).slice((i % 2) * 128, 128, dim=1).store(
        (x.to(gl.float32) * s_i[:, None]).to(gl.bfloat16))


@gluon.jit
def _issue_in_slot(kv_ptr, slot, j, n_blocks, num_slots, raw8, rawsc, kpe_smem,
                   NBUF: gl.constexpr, SC_PER: gl.constexpr, ROW: gl.constexpr,
                   lat8: gl.constexpr, sc: gl.constexpr, pe: gl.constexpr):
    """cp.async the raw rows of block j (if the block exists) into K ring slot j % NBUF:
    latents → half 0 (fp8 view), scales → start of half 1 (fp32 view), rope → the swizzled rope
    tile. One commit group per call, empty past the end, so wait_group counts stay uniform."""
    if j < n_blocks:
        ring = j % NBUF
        _copy_rows(kv_ptr, slot, num_slots, raw8, 2 * ring * NUM_TILES,
                   rawsc.index((2 * ring + 1) * SC_PER), kpe_smem.index(ring), ROW, lat8, sc, pe)
    async_copy.commit_group()


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _mark_l2_hint(ASM: gl.constexpr):
    """ASM (`l2_hint.mark_asm`: an identity inline asm kept for its side effect) in the PTX, so
    that l2_hint's rewrite gives the kernel's cp.async its L2 qualifiers."""
    z = gl.full([128], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
    gl.inline_asm_elementwise(ASM, "=r,r", [z], dtype=gl.int32, is_pure=False, pack=1)


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_ctas", "splits"])
def _sparse_mla_gluon_kernel(
    q_ptr,  # [T, H, 576] bf16
    kv_ptr,  # bf16 rows [num_slots, 576], or fp8_ds_mla bytes [num_slots, 656] (as fp8)
    idx_ptr,  # [T, K] int32 slots, −1 = skip
    o_ptr,  # [T, H, 512] bf16
    lse_ptr,  # [T, H] fp32, natural log
    part_o_ptr,  # [splits, T, H, 512] fp32: the splits' partials (splits > 1)
    part_lse_ptr,  # [splits, T, H] fp32
    num_tokens, num_heads, num_slots, topk,
    stride_qt, stride_qh, stride_it,
    sm_scale_log2,  # softmax scale · log2(e)
    num_ctas, splits,  # G, and splits per row (> 1: G = rows · splits)
    KV_FP8: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
    PV_REGS: gl.constexpr, GATHER_REGS: gl.constexpr, SCOLS: gl.constexpr,
    L2_MARK: gl.constexpr = "",  # l2_hint.mark_asm(mode): the rows' copies' L2 qualifiers
):
    if L2_MARK != "":
        _mark_l2_hint(L2_MARK)
    # This CTA's blocks [start, end) of the rows in order (row r = token · head_blocks + head
    # block, nb blocks each; mla_work.cta_blocks computes the same).
    cta = gl.program_id(0)
    nb = gl.cdiv(topk, BN)
    head_blocks = num_heads // HEADS
    if splits == 1:  # whole rows [c · rows // G, (c + 1) · rows // G), in 32-bit arithmetic
        rows = num_tokens * head_blocks
        per, rem = rows // num_ctas, rows % num_ctas
        start = (cta * per + cta * rem // num_ctas) * nb
        end = ((cta + 1) * per + (cta + 1) * rem // num_ctas) * nb
        split = cta * 0
    else:  # split `split` of row r: blocks [split · nb // splits, (split + 1) · nb // splits)
        r = cta // splits
        split = cta - r * splits
        start = r * nb + split * nb // splits
        end = r * nb + (split + 1) * nb // splits
    part_base = split.to(gl.int64) * num_tokens

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, HALF], _nvmma([HEADS, HALF]))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, R], _nvmma([HEADS, R]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NBUF, BN, HALF], _nvmma([BN, HALF]))
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, R], _nvmma([BN, R]))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, BN], _nvmma([HEADS, BN]))
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], _plain_shared(1))
    inv_l_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], _plain_shared(1))
    k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # 1 / l of a segment, softmax → P·V warpgroup, in a buffer per segment parity
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        # bf16: every gather thread arrives (cp.async.mbarrier.arrive.noinc); fp8: one arrive.
        mbarrier.init(k_ready.index(i), count=1 if KV_FP8 else 128)
        mbarrier.init(k_empty.index(i), count=2)  # both consumer warpgroups
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=2)  # both consumers read P
        mbarrier.init(fin.index(i), count=1)
        mbarrier.init(fin_empty.index(i), count=1)

    ptrs = (q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr)
    args = (part_base, start, end, nb, head_blocks, num_heads, num_slots, topk, stride_qt,
            stride_qh, stride_it, sm_scale_log2)
    smem = (q_smem, qpe_smem, k_smem, kpe_smem, p_smem, alpha_smem, inv_l_smem)
    bars = (k_ready, k_empty, p_ready, p_empty, fin, fin_empty)
    # Constexprs go inline: a tuple held in a variable turns them into tensors.
    if KV_FP8:  # raw rows staged in the K ring slots, dequantized in place
        gl.warp_specialize([
            (_softmax_partition, (ptrs, args, smem, bars, BN, NBUF, SCOLS)),
            (_pv_partition, (ptrs, args, smem, bars, BN, NBUF, SCOLS)),
            (_gather_fp8_in_slot_partition, (ptrs, args, smem, bars, BN, NBUF)),
        ], [4, 4], [PV_REGS, GATHER_REGS])
    else:
        gl.warp_specialize([
            (_softmax_partition, (ptrs, args, smem, bars, BN, NBUF, SCOLS)),
            (_pv_partition, (ptrs, args, smem, bars, BN, NBUF, SCOLS)),
            (_gather_bf16_partition, (ptrs, args, smem, bars, BN, NBUF)),
        ], [4, 4], [PV_REGS, GATHER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GluonMlaBuild:
    """Compile-time shape of the kernel (sm_90 build: no spills, shared memory under the 227 KB
    limit; `benchmarks/sm90_resources.py --only sparse_mla_gluon`). fp8_ds_mla rows are staged
    in the K ring slots themselves, so both formats need num_bufs ≥ 3 (4 = 2 blocks of copies
    in flight while a third is dequantized).

    12 warps at `maxnreg` 168 fill the register file (168 · 384 = 64,512); setmaxnreg then
    moves registers from the gather warpgroup to the two consumers. The softmax warpgroup,
    which also computes S, owns 128 output columns (64 accumulator registers, 184 in all), the
    P·V one the other 384 (192 accumulator registers, 240 in all). Measured on an H200
    against 256 / 256 (216 registers each, one row per CTA): FP8 decode b = 128 119.6 vs
    122.2 µs, s_q = 4 450.6 vs 455.9 µs, prefill T = 4096 equal (3443 vs 3434 µs). The
    gather's 72 → 80 registers (the softmax warpgroup's 192 → 184) measured no change: b = 128
    119.2–120.4 µs either way."""

    block_n: int = 32  # BN: rows per block; 32 leaves room for a ring deep enough
    num_bufs: int = 4  # NBUF: bf16 K ring slots (blocks gathered ahead of the consumers)
    softmax_cols: int = 128  # output columns of the softmax warpgroup (the P·V one: the rest)
    pv_regs: int = 240  # registers per thread, P·V warpgroup (the softmax one gets the rest)
    gather_regs: int = 80  # registers per thread, gather warpgroup
    maxnreg: int = 168


BUILD = GluonMlaBuild()  # 225 KB of shared memory for either cache format


REQUIREMENTS = ("an sm_90 device, bf16 q [T, H, 576] with H a multiple of 64, kv_lora_rank 512 "
                "and a bf16 or fp8_ds_mla cache")


def gluon_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int = 512) -> bool:
    """Whether this kernel runs these inputs (REQUIREMENTS; kv_cache [num_blocks, block_size,
    row] with rows of 576 bf16 or 656 fp8_ds_mla bytes)."""
    if not (q.is_cuda and kv_cache.is_cuda) or q.dim() != 3 or kv_cache.dim() != 3:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    row = {torch.bfloat16: L.value + R.value,
           torch.uint8: formats.mla_row_bytes(L.value, R.value)}.get(kv_cache.dtype)
    return (q.dtype == torch.bfloat16 and q.shape[1] % HEADS.value == 0
            and kv_lora_rank == L.value and q.shape[2] == L.value + R.value
            and kv_cache.shape[2] == row)


def aligned_rows(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """q as the Gluon kernels read it (rows of q and of the cache are copied in 16-byte
    pieces): q itself, or a contiguous copy; ValueError for a cache off a 16-byte boundary."""
    if kv.data_ptr() % 16:
        raise ValueError("sparse_mla: the Gluon kernels need kv_cache on a 16-byte boundary "
                         "(rows are gathered in 16-byte copies)")
    if q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        q = q.contiguous()
    return q


def launch(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, o: torch.Tensor,
           lse: torch.Tensor, num_slots: int, scale: float, fp8: bool,
           num_splits: int | None = None, num_ctas: int | None = None,
           l2_copies: str = l2_hint.PLAIN) -> None:
    """The kernel launches `sparse_mla.sparse_mla_fwd` makes when it picks this kernel
    (arguments checked there, gluon_supported true): q [T, H, 576], kv the cache as the kernel
    reads it, idx [T, K] int32 with unit last stride → o [T, H, 512], lse [T, H] (in place).
    num_splits / num_ctas: the grid (None: mla_work.choose_grid); split rows are merged by
    sparse_mla.merge_splits. l2_copies: the copies' L2 qualifiers (an l2_hint mode)."""
    q = aligned_rows(q, kv)
    num_tokens, num_heads, _ = q.shape
    rows = num_tokens * (num_heads // HEADS.value)
    blocks_per_row = triton.cdiv(idx.shape[1], BUILD.block_n)
    if blocks_per_row == 0:  # an empty index row: nothing to attend to
        o.zero_()
        lse.fill_(float("-inf"))
        return
    sms = sm_count(q.device, 0)
    grid, splits = mla_work.choose_grid(rows, blocks_per_row, sms, num_splits, num_ctas)
    if splits > 1:
        part_o = torch.empty(splits, num_tokens, num_heads, L.value, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32,
                               device=q.device)
    else:
        part_o, part_lse = o, lse  # not written
    _sparse_mla_gluon_kernel[(grid,)](
        q, kv, idx, o, lse, part_o, part_lse,
        num_tokens, num_heads, num_slots, idx.shape[1],
        q.stride(0), q.stride(1), idx.stride(0), scale * LOG2E, grid, splits,
        KV_FP8=fp8, BN=BUILD.block_n, NBUF=BUILD.num_bufs,
        PV_REGS=BUILD.pv_regs, GATHER_REGS=BUILD.gather_regs, SCOLS=BUILD.softmax_cols,
        L2_MARK=l2_hint.mark_asm(l2_copies), num_warps=4, maxnreg=BUILD.maxnreg,
    )
    if splits > 1:
        sparse_mla.merge_splits(part_o, part_lse, o, lse)


def sparse_mla_fwd_gluon(q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                         scale: float, kv_lora_rank: int = 512,
                         num_splits: int | None = None, num_ctas: int | None = None,
                         pingpong_fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla.sparse_mla_fwd` with the Gluon kernels forced (ValueError where they do not
    run): this one for fp8_ds_mla rows (num_ctas: its grid) unless pingpong_fp8, the ping-pong
    kernel for bf16 rows (num_splits: the splits of either)."""
    config = sparse_mla.SparseMlaConfig(gluon=True, num_splits=num_splits, num_ctas=num_ctas,
                                        pingpong_fp8=pingpong_fp8)
    return sparse_mla.sparse_mla_fwd(q, kv_cache, slot_indices, scale, kv_lora_rank, config)
