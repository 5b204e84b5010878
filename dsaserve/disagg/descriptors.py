"""A plan's runs as byte segments over whole cache tensors: what a zero-copy transport (NIXL READ
from the prefill rank's registered caches straight into the decode rank's) is handed.

Per layer, each cache tensor is one region; a segment (src byte, dst byte, nbytes) copies bytes
between the two ranks' regions of the same name. Row-major tensors (the MLA cache, a bf16 indexer
cache) map a run of rows to one segment. An FP8 indexer page keeps a token's values and its
scale apart, so a run maps to a values segment and a scales segment per page it touches; where a
run covers whole pages of equal size on both sides the two halves and the next page are
contiguous too, and coalesce into one segment of whole pages:

    page b (B tokens):   | v_0 v_1 ... v_{B-1} | s_0 s_1 ... s_{B-1} |  next page ...
    run of 2 rows at o:    [v_o v_o+1]           [s_o s_o+1]                → 2 segments
    run of the whole page: [--------------- one segment: B·(D+4) ---------------]

Segments depend only on the formats, so layers of one format share them (computed once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.disagg.relayout import CopyRuns
from dsaserve.disagg.transport import KVTransport
from dsaserve.model.dsa import LayerCache

_SCALE = 4  # bytes of an FP8 indexer key's fp32 scale


@dataclass(frozen=True)
class LayerFormat:
    """What a peer needs to know about one layer's caches to address their bytes (it travels in
    the transfer metadata; no tensor needed)."""

    block_size: int
    kv_bytes: int  # bytes of one MLA row
    index_bytes: int  # bytes of one indexer key (2·D bf16, or D + 4 FP8); 0: no indexer cache
    index_fp8: bool  # the indexer cache is FP8 pages (values, then scales), not rows


def layer_formats(caches: Sequence[LayerCache]) -> list[LayerFormat]:
    out = []
    for cache in caches:
        block_size = cache.kv.shape[1]
        index, fp8 = cache.index, cache.index is not None and cache.index.dtype == torch.uint8
        if index is None:
            index_bytes = 0
        elif fp8:
            index_bytes = index.shape[1] // block_size
        else:
            index_bytes = index.shape[2] * index.element_size()
        out.append(LayerFormat(block_size, cache.kv.shape[2] * cache.kv.element_size(),
                               index_bytes, fp8))
    return out


def coalesce(segs: torch.Tensor) -> torch.Tensor:
    """[K, 3] (src, dst, nbytes) → the fewest segments copying the same bytes: sorted by src,
    a segment that starts where the previous one ended on both sides joins it."""
    if segs.shape[0] == 0:
        return segs
    if bool((segs[1:, 0] < segs[:-1, 0]).any()):  # a staged READ's come sorted: no sort
        segs = segs[torch.argsort(segs[:, 0], stable=True)]
    src, dst, n = segs.unbind(1)
    breaks = torch.ones_like(src, dtype=torch.bool)  # [K] a segment starts here
    breaks[1:] = (src[1:] != src[:-1] + n[:-1]) | (dst[1:] != dst[:-1] + n[:-1])
    group = torch.cumsum(breaks, 0) - 1  # [K] merged segment of each input segment
    total = torch.zeros(int(group[-1]) + 1, dtype=torch.int64).index_add_(0, group, n)
    return torch.stack((src[breaks], dst[breaks], total), dim=1)


def _row_segments(pair: CopyRuns, width: int) -> torch.Tensor:  # [R, 3]
    return torch.stack((pair.src_start * width, pair.dst_start * width, pair.length * width), 1)


def _split_at_pages(first: torch.Tensor, other: torch.Tensor, length: torch.Tensor,
                    block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs (`first` slot on the side split, `other` side's first slot, length), each [R], cut
    where the `first` side crosses a page of `block` slots: pieces [P] in run order, none of
    which crosses a page on that side. Piece i of a run starting h slots into its page:

        block 4, run of 7 from slot 6 (h = 2):   slots  6 7 | 8 9 10 11 | 12
        piece i covers run rows [max(0, 4i − h), min(7, 4(i+1) − h)):   [0, 2) [2, 6) [6, 7)
    """
    head = first % block  # [R] slots before the run's first in its page
    count = (head + length - 1) // block + 1  # [R] pages the run touches
    if bool((count == 1).all()):  # nothing to cut: rows alone, or runs within a page
        return first, other, length
    ends = torch.cumsum(count, 0)  # [R] one past each run's last piece
    pieces = torch.arange(int(ends[-1]), dtype=torch.int64)  # [P]
    run = torch.searchsorted(ends, pieces, right=True)  # [P] run of each piece
    i = pieces - (ends - count)[run]  # [P] piece's index in its run
    lo = (i * block - head[run]).clamp_(min=0)  # [P] first run row of the piece
    hi = torch.minimum((i + 1) * block - head[run], length[run])  # [P] one past its last
    return first[run] + lo, other[run] + lo, hi - lo


