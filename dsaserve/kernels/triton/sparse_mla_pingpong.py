"""Sparse MLA forward over bf16 rows in Gluon for Hopper (sm_90), with the two consumer
warpgroups in ping-pong: each computes S for every other block of 64 keys and P·V for half of
O's columns, so the QK and P·V work is split evenly and one warpgroup's softmax runs while the
other's wgmmas keep the tensor cores busy (FlashMLA's sparse prefill schedule).

sparse_mla_gluon.py's kernel gives S and the softmax to one warpgroup and most of P·V to the
other; its softmax warpgroup is the critical path (QK of 576 columns plus its share of P·V,
against the other's P·V alone; docs/kernels.md). Here, per pair of blocks (b0 = 2i in buffer
k0, b1 = 2i + 1 in buffer k1; O = [O_left | O_right], 256 columns each):

    WG0 (default)                                  WG1 (worker 0)
    S0 = Q·K0ᵀ   (done at the end of pair i − 1)   S1 = Q·K1ᵀ
    softmax of S0 with its running max m → P0      wait m0
    publish m0 = max(m, rowmax S0)      → m0_ready m1 = max(m0, rowmax S1)  (the pair's max)
    O_left += P0·V0_left   (P0 in registers)       P1 = 2^(S1 − m1), O_right scaled
    K0 left free                                   publish m1                → m1_ready
    wait m1; P0 ·= 2^(m0 − m1) → shared memory     O_right += P1·V1_right  (P1 in registers)
                                        → s0_ready P1 → shared memory
    wait P1; O_left scaled                         wait P0; O_right += P0·V0_right
    O_left += P1·V1_left                           → s1_ready
    S0 of pair i + 1 issued (left columns of K0    K1 right free (its P·V done),
    first), K1 left free once P1·V1_left is done   K0 right free (P0·V0_right done)

Both warpgroups end a pair in the same frame (the running max m1), so each keeps only the sum
of its own blocks' probabilities; the two sums are added once at the end. No accumulator is
rescaled while a wgmma is in flight (ptxas would serialize every wgmma of the kernel, its
C7515 note; see sparse_mla_gluon.py).

Shared memory (bf16): Q 72 KB; K0 and K1, 64 rows × 576 each (144 KB), each in a left half
(latent columns 0–255) and a right half (latent 256–511 and the rope) with their own
ready / free mbarriers, so the gather refills a half as soon as its last reader is done, in
the order the consumers free them (K0 left, K1 right, K0 right, K1 left); P1 8 KB; P0 takes
K0's rope tile, which nothing reads between WG0's S0 and WG1's P0·V0_right. 225 KB in all.
The gather warpgroup (worker 1) also loads Q. Hand-offs between the warpgroups are mbarriers
(one arrive after a barrier of the writer's 128 threads); Gluon has no named barriers.
Invalid slots (< 0, ≥ num_slots, or past the index row) are never read: their cp.async is
predicated off and zero-fills, and their logits are −inf. The running max starts at −1e30,
not −inf, so that 2^(m_old − m_new) is never NaN (FlashMLA's choice).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsaserve.kernels.triton import l2_hint, sparse_mla_gluon
from dsaserve.kernels.triton.sparse_mla_gluon import (
    HALF,
    HEADS,
    LN2,
    LOG2E,
    ROW_BF16,
    L,
    R,
    _mark_l2_hint,
    _mma_layout,
    _nvmma,
    _plain_shared,
)

BN = gl.constexpr(64)  # keys per block: S is [64 heads, 64 keys] (wgmma N = 64)
PAIR = 2 * BN.value  # index positions per pair of blocks (a split is a whole number of pairs)
MAX_INIT = gl.constexpr(-1e30)

# K buffer halves: k_smem.index(2 · buffer + half), half 0 = latent 0–255, half 1 = latent
# 256–511 (with the rope tile kpe_smem.index(buffer)); barriers are indexed the same way.
K0L = gl.constexpr(0)
K0R = gl.constexpr(1)
K1L = gl.constexpr(2)
K1R = gl.constexpr(3)


@gluon.constexpr_function
def _copy_layout():
    """cp.async layout of a [64, 256] or [64, 64] bf16 tile: 8 threads × 16 bytes per row piece,
    4 rows per warp, so each gather thread owns 4 rows of a block (4 slots in registers)."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _slots(idx_row, pos0, topk, num_slots, layout: gl.constexpr):
    """Slots of the 64 index positions pos0 … pos0 + 63 ([64] int32 in `layout`) and whether
    each is a row to read."""
    n = pos0 + gl.arange(0, BN, layout)
    slot = gl.load(idx_row + n, mask=n < topk, other=-1)
    return slot, (slot >= 0) & (slot < num_slots)


