"""KV addressing: which DCP rank owns a token, and which physical slot holds it.

The scheduler keeps ONE block table per request, shared by every rank of an engine. Under decode
context parallelism (DCP) of size N with physical page size B, a scheduler ("virtual") block covers
B·N tokens; physical block b on rank r holds the B tokens of virtual block b that rank r owns.
Ownership rotates in runs of I tokens (I = `--cp-kv-cache-interleave-size`):

    owner(t) = (t // I) % N            local(t) = (t // (N·I))·I + t % I

Example N = 2, I = 2, B = 4 (a virtual block covers 8 tokens):

    position t  :  0  1  2  3  4  5  6  7 |  8  9 10 11 12 13 14 15
    owner(t)    :  0  0  1  1  0  0  1  1 |  0  0  1  1  0  0  1  1
    local(t)    :  0  1  0  1  2  3  2  3 |  4  5  4  5  6  7  6  7
    virtual blk :  ---------- v0 -------- | --------- v1 ----------
    rank 0 page :  table[v0] holds t = 0 1 4 5 ; table[v1] holds t = 8 9 12 13
    rank 1 page :  table[v0] holds t = 2 3 6 7 ; table[v1] holds t = 10 11 14 15

Because B·N is a multiple of N·I, rank r's tokens in position order form its *local sequence*
(local(t) = 0, 1, 2, ...) and that sequence is paged by the same block table with page size B:
`slot(t) = table[local(t) // B]·B + local(t) % B`. Every function here is that one rule.

All ranks compute, the owner writes: a token this rank does not own gets the pad slot −1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

PAD_SLOT_ID = -1

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def check_interleave(block_size: int, interleave: int) -> None:
    """I must divide the page so that a page never splits an interleave run across two ranks."""
    if interleave < 1 or interleave > block_size or block_size % interleave:
        raise ValueError(
            f"--cp-kv-cache-interleave-size: {interleave} must be >= 1, <= the block size "
            f"{block_size} and divide it"
        )


def _check_dcp(dcp_size: int, dcp_rank: int = 0) -> None:
    if dcp_size < 1:
        raise ValueError(f"--decode-context-parallel-size: must be >= 1, got {dcp_size}")
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank: {dcp_rank} is outside [0, {dcp_size})")


def dcp_owner(pos: IntOrTensor, dcp_size: int, interleave: int) -> IntOrTensor:
    """The DCP rank that stores token position(s) `pos` (int, or an int64 tensor of any shape).

        I = 2, N = 3:   t      0 1 2 3 4 5 6 7 8 9
                        owner  0 0 1 1 2 2 0 0 1 1
    """
    return (pos // interleave) % dcp_size


def dcp_local_index(pos: IntOrTensor, dcp_size: int, interleave: int) -> IntOrTensor:
    """Index of position(s) `pos` in its owner's local sequence (int or int64 tensor).

        I = 2, N = 3:   t      0 1 2 3 4 5 6 7 8 9
                        local  0 1 0 1 0 1 2 3 2 3
    Runs of I tokens are kept together; round k of N·I tokens adds I tokens to every rank.
    """
    return (pos // (dcp_size * interleave)) * interleave + pos % interleave


def dcp_global_position(
    local: IntOrTensor, dcp_size: int, rank: int, interleave: int
) -> IntOrTensor:
    """Inverse of (dcp_owner, dcp_local_index): the position of rank `rank`'s local token `local`.

        I = 2, N = 3, rank 1:   local     0 1 2 3 4  5
                                position  2 3 8 9 14 15
    """
    return (local // interleave) * (dcp_size * interleave) + rank * interleave + local % interleave


def dcp_local_seq_len(seq_len: IntOrTensor, dcp_size: int, rank: int,
                      interleave: int) -> IntOrTensor:
    """How many of positions [0, seq_len) rank `rank` owns (int, or elementwise on an int64
    tensor). Summed over ranks this is seq_len.

        seq_len = 11, N = 3, I = 2:
        t      0 1 2 3 4 5 | 6 7 8 9 10
        owner  0 0 1 1 2 2 | 0 0 1 1 2      full rounds: 1 → 2 each; remainder 5 = 2 + 2 + 1
        local_seq_len = [4, 4, 3]

    Kernels' seq_lens and workspace sizes come from here, so every rank must compute it identically
    from the global length (never from rank-local state).
    """
    _check_dcp(dcp_size, rank)
    if dcp_size == 1:  # every position is this rank's (and no tensor ops for it)
        return seq_len
    round_len = dcp_size * interleave
    base = (seq_len // round_len) * interleave
    extra = seq_len % round_len - rank * interleave  # this rank's part of the last partial round
    if isinstance(extra, torch.Tensor):
        return base + extra.clamp(0, interleave)
    return base + min(max(extra, 0), interleave)


def slot_mapping(
    positions: torch.Tensor,  # [N] int64, true token positions
    req_indices: torch.Tensor,  # [N] int64, row of block_table for each token
    block_table: torch.Tensor,  # [R, max_blocks] int32, virtual block ids (−1 = unallocated)
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor:  # [N] int64, physical slot on this rank, −1 = not owned here (not written)
    """Where this rank writes each token's KV.

        virtual block v = t // (B·N), offset o = t % (B·N)
        slot = table[req][v]·B + local(o)      if owner(t) == rank
             = −1                              otherwise (and where the table entry is −1)

    local(o) < B because o < B·N; owner(o) == owner(t) because B·N is a multiple of N·I.
    """
    check_interleave(block_size, interleave)
    _check_dcp(dcp_size, dcp_rank)
    positions = positions.to(torch.int64)
    if dcp_size == 1:  # every position is this rank's: 8 ops, not 17 (MTP drafts, per step)
        blocks = block_table[req_indices.to(torch.int64),
                             positions // block_size].to(torch.int64)  # [N]
        return torch.where(blocks >= 0, blocks * block_size + positions % block_size,
                           PAD_SLOT_ID)
    virtual = block_size * dcp_size
    blocks = block_table[req_indices.to(torch.int64), positions // virtual].to(torch.int64)  # [N]
    local = dcp_local_index(positions % virtual, dcp_size, interleave)  # [N] in [0, B)
    owned = (dcp_owner(positions, dcp_size, interleave) == dcp_rank) & (blocks >= 0)
    return torch.where(owned, blocks * block_size + local, PAD_SLOT_ID)


def run_slots(
    starts: Sequence[int],  # [R] each run's first position
    counts: Sequence[int],  # [R] its positions (0: none)
    rows: np.ndarray,  # [R] int64, its row of `table`
    table: np.ndarray,  # [rows, max_blocks] int32 virtual block ids on the host (−1 = none)
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> np.ndarray:  # [sum(counts)] int64, run by run: slot_mapping's values at those positions
    """slot_mapping of runs of consecutive positions (a step's rows: request r computes
    counts[r] tokens from starts[r]), on the host. Built per block, not per token: each block
    a run touches gives the slots of its V = B·N positions at once (a [blocks, V] grid, the
    owner rule computed once for V offsets), and a run's slots are a slice of its blocks':

        B 4, N 1, a run of 5 positions from 6 over the row (7, 2, −1, ...)
        grid   7 → 28 29 30 31 │ 2 → 8 9 10 11        (its blocks 1 and 2: positions 4..11)
        slots        30 31       8 9 10                (positions 6..10)

    A 16K-token prefill: 256 blocks of 64 and a gather, about a tenth of slot_mapping's
    time on CPU tensors (benchmarks/prefill_prep.py).
    """
    check_interleave(block_size, interleave)
    _check_dcp(dcp_size, dcp_rank)
    virtual = block_size * dcp_size
    offsets = np.arange(virtual, dtype=np.int64)  # [V] offset in a virtual block
    local = np.where(dcp_owner(offsets, dcp_size, interleave) == dcp_rank,
                     dcp_local_index(offsets, dcp_size, interleave), PAD_SLOT_ID)  # [V]
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    first = starts // virtual  # [R] each run's first block
    num_blocks = np.where(counts > 0, (starts + counts - 1) // virtual - first + 1, 0)  # [R]
    grid_first = np.cumsum(num_blocks) - num_blocks  # [R] each run's first row of the grid
    block_run = np.repeat(np.arange(len(counts), dtype=np.int64), num_blocks)  # [NB]
    cols = first[block_run] + np.arange(len(block_run), dtype=np.int64) - grid_first[block_run]
    blocks = table[rows[block_run], cols].astype(np.int64)[:, None]  # [NB, 1]
    grid = np.where((blocks >= 0) & (local >= 0), blocks * block_size + local,
                    PAD_SLOT_ID)  # [NB, V]
    # row i of run r: the grid's flat entry grid_first[r]·V + starts[r] % V + i
    run = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [N]
    row_first = np.cumsum(counts) - counts  # [R] each run's first row of the step
    shift = grid_first * virtual + starts % virtual - row_first  # [R]
    return grid.reshape(-1)[np.arange(len(run), dtype=np.int64) + shift[run]]


def page_slots(
    slots: torch.Tensor,  # [N] int64 slots of block ids (slot_mapping), −1 = not written
    page_of: torch.Tensor,  # [num_blocks] int32 block id → page, −1 = none
    block_size: int,
) -> torch.Tensor:  # [N] int64 the same rows in the pages, −1 = not written or no page
    """slot_mapping through a table whose entries are page_of[block id] (HiSparse's MLA pages,
    fewer than the blocks), from the slots of the block ids:

        slot = block·B + o   →   page_of[block]·B + o      (−1 where either is −1)
    """
    blocks = slots.clamp(min=0) // block_size
    pages = page_of[blocks].to(torch.int64)  # [N]
    return torch.where((slots >= 0) & (pages >= 0), pages * block_size + slots % block_size,
                       PAD_SLOT_ID)


def logical_to_slots(
    indices: torch.Tensor,  # [T, K] request-local token positions, −1 = pad
    req_indices: torch.Tensor,  # [T] row of block_table for each query row
    block_table: torch.Tensor,  # [R, max_blocks] int32, virtual block ids
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor:  # [T, K] int64 physical slots on this rank, −1 = pad or not owned here
    """Map the indexer's top-k (global positions of one request) to this rank's cache slots.

    Under DCP each rank keeps only the entries it owns; the LSE merge across ranks then equals
    attention over the whole top-k set. Same rule as `slot_mapping`, applied elementwise.
    """
    t, k = indices.shape
    valid = indices >= 0  # [T, K]
    positions = indices.clamp(min=0).to(torch.int64)  # pads read column 0, then masked
    rows = req_indices.to(torch.int64)[:, None].expand(t, k)  # [T, K]
    slots = slot_mapping(
        positions.reshape(-1), rows.reshape(-1), block_table, block_size,
        dcp_size, dcp_rank, interleave,
    ).view(t, k)
    return torch.where(valid, slots, PAD_SLOT_ID)


def context_slots(
    seq_len: int,
    block_ids: Sequence[int] | torch.Tensor,  # [num_blocks] virtual block ids of one request
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([L_local] int64 slots, [L_local] int64 positions)
    """The slots of positions [0, seq_len) that this rank owns, in position order, and their
    positions — how the indexer and the dense path read one request's cached keys.

        rank r's local sequence   j = 0 1 ... L_local−1       (L_local = dcp_local_seq_len)
        position                  dcp_global_position(j)
        slot                      block_ids[j // B]·B + j % B

    `block_ids` may be a −1-padded block-table row; it must cover the first L_local local tokens.
    """
    check_interleave(block_size, interleave)
    num_local = dcp_local_seq_len(seq_len, dcp_size, dcp_rank, interleave)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)  # [num_blocks]
    local = torch.arange(num_local, dtype=torch.int64, device=blocks.device)  # [L_local]
    needed = -(-num_local // block_size)
    if needed > blocks.numel():
        raise ValueError(
            f"block_ids: {blocks.numel()} blocks cannot hold {num_local} local tokens "
            f"(seq_len {seq_len}, block size {block_size}, dcp {dcp_size})"
        )
    if bool((blocks[:needed] < 0).any()):
        raise ValueError(f"block_ids: an unallocated (−1) block among the first {needed}")
    slots = blocks[local // block_size] * block_size + local % block_size  # [L_local]
    positions = dcp_global_position(local, dcp_size, dcp_rank, interleave)  # [L_local]
    return slots, positions
