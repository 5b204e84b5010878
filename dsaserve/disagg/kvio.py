"""Apply a re-layout plan to real caches: gather a pair's rows into one contiguous byte buffer on
the source rank, scatter that buffer into the target rank's caches.

A rank's caches are `list[LayerCache]` (the decoder layers, then the MTP layer: one more layer).
The buffer for n rows is layer-major and token-major inside a layer, with no padding:

    | layer 0: kv rows [n, kv_0] | index keys [n, idx_0] | layer 1: kv [n, kv_1] | ... |

    kv row     bf16: L+R values (2·(L+R) bytes)     fp8_ds_mla: the 656-byte row as stored
    index key  bf16: D values (2·D bytes)           fp8: D e4m3 bytes, then the 4-byte fp32 scale
               IndexShare layers (index None): 0 bytes

An FP8 indexer page is not token-major (`formats`: all values of the page, then all scales), so a
key's D value bytes and its scale are gathered from their two places in the page and put back the
same way; every byte is copied, nothing is re-quantized. The buffer's size is exactly
`rows × RowBytes.per_token`, the number the plan's `nbytes` predicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsaserve.disagg.relayout import RowBytes, TransferPlan
from dsaserve.kernels import formats
from dsaserve.model.dsa import LayerCache


def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """MLA cache [num_blocks, B, W] of any dtype → byte rows [num_blocks·B, W·itemsize] (a view)."""
    if kv.dim() != 3 or not kv.is_contiguous():
        raise ValueError(f"kv cache: expected a contiguous [num_blocks, B, W], got "
                         f"{tuple(kv.shape)} (contiguous={kv.is_contiguous()})")
    return kv.view(kv.shape[0] * kv.shape[1], kv.shape[2]).view(torch.uint8)


def _index_parts(cache: LayerCache) -> tuple[torch.Tensor, ...]:
    """The indexer cache as byte-row views over slots: (rows,) for bf16 [num_blocks·B, 2·D], or
    (values [num_blocks, B, D], scales [num_blocks, B, 4]) for FP8 pages (not flattenable: the
    page stride is B·(D+4))."""
    index = cache.index
    if index is None:
        return ()
    block_size = cache.kv.shape[1]
    if index.dtype == torch.uint8:
        head_dim = index.shape[1] // block_size - 4
        return formats._index_page_views(index, head_dim)
    if index.dim() != 3 or index.shape[1] != block_size or not index.is_contiguous():
        raise ValueError(f"index cache: expected a contiguous [num_blocks, {block_size}, D], got "
                         f"{tuple(index.shape)}")
    return (index.view(index.shape[0] * block_size, index.shape[2]).view(torch.uint8),)


def row_bytes(caches: Sequence[LayerCache]) -> RowBytes:
    """Bytes per token of every layer, read off the cache tensors."""
    kv, index = [], []
    for cache in caches:
        kv.append(cache.kv.shape[2] * cache.kv.element_size())
        index.append(sum(part.shape[-1] for part in _index_parts(cache)))
    return RowBytes(tuple(kv), tuple(index))


def check_compatible(src: Sequence[LayerCache], dst: Sequence[LayerCache]) -> None:
    """The byte formats must agree layer by layer: re-layout moves rows, it does not convert."""
    if len(src) != len(dst):
        raise ValueError(f"caches: {len(src)} source layers but {len(dst)} target layers")
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s.kv.dtype != d.kv.dtype or s.kv.shape[2] != d.kv.shape[2]:
            raise ValueError(f"layer {i}: kv rows {s.kv.dtype} x {s.kv.shape[2]} vs "
                             f"{d.kv.dtype} x {d.kv.shape[2]} (same format needed on P and D)")
        s_idx = None if s.index is None else (s.index.dtype, row_bytes([s]).index[0])
        d_idx = None if d.index is None else (d.index.dtype, row_bytes([d]).index[0])
        if s_idx != d_idx:
            raise ValueError(f"layer {i}: indexer caches differ: {s_idx} vs {d_idx}")


def _words(t: torch.Tensor) -> torch.Tensor:
    """uint8 [..., w] → the same bytes as the widest integer words its strides allow
    ([..., w/k], k = 8, 4 or 2): torch's CPU index copies move rows of few wide elements several
    times faster than rows of bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        k = dtype.itemsize
        if (t.shape[-1] % k == 0 and t.stride(-1) == 1 and t.storage_offset() % k == 0
                and all(st % k == 0 for st in t.stride()[:-1])):
            return t.view(dtype)
    return t


