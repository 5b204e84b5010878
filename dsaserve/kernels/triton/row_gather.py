"""HiSparse's fetch: copy the missed MLA rows into their hot-buffer slots, each from the pinned
host pool or from a GPU page, in one launch and with no host sync.

The host pool is read in place over PCIe (zero copy): it is page-locked and mapped
(`kv/host_pool.pin_host_memory`), and Triton's launcher turns a mapped host pointer into its
device address. A CPU gather followed by a copy up (what the reference path does) round-trips
through the host and synchronises; random 656-byte rows read this way were measured at 24-33
GB/s on an H200, against 2-14 GB/s for a CPU gather.

The residency step's fixed-shape output has one entry per union slot, mostly masked (hits and
padding): a masked entry (dst < 0) costs one index load, so the bytes moved are the misses only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def _row_gather_kernel(
    dst_ptr,  # [D, WORDS] int32: the hot buffer's rows
    dst_idx_ptr,  # [n] int64 destination row, −1 = nothing to fetch
    host_ptr,  # [H, WORDS] int32: the host pool's rows (mapped pinned memory on CUDA)
    host_idx_ptr,  # [n] int64
    gpu_ptr,  # [G, WORDS] int32: the GPU cache's rows
    gpu_idx_ptr,  # [n] int64
    from_host_ptr,  # [n] bool (as uint8)
    n,
    WORDS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    inside = cols < WORDS
    for r in range(ROWS):
        i = tl.program_id(0).to(tl.int64) * ROWS + r
        if i < n:
            d = tl.load(dst_idx_ptr + i)
            if d >= 0:
                if tl.load(from_host_ptr + i) != 0:
                    src = host_ptr + tl.load(host_idx_ptr + i) * WORDS
                else:
                    src = gpu_ptr + tl.load(gpu_idx_ptr + i) * WORDS
                tl.store(dst_ptr + d * WORDS + cols, tl.load(src + cols, mask=inside),
                         mask=inside)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """[N, ...] rows of any dtype → [N, bytes / 4] int32, the same memory."""
    flat = rows.reshape(rows.shape[0], -1).view(torch.uint8)
    if flat.shape[1] % 4:
        raise ValueError(f"row gather: rows of {flat.shape[1]} bytes are not whole words")
    return flat.view(torch.int32)


def row_gather(dst: torch.Tensor, dst_idx: torch.Tensor, host: torch.Tensor,
               host_idx: torch.Tensor, gpu: torch.Tensor, gpu_idx: torch.Tensor,
               from_host: torch.Tensor, rows_per_program: int = 8) -> None:
    """dst[dst_idx[i]] = host[host_idx[i]] if from_host[i] else gpu[gpu_idx[i]], for every i
    with dst_idx[i] ≥ 0. dst, gpu [N, ...] on the GPU; host [H, ...] mapped pinned memory with
    the same row layout; the index tensors [n] int64 and from_host [n] bool on the GPU."""
    d, h, g = _words(dst), _words(host), _words(gpu)
    words = d.shape[1]
    if h.shape[1] != words or g.shape[1] != words:
        raise ValueError("row gather: the host, GPU and destination rows differ in width")
    n = dst_idx.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, rows_per_program),)
    _row_gather_kernel[grid](
        d, dst_idx, h, host_idx, g, gpu_idx, from_host.view(torch.uint8), n,
        WORDS=words, BLOCK=triton.next_power_of_2(words), ROWS=rows_per_program)
