"""HiSparse's row moves in one launch each, with no host sync: the fetch (`fetch_misses`: the
residency step's misses into their hot-buffer slots, each row from the pinned host pool or from
a GPU page) and the mirror (`row_gather`: rows a step wrote, from their GPU pages into the pool).

The host pool is read and written in place over PCIe (zero copy): it is page-locked and mapped
(`kv/host_pool.pin_host_memory`), and Triton's launcher turns a mapped host pointer into its
device address. A CPU gather followed by a copy up (what the reference path does) round-trips
through the host and synchronises; random 656-byte rows read this way were measured at 24-33
GB/s on an H200, against 2-14 GB/s for a CPU gather.

A program copies a block of ENTRIES entries at once: one [ENTRIES, WORDS] masked load per
source, so several PCIe row reads are in flight per program, and a masked entry (a hit, padding:
most of the residency step's fixed-shape output) costs its index loads only.

The fetch derives each entry's operands itself from the residency step's outputs and the tables
(destination, source row, host or GPU), where they were ~12 elementwise and gather launches over
[R, W] tensors, and counts the misses (device counters, one atomic per program with a miss).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows(dst_ptr, dst_row, a_ptr, a_row, use_a, b_ptr, b_row, copy,
               WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """dst[dst_row[e]] = a[a_row[e]] if use_a[e] else b[b_row[e]], for each entry e with
    copy[e]; rows of WORDS int32 words. Two masked [E, BLOCK] loads: a lane reads one side."""
    cols = tl.arange(0, BLOCK)[None, :]
    inside = cols < WORDS
    from_a = (copy & use_a)[:, None] & inside
    from_b = (copy & ~use_a)[:, None] & inside
    va = tl.load(a_ptr + a_row[:, None] * WORDS + cols, mask=from_a, other=0)
    vb = tl.load(b_ptr + b_row[:, None] * WORDS + cols, mask=from_b, other=0)
    tl.store(dst_ptr + dst_row[:, None] * WORDS + cols, tl.where(from_a, va, vb),
             mask=copy[:, None] & inside)


@triton.jit(do_not_specialize=["n"])
def _row_gather_kernel(
    dst_ptr,  # [D, WORDS] int32: the destination rows
    dst_idx_ptr,  # [n] int64 destination row, −1 = nothing to copy
    host_ptr,  # [H, WORDS] int32: the host pool's rows (mapped pinned memory on CUDA)
    host_idx_ptr,  # [n] int64
    gpu_ptr,  # [G, WORDS] int32: the GPU cache's rows
    gpu_idx_ptr,  # [n] int64
    from_host_ptr,  # [n] bool (as uint8)
    n,
    WORDS: tl.constexpr, BLOCK: tl.constexpr, ENTRIES: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * ENTRIES + tl.arange(0, ENTRIES)
    inside = e < n
    d = tl.load(dst_idx_ptr + e, mask=inside, other=-1)
    copy = d >= 0
    from_host = tl.load(from_host_ptr + e, mask=copy, other=0) != 0
    h = tl.load(host_idx_ptr + e, mask=copy & from_host, other=0)
    g = tl.load(gpu_idx_ptr + e, mask=copy & ~from_host, other=0)
    _copy_rows(dst_ptr, d, host_ptr, h, from_host, gpu_ptr, g, copy, WORDS, BLOCK)


@triton.jit(do_not_specialize=["n", "W", "max_blocks"])
def _fetch_kernel(
    hot_ptr,  # [C·P, WORDS] int32: the hot buffer's rows (region c's slot s: row c·P + s)
    host_ptr,  # [H·B, WORDS] int32: the host pool's rows (mapped pinned memory on CUDA)
    gpu_ptr,  # [G·B, WORDS] int32: the layer's GPU pages
    miss_pos_ptr, miss_slot_ptr,  # [R, W] int64: the residency step's (−1 / S: no fetch)
    regions_ptr, requests_ptr, upto_ptr,  # [R] int64: region, block-table row, mirrored upto
    host_table_ptr, stride_host,  # [C + 1, NB] int64: region → its host blocks
    block_table_ptr, stride_block, max_blocks,  # [num_reqs, max_blocks] int32/64: MLA pages
    counts_ptr,  # [2] int64 += (misses, of those from the host)
    n, W,  # R·W entries; W per region
    S: tl.constexpr, P: tl.constexpr, TRASH: tl.constexpr, B: tl.constexpr,
    WORDS: tl.constexpr, BLOCK: tl.constexpr, ENTRIES: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * ENTRIES + tl.arange(0, ENTRIES)
    inside = e < n
    r = e // W
    miss_pos = tl.load(miss_pos_ptr + e, mask=inside, other=-1)
    slot = tl.load(miss_slot_ptr + e, mask=inside, other=S)
    miss = inside & (miss_pos >= 0)
    region = tl.load(regions_ptr + r, mask=miss, other=TRASH)
    # masked entries (the trash slot S) fetch nothing, nor does the trash region (no hot rows)
    copy = miss & (slot < S) & (region < TRASH)
    upto = tl.load(upto_ptr + r, mask=miss, other=0)
    from_host = miss_pos < upto
    # spelled out, not copy & ~from_host: Triton 3.6's sm_90 layout pass refuses that mask on
    # the loads below ("mask type matches ptr type")
    from_gpu = copy & (miss_pos >= upto)
    pos = tl.maximum(miss_pos, 0)
    blk, off = pos // B, pos % B
    host_blk = tl.load(host_table_ptr + region * stride_host + blk, mask=copy & from_host,
                       other=0)
    req = tl.load(requests_ptr + r, mask=from_gpu, other=0)
    page = tl.load(block_table_ptr + req * stride_block + tl.minimum(blk, max_blocks - 1),
                   mask=from_gpu, other=0).to(tl.int64)
    _copy_rows(hot_ptr, region * P + slot, host_ptr, host_blk * B + off, from_host,
               gpu_ptr, tl.maximum(page, 0) * B + off, copy, WORDS, BLOCK)
    num_miss = tl.sum(miss.to(tl.int64), axis=0)
    if num_miss > 0:  # most programs of a high-overlap step have none
        tl.atomic_add(counts_ptr, num_miss, sem="relaxed")
        tl.atomic_add(counts_ptr + 1, tl.sum((miss & from_host).to(tl.int64), axis=0),
                      sem="relaxed")


def _words(rows: torch.Tensor) -> torch.Tensor:
    """[N, ...] rows of any dtype → [N, bytes / 4] int32, the same memory."""
    flat = rows.reshape(rows.shape[0], -1).view(torch.uint8)
    if flat.shape[1] % 4:
        raise ValueError(f"row gather: rows of {flat.shape[1]} bytes are not whole words")
    return flat.view(torch.int32)


def _num_warps(block: int, entries: int) -> int:
    """Threads for an [entries, block] tile of words: 32 words a thread per copy (on sm_90 the
    fetch of 656-byte rows, 16 entries, 4 warps: 118 registers, no spill;
    benchmarks/sm90_resources.py --only fetch)."""
    return max(1, min(16, block * entries // 1024))


def _same_width(*rows: torch.Tensor) -> int:
    words = {r.shape[1] for r in rows}
    if len(words) != 1:
        raise ValueError("row gather: the host, GPU and destination rows differ in width")
    return words.pop()


def row_gather(dst: torch.Tensor, dst_idx: torch.Tensor, host: torch.Tensor,
               host_idx: torch.Tensor, gpu: torch.Tensor, gpu_idx: torch.Tensor,
               from_host: torch.Tensor, entries_per_program: int = 16) -> None:
    """dst[dst_idx[i]] = host[host_idx[i]] if from_host[i] else gpu[gpu_idx[i]], for every i
    with dst_idx[i] ≥ 0. dst, gpu [N, ...] on the GPU; host [H, ...] mapped pinned memory with
    the same row layout; the index tensors [n] int64 and from_host [n] bool on the GPU."""
    d, h, g = _words(dst), _words(host), _words(gpu)
    words = _same_width(d, h, g)
    n = dst_idx.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, entries_per_program),)
    _row_gather_kernel[grid](
        d, dst_idx, h, host_idx, g, gpu_idx, from_host.view(torch.uint8), n,
        WORDS=words, BLOCK=triton.next_power_of_2(words), ENTRIES=entries_per_program,
        num_warps=_num_warps(triton.next_power_of_2(words), entries_per_program))


def fetch_misses(hot: torch.Tensor, host: torch.Tensor, gpu: torch.Tensor,
                 miss_pos: torch.Tensor, miss_slot: torch.Tensor, regions: torch.Tensor,
                 requests: torch.Tensor, mirrored_upto: torch.Tensor, host_table: torch.Tensor,
                 block_table: torch.Tensor, counts: torch.Tensor, *, block_size: int,
                 buffer_rows: int, region_rows: int, trash_region: int,
                 entries_per_program: int = 16) -> None:
    """As `kv/hisparse/fetch.fetch_misses_reference` (the contract), in one launch. hot [C·P,
    ...] and gpu [G·B, ...] rows on the GPU, host [H·B, ...] mapped pinned memory, all of one
    row layout; the index tensors int64 (block_table int32 or int64) on the GPU."""
    d, h, g = _words(hot), _words(host), _words(gpu)
    words = _same_width(d, h, g)
    num_regions, width = miss_pos.shape
    n = num_regions * width
    if n == 0:
        return
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    grid = (triton.cdiv(n, entries_per_program),)
    _fetch_kernel[grid](
        d, h, g, miss_pos.contiguous(), miss_slot.contiguous(), regions, requests,
        mirrored_upto, host_table, host_table.stride(0), block_table, block_table.stride(0),
        block_table.shape[1], counts, n, width,
        S=buffer_rows, P=region_rows, TRASH=trash_region, B=block_size, WORDS=words,
        BLOCK=triton.next_power_of_2(words), ENTRIES=entries_per_program,
        num_warps=_num_warps(triton.next_power_of_2(words), entries_per_program))