def _like(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Buffer rows [n, w] uint8 as `words`' dtype (a copy when the buffer offset is unaligned)."""
    if words.dtype == torch.uint8:
        return rows
    out = _words(rows)
    return out if out.dtype == words.dtype else rows.clone().view(words.dtype)


def part_views(cache: LayerCache) -> list[torch.Tensor]:
    """The cache's byte views in buffer order: kv rows, then the index rows, or the FP8 page's
    values then scales (their bytes sit side by side in the buffer: one D+4-byte key)."""
    return [kv_rows(cache.kv), *_index_parts(cache)]


def gather_rows(caches: Sequence[LayerCache], slots: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows at `slots` [n] (this rank's slots, all valid) → the buffer above, [n·per_token]
    uint8 on the caches' device; written into `out` (a 1-D uint8 tensor, e.g. a registered
    transport region) when given."""
    n = int(slots.numel())
    per_token = row_bytes(caches).per_token
    if out is None:
        out = torch.empty(n * per_token, dtype=torch.uint8, device=caches[0].kv.device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < n * per_token:
        raise ValueError(f"gather_rows: out must be 1-D uint8 of >= {n * per_token} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    slots = slots.to(device=caches[0].kv.device, dtype=torch.int64)
    offset = 0
    for cache in caches:
        parts = part_views(cache)
        width = sum(p.shape[-1] for p in parts)  # this layer's bytes per token
        dest = out[offset: offset + n * width].view(n, width)  # [n, width]
        col = 0
        for part in parts:
            w = part.shape[-1]
            if part.dim() == 2:  # [num_slots, w]: rows indexed by slot
                rows = _words(part).index_select(0, slots)
            else:  # [num_blocks, B, w]: an FP8 page half, indexed by (block, offset)
                block_size = part.shape[1]
                rows = _words(part)[slots // block_size, slots % block_size]
            dest[:, col: col + w].copy_(rows.view(torch.uint8))
            col += w
        offset += n * width
    return out[:offset]


def scatter_rows(caches: Sequence[LayerCache], slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Inverse of `gather_rows`: write the buffer's rows at `slots` [n] of these caches. Only
    those rows' bytes change (the target's cached prefix and other requests are untouched)."""
    n = int(slots.numel())
    per_token = row_bytes(caches).per_token
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < n * per_token:
        raise ValueError(f"scatter_rows: buf must be 1-D uint8 of >= {n * per_token} bytes, got "
                         f"{buf.dtype} {tuple(buf.shape)}")
    device = caches[0].kv.device
    slots = slots.to(device=device, dtype=torch.int64)
    buf = buf.to(device)
    offset = 0
    for cache in caches:
        parts = part_views(cache)
        width = sum(p.shape[-1] for p in parts)
        src = buf[offset: offset + n * width].view(n, width)  # [n, width]
        col = 0
        for part in parts:
            w = part.shape[-1]
            rows = src[:, col: col + w]
            put_rows(part, slots, rows if col == 0 and w == width else rows.contiguous())
            col += w
        offset += n * width


def put_rows(part: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write byte rows [n, w] (contiguous uint8) at `slots` [n] (int64, on the part's device)
    of one cache byte view: [num_slots, w] rows, or an FP8 page half [num_blocks, B, w]."""
    words = _words(part)
    rows = _like(rows, words)
    if part.dim() == 2:
        words.index_copy_(0, slots, rows)
    else:
        block_size = part.shape[1]
        words[slots // block_size, slots % block_size] = rows


def apply_plan(plan: TransferPlan, src: Sequence[Sequence[LayerCache]],
               dst: Sequence[Sequence[LayerCache]]) -> int:
    """Run a whole plan in one process (src[r] / dst[q]: every rank's caches), pair by pair,
    through the same buffers a transport would carry. Returns the bytes moved."""
    moved = 0
    for pair in plan.pairs:
        buf = gather_rows(src[pair.src_rank], pair.src_slots())
        scatter_rows(dst[pair.dst_rank], pair.dst_slots(), buf)
        moved += buf.numel()
    return moved
