"""Sparse MLA in the absorbed (MQA) form over a paged cache: one kernel for prefill and decode.

Every query row t attends over the K cache slots its index row names (−1 = skip); all heads of
the row share those slots, so a program takes one row and BLOCK_H heads and streams the K rows
through once for all of them:

    program (head block hb, row t, split s)
      Q   [BLOCK_H, L | R]         loaded once
      for each block of BLOCK_N slots of split s:
        K   [BLOCK_N, L | R]       gathered rows (fp8_ds_mla: dequantized in registers)
        S = Q_lat·K_latᵀ + Q_pe·K_peᵀ        [BLOCK_H, BLOCK_N]  fp32, masked where slot < 0
        online softmax (base 2); acc += P·K_lat   [BLOCK_H, L]  (V is the latent itself)

Decode batches have few rows, so the slots of a row are cut into NUM_SPLITS contiguous pieces
whose partial (o, lse) are merged by a second kernel (the same log-sum-exp merge DCP uses).
Flops per row and head: 2·K·(L+R) + 2·K·L = 2176·K for L = 512, R = 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats
from dsaserve.kernels.device import sm_count
from dsaserve.kernels.triton import l2_hint

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))  # base-2 lse → natural log


@dataclass(frozen=True)
class SparseMlaConfig:
    """Launch shape of the sparse MLA kernel. Block sizes are powers of two; BLOCK_H ≥ 16 and
    BLOCK_N ≥ 16 (tensor-core tile minimum).

    The K rows are gathered through the index row (one level of indirection), so Triton's
    pipeliner prefetches them (num_stages − 1) // 2 blocks ahead. Measured on an H200
    (docs/kernels.md), 64-row blocks with 3 stages beat 32-row blocks with 5 stages (deeper
    prefetch) by 20–25%: the per-block fixed cost (waits, cross-warpgroup softmax reductions,
    P's trip through shared memory) dominates. sm_90 build: 222 KB shared, no spills.
    """

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_splits: int | None = None  # None: chosen from the grid size and the SM count
    # sparse_mla_gluon.py's kernel (fp8_ds_mla rows, or bf16 rows with pingpong=False), when
    # it does not split rows: num_ctas CTAs share the rows, each running its rows back to back
    # (mla_work.py); None: the fewest with the most rows per CTA of one CTA per SM.
    num_ctas: int | None = None
    # The Gluon kernel (sparse_mla_gluon.py: sm_90, bf16 q, H a multiple of 64, L = 512,
    # R = 64); None: wherever it runs (it measured faster or even everywhere).
    gluon: bool | None = None
    # With the Gluon kernel and a bf16 cache: the ping-pong kernel (sparse_mla_pingpong.py)
    # instead of sparse_mla_gluon.py's.
    pingpong: bool = True
    # With the Gluon kernel and an fp8_ds_mla cache: the ping-pong kernel, its gather
    # dequantizing the rows (sparse_mla_pingpong.py), instead of sparse_mla_gluon.py's.
    pingpong_fp8: bool = False
    # The L2 qualifiers of the Gluon kernels' row copies, an l2_hint mode: "plain", "prefetch"
    # (256-byte L2 prefetch) or "evict_last" (that and FlashMLA's evict_last policy on the
    # gathered rows). Neither measured faster on an H200 (docs/kernels.md): plain by default.
    l2_copies: str = "plain"
    # Prefill chunks over an fp8_ds_mla cache (TritonBackend.sparse_mla_positions): a request
    # whose rows read each of its context rows at least this many times on average has its
    # pages dequantized once into a bf16 workspace (mla_workspace.py) and runs the ping-pong
    # kernel on it; math.inf: never. At most workspace_max_rows rows (1152 bytes each) per
    # call: 2^19 is 604 MB, a 512K-token context; longer ones keep the fp8 path.
    workspace_min_reads: float = 8.0
    workspace_max_rows: int = 1 << 19

    def __post_init__(self):
        if self.l2_copies not in l2_hint.MODES:
            raise ValueError(f"SparseMlaConfig.l2_copies must be one of {l2_hint.MODES}, got "
                             f"{self.l2_copies!r}")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"SparseMlaConfig.num_ctas must be >= 1 or None, got {self.num_ctas}")
        if not self.workspace_min_reads > 0 or self.workspace_max_rows < 0:
            raise ValueError(f"SparseMlaConfig: workspace_min_reads must be > 0 and "
                             f"workspace_max_rows >= 0, got {self.workspace_min_reads} and "
                             f"{self.workspace_max_rows}")


def _use_gluon(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
               cfg: SparseMlaConfig) -> bool:
    if cfg.gluon is False or not q.is_cuda:
        return False
    from dsaserve.kernels.triton import sparse_mla_gluon  # Hopper only: imported on demand

    # Measured on an H200 (docs/kernels.md): prefill T = 4096 2.70 ms (the ping-pong kernel,
    # bf16 rows) vs 5.11 ms; FP8 decode b = 128 120 vs 200 µs.
    if sparse_mla_gluon.gluon_supported(q, kv_cache, kv_lora_rank):
        return True
    if cfg.gluon:
        raise ValueError(f"sparse_mla: the Gluon kernel needs {sparse_mla_gluon.REQUIREMENTS}; "
                         f"got q {q.dtype} {tuple(q.shape)} on {q.device}, kv_lora_rank "
                         f"{kv_lora_rank}, a {kv_cache.dtype} cache {tuple(kv_cache.shape)}")
    return False


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _sparse_mla_fwd_kernel(
    q_ptr,  # [T, H, L + R]
    kv_ptr,  # float rows [num_slots, L + R], or the fp8 view of fp8_ds_mla bytes
    idx_ptr,  # [T, K] int32 slots, −1 = skip
    o_ptr,  # [T, H, L] (NUM_SPLITS == 1) or fp32 partials [NUM_SPLITS, T, H, L]
    lse_ptr,  # [T, H] or [NUM_SPLITS, T, H] fp32, natural log
    num_tokens, num_heads, num_slots, topk,
    stride_qt, stride_qh, stride_it,
    sm_scale_log2,  # softmax scale · log2(e)
    L: tl.constexpr, R: tl.constexpr, KV_FP8: tl.constexpr, ROW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_ok = heads < num_heads
    d_lat = tl.arange(0, L)
    d_pe = tl.arange(0, R)

    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + d_lat[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, L]
    q_pe = tl.load(q_row + L + d_pe[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, R]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running Σ 2^(s − m)
    acc = tl.zeros([BLOCK_H, L], tl.float32)

    first = split * BLOCKS_PER_SPLIT * BLOCK_N
    for b in range(0, BLOCKS_PER_SPLIT):
        n = first + b * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the index row
        slot = tl.load(idx_ptr + t * stride_it + n, mask=n < topk, other=-1)
        valid = (slot >= 0) & (slot < num_slots)
        # Masked rows are never read: unwritten cache bytes may hold NaN patterns.
        row = tl.where(valid, slot, 0).to(tl.int64) * ROW  # [BLOCK_N] element offset of the row
        if KV_FP8:
            NUM_TILES: tl.constexpr = L // 128
            k8 = tl.load(kv_ptr + row[:, None] + d_lat[None, :], mask=valid[:, None], other=0.0)
            scale_ptr = (kv_ptr + row + L).to(tl.pointer_type(tl.float32))  # [BLOCK_N]
            scales = tl.load(scale_ptr[:, None] + tl.arange(0, NUM_TILES)[None, :],
                             mask=valid[:, None], other=0.0)  # [BLOCK_N, NUM_TILES]
            k_lat = tl.reshape(k8.to(tl.float32), [BLOCK_N, NUM_TILES, 128]) * scales[:, :, None]
            k_lat = tl.reshape(k_lat, [BLOCK_N, L]).to(dtype)
            pe_ptr = (kv_ptr + row + L + 4 * NUM_TILES).to(tl.pointer_type(tl.bfloat16))
            k_pe = tl.load(pe_ptr[:, None] + d_pe[None, :], mask=valid[:, None], other=0.0)
            k_pe = k_pe.to(dtype)
        else:
            k_lat = tl.load(kv_ptr + row[:, None] + d_lat[None, :], mask=valid[:, None],
                            other=0.0).to(dtype)  # [BLOCK_N, L]
            k_pe = tl.load(kv_ptr + row[:, None] + L + d_pe[None, :], mask=valid[:, None],
                           other=0.0).to(dtype)  # [BLOCK_N, R]
        s = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.dot(q_lat, tl.trans(k_lat), s, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A head that has seen no valid slot yet keeps m = −inf; subtract 0 instead (no NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(dtype), k_lat, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # empty rows: acc is 0, so o = 0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out_row = (split * num_tokens + t) * num_heads + heads  # [BLOCK_H]
    tl.store(o_ptr + out_row[:, None] * L + d_lat[None, :], o.to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    tl.store(lse_ptr + out_row, lse, mask=head_ok)


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["num_rows"])
def _merge_splits_kernel(
    part_o_ptr,  # [num_splits, T·H, L] fp32
    part_lse_ptr,  # [num_splits, T·H] fp32
    o_ptr,  # [T·H, L]
    lse_ptr,  # [T·H]
    num_rows,  # T·H
    num_splits,
    L: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    """Log-sum-exp merge of the split partials (the DCP merge). Any split count: the splits are
    padded to SPLITS_P2 (arange lengths are powers of two) and the padding masked off as empty
    splits (weight 0)."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_P2)
    live = sp < num_splits
    lse_i = tl.load(part_lse_ptr + sp * num_rows + r, mask=live, other=float("-inf"))
    m = tl.max(lse_i, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_i - m_ref)  # 0 for empty (and padding) splits
    total = tl.sum(w, axis=0)
    o_i = tl.load(part_o_ptr + (sp[:, None] * num_rows + r) * L + tl.arange(0, L)[None, :],
                  mask=live[:, None], other=0.0)
    safe_total = tl.where(total == 0.0, 1.0, total)  # every split empty: o = 0, lse = −inf
    o = tl.sum(o_i * w[:, None], axis=0) / safe_total
    tl.store(o_ptr + r * L + tl.arange(0, L), o.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + r, tl.where(total == 0.0, float("-inf"), m_ref + tl.log(safe_total)))


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor) -> None:
    """part_o [S, T, H, L] fp32, part_lse [S, T, H] → o [T, H, L], lse [T, H] (in place)."""
    splits, num_tokens, num_heads, lora = part_o.shape
    _merge_splits_kernel[(num_tokens * num_heads,)](
        part_o, part_lse, o, lse, num_tokens * num_heads, splits, L=lora,
        SPLITS_P2=triton.next_power_of_2(splits), num_warps=4,
    )


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def choose_num_splits(num_programs: int, num_blocks: int, num_sms: int) -> int:
    """Splits of each index row so that the grid fills the SMs once: a power of two, 1 when the
    rows alone give at least one wave, and never so many that a split gets < 4 blocks."""
    if num_programs >= num_sms:
        return 1
    splits = _pow2_floor(num_sms // num_programs)
    return max(1, min(splits, _pow2_floor(max(1, num_blocks // 4))))


def check_sparse_mla_args(q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                          kv_lora_rank: int) -> tuple[bool, int, torch.Tensor]:
    """Validate the arguments of a sparse MLA call (shared by the Triton and Gluon kernels).
    Returns (fp8 cache?, row width in cache elements, the cache as the kernel reads it: the fp8
    view of fp8_ds_mla bytes, or the float cache itself)."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"sparse_mla: q must be [T, H, L+R] with unit last stride, "
                         f"got {tuple(q.shape)} strides {q.stride()}")
    num_tokens, num_heads, width = q.shape
    lora, rope = kv_lora_rank, width - kv_lora_rank
    if lora <= 0 or rope <= 0 or lora & (lora - 1) or rope & (rope - 1) or rope < 16:
        raise ValueError(f"sparse_mla: kv_lora_rank={lora} and rope dim {rope} must be powers "
                         f"of two (rope ≥ 16)")
    if slot_indices.dim() != 2 or slot_indices.shape[0] != num_tokens:
        raise ValueError(f"sparse_mla: slot_indices must be [T={num_tokens}, K], "
                         f"got {tuple(slot_indices.shape)}")
    if slot_indices.dtype != torch.int32:
        raise ValueError(f"sparse_mla: slot_indices must be int32, got {slot_indices.dtype}")
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"sparse_mla: kv_cache must be contiguous 3-D, "
                         f"got {tuple(kv_cache.shape)}")
    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        row = formats.mla_row_bytes(lora, rope)
        kv = kv_cache.view(torch.float8_e4m3fn)
    elif kv_cache.dtype.is_floating_point:
        row = width
        kv = kv_cache
    else:
        raise ValueError(f"sparse_mla: kv_cache dtype must be uint8 or float, got {kv_cache.dtype}")
    if kv_cache.shape[2] != row:
        raise ValueError(f"sparse_mla: kv_cache rows are {kv_cache.shape[2]} wide, expected {row} "
                         f"for L={lora}, R={rope} ({kv_cache.dtype})")
    return fp8, row, kv


def sparse_mla_fwd(q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                   scale: float, kv_lora_rank: int = 512,
                   config: SparseMlaConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a paged cache (FlashMLA sparse prefill / decode).

    q [T, H, L+R] (bf16 on GPU; fp32 works and runs the dots in full fp32), kv_cache
    [num_blocks, block_size, 656] uint8 fp8_ds_mla or [num_blocks, block_size, L+R] float (a
    bf16 workspace is the block_size = S, num_blocks = 1 case), slot_indices [T, K] int32
    (−1 = skip; slots past the cache are skipped too) → o [T, H, L] in q's dtype and
    lse [T, H] fp32 (natural log; a row with no valid slot gives o = 0, lse = −inf).
    """
    cfg = config or SparseMlaConfig()
    fp8, row, kv = check_sparse_mla_args(q, kv_cache, slot_indices, kv_lora_rank)
    gluon = _use_gluon(q, kv_cache, kv_lora_rank, cfg)
    num_tokens, num_heads, width = q.shape
    lora, rope = kv_lora_rank, width - kv_lora_rank
    topk = slot_indices.shape[1]
    idx = slot_indices if slot_indices.stride(1) == 1 else slot_indices.contiguous()
    o = torch.empty(num_tokens, num_heads, lora, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return o, lse

    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    pingpong = cfg.pingpong_fp8 if fp8 else cfg.pingpong
    if gluon and not pingpong:  # CTAs that run several rows (mla_work.py)
        from dsaserve.kernels.triton import sparse_mla_gluon

        sparse_mla_gluon.launch(q, kv, idx, o, lse, num_slots, scale, fp8, cfg.num_splits,
                                cfg.num_ctas, cfg.l2_copies)
        return o, lse
    if gluon:  # the ping-pong kernel: 64 heads per program, splits of whole pairs of blocks
        from dsaserve.kernels.triton import sparse_mla_pingpong

        block_h, unit = 64, sparse_mla_pingpong.PAIR
    else:
        block_h = max(16, min(cfg.block_h, triton.next_power_of_2(num_heads)))
        unit = cfg.block_n
    head_blocks = triton.cdiv(num_heads, block_h)
    # Split sizes in units of 64 index positions for the ping-pong kernel, of blocks for the
    # Triton one (a split keeps at least 4 of them). Interpreter runs count 4 SMs: small, but
    # the split path runs.
    splits = cfg.num_splits or choose_num_splits(num_tokens * head_blocks,
                                                 triton.cdiv(topk, 64 if gluon else unit),
                                                 sm_count(q.device, 4))
    # Index positions per split: whole units (trailing splits may then be empty: o = 0,
    # lse = −inf).
    per_split = triton.cdiv(triton.cdiv(topk, unit), splits) * unit
    if splits > 1:
        out_o = torch.empty(splits, num_tokens, num_heads, lora, dtype=torch.float32,
                            device=q.device)
        out_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32,
                              device=q.device)
    else:
        out_o, out_lse = o, lse
    if gluon:
        sparse_mla_pingpong.launch(q, kv, idx, out_o, out_lse, num_slots, scale, per_split,
                                   cfg.l2_copies, fp8)
    else:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        _sparse_mla_fwd_kernel[(head_blocks, num_tokens, splits)](
            q, kv, idx, out_o, out_lse,
            num_tokens, num_heads, num_slots, topk,
            q.stride(0), q.stride(1), idx.stride(0),
            scale * LOG2E,
            L=lora, R=rope, KV_FP8=fp8, ROW=row, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
            NUM_SPLITS=splits, BLOCKS_PER_SPLIT=per_split // cfg.block_n, DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if splits > 1:
        merge_splits(out_o, out_lse, o, lse)
    return o, lse