@gluon.jit
def _opaque_zero(i):
    """0 for every iteration a kernel runs (i < 2^30), which the compiler cannot prove. Shared
    memory views indexed with it keep their wgmma descriptors inside the loop: with constant
    indices every descriptor of every k-step is loop-invariant, all of them are hoisted out of
    the loop, and the 64-bit values (about 80 per consumer) spill."""
    return i >> 30


@gluon.jit
def _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, buf: gl.constexpr, left: gl.constexpr, s,
             use_acc: gl.constexpr, z):
    """S (+)= Q·Kᵀ over one half of buffer `buf`, asynchronously: the left latent columns, or
    the right ones and the rope. use_acc False: S starts from zero (s only gives the type).
    z: _opaque_zero."""
    if left:
        s = warpgroup_mma(q_smem.index(z), k_smem.index(2 * buf + z).permute((1, 0)), s,
                          use_acc=use_acc, is_async=True)
    else:
        s = warpgroup_mma(qpe_smem.index(z), kpe_smem.index(buf + z).permute((1, 0)), s,
                          use_acc=use_acc, is_async=True)
        s = warpgroup_mma(q_smem.index(1 + z), k_smem.index(2 * buf + 1 + z).permute((1, 0)), s,
                          is_async=True)
    return s


@gluon.jit
def _valid(idx_row, pos0, topk, num_slots, layout: gl.constexpr):
    """Which keys of the block at index positions pos0 … pos0 + 63 are rows to read ([64] in
    the key slice of `layout`, S's layout). Loaded a block ahead of its use: the index row is
    read from global memory, and that round trip would otherwise sit in every softmax."""
    _, valid = _slots(idx_row, pos0, topk, num_slots, gl.SliceLayout(0, layout))
    return valid


@gluon.jit
def _masked(s, valid, sm_scale_log2):
    """S [64, 64] → base-2 logits, −inf at keys that are not rows to read."""
    return gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))


@gluon.jit
def _signal(bar):
    """Every thread of this warpgroup is past its shared-memory writes → one arrive."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _scale_rows(acc, v):
    """O half [64, 256] · v [64] per head (v in S's row layout)."""
    return acc * gl.convert_layout(v, gl.SliceLayout(1, _mma_layout(HALF)))[:, None]


@gluon.jit
def _a_operand(p16):
    """P [64, 64] bf16 (S's layout) as the register A operand of a P·V wgmma."""
    return gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HALF),
                                                      k_width=2))


@gluon.jit
def _consumer_state():
    """A consumer's loop state at the start: running max (−1e30) and sum of its blocks, its O
    half, and a zero S (the accumulator an S wgmma starts from)."""
    s_layout: gl.constexpr = _mma_layout(BN)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    return (gl.full([HEADS], MAX_INIT, gl.float32, row_s), gl.zeros([HEADS], gl.float32, row_s),
            gl.zeros([HEADS, HALF], gl.float32, _mma_layout(HALF)),
            gl.zeros([HEADS, BN], gl.float32, s_layout))


