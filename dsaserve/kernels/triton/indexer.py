"""FP8 lightning indexer: paged FP8 logits and causal top-k (prefill and decode alike).

Scores (MODEL_SPEC §2.4 step 7, the DeepGEMM fp8 formula):

    I[t, j] = k_scale[j] · Σ_h ReLU(q8[t, h] · k8[j]) · w[t, h] · q_scale[t, h]

Query rows are grouped into tiles of BLOCK_T consecutive tokens of one request, so that one key
page read from the paged cache serves BLOCK_T·H rows of the fp8 matmul:

    program (tile i, page chunk c)     tile i = (request, first token, n tokens ≤ BLOCK_T)
      Qᵀ  [D, BLOCK_T·H] fp8           loaded and quantized once
      for each page of chunk c:  K [B, D] fp8 + k_scale [B] (one block-table entry, contiguous)
        S = K·Qᵀ (fp32, keys as the MMA's M) → ReLU · w → Σ over heads → [B, BLOCK_T] logits
        and the max of every row_topk.GROUP keys (what the top-k's threshold is taken from)
      keys at or past a token's causal limit are written as −inf

When a step's [T, S] fp32 logits would pass IndexerConfig.max_logits_bytes (a 16K-token chunk
over more than 32K keys), the query rows are scored in passes of whole tiles, each over every
key (`_row_passes`): a row's top-k never depends on another row, so nothing is merged and no
pass costs more than its share of the logits. (Scoring key windows instead and merging each
window's top-k into a running one repeats a sort of 2·k candidates per row per window: at 1M
keys, 32 merges per row per layer, costlier than the window's logits.)

Top-k then runs over the logits rows: for rows longer than row_topk's candidate list, the CUDA
kernel kernels/cuda/topk_rows.cu where it builds, else row_topk.topk_rows (both: a threshold
from the group maxima, one pass, a short list); torch.topk otherwise. Keys are this rank's
local sequence
(layout.context_slots): under DCP a row's keys are the ones this rank owns, and the result is a
local top-k of (score, global position). The key writer is index_cache.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats, staging
from dsaserve.kernels.cuda import indexer_logits as cuda_logits
from dsaserve.kernels.cuda import topk as cuda_topk
from dsaserve.kernels.device import sm_count
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.triton import row_topk
from dsaserve.kernels.triton.mla_cache import pow2_ceil, to_e4m3
from dsaserve.kv import layout


# --------------------------------------------------------------------------------------------
# Logits
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_q(q_ptr, w_ptr, row0, row_ok, ROWS: tl.constexpr, D: tl.constexpr,
            KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """Query rows row0 … row0 + ROWS − 1 (0 where not row_ok [ROWS]) → (qᵀ [D, ROWS],
    w [ROWS]), quantized for an fp8 cache: one power-of-two scale per (token, head), as
    formats.quantize_index_q; it is > 0, so it moves out of the ReLU into the head weight."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (row0 + r)[:, None] * D + d[None, :], mask=row_ok[:, None],
                other=0.0)  # [ROWS, D]
    w = tl.load(w_ptr + row0 + r, mask=row_ok, other=0.0)  # [ROWS]
    if KV_FP8:
        amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
        q_scale = pow2_ceil(tl.maximum(amax, MIN_AMAX) / FP8_MAX)  # [ROWS]
        q = to_e4m3(q.to(tl.float32) / q_scale[:, None], FP8_MAX)
        w = w * q_scale
    return tl.trans(q), w


