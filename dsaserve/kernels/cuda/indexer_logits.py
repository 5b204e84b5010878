"""FP8 indexer logits of prefill tiles on Hopper (indexer_logits.cu): the same scores, group
maxima and −inf past the causal limits as the Triton kernel in
dsaserve.kernels.triton.indexer, with wgmma issued directly and the epilogue written by hand
(docs/kernels.md has why and the timings)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsaserve.kernels.cuda.build import build

HEADS = (32, 64)  # index heads the kernel is built for: N / H tokens per consumer


class Shape(NamedTuple):
    """A block shape of the kernel."""

    consumers: int  # consumer warpgroups, each with its own tokens
    depth: int  # pages in flight per consumer (2: page b + 1's MMA runs while page b is reduced)
    rows: int  # query rows (token, head) per consumer: the MMA's N
    # ReLU(x) = (x + |x|) / 2: the weighted |x| summed in registers (one FFMA per product
    # instead of two), the linear half Σ_h w_h x_h by the tensor cores as 8 more MMA rows. Its
    # scores differ from the ReLU form's by at most LINEAR_REL_ERROR of Σ_h |w_h| (|q_h|·|k|)
    # (measured on an H200: 4–6e-5 of it, 2× the ReLU form's own distance from an fp32
    # reference; up to 9e-4 of the row's largest score against 3–5e-4).
    linear: bool = False


# Registers decide which shapes combine: three consumers have 152 each, two 224.
SHAPES = (Shape(2, 1, 128), Shape(2, 1, 128, True), Shape(2, 2, 128), Shape(2, 2, 128, True),
          Shape(3, 1, 128), Shape(3, 1, 128, True), Shape(2, 1, 256))
# Per head count, the shapes measured fastest on an H200 (docs/kernels.md), in order: the
# indexer takes the first whose consumers the step's longest query fills.
# MTP's verify rows (4 tokens × 64 heads: 256 rows) take the second: 2 × 128 with one page in
# flight measured 388–391 µs against 396–425 with two (b = 64, 64K keys).
PREFERRED = {64: [Shape(3, 1, 128, True), Shape(2, 1, 128, True)],
             32: [Shape(3, 1, 128, True), Shape(2, 1, 128, True)]}
HEAD_DIM, BLOCK_SIZE = 128, 64


# What the linear shapes may differ by from the ReLU form, per score: this fraction of the same
# score computed from |q|, |w| and |k| (abs_inputs): the hi + lo / 16 pair holds each element
# of c = Σ_h w_h q_h to 2^-8 of it, and the linear half enters the score with weight ½, so the
# bound has a factor of two to spare.
LINEAR_REL_ERROR = 2.0**-8


def abs_inputs(q: torch.Tensor, weights: torch.Tensor,
               index_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|q|, |w| and a copy of the FP8 key cache with every key's elements made positive (the
    sign bit of each e4m3 byte cleared; the scales are positive): any indexer run on them gives
    Σ_h |w_h| (|q_h|·|k|), which LINEAR_REL_ERROR scales into the linear shapes' tolerance."""
    cache = index_cache.clone()
    pages = cache.view(-1, BLOCK_SIZE * (HEAD_DIM + 4))
    pages[:, : BLOCK_SIZE * HEAD_DIM].bitwise_and_(0x7F)
    return q.abs(), weights.abs(), cache


def supported(q: torch.Tensor, index_cache: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel covers these inputs on this device (and builds here)."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[1] in HEADS
            and q.shape[2] == HEAD_DIM and index_cache.dtype == torch.uint8
            and block_size == BLOCK_SIZE
            and torch.cuda.get_device_capability(q.device) == (9, 0) and build() is None)


def pages_per_block(num_tiles: int, num_pages: int, num_sms: int) -> int:
    """Key pages per block: the most of 256 … 16 that still gives eight blocks per
    multiprocessor (one fits at a time), so that few long rows (MTP decode) fill the GPU while
    a long prefill pays each block's start (q quantized, the ring filled) rarely. On an H200,
    T = 4096 × 128K keys, 32 heads: 256 pages 5.63 ms, 128 5.86, 16 7.44 (3 consumers).

        tiles 342, pages 2048, 132 SMs → 256 (2,736 blocks); tiles 64, pages 1024 → 32
    """
    for pages in (256, 128, 64, 32):
        if num_tiles * -(-num_pages // pages) >= 8 * num_sms:
            return pages
    return 16


def block_rows(shape: Shape) -> int:
    """Query rows (token, head) a block takes: all its consumers'."""
    return shape.consumers * shape.rows


def launch(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
           block_table: torch.Tensor, tiles: torch.Tensor, limits: torch.Tensor,
           logits: torch.Tensor, group_max: torch.Tensor, *, shape: Shape,
           pages_per_prog: int) -> None:
    """Fill logits [T, S] and group_max [T, ceil(S / 8)] (fp32, unit column stride).

    q [T, H, 128] bf16, weights [T, H] fp32, index_cache uint8 pages (64 keys: e4m3 rows, then
    fp32 scales), block_table [R, ≥ ceil(S / 64)] int32, tiles [3, num_tiles] int32 (request,
    first token, length ≤ block_rows(shape) / H), limits [T] int32: keys j < limits[t] are
    visible to token t. One block per (tile, pages_per_prog pages of keys), of `shape` (one of
    SHAPES; a plain (consumers, depth, rows[, linear]) tuple is taken as that Shape)."""
    shape = Shape(*shape)
    if shape not in SHAPES or q.shape[1] not in HEADS:
        raise ValueError(f"indexer_logits (CUDA): shape must be one of {SHAPES} and heads one of "
                         f"{HEADS}, got {shape} and {q.shape[1]}")
    torch.ops.dsaserve_cuda.indexer_logits(q, weights, index_cache, block_table, tiles, limits,
                                           logits, group_max, *shape, pages_per_prog)
