"""Sparse MLA forward over bf16 rows (and fp8_ds_mla rows, opt-in) in Gluon for Hopper
(sm_90), with the two consumer warpgroups in ping-pong: each computes S for every other block
of 64 keys and P·V for half of O's columns, so the QK and P·V work is split evenly and one
warpgroup's softmax runs while the other's wgmmas keep the tensor cores busy (FlashMLA's
sparse prefill schedule).

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

fp8_ds_mla rows (KV_FP8; SparseMlaConfig.pingpong_fp8, off by default): shared memory has no
room for raw rows, so the gather loads the next K half's latents into registers (as 4-byte
words, one half ahead: 64 B per thread), waits for the half to be freed, stores it dequantized
(e4m3 · 2^k, exact in bf16, inline PTX) and copies its rope (bf16 already) with cp.async; a
right half's k_ready then counts the 128 copy arrivals and the one store arrival. Measured on
an H200, FP8 decode b = 128, s_q = 1 / 4: 136–138 / 528–533 µs against 120–122 / 467–490 µs
for sparse_mla_gluon.py's kernel in the same runs (hence off). With the loads replaced by
register arithmetic the same kernel takes 93 / 355 µs, and with every row L2-resident
106.5 / 411 µs: the gather waits on the rows' trip from DRAM. Two halves in flight need 32
more registers than the gather's 72 (it spilled and ran slower), L2 prefetches a pair ahead
did not help, and 32-key blocks with a raw-row ring in the shared memory they free were
slower still (docs/kernels.md).
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
    _block_slots,
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
    _, valid = _block_slots(idx_row, pos0, topk, num_slots, BN, gl.SliceLayout(0, layout))
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
def _load_q(ptrs, args, smem, bars):
    """A gather's start: Q [64 heads, 512 | 64] of the CTA's token → shared memory (cp.async;
    every gather thread's arrive on q_ready fires when its copies have landed). Returns the
    token's index row."""
    q_ptr, idx_ptr, stride_qt, stride_qh = ptrs[0], ptrs[2], ptrs[5], ptrs[6]
    t, head0, stride_it = args[0], args[1], args[9]
    q_smem, qpe_smem, q_ready = smem[0], smem[1], bars[0]
    ld: gl.constexpr = _copy_layout()
    h = gl.arange(0, HEADS, gl.SliceLayout(1, ld))
    q_rows = q_ptr + t * stride_qt + (head0 + h).to(gl.int64)[:, None] * stride_qh
    c = gl.arange(0, HALF, gl.SliceLayout(0, ld))
    for half in gl.static_range(2):
        async_copy.async_copy_global_to_shared(q_smem.index(half),
                                               q_rows + (half * HALF + c)[None, :])
    c_pe = L + gl.arange(0, R, gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(qpe_smem.index(0), q_rows + c_pe[None, :])
    async_copy.commit_group()
    async_copy.mbarrier_arrive(q_ready, increment_count=False)
    return idx_ptr + t * stride_it


@gluon.jit
def _gather_partition(ptrs, args, smem, bars):
    """Q once, then per pair the four K halves in the order the consumers free them; each
    thread's arrive on k_ready fires when its own copies have landed."""
    kv_ptr = ptrs[1]
    first, n_pairs, num_slots, topk = args[3], args[4], args[7], args[8]
    k_smem, kpe_smem, k_ready, k_free = smem[2], smem[3], bars[1], bars[2]
    ld: gl.constexpr = _copy_layout()
    rows_l: gl.constexpr = gl.SliceLayout(1, ld)
    idx_row = _load_q(ptrs, args, smem, bars)
    # The slots of pair i + 1 are loaded during pair i (an index load waited for right before
    # its copies would put a global-memory round trip on every pair).
    slot0_n, valid0_n = _block_slots(idx_row, first, topk, num_slots, BN, rows_l)
    slot1_n, valid1_n = _block_slots(idx_row, first + BN, topk, num_slots, BN, rows_l)
    for i in range(n_pairs):
        free_phase = (i & 1) ^ 1
        slot0, valid0, slot1, valid1 = slot0_n, valid0_n, slot1_n, valid1_n
        nxt = first + (i + 1) * (2 * BN)
        slot0_n, valid0_n = _block_slots(idx_row, nxt, topk, num_slots, BN, rows_l)
        slot1_n, valid1_n = _block_slots(idx_row, nxt + BN, topk, num_slots, BN, rows_l)
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


@gluon.constexpr_function
def _word_layout():
    """[64, 32] int32: one 128-value e4m3 latent tile of 64 rows as 4-byte words, 2 threads
    per row with 4 × 16 bytes each (16 registers), so each gather thread owns one row of a
    block (one slot, one tile scale). Words, not fp8 values: carried from one step to the next,
    8-bit values live in 16-bit registers each, and the sm_90 build spilled 1.5 KB."""
    return gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])


