"""HiSparse's row moves between the pinned host pool and the GPU: the fetch (the missed rows into
their hot-buffer slots, from the host pool, the durable copy, or from a GPU page: rows written
this step, not mirrored yet) and the mirror (rows a step wrote, from their GPU pages into the
host pool).

On CUDA each is one Triton launch that reads or writes the mapped pinned pool in place
(`kernels/triton/row_gather.py`): no host sync, and only the rows named move. On the CPU (the
documented fallback, what CI runs) the same contract is met with index_select / index_copy_.
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


def fetch_rows(dst: torch.Tensor, dst_idx: torch.Tensor, host: torch.Tensor,
               host_idx: torch.Tensor, gpu: torch.Tensor, gpu_idx: torch.Tensor,
               from_host: torch.Tensor) -> None:
    """As `fetch_rows_reference`; on CUDA the zero-copy kernel (the host pool must be the
    runtime's mapped pinned pool)."""
    if dst.is_cuda:
        from dsaserve.kernels.triton.row_gather import row_gather  # triton only where CUDA is

        row_gather(dst, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
    else:
        fetch_rows_reference(dst, dst_idx, host, host_idx, gpu, gpu_idx, from_host)


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
