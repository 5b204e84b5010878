"""A bf16 workspace of the fp8_ds_mla rows a prefill chunk reads, so that its sparse MLA runs on
bf16 rows (the ping-pong kernel) instead of dequantizing every selected row on the fly.

A request's top-k rows are positions of its own context. For a long prefill chunk every
context row is selected many times over (T = 4096 rows × 2048 indices over a 128K-token
context: 64 times each), and the fp8 kernel dequantizes it again each time; dequantizing the
request's pages once into a workspace costs one read of its fp8 rows and one write of bf16
rows. The workspace is itself a paged bf16 cache: a request's pages, in order, become
consecutive workspace pages, so its own block table is

    table[r] = start[r], start[r] + 1, …      start[r] = Σ_{r' before r} pages of r'

and the usual slot rule over that table (slots.position_slots, DCP ownership included: a rank's
pages hold its local sequence) gives the indices.

Decode rows (1–4 per request) read each row about once, so their requests keep the fp8 path:
`plan_segments` splits a step's requests, in order, into runs that take one path or the other
(docs/kernels.md has the measured break-even). The dequantized values are exact (e4m3 times a
power-of-two scale fits bf16), so either path reads the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from dsaserve.kernels import formats, staging


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
        cache.view(torch.float8_e4m3fn),
        pages if pages.dtype == torch.int32 else pages.to(torch.int32), ws, ws.shape[0],
        L=kv_lora_rank, R=rope_dim, B=block_size, ROWS=DEQUANT_ROWS, ROW_BYTES=row_bytes,
        TILE=formats.MLA_TILE, num_warps=DEQUANT_WARPS,
    )
    return ws


def workspace_pages(block_table: torch.Tensor, segment: Segment, local_lens: Sequence[int],
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's requests' cache pages in request then (local) position order [P], and the
    workspace's own block table [R, max pages] int32: request r's pages renumbered as the
    consecutive workspace pages they become, −1 elsewhere. Page counts come from the host's
    local_lens, so nothing waits for the device: the table and the (request, column) of each
    page are built on the host and go up in one copy, the pages are one gather."""
    device = block_table.device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # the upload's pinned buffer would be read at every replay: the capture fails instead
        raise RuntimeError("mla_workspace: pages planned under a CUDA graph's capture")
    reqs = np.asarray(segment.requests, dtype=np.int64)  # [S]
    counts = -(-np.asarray([local_lens[r] for r in segment.requests], dtype=np.int64)
               // block_size)  # [S] pages of each
    page_req = np.repeat(reqs, counts)  # [P] the request of each workspace page
    page_col = np.arange(len(page_req), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts)  # [P] its column in the request's row
    table = np.full((block_table.shape[0], int(counts.max())), -1, dtype=np.int32)
    table[page_req, page_col] = np.arange(len(page_req), dtype=np.int32)
    table_d, req_d, col_d = staging.upload(
        [torch.from_numpy(table), torch.from_numpy(page_req), torch.from_numpy(page_col)],
        device)
    return block_table[req_d, col_d], table_d


def build_workspace(cache: torch.Tensor, block_table: torch.Tensor, segment: Segment,
                    local_lens: Sequence[int], kv_lora_rank: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's requests' pages dequantized → (workspace [P, B, L + R] bf16: a paged bf16
    cache, its block table [R, max pages] int32). Indices into it are the cache's slot rule
    over that table (slots.position_slots), DCP ownership included."""
    pages, table = workspace_pages(block_table, segment, local_lens, cache.shape[1])
    ws = dequantize_pages(cache, pages, kv_lora_rank)
    return ws.view(pages.numel(), cache.shape[1], ws.shape[1]), table