@triton.jit
def _load_page(cache_ptr, blocks, p, b, o, d, D: tl.constexpr, BS: tl.constexpr,
               KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """Keys of page b of the chunk (its block id picked out of the chunk's `blocks` [P]) →
    (k [BS, D] fp8 or `dtype`, k_scale [BS] fp32)."""
    block = tl.sum(tl.where(p == b, blocks, 0), axis=0).to(tl.int64)
    if KV_FP8:
        page = cache_ptr + block * (BS * (D + 4))
        k = tl.load(page + o[:, None] * D + d[None, :])  # [BS, D] fp8, one 8 KB run
        k_scale = tl.load((page + BS * D).to(tl.pointer_type(tl.float32)) + o)  # [BS]
    else:
        k = tl.load(cache_ptr + (block * BS + o)[:, None] * D + d[None, :]).to(dtype)
        k_scale = tl.full([BS], 1.0, tl.float32)
    return k, k_scale


@triton.jit
def _store_page(s, k_scale, w, j, g, limit, tok_ok, out_cols, gmax_cols, s_out, num_groups,
                BS: tl.constexpr, BLOCK_T: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr):
    """S [BS, BLOCK_T·H] of one page → ReLU · w, Σ heads, · k_scale → logits [BS, BLOCK_T] and
    the max of every GROUP keys, stored; −inf at and past each token's limit."""
    s = tl.maximum(s, 0.0) * w[None, :]
    logits = tl.sum(tl.reshape(s, [BS, BLOCK_T, H]), axis=2) * k_scale[:, None]
    # Keys past a token's limit (also unwritten slots of the last page: maybe NaN).
    logits = tl.where(j[:, None] < limit[None, :], logits, float("-inf"))
    tl.store(out_cols + j[:, None], logits, mask=tok_ok[None, :] & (j[:, None] < s_out))
    NG: tl.constexpr = BS // GROUP
    group_max = tl.max(tl.reshape(logits, [NG, GROUP, BLOCK_T]), axis=1)
    tl.store(gmax_cols + g[:, None], group_max, mask=tok_ok[None, :] & (g[:, None] < num_groups))


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["stride_bt", "s_out"])
def _indexer_logits_kernel(
    q_ptr,  # [T·H, D] as given (bf16, fp16 or fp32); quantized here for an fp8 cache
    w_ptr,  # [T·H] fp32 head weights (softmax and head scales folded in)
    cache_ptr,  # fp8 pages (flat) or float rows [num_slots, D]
    block_table_ptr,  # [R, max_blocks] int32, local block b of a request → physical block
    tile_req_ptr, tile_tok_ptr, tile_len_ptr,  # [num_tiles] int32
    limit_ptr,  # [T] int32: keys j < limit[t] are visible to token t
    out_ptr,  # [T, S_out] fp32
    gmax_ptr,  # [T, ceil(S_out / GROUP)] fp32: max over each GROUP keys
    stride_bt, stride_out, stride_gmax, s_out,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, PAGES_PER_PROG: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile).to(tl.int64)
    tok0 = tl.load(tile_tok_ptr + tile).to(tl.int64)
    ntok = tl.load(tile_len_ptr + tile)
    N: tl.constexpr = BLOCK_T * H  # query rows of the tile: row n = token n // H, head n % H
    tt = tl.arange(0, BLOCK_T)
    tok_ok = tt < ntok
    limit = tl.load(limit_ptr + tok0 + tt, mask=tok_ok, other=0)  # [BLOCK_T]
    max_limit = tl.max(limit, axis=0)
    d = tl.arange(0, D)
    o = tl.arange(0, BS)  # key offsets inside a page
    n = tl.arange(0, N)
    q_t, w = _load_q(q_ptr, w_ptr, tok0 * H, n // H < ntok, N, D, KV_FP8, FP8_MAX,
                     MIN_AMAX)  # [D, N], [N]
    dtype = q_ptr.dtype.element_ty
    out_cols = out_ptr + (tok0 + tt)[None, :] * stride_out  # [1, BLOCK_T]
    gmax_cols = gmax_ptr + (tok0 + tt)[None, :] * stride_gmax  # [1, BLOCK_T]
    NG: tl.constexpr = BS // GROUP
    num_groups = tl.cdiv(s_out, GROUP)

    # Keys are the MMA's M dimension and (token, head) its N: the head sum is then a reduction
    # along N, inside each thread and its quad (no trip through shared memory).
    # Pages [first, first + num_live) hold keys some token of the tile can see; the rest of the
    # chunk is −inf for every token. Two loops keep the loads out of branches (pipelinable).
    first = chunk * PAGES_PER_PROG
    num_live = tl.minimum(tl.maximum(tl.cdiv(max_limit, BS) - first, 0), PAGES_PER_PROG)
    # The chunk's block ids, loaded once: a block-table load inside the loop would make the
    # page loads indirect, which Triton's pipeliner prefetches only half as far ahead.
    p = tl.arange(0, PAGES_PER_PROG)
    blocks = tl.load(block_table_ptr + req * stride_bt + first + p, mask=p < num_live, other=0)
    for b in range(0, num_live):
        k, k_scale = _load_page(cache_ptr, blocks, p, b, o, d, D, BS, KV_FP8, dtype)
        s = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # [BS, N] fp32
        _store_page(s, k_scale, w, (first + b) * BS + o, (first + b) * NG + tl.arange(0, NG),
                    limit, tok_ok, out_cols, gmax_cols, s_out, num_groups, BS, BLOCK_T, H, GROUP)
    for b in range(num_live, PAGES_PER_PROG):
        j = (first + b) * BS + o
        g = (first + b) * NG + tl.arange(0, NG)
        tl.store(out_cols + j[:, None], tl.full([BS, BLOCK_T], float("-inf"), tl.float32),
                 mask=tok_ok[None, :] & (j[:, None] < s_out))
        tl.store(gmax_cols + g[:, None], tl.full([NG, BLOCK_T], float("-inf"), tl.float32),
                 mask=tok_ok[None, :] & (g[:, None] < num_groups))


