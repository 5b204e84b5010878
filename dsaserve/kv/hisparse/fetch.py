"""HiSparse's fetch: the missed rows into their hot-buffer slots, from the host pool (the durable
copy) or from a GPU page (rows written this step, not mirrored yet).

On CUDA one Triton launch reads the pinned host pool in place (`kernels/triton/row_gather.py`):
no host sync, and only the misses move. On the CPU (the documented fallback, what CI runs) the
same contract is met with index_select / index_copy_.
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
