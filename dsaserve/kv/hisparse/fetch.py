"""HiSparse's row moves between the pinned host pool and the GPU: the fetch (the missed rows into
their hot-buffer slots, from the host pool, the durable copy, or from a GPU page: rows written
this step, not mirrored yet) and the mirror (rows a step wrote, from their GPU pages into the
host pool).

On CUDA each is one Triton launch that reads or writes the mapped pinned pool in place
(`kernels/triton/row_gather.py`): no host sync, and only the rows named move; the fetch's
launch also derives each entry's source and destination from the residency step's outputs and
the tables. On the CPU (the documented fallback, what CI runs) the same contracts are met with
index maths and index_select / index_copy_ (`fetch_misses_reference`, `fetch_rows_reference`).
"""

from __future__ import annotations

import torch


def fetch_rows_reference(dst: torch.Tensor, dst_idx: torch.Tensor, host: torch.Tensor,
                         host_idx: torch.Tensor, gpu: torch.Tensor, gpu_idx: torch.Tensor,
                         from_host: torch.Tensor) -> None:
    """dst[dst_idx[i]] = host[host_idx[i]] if from_host[i] else gpu[gpu_idx[i]], for every i
    with dst_idx[i] ≥ 0. Rows [N, ...]; indices [n] int64; from_host [n] bool."""
    live = dst_idx >= 0  # a data-dependent shape: fine here, the CUDA path has none
    rows_host = host.index_select(0, host_idx[live].to(host.device)).to(dst.device)
    rows_gpu = gpu.index_select(0, gpu_idx[live])
    pick = from_host[live].view(-1, *([1] * (dst.dim() - 1)))
    dst.index_copy_(0, dst_idx[live], torch.where(pick, rows_host, rows_gpu))


def fetch_misses_reference(hot: torch.Tensor, host: torch.Tensor, gpu: torch.Tensor,
                           miss_pos: torch.Tensor, miss_slot: torch.Tensor,
                           regions: torch.Tensor, requests: torch.Tensor,
                           mirrored_upto: torch.Tensor, host_table: torch.Tensor,
                           block_table: torch.Tensor, counts: torch.Tensor, *, block_size: int,
                           buffer_rows: int, region_rows: int, trash_region: int) -> None:
    """The residency step's misses into their hot slots. Entry (i, j) is a miss when
    p = miss_pos[i, j] ≥ 0; it is fetched when its slot s = miss_slot[i, j] < S (buffer_rows)
    and c = regions[i] is a request's (< trash_region: the trash region has no hot rows):

        hot[c·P + s] = host[host_table[c, p // B]·B + p % B]          p < mirrored_upto[i]
                     = gpu[page·B + p % B], page = block_table[requests[i], p // B]   else

    (B: block_size, P: region_rows; a GPU row is one written this step, not mirrored yet, whose
    page is resident.) counts [2] int64 += (misses, of those below mirrored_upto): metrics.
    Rows hot [C·P, ...], host [H·B, ...], gpu [G·B, ...]; miss_pos, miss_slot [R, W] int64;
    regions, requests, mirrored_upto [R] int64; host_table [C + 1, NB]; block_table [.., MB]."""
    b = block_size
    miss = miss_pos >= 0  # [R, W]
    pos = miss_pos.clamp(min=0)
    blk, off = pos // b, pos % b
    host_rows = host_table[regions].gather(1, blk) * b + off
    table = block_table[requests].long()  # [R, MB]
    gpu_rows = table.gather(1, blk.clamp(max=table.shape[1] - 1)).clamp(min=0) * b + off
    from_host = miss_pos < mirrored_upto[:, None]
    counts += torch.stack([miss.sum(), (miss & from_host).sum()])
    owned = (regions < trash_region)[:, None]  # [R, 1]
    dest = torch.where(miss & (miss_slot < buffer_rows) & owned,
                       regions[:, None] * region_rows + miss_slot, -1)  # [R, W]
    fetch_rows_reference(hot, dest.flatten(), host, host_rows.flatten(), gpu, gpu_rows.flatten(),
                         from_host.flatten())


def fetch_misses(hot: torch.Tensor, host: torch.Tensor, gpu: torch.Tensor,
                 miss_pos: torch.Tensor, miss_slot: torch.Tensor, regions: torch.Tensor,
                 requests: torch.Tensor, mirrored_upto: torch.Tensor, host_table: torch.Tensor,
                 block_table: torch.Tensor, counts: torch.Tensor, *, block_size: int,
                 buffer_rows: int, region_rows: int, trash_region: int) -> None:
    """As `fetch_misses_reference`; on CUDA one launch of the zero-copy kernel (the host pool
    must be the runtime's mapped pinned pool), operands derived inside it."""
    args = (hot, host, gpu, miss_pos, miss_slot, regions, requests, mirrored_upto, host_table,
            block_table, counts)
    kw = dict(block_size=block_size, buffer_rows=buffer_rows, region_rows=region_rows,
              trash_region=trash_region)
    if hot.is_cuda:
        from dsaserve.kernels.triton.row_gather import fetch_misses as fetch_triton

        fetch_triton(*args, **kw)
    else:
        fetch_misses_reference(*args, **kw)


def mirror_rows(layers: list[tuple[torch.Tensor, torch.Tensor]], host_idx: torch.Tensor,
                gpu_idx: torch.Tensor) -> None:
    """host[host_idx[i]] = gpu[gpu_idx[i]] for every i, for each layer's (host, gpu) rows
    [N, ...]; indices [n] int64 on the GPU rows' device. On CUDA the zero-copy kernel writes the
    mapped pinned pool behind the step's work on the stream (no host sync: the step's result
    copy, later on the same stream, is what the host waits for); on the CPU index_copy_."""
    if not layers or not layers[0][1].is_cuda:
        for host, gpu in layers:
            host.index_copy_(0, host_idx, gpu.index_select(0, gpu_idx))
        return
    from dsaserve.kernels.triton.row_gather import row_gather  # triton only where CUDA is

    # the fetch's kernel, every row taken from the GPU side, the pool as the destination
    from_gpu = torch.zeros(host_idx.shape, dtype=torch.bool, device=host_idx.device)
    for host, gpu in layers:
        row_gather(host, host_idx, host, host_idx, gpu, gpu_idx, from_gpu)
