"""Exact top-k of long score rows in one launch (topk_rows.cu).

Same contract as dsaserve.kernels.triton.row_topk.topk_rows, which it replaces where it builds:
that one takes three latency-bound launches (a bit-by-bit threshold search, a compaction, a
selection); this one a thread block per row (a cluster of 2-8 on Hopper where rows are few)
with shared-memory histograms. Measured on an H200 in docs/kernels.md.
"""

from __future__ import annotations

import torch

from dsaserve.kernels.cuda.build import build as _build
from dsaserve.kernels.device import properties

MAX_K = 4096  # kList in topk_rows.cu, the list length: k ≤ it
CLUSTER_SIZES = (1, 2, 4, 8)  # blocks per row the kernel is built for (launch_for in the .cu)
THREADS = (512, 1024)  # threads per block it is built for (clusters: 1024 only)


def blocks_per_row(num_rows: int, num_sms: int, threads: int, major: int) -> int:
    """Blocks sharing a row's compaction (a thread-block cluster; Hopper and later, 1024-thread
    blocks): the most of CLUSTER_SIZES that keeps one block per multiprocessor, so that a decode
    batch of few rows still uses the whole GPU (64 rows on 132: 2 per row)."""
    if threads != 1024 or major < 9:
        return 1
    return max(c for c in CLUSTER_SIZES if c == 1 or num_rows * c <= num_sms)


def threads_per_row(num_rows: int, num_sms: int) -> int:
    """Threads of a row's block: 1024 while every row has a multiprocessor of its own (a row's
    latency is the cost), else 512, two blocks per multiprocessor: one wave for twice the rows
    (MTP's 256 verify rows on 132 SMs: 26 µs against 46 with 1024, docs/kernels.md)."""
    return 1024 if num_rows <= num_sms else 512


def unavailable_reason() -> str | None:
    """None when the CUDA kernels can run here, else why not (builds on first call)."""
    return _build()


def available() -> bool:
    return _build() is None


def topk_rows(logits: torch.Tensor, group_max: torch.Tensor | None, limits: torch.Tensor,
              k: int, *, group: int = 8, index_dtype: torch.dtype = torch.int64,
              threads: int | None = None, cluster: int | None = None, group_list: bool = True,
              stage: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row's visible prefix, in no particular order.

    logits [T, S] fp32 (unit column stride), group_max [T, ceil(S / group)] (max over keys
    group·g … group·g + group − 1; None: the rows are searched directly), limits [T] int32 or
    int64 → (values [T, k] fp32, indices [T, k] index_dtype): min(k, limits[t]) chosen keys
    first, then (−inf, −1). Among equal scores the smaller key index wins. threads: 512 or 1024
    per row (None: threads_per_row's choice). cluster: blocks per row, 1, 2, 4 or 8 (more than
    one: a thread-block cluster of 1024-thread blocks, Hopper and later; None: as many as fit
    one block per multiprocessor, see blocks_per_row). group_list: where a row's group maxima
    fit in shared memory (≤ 131,072 keys) and group is 8, the compaction reads only the groups
    whose maximum clears the threshold, about k of them (False: the whole row; for comparison).
    stage: on Hopper, 1024-thread blocks that read their whole share of the row copy it into
    shared memory while they search the threshold (False: the compaction reads it from memory).
    """
    reason = _build()
    if reason is not None:
        raise RuntimeError(f"topk_rows (CUDA): unavailable: {reason}")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"topk_rows: logits must be fp32 [T, S] with unit column stride, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    num_rows, seq = logits.shape
    if not 0 < k <= min(seq, MAX_K):
        raise ValueError(f"topk_rows: k={k} must be in [1, min(S={seq}, {MAX_K})]")
    if group_max is not None:
        num_groups = -(-seq // group)
        if group_max.dtype != torch.float32 or group_max.shape != (num_rows, num_groups) \
                or group_max.stride(1) != 1:
            raise ValueError(f"topk_rows: group_max must be fp32 [{num_rows}, {num_groups}], "
                             f"got {group_max.dtype} {tuple(group_max.shape)}")
    if limits.dtype not in (torch.int32, torch.int64) or limits.shape != (num_rows,):
        raise ValueError(f"topk_rows: limits must be int32 or int64 [{num_rows}], got "
                         f"{limits.dtype} {tuple(limits.shape)}")
    if index_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_rows: index_dtype must be int32 or int64, got {index_dtype}")
    if threads not in (None, *THREADS):
        raise ValueError(f"topk_rows: threads must be one of {THREADS}, got {threads}")
    props = properties(logits.device)
    if threads is None:
        threads = threads_per_row(num_rows, props.multi_processor_count)
    if cluster is None:
        cluster = blocks_per_row(num_rows, props.multi_processor_count, threads, props.major)
    elif cluster not in CLUSTER_SIZES or (cluster > 1 and (threads != 1024 or props.major < 9)):
        raise ValueError(f"topk_rows: cluster={cluster} must be one of {CLUSTER_SIZES}, and 1 "
                         f"unless threads=1024 on compute capability ≥ 9.0 (got threads="
                         f"{threads}, {props.major}.{props.minor})")
    values = torch.empty(num_rows, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(num_rows, k, dtype=index_dtype, device=logits.device)
    torch.ops.dsaserve_cuda.topk_rows(logits, group_max, limits.contiguous(), k, group, threads,
                                      cluster, group_list, stage, values, indices)
    return values, indices