def _tiles(query_start_loc: tuple[int, ...], block_t: int) -> np.ndarray:
    """Cut each request's tokens into tiles of ≤ block_t consecutive tokens → [3, num_tiles]
    int64 rows (request, first token, length):

        qsl 0 3 4 6, block_t 2  →  (0,0,2) (0,2,1) (1,3,1) (2,4,2)

    In numpy: a 16K-token prompt has thousands of tiles at GLM-5.3's 8 tokens per tile, and a
    loop over them cost ~2 ms of host time per step (benchmarks/prefill_prep.py)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)  # [R + 1]
    num = np.diff(qsl)  # [R] tokens of each request
    per = -(-num // block_t)  # [R] tiles of each request
    reqs = np.repeat(np.arange(len(num), dtype=np.int64), per)  # [n]
    first_tile = np.cumsum(per) - per  # [R] each request's first tile
    toks = qsl[reqs] + (np.arange(len(reqs), dtype=np.int64) - first_tile[reqs]) * block_t
    return np.stack((reqs, toks, np.minimum(block_t, qsl[reqs + 1] - toks)))


@dataclass(frozen=True)
class _StepPlan:
    """What the logits kernel needs from one step's host-side metadata, identical for every
    indexer layer of the step: built once (host work and small copies) and kept on the metadata
    (meta.derived), then reused by the other layers. Nothing in it depends on device values:
    a CUDA graph captured over one metadata object stays valid when its positions change
    (_limits reads them at every call)."""

    local_lens: torch.Tensor  # [R + 1] int64: 0, then each request's local keys
    tiles: torch.Tensor  # [3, num_tiles] int32: request, first token, length
    block_table: torch.Tensor  # [R, max_blocks] int32 on the device
    s_out: int  # longest local key sequence of the batch
    block_t: int  # tokens per tile
    cuda_shape: cuda_logits.Shape | None  # the CUDA logits kernel's block, if it runs
    num_sms: int  # multiprocessors of the device (the CUDA kernel's grid sizing), 0 on the CPU
    row_passes: tuple[_RowPass, ...]  # () : every row in one pass (see _row_passes)


@dataclass(frozen=True)
class _RowPass:
    """Query rows [first, end) of a step, whole tiles of it, scored in one logits launch."""

    first: int
    end: int
    tiles: torch.Tensor  # [3, n] int32: the pass's tiles, first token counted from `first`


def _row_passes(toks: Sequence[int], lens: Sequence[int], max_rows: int
                ) -> list[tuple[int, int, int, int]]:
    """Group consecutive tiles (first token, length; they cover the rows in order) into passes
    of at most max_rows rows (at least one tile each) → (first row, end row, first tile, end
    tile) per pass:

        toks 0 4 8 9, lens 4 4 1 3, max_rows 8  →  (0, 8, 0, 2) (8, 12, 2, 4)

    A pass from tile i takes the tiles whose rows end within toks[i] + max_rows (the ends
    ascend): one search per pass, not a step per tile."""
    toks = np.asarray(toks, dtype=np.int64)
    ends = toks + np.asarray(lens, dtype=np.int64)  # [n] ascending
    passes: list[tuple[int, int, int, int]] = []
    first_tile = 0
    while first_tile < len(toks):
        end_tile = max(first_tile + 1, int(np.searchsorted(
            ends, toks[first_tile] + max_rows, side="right")))
        passes.append((int(toks[first_tile]), int(ends[end_tile - 1]), first_tile, end_tile))
        first_tile = end_tile
    return passes


def _max_query_len(meta: AttentionMetadata) -> int:
    return max((b - a for a, b in map(meta.query_range, range(meta.num_reqs))), default=1)


def _step_plan(meta: AttentionMetadata, q: torch.Tensor, index_cache: torch.Tensor,
               config: IndexerConfig) -> _StepPlan:
    num_heads, device = q.shape[1], q.device
    key = ("indexer", num_heads, str(device), q.dtype, index_cache.dtype, config)
    plan = meta.derived.get(key)
    if plan is not None:
        return plan
    # Which logits kernel runs is decided here, once per step, and so are its tiles.
    cuda_shape = _cuda_shape(q, index_cache, config, meta)
    rows_per_tile = cuda_logits.block_rows(cuda_shape) if cuda_shape else config.rows_per_tile
    local_lens = [layout.dcp_local_seq_len(s, meta.dcp_size, meta.dcp_rank, meta.interleave)
                  for s in meta.seq_lens]
    max_len = _max_query_len(meta)
    # Tiles of up to rows_per_tile (tokens × heads): one page read serves all of them.
    block_t = min(triton.next_power_of_2(max(1, max_len)), max(1, rows_per_tile // num_heads))
    tiles = _tiles(meta.query_start_loc, block_t)  # [3, num_tiles]
    s_out = max(local_lens, default=0)
    # Full-width rows per pass within the logits budget (logits_split="keys": key windows,
    # indexer_topk).
    max_rows = config.max_logits_bytes // (4 * max(s_out, 1))
    passes = [] if config.logits_split == "keys" or max_rows >= meta.num_tokens else \
        _row_passes(tiles[1], tiles[2], max_rows)
    # Every pass's tiles [3, n], rebased to its first row, back to back, each a contiguous
    # view of one tensor; with the lengths and the step's tiles, one host → device copy that
    # does not wait for the device (kernels/staging.py; a plan is never built under a CUDA
    # graph's capture: its warm-up runs build it first).
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # what a blocking copy raised here before: the capture fails, decode runs eager
        raise RuntimeError("indexer: a step plan built under a CUDA graph's capture")
    rebased = [(tiles[:, a:b] - np.array([[0], [first], [0]])).reshape(-1)
               for first, _, a, b in passes]
    local_lens_d, tiles_d, *flat_d = staging.upload(
        [torch.tensor([0] + local_lens, dtype=torch.int64),
         torch.from_numpy(tiles.astype(np.int32)),
         *([torch.from_numpy(np.concatenate(rebased).astype(np.int32))] if passes else [])],
        device)
    row_passes = [_RowPass(first, end, flat_d[0][3 * a : 3 * b].view(3, b - a))
                  for first, end, a, b in passes]
    plan = _StepPlan(
        local_lens=local_lens_d,
        tiles=tiles_d,
        block_table=meta.block_table.to(device=device, dtype=torch.int32).contiguous(),
        s_out=s_out, block_t=block_t, cuda_shape=cuda_shape,
        num_sms=sm_count(device, 0),
        row_passes=tuple(row_passes),
    )
    meta.derived[key] = plan
    return plan


def _limits(meta: AttentionMetadata, plan: _StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] int64, the same as int32): the local keys among positions [0, pos] of each query
    (its visible keys), from the device positions; at most its request's local length. The
    same for every indexer layer of a step: kept on the step's metadata with the positions
    tensor they came from (rows moved on the device are a new tensor and new metadata), and
    reused by its other indexer layers (a GLM-5.3 step has 21). Computed at every call from
    bounded metadata (engine/decode_graph.py: one object whose positions are rewritten in
    place from step to step) and under a CUDA graph's capture (the graph must compute them
    itself, not read its eager warm-up's)."""
    fresh = meta.bounded_seq_lens or (plan.local_lens.is_cuda
                                      and torch.cuda.is_current_stream_capturing())
    key = ("indexer_limits", id(plan))
    kept = None if fresh else meta.derived.get(key)
    if kept is not None and kept[0] is meta.positions:
        return kept[1]
    limits = _visible_keys(meta, plan)
    found = (limits, limits.to(torch.int32))
    if not fresh:
        meta.derived[key] = (meta.positions, found)
    return found


