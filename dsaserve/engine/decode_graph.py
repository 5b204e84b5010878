"""Decode steps through static buffers, padded to a capture size; replayed from a CUDA graph
where graphs are on (CUDA, a `capturable` attention backend, not --enforce-eager), run eager
over the same buffers elsewhere (the CPU), so that the padding is tested wherever the engine
runs.

A decode-only step (every request computes its last known token and its drafts: 1 to
q = 1 + k rows) is laid out as size / q request slots of q rows each, size the smallest
capture size ≥ R·q that q divides:

    step rows     r0: t d d d | r1: t d     | r2: t d d d |                     (N = 10)
    padded rows   r0: t d d d | r1: t d ¹ ¹ | r2: t d d d | ² ² ² ²             (size 16, q = 4)
                  ¹ copies of r1's last row   ² copies of r0's last row, with r0's block table

A padding row copies a live row (token, position, block-table row) and writes nowhere (slot
−1): it reads only what that row reads, touches no request's KV, and its output is dropped.

The metadata of a size is built once over the static buffers (fixed addresses): input ids,
positions, write slots [size], the block table [size / q, max_model_len / B] and the
constant request index of each row; query_start_loc every q rows; seq_lens the bound
max_model_len (`bounded_seq_lens`), so that everything the host sizes from them (the
indexer's logits width and grid) is the same at every step and only positions give a row's
context. Each step fills the buffers by device gathers from its own metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.engine import cudagraph, staging
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.model.dsa import DsaForCausalLM, LayerCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaddedLayout:
    """Where each row of a padded step comes from (see the module's picture)."""

    src_rows: list[int]  # [size] the step row each padded row copies
    writes: list[bool]  # [size] False: a padding row (slot −1)
    src_reqs: list[int]  # [size / q] the step request whose block-table row each slot takes
    out_rows: list[int]  # [N] the padded row of each step row


def pad_layout(counts: Sequence[int], q: int, size: int) -> PaddedLayout:
    """Request r has counts[r] rows (1 ≤ counts[r] ≤ q) → the layout of `size` rows in
    request slots of q (q divides size, len(counts) ≤ size / q)."""
    num_slots = size // q
    if size % q or not 0 < len(counts) <= num_slots or not all(0 < n <= q for n in counts):
        raise ValueError(f"pad_layout: {list(counts)} rows per request do not fit {size} rows "
                         f"in slots of {q}")
    src_rows: list[int] = []
    writes: list[bool] = []
    out_rows: list[int] = []
    first = 0
    for n in counts:
        out_rows += range(len(src_rows), len(src_rows) + n)
        src_rows += [first + min(i, n - 1) for i in range(q)]
        writes += [i < n for i in range(q)]
        first += n
    num_pad = num_slots - len(counts)
    src_rows += [counts[0] - 1] * (q * num_pad)
    writes += [False] * (q * num_pad)
    return PaddedLayout(src_rows, writes, list(range(len(counts))) + [0] * num_pad, out_rows)


class DecodeGraphs:
    """The runner's padded decode path over one set of static buffers (the largest size; each
    size uses their first rows). `capture`: record each size's forward in a CUDA graph at its
    first step and replay it afterwards; otherwise run the forward eager over the buffers."""

    def __init__(self, model: DsaForCausalLM, caches: list[LayerCache], sizes: Sequence[int],
                 rows_per_request: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: bool) -> None:
        self.model = model
        self.caches = caches
        self.q = rows_per_request
        self.sizes = tuple(n for n in sizes if n % self.q == 0)  # the others never fit
        if not self.sizes:
            logger.warning("--compilation-config: no cudagraph_capture_sizes is a multiple of "
                           "1 + num_speculative_tokens = %d; decode steps run as they are",
                           self.q)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.capture = capture
        max_size = max(self.sizes, default=0)
        width = -(-max_model_len // block_size)  # blocks of the longest request
        with torch.inference_mode():  # written inside the model's inference-mode forward
            self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.slots = torch.full((max_size,), -1, dtype=torch.int64, device=device)
            self.block_table = torch.full((max_size // self.q, width), -1, dtype=torch.int32,
                                          device=device)
            # row i belongs to request slot i // q, at every step
            self.req_indices = torch.arange(max_size, device=device) // self.q
        self._metas: dict[int, AttentionMetadata] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.num_steps = 0  # steps run through the static buffers
        self.num_replays = 0  # of them, replayed from a graph

    def size_for(self, counts: Sequence[int]) -> int | None:
        """The size a decode-only step whose requests have counts[r] rows runs at; None: it
        runs as it is (too large, or a request with more than q rows)."""
        if not counts or max(counts) > self.q:
            return None
        return cudagraph.padded_size(len(counts) * self.q, self.sizes)

    @torch.inference_mode()
    def forward(self, size: int, counts: Sequence[int], input_ids: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The target forward of the step (input_ids [N], its exact metadata), run at `size`
        → hidden [N, hidden] in the step's row order, as model(input_ids, meta) gives it."""
        layout = pad_layout(counts, self.q, size)
        src_rows, writes, src_reqs, out_rows = staging.upload([
            torch.tensor(layout.src_rows), torch.tensor(layout.writes),
            torch.tensor(layout.src_reqs), torch.tensor(layout.out_rows)], input_ids.device)
        # 1. the static buffers, by device gathers from the step's metadata
        self.input_ids[:size].copy_(input_ids[src_rows])
        self.positions[:size].copy_(meta.positions[src_rows])
        self.slots[:size].copy_(torch.where(writes.bool(), meta.slot_mapping[src_rows], -1))
        table = self.block_table[: size // self.q]  # [slots, W]
        width = min(meta.block_table.shape[1], table.shape[1])  # lookahead blocks past W: unread
        table[:, :width].copy_(meta.block_table[src_reqs, :width])
        table[:, width:] = -1
        # 2. the forward over them: replayed, captured at the size's first step, or eager
        return self._run(size)[out_rows]

    def _run(self, size: int) -> torch.Tensor:
        self.num_steps += 1
        meta = self._metadata(size)
        ids = self.input_ids[:size]
        if not self.capture:
            return self.model(ids, meta, self.caches)
        if size not in self._graphs:
            logger.info("capturing the decode forward of %d tokens in a CUDA graph", size)
            try:
                graph, out = cudagraph.capture(lambda: self.model(ids, meta, self.caches),
                                               self._pool)
            except RuntimeError as e:  # a kernel that cannot be captured: serve eager
                logger.warning("capturing the decode forward of %d tokens failed (%s); decode "
                               "steps run eager from now on (--enforce-eager says so at "
                               "start-up)", size, e)
                self.capture = False
                return self.model(ids, meta, self.caches)
            self._pool = graph.pool()
            self._graphs[size] = (graph, out)
        graph, out = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return out

    def _metadata(self, size: int) -> AttentionMetadata:
        """The size's metadata over the static buffers: one object for every step, so that
        what backends derive from it once (meta.derived) outlives the graph's capture."""
        if size not in self._metas:
            num_reqs = size // self.q
            self._metas[size] = AttentionMetadata(
                positions=self.positions[:size],
                req_indices=self.req_indices[:size],
                slot_mapping=self.slots[:size],
                block_table=self.block_table[:num_reqs],
                query_start_loc=tuple(range(0, size + 1, self.q)),
                seq_lens=(self.max_model_len,) * num_reqs,
                block_size=self.block_size,
                use_dense=False,
                bounded_seq_lens=True,
            )
        return self._metas[size]
