"""FP8 indexer logits of prefill tiles on Hopper (indexer_logits.cu): the same scores, group
maxima and −inf past the causal limits as the Triton kernel in
dsaserve.kernels.triton.indexer, with wgmma issued directly and the epilogue written by hand
(docs/kernels.md has why and the timings)."""

from __future__ import annotations

import torch

from dsaserve.kernels.cuda.build import build

HEADS = (32, 64)  # index heads the kernel is built for: 128 / H tokens per warpgroup
# (consumer warpgroups per block, each with its own tokens; pages in flight per consumer, 2:
# page b + 1's MMA runs while page b is reduced, with two sets of accumulators, which three
# consumers have no registers for)
SHAPES = ((2, 1), (2, 2), (3, 1))
# Per head count, the shapes measured fastest on an H200 (docs/kernels.md), in order: the
# indexer takes the first whose consumers the step's longest query fills.
PREFERRED = {64: [(3, 1), (2, 2)], 32: [(2, 2)]}
HEAD_DIM, BLOCK_SIZE = 128, 64


def supported(q: torch.Tensor, index_cache: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel covers these inputs on this device (and builds here)."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[1] in HEADS
            and q.shape[2] == HEAD_DIM and index_cache.dtype == torch.uint8
            and block_size == BLOCK_SIZE
            and torch.cuda.get_device_capability(q.device) == (9, 0) and build() is None)


def tokens_per_tile(num_heads: int, consumers: int) -> int:
    """Tokens of one request a block takes: 128 query rows (token, head) per consumer."""
    return consumers * 128 // num_heads


def launch(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
           block_table: torch.Tensor, tiles: torch.Tensor, limits: torch.Tensor,
           logits: torch.Tensor, group_max: torch.Tensor, *, consumers: int, depth: int,
           pages_per_prog: int) -> None:
    """Fill logits [T, S] and group_max [T, ceil(S / 8)] (fp32, unit column stride).

    q [T, H, 128] bf16, weights [T, H] fp32, index_cache uint8 pages (64 keys: e4m3 rows, then
    fp32 scales), block_table [R, ≥ ceil(S / 64)] int32, tiles [3, num_tiles] int32 (request,
    first token, length ≤ tokens_per_tile(H, consumers)), limits [T] int32: keys j < limits[t]
    are visible to token t. One block per (tile, pages_per_prog pages of keys); `consumers`
    warpgroups of 128 query rows each, `depth` pages in flight per consumer (see SHAPES)."""
    if (consumers, depth) not in SHAPES or q.shape[1] not in HEADS:
        raise ValueError(f"indexer_logits (CUDA): (consumers, depth) must be one of {SHAPES} and "
                         f"heads one of {HEADS}, got ({consumers}, {depth}) and {q.shape[1]}")
    torch.ops.dsaserve_cuda.indexer_logits(q, weights, index_cache, block_table, tiles, limits,
                                           logits, group_max, consumers, depth, pages_per_prog)