def _visible_keys(meta: AttentionMetadata, plan: _StepPlan) -> torch.Tensor:
    """_limits' [T] int64 values."""
    device = plan.local_lens.device
    # (no-op conversions skipped: each is a host op of every indexer layer)
    pos, req = meta.positions, meta.req_indices
    pos = pos if pos.device == device and pos.dtype == torch.int64 else pos.to(device,
                                                                               torch.int64)
    req = req if req.device == device else req.to(device)
    limits = layout.dcp_local_seq_len(pos + 1, meta.dcp_size, meta.dcp_rank,
                                      meta.interleave)  # [T]
    return torch.minimum(limits, plan.local_lens[req + 1])


@dataclass(frozen=True)
class IndexerConfig:
    """Launch shape of the logits kernel and size of the top-k candidate list.

    Measured on an H200 (docs/kernels.md, `benchmarks/kernels.py --only indexer --sweep`, 16
    configurations per kernel): 256 rows per tile, 3 stages and 4 warps are best for prefill
    (T = 4096 × 128K keys: Triton 11.1 ms at 128 pages per program, Gluon 13.1) and the Gluon
    kernel for decode (b = 64 × 64K, s_q = 1: 157 µs at 64 pages, Triton 177 at 16). Where the
    CUDA kernel builds it takes prefill (9.9 ms at 64 heads, 5.6 at 32) and MTP decode of 4+
    tokens per request (s_q = 4: 408 µs against Gluon's 477).
    """

    rows_per_tile: int = 256  # tokens × heads per tile: the MMA's N, ≤ 256
    # Key pages per program; None: 128 for ≥ 512 tiles, else 16 (Triton) or 64 (Gluon).
    pages_per_prog: int | None = None
    # The Gluon kernel (indexer_gluon.py, sm_90, FP8 cache, D = 128, pages of 64 keys) instead
    # of the Triton one; None: where it measured faster, tiles of ≤ 64 rows (decode, one token).
    gluon: bool | None = None
    # The Gluon kernel's warpgroups take their pages two at a time (both MMAs, then both
    # epilogues: two independent instruction streams per warp), for tiles of one token (decode,
    # s_q = 1). Built for sm_90 without spills (128 registers); measured on an H200 no faster
    # (159.0 against 159.8 µs, docs/kernels.md), so off.
    gluon_pairs: bool = False
    # The CUDA kernel (kernels/cuda/indexer_logits.cu: wgmma issued directly, sm_90, FP8 cache,
    # bf16 q, D = 128, pages of 64 keys, 32 or 64 heads) instead of both; None: where it builds,
    # for steps whose longest query fills a block's consumers (prefill, MTP decode).
    cuda_logits: bool | None = None
    # Its block shape (consumer warpgroups, pages in flight per consumer, query rows per
    # consumer[, linear]: indexer_logits.Shape), one of indexer_logits.SHAPES; None: the
    # measured best for the head count (indexer_logits.PREFERRED).
    cuda_shape: tuple[int, int, int] | tuple[int, int, int, bool] | None = None
    num_stages: int = 3
    num_warps: int = 4  # 8 (two warpgroups split N) measured 30% slower
    list_len: int | None = None  # row_topk's C; None: row_topk.list_size(k)
    # Top-k of long rows: "cuda" (kernels/cuda/topk_rows.cu, one launch, built at engine start
    # on a GPU or on first use), "triton" (row_topk, three launches), None: cuda where it
    # builds (needs nvcc), else triton.
    topk_kernel: str | None = None
    max_logits_bytes: int = 2**31  # logits workspace bound; past it, several passes
    # How a step past max_logits_bytes is split: "rows" (passes of query rows over every key;
    # no merging) or "keys" (key windows, each window's top-k merged into a running one: the
    # way before row passes, kept for comparison; docs/long_prefill.md).
    logits_split: str = "rows"

    def __post_init__(self) -> None:
        if self.cuda_shape is not None and len(self.cuda_shape) not in (3, 4):
            raise ValueError(f"indexer: cuda_shape must be (consumers, depth, rows[, linear]), "
                             f"got {self.cuda_shape!r}")
        if self.logits_split not in ("rows", "keys"):
            raise ValueError(f"indexer: logits_split must be 'rows' or 'keys', "
                             f"got {self.logits_split!r}")
        if self.topk_kernel not in (None, "cuda", "triton"):
            raise ValueError(f"indexer: topk_kernel must be 'cuda', 'triton' or None, "
                             f"got {self.topk_kernel!r}")