@gluon.jit
def _wg0_partition(ptrs, args, smem, bars):
    o_ptr, lse_ptr = ptrs[3], ptrs[4]
    (t, head0, split, first, n_pairs, num_tokens, num_heads, num_slots, topk, stride_it,
     sm_scale_log2) = args
    q_smem, qpe_smem, k_smem, kpe_smem, p1_smem, m_smem, l_smem = smem
    q_ready, k_ready, k_free, m0_ready, m1_ready, s0_ready, s1_ready, fin = bars
    s_layout: gl.constexpr = _mma_layout(BN)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    idx_row = ptrs[2] + t * stride_it
    m_i, l_i, acc, zero_s = _consumer_state()  # acc: O[:, :256]

    # S0 of pair 0 (a read of stale shared memory when there is none; never used).
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(K0L), 0, pred=n_pairs > 0)
    fence_async_shared()
    s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 0, True, zero_s, False, 0)
    mbarrier.wait(k_ready.index(K0R), 0, pred=n_pairs > 0)
    fence_async_shared()
    s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 0, False, s, True, 0)
    s = warpgroup_mma_wait(0, deps=(s,))
    valid = _valid(idx_row, first, topk, num_slots, s_layout)
    for i in range(n_pairs):
        phase = i & 1
        z = _opaque_zero(i)
        # Softmax of block 2i against the running max (the frame of the previous pair).
        s = _masked(s, valid, sm_scale_log2)
        valid = _valid(idx_row, first + (i + 1) * (2 * BN), topk, num_slots, s_layout)
        m_own = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_own)
        p = gl.exp2(s - m_own[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = _scale_rows(acc, alpha)
        m_smem.index(0).store(m_own)
        _signal(m0_ready)
        # O_left += P0·V0_left, P0 from registers.
        p_a = _a_operand(p.to(gl.bfloat16))
        acc = warpgroup_mma(p_a, k_smem.index(K0L + z), acc, is_async=True)
        acc, p_a = warpgroup_mma_wait(0, deps=(acc, p_a))
        mbarrier.arrive(k_free.index(K0L))
        # The pair's max from WG1: P0 into that frame, to shared memory for WG1.
        mbarrier.wait(m1_ready, phase)
        m_i = m_smem.index(1).load(row_s)
        beta = gl.exp2(m_own - m_i)
        kpe_smem.index(z).store((p * beta[:, None]).to(gl.bfloat16))  # P0 in K0's rope tile
        fence_async_shared()  # generic-proxy stores → WG1's wgmma reads
        _signal(s0_ready)
        # O_left += P1·V1_left once WG1 stored P1.
        mbarrier.wait(s1_ready, phase)
        acc = _scale_rows(acc, beta)
        l_i = l_i * beta
        acc = warpgroup_mma(p1_smem.index(z), k_smem.index(K1L + z), acc, is_async=True)
        # S0 of pair i + 1 (left columns first: K0 left is refilled first), K1 left released
        # once P1·V1_left is done. Past the last pair this reads stale K0, never used.
        more = i + 1 < n_pairs
        mbarrier.wait(k_ready.index(K0L), phase ^ 1, pred=more)
        fence_async_shared()
        s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 0, True, zero_s, False, z)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(k_free.index(K1L))
        mbarrier.wait(k_ready.index(K0R), phase ^ 1, pred=more)
        fence_async_shared()
        s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 0, False, s, True, z)
        s = warpgroup_mma_wait(0, deps=(s,))

    l_total = _sum_with_peer(l_i, l_smem, fin, 0, row_s)
    empty = l_total == 0.0  # no valid slot
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_total))) * LN2)
    heads = head0 + gl.arange(0, HEADS, row_s)
    gl.store(lse_ptr + (split * num_tokens + t) * num_heads + heads, lse)
    _store_half(o_ptr, acc, l_total, split, num_tokens, t, num_heads, head0, 0)


