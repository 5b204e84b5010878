"""A bf16 workspace of the fp8_ds_mla rows a prefill chunk reads, so that its sparse MLA runs on
bf16 rows (the ping-pong kernel) instead of dequantizing every selected row on the fly.

A request's top-k rows are positions of its own context. For a long prefill chunk every
context row is selected many times over (T = 4096 rows × 2048 indices over a 128K-token
context: 64 times each), and the fp8 kernel dequantizes it again each time; dequantizing the
request's pages once into a workspace laid out in position order costs one read of its fp8
rows and one write of bf16 rows, and the indices then need no block table:

    workspace row of (request r, position p) = base[r] + p     base[r] = Σ_{r' before r} pages·B

Under decode context parallelism a rank's pages hold its local sequence (kv/layout.py), so the
workspace holds that: row base[r] + local(p) for the positions p the rank owns, −1 for the
others (the LSE merge over the group adds them), as layout.logical_to_slots masks them.

Decode rows (1–4 per request) read each row about once, so their requests keep the fp8 path:
`plan_segments` splits a step's requests, in order, into runs that take one path or the other
(docs/kernels.md has the measured break-even). The dequantized values are exact (e4m3 times a
power-of-two scale fits bf16), so either path reads the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats
from dsaserve.kv import layout


@dataclass(frozen=True)
class Segment:
    """Consecutive requests of a step whose rows take one path."""

    rows: tuple[int, int]  # [first, end) of the step's query rows
    requests: tuple[int, ...]  # the requests, in order (each with ≥ 1 row)
    workspace: bool  # True: read from a bf16 workspace of their pages; False: from the cache


def plan_segments(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                  local_lens: Sequence[int], block_size: int, topk: int, min_reads: float,
                  max_rows: int) -> list[Segment]:
    """Per request with rows: the workspace when its rows read each of its context rows at
    least `min_reads` times on average (rows × min(topk, context) ≥ min_reads × context) and
    the pages of its local_lens rows (this rank's; seq_lens without DCP) fit in what is left
    of `max_rows` workspace rows; then runs of equal choices.

        qsl (0, 1, 2, 4098), seq_lens (900, 5000, 131072), B 64, topk 2048, min_reads 8:
        request 0 and 1 one row each → cache; request 2 4096 rows over 131072 → workspace
        → [Segment((0, 2), (0, 1), False), Segment((2, 4098), (2,), True)]
    """
    segments: list[Segment] = []
    rows_left = max_rows
    for r, (seq_len, local_len) in enumerate(zip(seq_lens, local_lens, strict=True)):
        first, end = query_start_loc[r], query_start_loc[r + 1]
        if end == first:
            continue
        ws_rows = -(-local_len // block_size) * block_size
        use = (end - first) * min(topk, seq_len) >= min_reads * seq_len and ws_rows <= rows_left
        rows_left -= ws_rows if use else 0
        last = segments[-1] if segments else None
        if last is not None and last.workspace == use and last.rows[1] == first:
            segments[-1] = Segment((last.rows[0], end), last.requests + (r,), use)
        else:
            segments.append(Segment((first, end), (r,), use))
    return segments


DEQUANT_ROWS, DEQUANT_WARPS = 32, 4  # workspace rows per program, and its warps


# num_rows changes from call to call: not specialized on (a new value divisible by 16 would
# compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["num_rows"])
def _dequantize_pages_kernel(
    cache_ptr,  # fp8 view of the uint8 cache, flat [num_pages · B · ROW_BYTES]
    pages_ptr,  # [P] int32: the cache page of each workspace page
    ws_ptr,  # [P · B, L + R] bf16
    num_rows,  # P · B
    L: tl.constexpr, R: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
    ROW_BYTES: tl.constexpr, TILE: tl.constexpr,
):
    """ROWS workspace rows (any page size, a page of one row included), a scale tile at a time
    (no reshapes: each [ROWS, TILE] tile is loaded, scaled and stored in one register layout),
    then the bf16 RoPE part."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] workspace rows
    ok = rows < num_rows
    page = tl.load(pages_ptr + rows // B, mask=ok, other=0).to(tl.int64)
    src = cache_ptr + (page * B + rows % B) * ROW_BYTES  # [ROWS] row starts in the cache
    dst = ws_ptr + rows[:, None] * (L + R)  # [ROWS, 1]
    scale_ptr = (src + L).to(tl.pointer_type(tl.float32))  # [ROWS]
    cols = tl.arange(0, TILE)[None, :]
    for t in tl.static_range(L // TILE):
        k8 = tl.load(src[:, None] + t * TILE + cols, mask=ok[:, None])  # [ROWS, TILE] e4m3
        scale = tl.load(scale_ptr + t, mask=ok)  # [ROWS]
        tl.store(dst + t * TILE + cols, (k8.to(tl.float32) * scale[:, None]).to(tl.bfloat16),
                 mask=ok[:, None])
    pe_ptr = (src + L + 4 * (L // TILE)).to(tl.pointer_type(tl.bfloat16))  # [ROWS]
    pe = tl.arange(0, R)[None, :]
    tl.store(dst + L + pe, tl.load(pe_ptr[:, None] + pe, mask=ok[:, None]), mask=ok[:, None])


def dequantize_pages(cache: torch.Tensor, pages: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """cache [num_pages, B, 656] uint8 (fp8_ds_mla), pages [P] int (cache pages, any order) →
    bf16 rows [P · B, L + R], page i's rows at i·B … i·B + B − 1. Rows never written in the
    cache come out as whatever their bytes decode to (the caller never selects them)."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or not cache.is_contiguous():
        raise ValueError(f"dequantize_pages: expected a contiguous uint8 cache [pages, B, row "
                         f"bytes], got {cache.dtype} {tuple(cache.shape)}")
    block_size, row_bytes = cache.shape[1], cache.shape[2]
    rope_bytes = row_bytes - kv_lora_rank - 4 * (kv_lora_rank // formats.MLA_TILE)
    rope_dim = rope_bytes // 2
    if kv_lora_rank <= 0 or kv_lora_rank % formats.MLA_TILE or rope_bytes <= 0 or rope_bytes % 2:
        raise ValueError(f"dequantize_pages: {row_bytes}-byte rows do not fit kv_lora_rank "
                         f"{kv_lora_rank}")
    ws = torch.empty(pages.numel() * block_size, kv_lora_rank + rope_dim, dtype=torch.bfloat16,
                     device=cache.device)
    if pages.numel() == 0:
        return ws
    _dequantize_pages_kernel[(triton.cdiv(ws.shape[0], DEQUANT_ROWS),)](
        cache.view(torch.float8_e4m3fn), pages.to(torch.int32), ws, ws.shape[0],
        L=kv_lora_rank, R=rope_dim, B=block_size, ROWS=DEQUANT_ROWS, ROW_BYTES=row_bytes,
        TILE=formats.MLA_TILE, num_warps=DEQUANT_WARPS,
    )
    return ws


def build_workspace(cache: torch.Tensor, block_table: torch.Tensor, segment: Segment,
                    local_lens: Sequence[int], kv_lora_rank: int
                    ) -> tuple[torch.Tensor, list[int]]:
    """The segment's requests' pages dequantized in request then (local) position order →
    (workspace [rows, L + R] bf16, the workspace row of each request's first local row). Page
    counts come from the host's local_lens, so nothing waits for the device."""
    block_size = cache.shape[1]
    pages, bases = [], []
    start = 0
    for r in segment.requests:
        n = -(-local_lens[r] // block_size)
        pages.append(block_table[r, :n])
        bases.append(start * block_size)
        start += n
    return dequantize_pages(cache, torch.cat(pages), kv_lora_rank), bases


def workspace_indices(positions: torch.Tensor, segment: Segment,
                      query_start_loc: Sequence[int], bases: Sequence[int], dcp_size: int = 1,
                      dcp_rank: int = 0, interleave: int = 1) -> torch.Tensor:
    """positions [segment rows, K] request-local (−1 skip) → [segment rows, K] int32
    workspace rows: base + the position's index in this rank's local sequence, −1 where the
    position is −1 or another DCP rank's; request by request (host bases: no copy of them to
    the device)."""
    idx = torch.empty(positions.shape, dtype=torch.int32, device=positions.device)
    first = segment.rows[0]
    for r, base in zip(segment.requests, bases, strict=True):
        rows = slice(query_start_loc[r] - first, query_start_loc[r + 1] - first)
        pos = positions[rows]
        if dcp_size == 1:
            idx[rows] = torch.where(pos >= 0, pos + base, -1)
            continue
        local = layout.dcp_local_index(pos, dcp_size, interleave)
        owned = (pos >= 0) & (layout.dcp_owner(pos, dcp_size, interleave) == dcp_rank)
        idx[rows] = torch.where(owned, local + base, -1)
    return idx