def _check_inputs(q: torch.Tensor, weights: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"indexer: expected q [T, H, D], got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if num_heads < 1 or num_heads & (num_heads - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"indexer: heads ({num_heads}) and head dim ({head_dim}) must be powers "
                         f"of two, head dim ≥ 16")
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"indexer: weights must be [T, H] = [{num_tokens}, {num_heads}], "
                         f"got {tuple(weights.shape)}")


def _use_gluon(q: torch.Tensor, index_cache: torch.Tensor, config: IndexerConfig,
               tile_rows: int, block_size: int) -> bool:
    """Whether config picks the Gluon logits kernel for this step (see IndexerConfig.gluon)."""
    if config.gluon is False or not q.is_cuda:
        return False
    from dsaserve.kernels.triton import indexer_gluon  # Hopper only: imported on demand

    supported = indexer_gluon.gluon_logits_supported(q, index_cache, q.shape[1], q.shape[2],
                                                     block_size)
    if config.gluon and not supported:
        raise ValueError(f"indexer: the Gluon kernel does not cover q {tuple(q.shape)} "
                         f"{q.dtype}, cache {index_cache.dtype}, block size {block_size}")
    # Measured on an H200 (docs/kernels.md): decode 157 vs 177 µs; prefill 13.1 vs 11.1 ms.
    return supported and (config.gluon or tile_rows <= 64)


def _cuda_shape(q: torch.Tensor, index_cache: torch.Tensor, config: IndexerConfig,
                meta: AttentionMetadata) -> cuda_logits.Shape | None:
    """The CUDA logits kernel's block shape where config picks it for this step (see
    IndexerConfig.cuda_logits), else None."""
    if config.cuda_logits is False or not q.is_cuda:
        return None
    num_heads = q.shape[1]
    supported = cuda_logits.supported(q, index_cache, meta.block_size)
    shapes = [cuda_logits.Shape(*config.cuda_shape)] if config.cuda_shape else \
        cuda_logits.PREFERRED.get(num_heads, [])
    if config.cuda_logits and (not supported or not shapes
                               or not set(shapes) <= set(cuda_logits.SHAPES)):
        raise ValueError(f"indexer: the CUDA logits kernel does not cover q {tuple(q.shape)} "
                         f"{q.dtype}, cache {index_cache.dtype}, block size {meta.block_size}, "
                         f"shape {config.cuda_shape} (one of cuda/indexer_logits.SHAPES), or "
                         f"did not build")
    if not supported:
        return None
    if config.cuda_logits:
        return shapes[0]
    # Automatic: the first shape whose consumers the longest query fills.
    rows = _max_query_len(meta) * num_heads
    return next((sh for sh in shapes if rows >= cuda_logits.block_rows(sh)), None)