@gluon.jit
def _wg1_partition(ptrs, args, smem, bars):
    o_ptr = ptrs[3]
    (t, head0, split, first, n_pairs, num_tokens, num_heads, num_slots, topk, stride_it,
     sm_scale_log2) = args
    q_smem, qpe_smem, k_smem, kpe_smem, p1_smem, m_smem, l_smem = smem
    q_ready, k_ready, k_free, m0_ready, m1_ready, s0_ready, s1_ready, fin = bars
    s_layout: gl.constexpr = _mma_layout(BN)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    idx_row = ptrs[2] + t * stride_it
    m_i, l_i, acc, zero_s = _consumer_state()  # acc: O[:, 256:]
    mbarrier.wait(q_ready, 0)
    valid = _valid(idx_row, first + BN, topk, num_slots, s_layout)
    for i in range(n_pairs):
        phase = i & 1
        z = _opaque_zero(i)
        # S1 = Q·K1ᵀ, right half first (the gather fills K1 right before K1 left).
        mbarrier.wait(k_ready.index(K1R), phase)
        fence_async_shared()
        s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 1, False, zero_s, False, z)
        mbarrier.wait(k_ready.index(K1L), phase)
        fence_async_shared()
        s = _issue_s(q_smem, qpe_smem, k_smem, kpe_smem, 1, True, s, True, z)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = _masked(s, valid, sm_scale_log2)
        valid = _valid(idx_row, first + (i + 1) * (2 * BN) + BN, topk, num_slots, s_layout)
        # The pair's max: WG0's (which includes every earlier block) and this block's.
        mbarrier.wait(m0_ready, phase)
        m_new = gl.maximum(m_smem.index(0).load(row_s), gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = _scale_rows(acc, alpha)
        m_smem.index(1).store(m_new)
        _signal(m1_ready)
        m_i = m_new
        # O_right += P1·V1_right (P1 from registers), P1 → shared memory for WG0, then
        # O_right += P0·V0_right once WG0 stored P0.
        p16 = p.to(gl.bfloat16)
        p_a = _a_operand(p16)
        acc = warpgroup_mma(p_a, k_smem.index(K1R + z), acc, is_async=True)
        p1_smem.index(z).store(p16)
        mbarrier.wait(s0_ready, phase)
        acc = warpgroup_mma(kpe_smem.index(z), k_smem.index(K0R + z), acc, is_async=True)
        fence_async_shared()  # P1's generic-proxy stores → WG0's wgmma reads
        _signal(s1_ready)
        p_a = warpgroup_mma_wait(1, deps=(p_a,))
        mbarrier.arrive(k_free.index(K1R))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_free.index(K0R))

    _store_half(o_ptr, acc, _sum_with_peer(l_i, l_smem, fin, 1, row_s), split, num_tokens, t,
                num_heads, head0, HALF)


@gluon.jit
def _sum_with_peer(l_i, l_smem, fin, me: gl.constexpr, layout: gl.constexpr):
    """This warpgroup's share of the softmax sum plus the other's (both in the same frame)."""
    l_smem.index(me).store(l_i)
    _signal(fin)
    mbarrier.wait(fin, 0)
    return l_i + l_smem.index(1 - me).load(layout)


@gluon.jit
def _store_half(o_ptr, acc, l_total, split, num_tokens, t, num_heads, head0, col0):
    """o = acc / l (acc [64, 256] fp32, one O half; 0 where no slot was valid: acc is 0 there)
    → rows (split, t, head0 + h), columns col0 … col0 + 255 of o_ptr."""
    o = _scale_rows(acc, 1.0 / gl.where(l_total == 0.0, 1.0, l_total))
    layout: gl.constexpr = _mma_layout(HALF)
    h = head0 + gl.arange(0, HEADS, gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, HALF, gl.SliceLayout(0, layout))
    row = ((split * num_tokens + t) * num_heads + h).to(gl.int64)
    gl.store(o_ptr + row[:, None] * L + c[None, :], o.to(o_ptr.dtype.element_ty))


