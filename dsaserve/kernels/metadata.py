"""Per-step attention metadata: what every layer's attention needs to address the paged caches.

Built once per step by the model runner (on the CPU, then moved to the device) and read by every layer.
Tokens of a step are flattened request by request:

    tokens   | r0: t0 t1 t2 | r1: t0 | r2: t0 t1 |
    qsl      0              3        4          6      (query_start_loc, R+1 entries)
    seq_lens   r0: ctx+3      r1: ctx+1 r2: ctx+2      (context length after this step's tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [N] int64, true token positions
    req_indices: torch.Tensor  # [N] int64, row of block_table for each token
    slot_mapping: torch.Tensor  # [N] int64, physical slot to write (−1: not written by this rank)
    block_table: torch.Tensor  # [R, max_blocks] int32, scheduler (virtual) block ids, −1 padded
    query_start_loc: tuple[int, ...]  # R+1 offsets into the flattened tokens (host ints)
    seq_lens: tuple[int, ...]  # [R] context length after this step (host ints)
    block_size: int  # physical page size B (a scheduler block covers B·dcp_size tokens)
    use_dense: bool  # every query sees ≤ index_topk keys and the dense path is allowed
    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_range(self, r: int) -> tuple[int, int]:
        return self.query_start_loc[r], self.query_start_loc[r + 1]