def _aligned_rows(num_rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """Uninitialized fp32 [num_rows, cols] whose rows start 64 bytes apart (a view of a buffer
    padded to a multiple of 16 columns): the CUDA top-k reads logits and group maxima 16 bytes
    at a time only where rows are aligned, and a context's key count rarely is a multiple of
    32. Every kernel here takes the row stride, which Triton specializes on when it is a
    multiple of 16: always, so a growing context never compiles a kernel again."""
    return torch.empty(num_rows, -(-cols // 16) * 16, dtype=torch.float32,
                       device=device)[:, :cols]


def _logits(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
            meta: AttentionMetadata, config: IndexerConfig,
            window: tuple[int, int] | None = None, rows: _RowPass | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits over the local keys [start, start + length) of `window` (default: all):
    (logits [T, length], group maxima [T, ceil(length / row_topk.GROUP)], limits [T] int64),
    columns and limits counted from `start` (a multiple of the block size). With `rows`, only
    the pass's query rows: q and weights are the step's, the results [end − first, …]."""
    _check_inputs(q, weights)
    plan_q = q
    if rows is not None:
        q, weights = q[rows.first : rows.end], weights[rows.first : rows.end]
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    fp8 = index_cache.dtype == torch.uint8
    if fp8:
        cache = index_cache.view(torch.float8_e4m3fn)
        block_size = index_cache.shape[1] // formats.index_token_bytes(head_dim)
    else:
        cache = index_cache
        block_size = index_cache.shape[1]
    if block_size & (block_size - 1) or block_size < max(16, row_topk.GROUP):
        raise ValueError(f"indexer: block size {block_size} must be a power of two >= 16")
    if not index_cache.is_contiguous():
        raise ValueError("indexer: index_cache must be contiguous (pages are addressed flat)")
    plan = _step_plan(meta, plan_q, index_cache, config)
    start, length = window or (0, plan.s_out)
    if start % block_size or start < 0 or length < 0 or start + length > plan.s_out:
        raise ValueError(f"indexer: window ({start}, {length}) must start on a block boundary "
                         f"inside the {plan.s_out} local keys")
    tiles, (limits, limits_i32) = plan.tiles, _limits(meta, plan)
    if rows is not None:  # the kernel sees the pass's rows as a step of their own
        tiles = rows.tiles
        limits = limits[rows.first : rows.end]
        limits_i32 = limits.to(torch.int32)  # (its own allocation: aligned for the kernels)
    if window is None:
        block_table = plan.block_table
    else:  # the kernel sees the window as a sequence of its own
        limits = (limits - start).clamp(0, length)
        limits_i32 = limits.to(torch.int32)
        block_table = plan.block_table[:, start // block_size:]
    logits = _aligned_rows(num_tokens, length, device)
    group_max = _aligned_rows(num_tokens, triton.cdiv(length, row_topk.GROUP), device)
    if num_tokens == 0 or length == 0:
        return logits, group_max, limits
    num_pages = triton.cdiv(length, block_size)
    num_tiles = tiles.shape[1]
    cuda_shape = plan.cuda_shape
    gluon = not cuda_shape and _use_gluon(q, index_cache, config, num_heads * plan.block_t,
                                          block_size)
    if cuda_shape:
        auto = cuda_logits.pages_per_block(num_tiles, num_pages, plan.num_sms)
    else:
        auto = 128 if num_tiles >= 512 else 64 if gluon else 16
    per_prog = min(config.pages_per_prog or auto, triton.next_power_of_2(num_pages))
    # The kernels index rows as (token · H + head) · D and weights as token · H + head.
    q_in = q.contiguous()
    w_in = (weights if weights.dtype == torch.float32 else weights.float()).contiguous()
    if cuda_shape:
        cuda_logits.launch(q_in, w_in, index_cache, block_table, tiles, limits_i32, logits,
                           group_max, shape=cuda_shape, pages_per_prog=per_prog)
        return logits, group_max, limits
    if gluon:
        from dsaserve.kernels.triton import indexer_gluon

        indexer_gluon.launch_logits_gluon(
            q_in.view(-1, head_dim), w_in.view(-1), cache, block_table, tiles, limits_i32,
            logits, group_max, num_heads=num_heads, head_dim=head_dim, block_size=block_size,
            block_t=plan.block_t, pages_per_prog=per_prog, pairs=config.gluon_pairs)
        return logits, group_max, limits
    grid = (num_tiles, triton.cdiv(length, block_size * per_prog))
    _indexer_logits_kernel[grid](
        q_in, w_in, cache, block_table, *tiles.unbind(0), limits_i32, logits,
        group_max,
        block_table.stride(0), logits.stride(0), group_max.stride(0), length,
        H=num_heads, D=head_dim, BS=block_size, KV_FP8=fp8, BLOCK_T=plan.block_t,
        PAGES_PER_PROG=per_prog, GROUP=row_topk.GROUP,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_MAX=formats.FP8_MAX, MIN_AMAX=formats.INDEX_MIN_AMAX,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return logits, group_max, limits


def indexer_logits_paged(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                         meta: AttentionMetadata, config: IndexerConfig = IndexerConfig(),
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every query row against its request's local keys.

    q [T, H, D] (quantized in the kernel per token-head when the cache is FP8), weights [T, H]
    with the softmax and head scales folded in → (logits [T, S_out] fp32, limits [T] int64),
    where S_out = the longest local key sequence in the batch and logits[t, j] = −inf for
    j ≥ limits[t]. The host-side plan is derived from `meta` once and reused while the same
    metadata object comes back (the other indexer layers of the step).
    """
    logits, _, limits = _logits(q, weights, index_cache, meta, config)
    return logits, limits


def _window_len(num_tokens: int, s_out: int, block_size: int, config: IndexerConfig) -> int:
    """Keys per pass so that the logits take at most config.max_logits_bytes (whole blocks)."""
    keys = config.max_logits_bytes // (4 * max(num_tokens, 1))
    return max(keys // block_size * block_size, block_size) if keys < s_out else s_out


def _topk_window(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 meta: AttentionMetadata, k: int, config: IndexerConfig,
                 window: tuple[int, int] | None,
                 index_dtype: torch.dtype = torch.int64, rows: _RowPass | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of one key window (of one row pass: rows) → (scores [T, k], local key indices
    [T, k] from the start of the window, −1 past the row's visible keys); chosen keys first."""
    return _select(_logits(q, weights, index_cache, meta, config, window, rows), k, config,
                   index_dtype)


def _select(scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: int,
            config: IndexerConfig, index_dtype: torch.dtype,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, L], group maxima, limits [T]) → the top-k (scores [T, k], local key indices
    [T, k], −1 past the row's visible keys); chosen keys first."""
    logits, group_max, limits = scored
    length = logits.shape[1]
    kk = min(k, length)
    if length > (config.list_len or row_topk.list_size(kk)):
        # Already (−inf, −1) past min(k, limit) chosen keys: no masking ops to add.
        if _use_cuda_topk(config, kk, logits.is_cuda):
            values, local = cuda_topk.topk_rows(logits, group_max, limits, kk,
                                                group=row_topk.GROUP, index_dtype=index_dtype)
        else:
            values, local = row_topk.topk_rows(logits, group_max, limits, kk,
                                               list_len=config.list_len, index_dtype=index_dtype)
        return _in_key_order(values, local, length)
    values, local = torch.topk(logits, kk, dim=1, sorted=True)  # [T, kk]
    keep = torch.arange(kk, device=logits.device)[None, :] < limits.clamp(max=kk)[:, None]
    values, local = torch.where(keep, values, float("-inf")), torch.where(keep, local, -1)
    if kk < k:
        values = torch.nn.functional.pad(values, (0, k - kk), value=float("-inf"))
        local = torch.nn.functional.pad(local, (0, k - kk), value=-1)
    return values, local.to(index_dtype)


def _in_key_order(values: torch.Tensor, local: torch.Tensor, keys: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The list kernels' top-k [T, k] with the chosen keys in ascending key order, padding
    (−1) last. They write a row's keys in the order their atomics filled the list, which
    changes from run to run, and sparse MLA sums over the keys in the order given: unsorted,
    the same step rounded differently from run to run (on the GPU: greedy tokens of one prompt
    changed between runs, docs/hisparse.md). The key order is one launch (row_topk.in_key_order:
    a 32-bit sort per row where keys, the rows' length, allows it, else a 64-bit one);
    torch.topk's order (by score) cost 5x the top-k itself at b = 64 and 2.4x on a 16K-row
    chunk (H100, tests/gpu/test_topk_order_gpu.py)."""
    return row_topk.in_key_order(values, local, keys)  # one launch


def _order_key(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [T, n] fp32, index [T, n] (−1: none) → [T, n] int64 keys, distinct and ordered
    as (score, then the smaller index) are: the score's order-preserving bits, then the
    inverted index."""
    bits = values.contiguous().view(torch.int32).long()
    score = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # same order as the floats
    return (score << 32) | (0x7FFFFFFF - index.long())


def _use_cuda_topk(config: IndexerConfig, k: int, on_cuda: bool = True) -> bool:
    """Whether config picks the CUDA top-k for logits on the GPU (on_cuda) or not (see
    IndexerConfig.topk_kernel); builds it once."""
    if config.topk_kernel == "triton" or k > cuda_topk.MAX_K:
        return False
    reason = cuda_topk.unavailable_reason() if on_cuda else "the logits are not on a GPU"
    if config.topk_kernel == "cuda" and reason is not None:
        raise RuntimeError(f"indexer: topk_kernel='cuda' is unavailable: {reason}")
    return reason is None


def _merge_best(values: torch.Tensor, index: torch.Tensor, k: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [T, n] fp32, index [T, n] int64 (−1: none) → the best k (best first), equal scores
    by smaller index, as row_topk does: one int64 key per entry (the score's order-preserving
    bits, then the inverted index), so ties cannot go different ways from run to run."""
    pick = torch.topk(_order_key(values, index), k, dim=1, sorted=True).indices  # [T, k]
    return values.gather(1, pick), index.gather(1, pick)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 meta: AttentionMetadata, topk: int, config: IndexerConfig = IndexerConfig(),
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Best keys this rank stores for each query → (scores [T, topk] fp32, positions [T, topk]
    int32): the chosen keys first (best first from torch.topk and the key-window merge, in key
    order from the list kernels), then (−inf, −1) padding; the same order from run to run.

    positions are request-local token positions. Without DCP that is the answer; under DCP it is
    the local top-k, and merging every rank's lists by score gives the global top-k exactly
    (DESIGN §6). Batches whose rows are longer than row_topk's candidate list go through
    row_topk.topk_rows (a threshold from the group maxima, one pass, a short list); others
    through torch.topk. When T × S_out fp32 logits would pass config.max_logits_bytes (a 1M-key
    context with T = 4096 would need 16 GiB at once), the rows are scored in passes of whole
    tiles over every key (the plan's row_passes), or with logits_split="keys" the keys in
    windows, each window's top-k merged into the running one; either way the logits never take
    more than that.
    """
    _check_inputs(q, weights)
    num_tokens = q.shape[0]
    plan = _step_plan(meta, q, index_cache, config)
    if num_tokens == 0 or plan.s_out == 0 or topk == 0:
        return (torch.full((num_tokens, topk), float("-inf"), device=q.device),
                torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device))
    block_size = meta.block_size
    index_dtype = torch.int32 if meta.dcp_size == 1 else torch.int64
    if plan.row_passes:
        # Rows in passes over every key (the plan's, shared by the step's indexer layers).
        values = torch.empty(num_tokens, topk, dtype=torch.float32, device=q.device)
        local = torch.empty(num_tokens, topk, dtype=index_dtype, device=q.device)
        # (each pass's top-k on a side stream overlapping the next pass's logits measured no
        # faster: docs/long_prefill.md)
        for rows in plan.row_passes:
            logits = _logits(q, weights, index_cache, meta, config, None, rows)
            v, i = _select(logits, topk, config, index_dtype)
            values[rows.first : rows.end], local[rows.first : rows.end] = v, i
        if meta.dcp_size == 1:
            return values, local
        return _global_positions(values, local, meta)
    step = _window_len(num_tokens, plan.s_out, block_size, config)
    if step >= plan.s_out and meta.dcp_size == 1:
        # Local positions are the answer, with (−inf, −1) padding already in place: a decode
        # step under a CUDA graph runs no elementwise kernels after the top-k's own.
        return _topk_window(q, weights, index_cache, meta, topk, config, None, torch.int32)
    if step >= plan.s_out:
        values, local = _topk_window(q, weights, index_cache, meta, topk, config, None)
    else:
        values = local = None
        for start in range(0, plan.s_out, step):
            length = min(step, plan.s_out - start)
            v, i = _topk_window(q, weights, index_cache, meta, topk, config, (start, length))
            i = torch.where(i >= 0, i + start, -1)
            if values is None:
                values, local = v, i
                continue
            values, local = _merge_best(torch.cat([values, v], 1), torch.cat([local, i], 1),
                                        topk)
    return _global_positions(values, local, meta)


def _global_positions(values: torch.Tensor, local: torch.Tensor, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local key indices [T, k] (−1: none) → request-local token positions, int32."""
    found = local >= 0  # values are already −inf where local is −1
    pos = layout.dcp_global_position(local.clamp_min(0), meta.dcp_size, meta.dcp_rank,
                                     meta.interleave)
    return values, torch.where(found, pos, -1).to(torch.int32)