@gluon.jit
def _copy_half(kv_ptr, slot, valid, k_dst, pe_dst, col0: gl.constexpr, rope: gl.constexpr,
               ld: gl.constexpr):
    """cp.async latent columns col0 … col0 + 255 of 64 rows (and their rope) into shared
    memory; invalid rows zero-fill. (Triton 3.6 drops eviction_policy from cp.async: l2_hint
    rewrites the PTX of kernels built with an L2_MARK, for FlashMLA's L2 qualifiers.)"""
    rows = kv_ptr + gl.where(valid, slot, 0).to(gl.int64)[:, None] * ROW_BF16
    c = gl.arange(0, HALF, gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(k_dst, rows + (col0 + c)[None, :],
                                           mask=valid[:, None])
    if rope:
        c_pe = L + gl.arange(0, R, gl.SliceLayout(0, ld))
        async_copy.async_copy_global_to_shared(pe_dst, rows + c_pe[None, :], mask=valid[:, None])


@gluon.jit
def _gather_partition(ptrs, args, smem, bars):
    """Q once, then per pair the four K halves in the order the consumers free them; each
    thread's arrive on k_ready fires when its own copies have landed."""
    q_ptr, kv_ptr, idx_ptr = ptrs[0], ptrs[1], ptrs[2]
    (t, head0, split, first, n_pairs, num_tokens, num_heads, num_slots, topk, stride_it,
     sm_scale_log2) = args
    stride_qt, stride_qh = ptrs[5], ptrs[6]
    q_smem, qpe_smem, k_smem, kpe_smem = smem[0], smem[1], smem[2], smem[3]
    q_ready, k_ready, k_free = bars[0], bars[1], bars[2]
    ld: gl.constexpr = _copy_layout()
    rows_l: gl.constexpr = gl.SliceLayout(1, ld)

    h = gl.arange(0, HEADS, rows_l)
    q_rows = q_ptr + t * stride_qt + (head0 + h).to(gl.int64)[:, None] * stride_qh
    c = gl.arange(0, HALF, gl.SliceLayout(0, ld))
    for half in gl.static_range(2):
        async_copy.async_copy_global_to_shared(q_smem.index(half),
                                               q_rows + (half * HALF + c)[None, :])
    c_pe = L + gl.arange(0, R, gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(qpe_smem.index(0), q_rows + c_pe[None, :])
    async_copy.commit_group()
    async_copy.mbarrier_arrive(q_ready, increment_count=False)

    idx_row = idx_ptr + t * stride_it
    # The slots of pair i + 1 are loaded during pair i (an index load waited for right before
    # its copies would put a global-memory round trip on every pair).
    slot0_n, valid0_n = _slots(idx_row, first, topk, num_slots, rows_l)
    slot1_n, valid1_n = _slots(idx_row, first + BN, topk, num_slots, rows_l)
    for i in range(n_pairs):
        free_phase = (i & 1) ^ 1
        slot0, valid0, slot1, valid1 = slot0_n, valid0_n, slot1_n, valid1_n
        nxt = first + (i + 1) * (2 * BN)
        slot0_n, valid0_n = _slots(idx_row, nxt, topk, num_slots, rows_l)
        slot1_n, valid1_n = _slots(idx_row, nxt + BN, topk, num_slots, rows_l)
        mbarrier.wait(k_free.index(K0L), free_phase)
        _copy_half(kv_ptr, slot0, valid0, k_smem.index(K0L), kpe_smem.index(0), 0, False, ld)
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(K0L), increment_count=False)
        mbarrier.wait(k_free.index(K1R), free_phase)
        _copy_half(kv_ptr, slot1, valid1, k_smem.index(K1R), kpe_smem.index(1), HALF, True, ld)
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(K1R), increment_count=False)
        mbarrier.wait(k_free.index(K0R), free_phase)
        _copy_half(kv_ptr, slot0, valid0, k_smem.index(K0R), kpe_smem.index(0), HALF, True, ld)
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(K0R), increment_count=False)
        mbarrier.wait(k_free.index(K1L), free_phase)
        _copy_half(kv_ptr, slot1, valid1, k_smem.index(K1L), kpe_smem.index(1), 0, False, ld)
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(K1L), increment_count=False)
    async_copy.wait_group(0)


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@gluon.jit(do_not_specialize=["num_tokens", "num_slots", "pairs_per_split"])
def _sparse_mla_pingpong_kernel(
    q_ptr,  # [T, H, 576] bf16
    kv_ptr,  # bf16 rows [num_slots, 576]
    idx_ptr,  # [T, K] int32 slots, −1 = skip
    o_ptr,  # [T, H, 512] bf16 (one split) or fp32 partials [splits, T, H, 512]
    lse_ptr,  # [T, H] or [splits, T, H] fp32, natural log
    num_tokens, num_heads, num_slots, topk,
    stride_qt, stride_qh, stride_it,
    sm_scale_log2,  # softmax scale · log2(e)
    pairs_per_split,
    WG1_REGS: gl.constexpr, GATHER_REGS: gl.constexpr,
    L2_MARK: gl.constexpr,  # l2_hint.mark_asm(mode): the KV rows' copies' L2 qualifiers
):
    if L2_MARK != "":
        _mark_l2_hint(L2_MARK)
    head0 = gl.program_id(0) * HEADS
    t = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    first = split * pairs_per_split * (2 * BN)  # first index position of this split
    n_pairs = gl.minimum(gl.cdiv(topk - first, 2 * BN), pairs_per_split)
    n_pairs = gl.maximum(n_pairs, 0)  # trailing splits may be empty

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, HALF], _nvmma([HEADS, HALF]))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [1, HEADS, R], _nvmma([HEADS, R]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BN, HALF], _nvmma([BN, HALF]))
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], _nvmma([BN, R]))
    p1_smem = gl.allocate_shared_memory(gl.bfloat16, [1, HEADS, BN], _nvmma([HEADS, BN]))
    m_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], _plain_shared(1))
    l_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], _plain_shared(1))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    m0_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    m1_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    s0_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    s1_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=128)  # every gather thread's copies (arrive.noinc)
    for i in gl.static_range(4):
        mbarrier.init(k_ready.index(i), count=128)
        mbarrier.init(k_free.index(i), count=1)  # each half has one last reader
    mbarrier.init(m0_ready, count=1)
    mbarrier.init(m1_ready, count=1)
    mbarrier.init(s0_ready, count=1)
    mbarrier.init(s1_ready, count=1)
    mbarrier.init(fin, count=2)

    ptrs = (q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, stride_qt, stride_qh)
    args = (t, head0, split, first, n_pairs, num_tokens, num_heads, num_slots, topk, stride_it,
            sm_scale_log2)
    smem = (q_smem, qpe_smem, k_smem, kpe_smem, p1_smem, m_smem, l_smem)
    bars = (q_ready, k_ready, k_free, m0_ready, m1_ready, s0_ready, s1_ready, fin)
    gl.warp_specialize([
        (_wg0_partition, (ptrs, args, smem, bars)),
        (_wg1_partition, (ptrs, args, smem, bars)),
        (_gather_partition, (ptrs, args, smem, bars)),
    ], [4, 4], [WG1_REGS, GATHER_REGS])