@gluon.constexpr_function
def _rope_layout():
    """cp.async layout of a [64, 64] bf16 rope tile with the rows of _word_layout (thread →
    row the same, so slots move between the two layouts without data movement)."""
    return gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])


@gluon.jit
def _load_tile(kv_ptr, slot, ok, tile: gl.constexpr, ROW: gl.constexpr, lat: gl.constexpr):
    """Latent tile `tile` (values 128·tile … + 127) of 64 fp8_ds_mla rows → registers
    ([64, 32] int32 words of 4 e4m3 each, and the rows' fp32 scale as bits [64]), 0 where not
    `ok`. Plain loads: the bytes wait in registers, not in shared memory (which the bf16 tiles
    fill), until their half is free."""
    rows = kv_ptr + gl.where(ok, slot, 0).to(gl.int64) * ROW  # [64] row pointers
    c = gl.arange(0, 32, gl.SliceLayout(0, lat))
    words = rows.to(gl.pointer_type(gl.int32))[:, None] + (tile * 32 + c)[None, :]
    x = gl.load(words, mask=ok[:, None], other=0)
    scale = gl.load((rows + L + 4 * tile).to(gl.pointer_type(gl.int32)), mask=ok, other=0)
    return x, scale


# 4 e4m3 values (one word, $2) times a power of two (fp32 bits, $3) → 4 bf16 values in two
# words ($0: values 0, 1; $1: values 2, 3), exact. cvt.rn.bf16x2.f32 puts its first source in
# the upper half.
_DEQUANT_ASM = gl.constexpr("""{
.reg .b16 lo, hi, a, b, c, d;
.reg .b32 ab, cd;
.reg .f32 fa, fb, fc, fd;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 ab, lo;
cvt.rn.f16x2.e4m3x2 cd, hi;
mov.b32 {a, b}, ab;
mov.b32 {c, d}, cd;
cvt.f32.f16 fa, a;
cvt.f32.f16 fb, b;
cvt.f32.f16 fc, c;
cvt.f32.f16 fd, d;
mul.f32 fa, fa, $3;
mul.f32 fb, fb, $3;
mul.f32 fc, fc, $3;
mul.f32 fd, fd, $3;
cvt.rn.bf16x2.f32 $0, fb, fa;
cvt.rn.bf16x2.f32 $1, fd, fc;
}""")


