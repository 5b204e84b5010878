"""The indexer's request-local top-k positions → this rank's cache slots, in one pass.

The rule is kv/layout.py's (`logical_to_slots`); done there in PyTorch it takes about ten
passes over [T, K] int64 tensors (clamp, gather from the block table, DCP ownership, masks):
650 µs for a 4096-token prefill chunk (8.4M indices) on an H200, a fifth of its sparse MLA.
Here one program reads a block of one row's positions and writes int32 slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Sizes that change from step to step: not specialized on (a new value divisible by 16
# would compile the kernel again, mid-serving).
@triton.jit(do_not_specialize=["topk", "stride_pos", "stride_bt"])
def _position_slots_kernel(
    pos_ptr,  # [T, K] int32 / int64 request-local positions, −1 = pad
    req_ptr,  # [T] int64: each row's row of the block table
    bt_ptr,  # [R, max_blocks] int32 virtual block ids (−1 = unallocated)
    out_ptr,  # [T, K] int32 slots, −1 = pad or another rank's
    topk, stride_pos, stride_bt,
    B: tl.constexpr, DCP: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inside = cols < topk
    p = tl.load(pos_ptr + row * stride_pos + cols, mask=inside, other=-1).to(tl.int64)
    req = tl.load(req_ptr + row).to(tl.int64)
    live = p >= 0
    VIRTUAL: tl.constexpr = B * DCP  # tokens of one virtual block
    block = tl.load(bt_ptr + req * stride_bt + p // VIRTUAL, mask=inside & live,
                    other=-1).to(tl.int64)
    offset = p % VIRTUAL
    local = (offset // (DCP * INTERLEAVE)) * INTERLEAVE + offset % INTERLEAVE
    owned = live & (block >= 0) & ((p // INTERLEAVE) % DCP == RANK)
    slot = tl.where(owned, block * B + local, -1)
    tl.store(out_ptr + row * topk + cols, slot.to(tl.int32), mask=inside)


def position_slots(positions: torch.Tensor, req_indices: torch.Tensor,
                   block_table: torch.Tensor, block_size: int, dcp_size: int = 1,
                   dcp_rank: int = 0, interleave: int = 1) -> torch.Tensor:
    """positions [T, K] request-local (−1 pad), req_indices [T], block_table [R, max_blocks]
    int32 → [T, K] int32 slots on this rank, −1 for pads and positions another DCP rank owns:
    layout.logical_to_slots, as int32 (a cache of < 2^31 slots)."""
    if positions.dim() != 2 or req_indices.shape != positions.shape[:1]:
        raise ValueError(f"position_slots: expected positions [T, K] and req_indices [T], got "
                         f"{tuple(positions.shape)} and {tuple(req_indices.shape)}")
    num_rows, topk = positions.shape
    out = torch.empty(num_rows, topk, dtype=torch.int32, device=positions.device)
    if out.numel() == 0:
        return out
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    block = min(1024, triton.next_power_of_2(topk))
    _position_slots_kernel[(num_rows, triton.cdiv(topk, block))](
        positions, req_indices, block_table, out, topk, positions.stride(0),
        block_table.stride(0), B=block_size, DCP=dcp_size, RANK=dcp_rank, INTERLEAVE=interleave,
        BLOCK=block, num_warps=4,
    )
    return out