# Registers per thread: 12 warps at maxnreg 168; setmaxnreg gives each consumer 224 (O half
# 128, S and P 48, the next block's key mask) and the gather 56 (216 / 72 spills 8 bytes).
MAXNREG, WG1_REGS, GATHER_REGS = 168, 224, 56


def launch(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, out_o: torch.Tensor,
           out_lse: torch.Tensor, num_slots: int, scale: float, positions_per_split: int,
           l2_copies: str = l2_hint.PLAIN) -> None:
    """The launch `sparse_mla.sparse_mla_fwd` makes for a bf16 cache on sm_90 (arguments
    checked there): q [T, H, 576] (H a multiple of 64), kv bf16 [.., .., 576], idx [T, K] int32
    with unit last stride → out_o / out_lse (o and lse, or fp32 partials [splits, ...] of
    positions_per_split index positions each, a multiple of PAIR). l2_copies: the copies' L2
    qualifiers (an l2_hint mode)."""
    if positions_per_split % PAIR:
        raise ValueError(f"sparse_mla_pingpong: splits must cover a multiple of {PAIR} "
                         f"index positions, got {positions_per_split}")
    q = sparse_mla_gluon.aligned_rows(q, kv)
    num_tokens, num_heads, _ = q.shape
    splits = out_o.shape[0] if out_o.dim() == 4 else 1
    _sparse_mla_pingpong_kernel[(num_heads // HEADS.value, num_tokens, splits)](
        q, kv, idx, out_o, out_lse,
        num_tokens, num_heads, num_slots, idx.shape[1],
        q.stride(0), q.stride(1), idx.stride(0), scale * LOG2E, positions_per_split // PAIR,
        WG1_REGS=WG1_REGS, GATHER_REGS=GATHER_REGS, L2_MARK=l2_hint.mark_asm(l2_copies),
        num_warps=4, maxnreg=MAXNREG,
    )