@gluon.jit
def _store_dequantized(k_words, col0: gl.constexpr, x, scale):
    """x · 2^k ([64, 32] words of e4m3 → [64, 128] bf16, exact: power-of-two scales) → bf16
    columns col0 … col0 + 127 of a K half (k_words: the half as [64, 128] words)."""
    lo, hi = gl.inline_asm_elementwise(
        _DEQUANT_ASM, "=r,=r,r,r", [x, scale[:, None] + gl.zeros_like(x)],
        dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    pairs = gl.reshape(gl.join(lo, hi), [HEADS, 64])  # words 2j, 2j + 1: values 4j … 4j + 3
    k_words.slice(col0 // 2, 64, dim=1).store(pairs)


@gluon.jit
def _fp8_step(kv_ptr, k_words, kpe_smem, k_ready, k_free, phase, half: gl.constexpr,
              buf: gl.constexpr, xa, sa, xb, sb, slot, ok, slot_n, ok_n, tile_n: gl.constexpr,
              z, ROW: gl.constexpr, lat: gl.constexpr, pe: gl.constexpr):
    """One K half (k_words.index(half) of buffer `buf`, rows `slot` where `ok`) from the
    registers xa, sa / xb, sb (its two latent tiles) once its last reader freed it; a right
    half also gets its rows' rope (cp.async, counted on k_ready by every thread). Each tile's
    registers are reloaded, right after they are stored, with the next half's tiles tile_n,
    tile_n + 1 (rows slot_n where ok_n), so 64 B per thread stay in flight throughout.
    z: _opaque_zero (constant views would have every store address of the loop hoisted out
    of it, and spilled)."""
    mbarrier.wait(k_free.index(half), phase ^ 1)
    if half % 2 == 1:  # right half: latent 256–511 and the rope
        rows = kv_ptr + gl.where(ok, slot, 0).to(gl.int64) * ROW
        rows_pe = gl.convert_layout(rows, gl.SliceLayout(1, pe))
        ok_pe = gl.convert_layout(ok, gl.SliceLayout(1, pe))
        c_pe = gl.arange(0, R, gl.SliceLayout(0, pe))
        async_copy.async_copy_global_to_shared(
            kpe_smem.index(buf + z),
            (rows_pe + (L + 16)).to(gl.pointer_type(gl.bfloat16))[:, None] + c_pe[None, :],
            mask=ok_pe[:, None])
        async_copy.commit_group()
        async_copy.mbarrier_arrive(k_ready.index(half), increment_count=False)
    _store_dequantized(k_words.index(half + z), 0, xa, sa)
    xa, sa = _load_tile(kv_ptr, slot_n, ok_n, tile_n, ROW, lat)
    _store_dequantized(k_words.index(half + z), 128, xb, sb)
    xb, sb = _load_tile(kv_ptr, slot_n, ok_n, tile_n + 1, ROW, lat)
    fence_async_shared()  # generic-proxy stores → the consumers' wgmma reads
    _signal(k_ready.index(half))
    return xa, sa, xb, sb


@gluon.jit
def _gather_fp8_partition(ptrs, args, smem, bars):
    """fp8_ds_mla rows: Q once, then per pair the four K halves in the order the consumers free
    them (K0 left, K1 right, K0 right, K1 left), each dequantized from registers that were
    loaded while the half before it was being filled (_fp8_step)."""
    kv_ptr = ptrs[1]
    first, n_pairs, num_slots, topk = args[3], args[4], args[7], args[8]
    k_smem, kpe_smem, k_ready, k_free = smem[2], smem[3], bars[1], bars[2]
    ROW: gl.constexpr = L + 16 + 2 * R  # 656 bytes: latents, 4 fp32 scales, bf16 rope
    lat: gl.constexpr = _word_layout()
    pe: gl.constexpr = _rope_layout()
    # The K halves as words (the same bytes: a 128-byte swizzle is laid out in bytes).
    k_words = k_smem._reinterpret(gl.int32, [4, HEADS, HALF // 2],
                                  gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                       rank=2))
    rows_l: gl.constexpr = gl.SliceLayout(1, lat)
    idx_row = _load_q(ptrs, args, smem, bars)
    slot0, ok0 = _block_slots(idx_row, first, topk, num_slots, BN, rows_l)
    slot1, ok1 = _block_slots(idx_row, first + BN, topk, num_slots, BN, rows_l)
    ok0 = ok0 & (n_pairs > 0)
    ok1 = ok1 & (n_pairs > 0)
    xa, sa = _load_tile(kv_ptr, slot0, ok0, 0, ROW, lat)  # K0 left of pair 0
    xb, sb = _load_tile(kv_ptr, slot0, ok0, 1, ROW, lat)
    for i in range(n_pairs):
        phase = i & 1
        z = _opaque_zero(i)
        nxt = first + (i + 1) * (2 * BN)
        slot0_n, ok0_n = _block_slots(idx_row, nxt, topk, num_slots, BN, rows_l)
        slot1_n, ok1_n = _block_slots(idx_row, nxt + BN, topk, num_slots, BN, rows_l)
        more = i + 1 < n_pairs
        ok0_n = ok0_n & more
        ok1_n = ok1_n & more
        xa, sa, xb, sb = _fp8_step(kv_ptr, k_words, kpe_smem, k_ready, k_free, phase, K0L, 0,
                                   xa, sa, xb, sb, slot0, ok0, slot1, ok1, 2, z, ROW, lat, pe)
        xa, sa, xb, sb = _fp8_step(kv_ptr, k_words, kpe_smem, k_ready, k_free, phase, K1R, 1,
                                   xa, sa, xb, sb, slot1, ok1, slot0, ok0, 2, z, ROW, lat, pe)
        xa, sa, xb, sb = _fp8_step(kv_ptr, k_words, kpe_smem, k_ready, k_free, phase, K0R, 0,
                                   xa, sa, xb, sb, slot0, ok0, slot1, ok1, 0, z, ROW, lat, pe)
        xa, sa, xb, sb = _fp8_step(kv_ptr, k_words, kpe_smem, k_ready, k_free, phase, K1L, 1,
                                   xa, sa, xb, sb, slot1, ok1, slot0_n, ok0_n, 0, z, ROW, lat, pe)
        slot0, ok0, slot1, ok1 = slot0_n, ok0_n, slot1_n, ok1_n
    async_copy.wait_group(0)


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@gluon.jit(do_not_specialize=["num_tokens", "num_slots", "pairs_per_split"])
def _sparse_mla_pingpong_kernel(
    q_ptr,  # [T, H, 576] bf16
    kv_ptr,  # bf16 rows [num_slots, 576], or fp8_ds_mla bytes [num_slots, 656] (as fp8)
    idx_ptr,  # [T, K] int32 slots, −1 = skip
    o_ptr,  # [T, H, 512] bf16 (one split) or fp32 partials [splits, T, H, 512]
    lse_ptr,  # [T, H] or [splits, T, H] fp32, natural log
    num_tokens, num_heads, num_slots, topk,
    stride_qt, stride_qh, stride_it,
    sm_scale_log2,  # softmax scale · log2(e)
    pairs_per_split,
    KV_FP8: gl.constexpr, WG1_REGS: gl.constexpr, GATHER_REGS: gl.constexpr,
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
        # bf16: every gather thread's copies (arrive.noinc); fp8: one arrive once the
        # dequantized latents are stored, and for a right half every thread's rope copies.
        if not KV_FP8:
            mbarrier.init(k_ready.index(i), count=128)
        elif i % 2 == 1:
            mbarrier.init(k_ready.index(i), count=129)
        else:
            mbarrier.init(k_ready.index(i), count=1)
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
    if KV_FP8:
        gl.warp_specialize([
            (_wg0_partition, (ptrs, args, smem, bars)),
            (_wg1_partition, (ptrs, args, smem, bars)),
            (_gather_fp8_partition, (ptrs, args, smem, bars)),
        ], [4, 4], [WG1_REGS, GATHER_REGS])
    else:
        gl.warp_specialize([
            (_wg0_partition, (ptrs, args, smem, bars)),
            (_wg1_partition, (ptrs, args, smem, bars)),
            (_gather_partition, (ptrs, args, smem, bars)),
        ], [4, 4], [WG1_REGS, GATHER_REGS])


# Registers per thread: 12 warps at maxnreg 168; setmaxnreg gives each consumer 224 (O half
# 128, S and P 48, the next block's key mask) and the gather 56 (216 / 72 spills 8 bytes).
MAXNREG, WG1_REGS, GATHER_REGS = 168, 224, 56
# fp8_ds_mla rows: the gather also holds the next half's raw tiles (32 registers). At 224 / 56
# it spilled 56 bytes and ran 1.17x slower (H200, FP8 decode b = 128); 216 / 72 leaves 8 bytes
# spilled by a consumer warpgroup.
FP8_WG1_REGS, FP8_GATHER_REGS = 216, 72


def launch(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, out_o: torch.Tensor,
           out_lse: torch.Tensor, num_slots: int, scale: float, positions_per_split: int,
           l2_copies: str = l2_hint.PLAIN, fp8: bool = False) -> None:
    """The launch `sparse_mla.sparse_mla_fwd` makes on sm_90 for a bf16 cache, or for an
    fp8_ds_mla one with SparseMlaConfig.pingpong_fp8 (arguments checked there): q [T, H, 576]
    (H a multiple of 64), kv bf16 [.., .., 576] or (fp8) the fp8 view of fp8_ds_mla bytes
    [.., .., 656], idx [T, K] int32 with unit last stride → out_o / out_lse (o and lse, or
    fp32 partials [splits, ...] of positions_per_split index positions each, a multiple of
    PAIR). l2_copies: the copies' L2 qualifiers (an l2_hint mode)."""
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
        KV_FP8=fp8, WG1_REGS=FP8_WG1_REGS if fp8 else WG1_REGS,
        GATHER_REGS=FP8_GATHER_REGS if fp8 else GATHER_REGS, L2_MARK=l2_hint.mark_asm(l2_copies),
        num_warps=4, maxnreg=MAXNREG,
    )