def _page_segments(pair: CopyRuns, head_dim: int, src_block: int,
                   dst_block: int) -> torch.Tensor:  # [K, 3]
    """Per piece of a run within one page on both sides: its n·D value bytes and its n scales,
    each contiguous at their places in each side's page (coalesce then joins what touches)."""
    s, t, n = _split_at_pages(pair.src_start, pair.dst_start, pair.length, src_block)
    t, s, n = _split_at_pages(t, s, n, dst_block)  # [P] each
    src_page, dst_page = src_block * (head_dim + _SCALE), dst_block * (head_dim + _SCALE)
    src_base, dst_base = (s // src_block) * src_page, (t // dst_block) * dst_page
    values = torch.stack((src_base + (s % src_block) * head_dim,
                          dst_base + (t % dst_block) * head_dim, n * head_dim), 1)
    scales = torch.stack((src_base + src_block * head_dim + (s % src_block) * _SCALE,
                          dst_base + dst_block * head_dim + (t % dst_block) * _SCALE,
                          n * _SCALE), 1)
    return coalesce(torch.cat((values, scales)))


def check_formats(src: Sequence[LayerFormat], dst: Sequence[LayerFormat]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"caches: {len(src)} source layers but {len(dst)} target layers")
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if (s.kv_bytes, s.index_bytes, s.index_fp8) != (d.kv_bytes, d.index_bytes, d.index_fp8):
            raise ValueError(f"layer {i}: formats differ ({s} vs {d}); P and D must agree")


def plan_segments(pair: CopyRuns, src: Sequence[LayerFormat], dst: Sequence[LayerFormat],
                  parts: tuple[str, ...] = ("kv", "index")) -> list[dict[str, torch.Tensor]]:
    """Per layer, {"kv": [K, 3], "index": [K', 3]} byte segments (src, dst, nbytes) that move
    `pair`'s rows between the two ranks' cache tensors ("index" absent where there is none);
    only the `parts` asked for (a HiSparse destination plans MLA rows and keys apart)."""
    check_formats(src, dst)
    memo: dict[tuple, torch.Tensor] = {}

    def segments(key: tuple) -> torch.Tensor:
        if key not in memo:
            kind, width, src_block, dst_block = key
            memo[key] = (_row_segments(pair, width) if kind == "rows"
                         else _page_segments(pair, width, src_block, dst_block))
        return memo[key]

    out = []
    for s, d in zip(src, dst, strict=True):
        layer = {"kv": segments(("rows", s.kv_bytes, 0, 0))} if "kv" in parts else {}
        if "index" not in parts or not s.index_bytes:
            pass
        elif s.index_fp8:
            layer["index"] = segments(("pages", s.index_bytes - _SCALE, s.block_size,
                                       d.block_size))
        else:
            layer["index"] = segments(("rows", s.index_bytes, 0, 0))
        out.append(layer)
    return out


def segments_nbytes(layers: Sequence[dict[str, torch.Tensor]]) -> int:
    return sum(int(seg[:, 2].sum()) for layer in layers for seg in layer.values())


def for_read(segs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src, dst, n) segments as a transport READ's (local, remote, n): the reader is the target."""
    return [(d, s, n) for s, d, n in segs.tolist()]


def for_write(segs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src, dst, n) segments as a transport WRITE's (local, remote, n): the source writes."""
    return [(s, d, n) for s, d, n in segs.tolist()]


def cache_regions(caches: Sequence[LayerCache]) -> dict[str, torch.Tensor]:
    """The caches as named flat byte views, the names `plan_segments`' keys take per layer:
    "L{i}.kv", "L{i}.index" (register these with a transport)."""
    out = {}
    for i, cache in enumerate(caches):
        out[f"L{i}.kv"] = cache.kv.reshape(-1).view(torch.uint8)
        if cache.index is not None:
            out[f"L{i}.index"] = cache.index.reshape(-1).view(torch.uint8)
    return out


def register_caches(transport: KVTransport, caches: Sequence[LayerCache]) -> list[LayerCache]:
    """The same caches (contents copied) in memory `transport` registered, one region per tensor
    named as in `cache_regions`; a runner swaps them in at start-up so that peers can READ or
    WRITE its cache pages directly."""
    out = []
    for i, cache in enumerate(caches):
        moved = []
        for part, tensor in (("kv", cache.kv), ("index", cache.index)):
            if tensor is None:
                moved.append(None)
                continue
            region = transport.allocate(f"L{i}.{part}", tensor.numel() * tensor.element_size())
            view = region.view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            moved.append(view)
        out.append(LayerCache(kv=moved[0], index=moved[1]))
    return out


def host_region_name(layer: int) -> str:
    """The name a HiSparse host pool's layer is registered under (the MLA rows' other home)."""
    return f"H{layer}.kv"


def register_host_pool(transport: KVTransport, host: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A HiSparse host pool ([H, B, row] per layer) in memory `transport` can write into: NIXL
    registers the tensors in place (DRAM); shared memory allocates its own files and the
    contents move there (the runtime swaps them in at start-up)."""
    out = []
    for i, tensor in enumerate(host):
        flat = tensor.reshape(-1).view(torch.uint8)
        if transport.backend == "nixl":
            transport.register(host_region_name(i), flat)
            out.append(tensor)
            continue
        region = transport.allocate(host_region_name(i), flat.numel())
        view = region.view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        out.append(view)
    return out
