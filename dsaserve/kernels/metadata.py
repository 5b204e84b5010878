"""Per-step attention metadata: what every layer's attention needs to address the paged caches.

Built once per step by the model runner (on the CPU, then moved to the device) and read by every
layer. Tokens of a step are flattened request by request:

    tokens   | r0: t0 t1 t2 | r1: t0 | r2: t0 t1 |
    qsl      0              3        4          6      (query_start_loc, R+1 entries)
    seq_lens   r0: ctx+3      r1: ctx+1 r2: ctx+2      (context length after this step's tokens)

A decode step replayed from a CUDA graph (engine/decode_graph.py) has `bounded_seq_lens`: its
seq_lens are the bound max_model_len, the same at every replay, so that what the host sizes from
them (grids, buffers) stays valid; each row's context is then given by its position only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from dsaserve.kv import layout

if TYPE_CHECKING:
    from dsaserve.kv.hisparse.runtime import HiSparseStep


@dataclass(frozen=True)
class PcpMetadata:
    """Prefill context parallelism: this rank computes only some rows of the global batch.

    New KV rows are all-gathered (rank-major, each rank padded to `padded_len` rows) and restored
    to the global order, then written at `write_slots` (the owner's slots of every global token)."""

    local_index: torch.Tensor  # [n_local] global token index of each local row
    restore_index: torch.Tensor  # [N_global] row of the gathered [pcp·padded_len] layout
    padded_len: int
    write_slots: torch.Tensor  # [N_global] int64 slots (−1: not owned by this rank)
    replicated: tuple[bool, ...]  # per request: computed by every rank (decode, short prefill)
    query_lens: tuple[int, ...]  # per request: tokens of the global batch (new tokens this step)

    def global_range(self, r: int) -> tuple[int, int]:
        """Rows of request r in the global batch (the order of gathered new rows)."""
        start = sum(self.query_lens[:r])
        return start, start + self.query_lens[r]


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
    pcp: PcpMetadata | None = None  # None: this rank computes every row of the batch
    hisparse: HiSparseStep | None = None  # None: every row reads the paged cache
    # seq_lens are an upper bound, not the lengths (a captured decode step): only positions
    # say what a row may see, and nothing may read pages up to seq_lens
    bounded_seq_lens: bool = False
    # what backends derive from this step's host values once and reuse in every layer (the
    # indexer's plan; the indexer's limits and the sparse MLA slots, kept with the device
    # tensor they came from); lives as long as the metadata (a captured graph holds its own),
    # and a dataclasses.replace of it starts empty
    derived: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False,
                                    compare=False)
    # HiSparse spilling: the MLA cache has its own pages (kv/hisparse/mla_pages.py); None: the
    # block ids address the MLA pages as they do the indexer's
    mla_block_table: torch.Tensor | None = None  # [R, max_blocks] int32 MLA pages, −1: none
    mla_slot_mapping: torch.Tensor | None = None  # [N] int64 MLA slot each row writes

    def for_mla(self) -> AttentionMetadata:
        """The metadata that addresses the MLA cache: ours, or under HiSparse spilling the same
        step over the MLA pages (the indexer keeps reading `self`)."""
        if self.mla_block_table is None:
            return self
        return replace(self, block_table=self.mla_block_table,
                       slot_mapping=self.mla_slot_mapping, mla_block_table=None,
                       mla_slot_mapping=None)

    def shared_requests(self) -> tuple[bool, ...]:
        """Per request: are its rows identical on every rank of the DCP group (so partial results
        can be merged across the group)? Always without PCP (the group shares the batch)."""
        if self.pcp is None:
            return (True,) * self.num_reqs
        return self.pcp.replicated

    def select(self, requests: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata restricted to some requests, and the rows [n_sel] it keeps (index into ours)."""
        rows = [torch.arange(*self.query_range(r)) for r in requests]
        row_index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        qsl = [0]
        for r in requests:
            qsl.append(qsl[-1] + self.query_range(r)[1] - self.query_range(r)[0])
        dev = self.positions.device
        idx = row_index.to(dev)
        sub = AttentionMetadata(
            positions=self.positions[idx],
            req_indices=torch.repeat_interleave(
                torch.arange(len(requests), device=dev),
                torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(requests))], device=dev)),
            slot_mapping=self.slot_mapping[idx] if self.slot_mapping.numel() else self.slot_mapping,
            block_table=self.block_table[torch.tensor(requests, dtype=torch.int64, device=dev)],
            query_start_loc=tuple(qsl),
            seq_lens=tuple(self.seq_lens[r] for r in requests),
            block_size=self.block_size, use_dense=self.use_dense, dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank, interleave=self.interleave, pcp=None,
            bounded_seq_lens=self.bounded_seq_lens,
        )
        return sub, idx

    @classmethod
    def for_requests(cls, seq_lens: Sequence[int], new_tokens: Sequence[int],
                     block_table: torch.Tensor, block_size: int, *, dcp_size: int = 1,
                     dcp_rank: int = 0, interleave: int = 1) -> AttentionMetadata:
        """One step in which request r computes its last new_tokens[r] tokens (positions
        seq_lens[r] − new_tokens[r] … seq_lens[r] − 1) over block_table [R, max_blocks] (on the
        device the tensors should live on). Kernel tests and benchmarks build their steps with
        it; the runner builds its own from the scheduler's output."""
        qsl, positions, reqs = [0], [], []
        for r, (s, n) in enumerate(zip(seq_lens, new_tokens, strict=True)):
            if not 0 <= n <= s:
                raise ValueError(f"for_requests: request {r} has {n} new tokens of {s}")
            qsl.append(qsl[-1] + n)
            positions += range(s - n, s)
            reqs += [r] * n
        device = block_table.device
        pos = torch.tensor(positions, dtype=torch.int64, device=device)  # [N]
        req = torch.tensor(reqs, dtype=torch.int64, device=device)  # [N]
        return cls(
            positions=pos, req_indices=req, block_table=block_table,
            slot_mapping=layout.slot_mapping(pos, req, block_table, block_size, dcp_size,
                                             dcp_rank, interleave),
            query_start_loc=tuple(qsl), seq_lens=tuple(seq_lens), block_size=block_size,
            use_dense=False, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_range(self, r: int) -> tuple[int, int]:
        return self.query_start_loc[r], self.query_start_loc[r + 1]


def dense_allowed(max_seq_len: int, index_topk: int, dcp_size: int, force_mqa: bool) -> bool:
    """A step whose longest context is `max_seq_len` takes the dense path (`use_dense`): every
    query then sees ≤ index_topk keys, all of them in the local cache (no DCP), unless
    --attention-config forces the sparse MQA path. The runner's rule, and engine/dp.py's for
    the steps it pads (a dense step runs as it is)."""
    return not force_mqa and dcp_size == 1 and max_seq_len <= index_topk


def scattered_block_table(pages: Sequence[int], generator: torch.Generator | None = None,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """[R, max(pages)] int32: request r owns pages[r] distinct blocks taken from a shuffled pool
    of sum(pages) blocks, −1 after them; a block table whose pages are out of order, for kernel
    tests and benchmarks."""
    pool = torch.randperm(sum(pages), generator=generator, device=device).int()
    table = torch.full((len(pages), max(pages, default=0)), -1, dtype=torch.int32,
                       device=device)
    start = 0
    for r, n in enumerate(pages):
        table[r, :n] = pool[start : start + n]
        start += n
    return table
