"""FP8 lightning indexer: key writer, paged FP8 logits, causal top-k (prefill and decode alike).

Scores (MODEL_SPEC §2.4 step 7, the DeepGEMM fp8 formula):

    I[t, j] = k_scale[j] · Σ_h ReLU(q8[t, h] · k8[j]) · w[t, h] · q_scale[t, h]

Query rows are grouped into tiles of BLOCK_T consecutive tokens of one request, so that one key
block read from the paged cache serves BLOCK_T·H rows of the fp8 matmul:

    program (tile i, page chunk c)     tile i = (request, first token, n tokens ≤ BLOCK_T)
      Q   [BLOCK_T·H, D] fp8            loaded once
      for each page of chunk c:  K [B, D] fp8 + k_scale [B] (one block-table entry, contiguous)
        S = Q·Kᵀ (fp32) → ReLU · w → Σ over heads → [BLOCK_T, B] logits
      keys at or past a token's causal limit are written as −inf

Top-k then runs over the logits rows with torch.topk (not fused into the logits kernel;
docs/kernels.md says what that costs). Keys are this rank's local sequence
(layout.context_slots): under DCP a row's keys are the ones this rank owns, and the result is a
local top-k of (score, global position).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.triton.mla_cache import pow2_ceil
from dsaserve.kv import layout


# --------------------------------------------------------------------------------------------
# Key writer
# --------------------------------------------------------------------------------------------
@triton.jit
def _write_index_fp8_kernel(
    cache_ptr,  # fp8 view of the uint8 pages, flat [num_blocks · BS · (D + 4)]
    slots_ptr,  # [N] int64, −1 = skip
    k_ptr,  # [N, D]
    stride_k,
    D: tl.constexpr, BS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    if slot < 0:
        return
    page = cache_ptr + (slot // BS) * (BS * (D + 4))
    offset = slot % BS
    k = tl.load(k_ptr + i * stride_k + tl.arange(0, D)).to(tl.float32)  # [D]
    scale = pow2_ceil(tl.maximum(tl.max(tl.abs(k), axis=0), MIN_AMAX) / FP8_MAX)
    k8 = tl.clamp(k / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(page + offset * D + tl.arange(0, D), k8)
    tl.store((page + BS * D + offset * 4).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _write_index_float_kernel(cache_ptr, slots_ptr, k_ptr, stride_k, D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    if slot < 0:
        return
    k = tl.load(k_ptr + i * stride_k + tl.arange(0, D))
    tl.store(cache_ptr + slot * D + tl.arange(0, D), k.to(cache_ptr.dtype.element_ty))


def write_index_cache(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Store indexer keys k [N, D] at slots [N] (−1: skip; valid slots distinct and in range).

    cache: uint8 pages [num_blocks, block_size·(D+4)] (values then scales, power-of-two scale
    per token) or float [num_blocks, block_size, D]; contiguous. Same bytes as
    formats.write_index_cache.
    """
    if k.dim() != 2:
        raise ValueError(f"write_index_cache: expected k [N, D], got {tuple(k.shape)}")
    n, head_dim = k.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"write_index_cache: head dim {head_dim} must be a power of two")
    if slots.shape != (n,) or slots.dtype.is_floating_point:
        raise ValueError(f"write_index_cache: slots must be integer [N={n}], "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if not cache.is_contiguous():
        raise ValueError("write_index_cache: cache must be contiguous")
    if n == 0:
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    slots = slots.to(torch.int64)
    if cache.dtype == torch.uint8:
        token_bytes = formats.index_token_bytes(head_dim)
        if cache.dim() != 2 or cache.shape[1] % token_bytes:
            raise ValueError(f"write_index_cache: fp8 cache must be [num_blocks, "
                             f"block_size*{token_bytes}], got {tuple(cache.shape)}")
        _write_index_fp8_kernel[(n,)](
            cache.view(torch.float8_e4m3fn), slots, k, k.stride(0),
            D=head_dim, BS=cache.shape[1] // token_bytes, FP8_MAX=formats.FP8_MAX,
            MIN_AMAX=formats.INDEX_MIN_AMAX, num_warps=1,
        )
    elif cache.dtype.is_floating_point:
        if cache.dim() != 3 or cache.shape[2] != head_dim:
            raise ValueError(f"write_index_cache: float cache must be [num_blocks, block_size, "
                             f"{head_dim}], got {tuple(cache.shape)}")
        _write_index_float_kernel[(n,)](cache, slots, k, k.stride(0), D=head_dim, num_warps=1)
    else:
        raise ValueError(f"write_index_cache: cache dtype must be uint8 or float, "
                         f"got {cache.dtype}")


# --------------------------------------------------------------------------------------------
# Logits
# --------------------------------------------------------------------------------------------
@triton.jit
def _indexer_logits_kernel(
    q_ptr,  # [T·H, D] fp8 (or float for a float cache)
    w_ptr,  # [T·H] fp32, weights · q_scale
    cache_ptr,  # fp8 pages (flat) or float rows [num_slots, D]
    block_table_ptr,  # [R, max_blocks] int32, local block b of a request → physical block
    tile_req_ptr, tile_tok_ptr, tile_len_ptr,  # [num_tiles] int32
    limit_ptr,  # [T] int32: keys j < limit[t] are visible to token t
    out_ptr,  # [T, S_out] fp32
    stride_bt, stride_out, s_out,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, PAGES_PER_PROG: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile).to(tl.int64)
    tok0 = tl.load(tile_tok_ptr + tile).to(tl.int64)
    ntok = tl.load(tile_len_ptr + tile)
    BLOCK_M: tl.constexpr = BLOCK_T * H
    tt = tl.arange(0, BLOCK_T)
    tok_ok = tt < ntok
    limit = tl.load(limit_ptr + tok0 + tt, mask=tok_ok, other=0)  # [BLOCK_T]
    max_limit = tl.max(limit, axis=0)
    rows = tl.arange(0, BLOCK_M)  # row r = token r // H, head r % H
    row_ok = rows // H < ntok
    d = tl.arange(0, D)
    o = tl.arange(0, BS)  # token offsets inside a page
    q = tl.load(q_ptr + (tok0 * H + rows)[:, None] * D + d[None, :], mask=row_ok[:, None],
                other=0.0)  # [BLOCK_M, D]
    w = tl.load(w_ptr + tok0 * H + rows, mask=row_ok, other=0.0)  # [BLOCK_M]
    out_rows = out_ptr + (tok0 + tt)[:, None] * stride_out  # [BLOCK_T, 1]

    # One page of BS keys per step: one block-table entry, then contiguous values and scales.
    # Pages [first, first + num_live) hold keys some token of the tile can see; the rest of the
    # chunk is −inf for every token. Two loops keep the loads out of branches (pipelinable).
    first = chunk * PAGES_PER_PROG
    num_live = tl.minimum(tl.maximum(tl.cdiv(max_limit, BS) - first, 0), PAGES_PER_PROG)
    # The chunk's block ids, loaded once: a block-table load inside the loop would make the
    # page loads indirect, which Triton's pipeliner prefetches only half as far ahead.
    p = tl.arange(0, PAGES_PER_PROG)
    blocks = tl.load(block_table_ptr + req * stride_bt + first + p, mask=p < num_live, other=0)
    for b in range(0, num_live):
        j = (first + b) * BS + o  # [BS] local key indices
        block = tl.sum(tl.where(p == b, blocks, 0), axis=0).to(tl.int64)
        if KV_FP8:
            page = cache_ptr + block * (BS * (D + 4))
            k = tl.load(page + o[:, None] * D + d[None, :])  # [BS, D] fp8, one 8 KB run
            k_scale = tl.load((page + BS * D).to(tl.pointer_type(tl.float32)) + o)  # [BS]
        else:
            k = tl.load(cache_ptr + (block * BS + o)[:, None] * D + d[None, :])
            k = k.to(q_ptr.dtype.element_ty)
            k_scale = tl.full([BS], 1.0, tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BS] fp32
        s = tl.maximum(s, 0.0) * w[:, None]
        logits = tl.sum(tl.reshape(s, [BLOCK_T, H, BS]), axis=1) * k_scale[None, :]
        # Keys past a token's limit (also unwritten slots of the last page: maybe NaN) → −inf.
        logits = tl.where(j[None, :] < limit[:, None], logits, float("-inf"))
        tl.store(out_rows + j[None, :], logits, mask=tok_ok[:, None] & (j[None, :] < s_out))
    for b in range(num_live, PAGES_PER_PROG):
        j = (first + b) * BS + o
        tl.store(out_rows + j[None, :], tl.full([BLOCK_T, BS], float("-inf"), tl.float32),
                 mask=tok_ok[:, None] & (j[None, :] < s_out))


def _tiles(query_start_loc: tuple[int, ...],
           block_t: int) -> tuple[list[int], list[int], list[int]]:
    """Cut each request's tokens into tiles of ≤ block_t consecutive tokens:

        qsl 0 3 4 6, block_t 2  →  (req, first token, length) = (0,0,2) (0,2,1) (1,3,1) (2,4,2)
    """
    reqs, toks, lens = [], [], []
    for r in range(len(query_start_loc) - 1):
        for start in range(query_start_loc[r], query_start_loc[r + 1], block_t):
            reqs.append(r)
            toks.append(start)
            lens.append(min(block_t, query_start_loc[r + 1] - start))
    return reqs, toks, lens


@dataclass(frozen=True)
class _StepPlan:
    """What the logits kernel needs from one step's metadata, identical for every indexer layer
    of the step: built once (host work and small copies), then reused by the other layers."""

    limits: torch.Tensor  # [T] int64: visible local keys per token
    limits_i32: torch.Tensor  # [T] int32, the kernel's copy
    tiles: torch.Tensor  # [3, num_tiles] int32: request, first token, length
    block_table: torch.Tensor  # [R, max_blocks] int32 on the device
    s_out: int  # longest local key sequence of the batch
    block_t: int  # tokens per tile


_last_plan: tuple[weakref.ref, tuple, _StepPlan] | None = None


def _step_plan(meta: AttentionMetadata, num_heads: int, device: torch.device) -> _StepPlan:
    global _last_plan
    key = (num_heads, str(device))
    if _last_plan is not None and _last_plan[0]() is meta and _last_plan[1] == key:
        return _last_plan[2]
    local_lens = [layout.dcp_local_seq_len(s, meta.dcp_size, meta.dcp_rank, meta.interleave)
                  for s in meta.seq_lens]
    # Keys this rank owns among positions [0, pos] of each query: its visible local keys.
    limits = layout.dcp_local_seq_len(meta.positions.to(device, torch.int64) + 1, meta.dcp_size,
                                      meta.dcp_rank, meta.interleave)  # [T]
    lens = torch.tensor([0] + local_lens, device=device)
    limits = torch.minimum(limits, lens[meta.req_indices.to(device) + 1])
    max_len = max((b - a for a, b in map(meta.query_range, range(meta.num_reqs))), default=1)
    # Tiles of up to 256 rows (tokens × heads): one page read serves all of them.
    block_t = min(triton.next_power_of_2(max(1, max_len)), max(1, 256 // num_heads))
    reqs, toks, tile_lens = _tiles(meta.query_start_loc, block_t)
    plan = _StepPlan(
        limits=limits, limits_i32=limits.to(torch.int32),
        tiles=torch.tensor([reqs, toks, tile_lens], dtype=torch.int32, device=device),
        block_table=meta.block_table.to(device=device, dtype=torch.int32).contiguous(),
        s_out=max(local_lens, default=0), block_t=block_t,
    )
    _last_plan = (weakref.ref(meta), key, plan)
    return plan


def indexer_logits_paged(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                         meta: AttentionMetadata, *, pages_per_prog: int = 16,
                         num_stages: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every query row against its request's local keys.

    q [T, H, D] (quantized here per token-head when the cache is FP8), weights [T, H] with the
    softmax and head scales folded in → (logits [T, S_out] fp32, limits [T] int64), where S_out =
    the longest local key sequence in the batch and logits[t, j] = −inf for j ≥ limits[t].
    The host-side plan is derived from `meta` once and reused while the same metadata object
    comes back (the other indexer layers of the step).
    """
    num_tokens, num_heads, head_dim = q.shape
    if num_heads < 1 or num_heads & (num_heads - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"indexer: heads ({num_heads}) and head dim ({head_dim}) must be powers "
                         f"of two, head dim ≥ 16")
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"indexer: weights must be [T, H] = [{num_tokens}, {num_heads}], "
                         f"got {tuple(weights.shape)}")
    device = q.device
    fp8 = index_cache.dtype == torch.uint8
    if fp8:
        q8, q_scale = formats.quantize_index_q(q)  # [T, H, D] e4m3, [T, H]
        q_in, w = q8.contiguous(), (weights.float() * q_scale).contiguous()
        cache = index_cache.view(torch.float8_e4m3fn)
        block_size = index_cache.shape[1] // formats.index_token_bytes(head_dim)
    else:
        q_in, w = q.contiguous(), weights.float().contiguous()
        cache = index_cache
        block_size = index_cache.shape[1]
    if block_size & (block_size - 1) or block_size < 16:
        raise ValueError(f"indexer: block size {block_size} must be a power of two >= 16")
    plan = _step_plan(meta, num_heads, device)
    logits = torch.empty(num_tokens, plan.s_out, dtype=torch.float32, device=device)
    if num_tokens == 0 or plan.s_out == 0:
        return logits, plan.limits
    per_prog = min(pages_per_prog, triton.next_power_of_2(triton.cdiv(plan.s_out, block_size)))
    grid = (plan.tiles.shape[1], triton.cdiv(plan.s_out, block_size * per_prog))
    precision = "ieee" if q_in.dtype == torch.float32 else "tf32"
    _indexer_logits_kernel[grid](
        q_in, w, cache, plan.block_table, plan.tiles[0], plan.tiles[1], plan.tiles[2],
        plan.limits_i32, logits, plan.block_table.stride(0), logits.stride(0), plan.s_out,
        H=num_heads, D=head_dim, BS=block_size, KV_FP8=fp8, BLOCK_T=plan.block_t,
        PAGES_PER_PROG=per_prog, DOT_PRECISION=precision,
        num_warps=4 if plan.block_t * num_heads <= 64 else 8, num_stages=num_stages,
    )
    return logits, plan.limits


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 meta: AttentionMetadata, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best keys this rank stores for each query → (scores [T, topk] fp32, positions [T, topk]
    int32), best first, padded with (−inf, −1).

    positions are request-local token positions. Without DCP that is the answer; under DCP it is
    the local top-k, and merging every rank's lists by score gives the global top-k exactly
    (DESIGN §6).
    """
    logits, limits = indexer_logits_paged(q, weights, index_cache, meta)
    num_tokens, s_out = logits.shape
    scores = torch.full((num_tokens, topk), float("-inf"), device=q.device)
    positions = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    k = min(topk, s_out)
    if num_tokens == 0 or k == 0:
        return scores, positions
    # torch.topk (radix select): 3x faster here than a Triton radix kernel (docs/kernels.md).
    values, local = torch.topk(logits, k, dim=1, sorted=True)  # [T, k]
    keep = torch.arange(k, device=q.device)[None, :] < limits.clamp(max=k)[:, None]  # [T, k]
    pos = layout.dcp_global_position(local, meta.dcp_size, meta.dcp_rank, meta.interleave)
    scores[:, :k] = torch.where(keep, values, float("-inf"))
    positions[:, :k] = torch.where(keep, pos, -1).to(torch.int32)
    return scores, positions
