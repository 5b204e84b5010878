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

With MTP, the step's drafts (spec/mtp.py: draft_chain) run at the same size, as one more graph
per size: step 0 over the padded rows with the target's padded metadata (the same slots, so
the MTP layer's KV is written exactly where eager writes it), then the k − 1 one-row steps over
the size / q request slots, slot s drafting from its row s·q + accepted (a live row: accepted ≤
its drafts):

    draft rows    r0: t d d d | r1: t d ¹ ¹ | r2: t d d d | ² ² ² ²
                        ^             ^         ^           ^
                  slot 0 (1 accepted), 1 (0), 2 (2); padding slot 3: its first row, r0's copy

Draft step j writes at position + j of its slot (the lookahead blocks are in the table), a
padding slot nowhere; its seq_lens are the bound max_model_len + k − 1.

With HiSparse (kv/hisparse/padded.py) the metadata of a size carries a `HiSparseStep` over
static buffers too (every slot tracked, padding and page-reading slots in the trash region),
filled from the step's own, and under spilling the MLA pages' table and write slots, gathered
as the block table and the slots are.

Every size's graphs are captured at start-up (`warm_up`, largest first: the shared pool is
sized by the largest), as vLLM does, over an all-padding batch: no request, every row a
padding row at position 0 reading block 0 (a real block, as a padding row reads its live
row's) and writing nowhere, every HiSparse slot in the trash region. A step then never
captures; a size it finds without its graph (none should) is captured inside that step.

Under DP + EP (the routed experts shared by every replica's ranks, parallel/lockstep.py) a
decode step is padded only to the size engine/dp.py picks for every replica at once (the
smallest capture size ≥ the largest replica's rows), and a replica with no rows in that step
runs the all-padding batch of that size (`run_padding`, the drafts included), so that every
rank makes the same dispatches with the same row count: no row counts are exchanged
(parallel/ep.py), and the dispatches are captured with the rest. Every rank warms up the same
sizes in the same order (one config), and a capture that fails raises (`must_capture`): one
rank turning its graphs off alone would leave the others waiting in the warm-up's collectives.
Graphs are captured under DP + EP only with replicas of one rank (runner.py `_decode_graphs`),
and their replays are unverified on GPUs (a 2-GPU machine is needed).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dsaserve.engine import cudagraph
from dsaserve.kernels import staging
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kv import layout as kv_layout
from dsaserve.kv.hisparse.padded import PaddedHiSparse
from dsaserve.kv.hisparse.runtime import HiSparseRuntime
from dsaserve.model.dsa import DsaForCausalLM, LayerCache
from dsaserve.spec.mtp import DraftInputs, draft_chain

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


@dataclass(frozen=True)
class _LayoutTensors:
    """A PaddedLayout on the device, as the step's gathers read it (never written)."""

    src_rows: torch.Tensor  # [size] int64
    writes: torch.Tensor  # [size] bool
    src_reqs: torch.Tensor  # [size / q] int64
    out_rows: torch.Tensor  # [N] int64


# Layouts kept on the device, by (rows per request, size): a decode batch repeats its layout
# step after step (every request one row, or 1 + k with MTP), so the host builds and uploads
# it once, not at every step. Bounded: a batch whose counts keep changing stays cheap to hold.
MAX_CACHED_LAYOUTS = 256


@dataclass(frozen=True)
class _PaddedStep:
    """The last step run through the buffers, for its drafts."""

    size: int
    num_reqs: int
    src_rows: torch.Tensor  # [size] int64 the step row each padded row copies
    out_rows: torch.Tensor  # [N] int64 the padded row of each step row
    hidden: torch.Tensor  # [size, hidden] the target's padded output


class DecodeGraphs:
    """The runner's padded decode path over one set of static buffers (the largest size; each
    size uses their first rows). `capture`: record each size's forward (and with MTP its
    drafts) in a CUDA graph (at start-up through `warm_up`, else at the size's first step) and
    replay it afterwards; otherwise run them eager over the buffers. `num_drafts`: MTP's k
    (0: no drafting). `hisparse`: the rank's HiSparse runtime (None: off); `mla_pages`:
    HiSparse spilling (MLA pages apart from the block ids). `must_capture`: a capture that
    fails raises instead of turning `capture` off (DP + EP: every rank must capture alike)."""

    def __init__(self, model: DsaForCausalLM, caches: list[LayerCache], sizes: Sequence[int],
                 num_drafts: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: bool, *,
                 hisparse: HiSparseRuntime | None = None, mla_pages: bool = False,
                 must_capture: bool = False) -> None:
        self.model = model
        self.caches = caches
        self.k = num_drafts
        self.q = 1 + num_drafts
        self.sizes = tuple(n for n in sizes if n % self.q == 0)  # the others never fit
        if not self.sizes:
            logger.warning("--compilation-config: no cudagraph_capture_sizes is a multiple of "
                           "1 + num_speculative_tokens = %d; decode steps run as they are",
                           self.q)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.capture = capture
        self.must_capture = must_capture
        max_size = max(self.sizes, default=0)
        # blocks of the longest request, with the draft steps' k − 1 lookahead positions
        width = -(-(max_model_len + max(self.k - 1, 0)) // block_size)
        max_reqs = max_size // self.q
        with torch.inference_mode():  # written inside the model's inference-mode forward
            self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.slots = torch.full((max_size,), -1, dtype=torch.int64, device=device)
            self.block_table = torch.full((max_reqs, width), -1, dtype=torch.int32,
                                          device=device)
            # row i belongs to request slot i // q, at every step
            self.req_indices = torch.arange(max_size, device=device) // self.q
            # the drafts: step 0's input tokens, each slot's row, draft step j's positions and
            # slots ([j − 1]); one row per request slot in the draft steps
            self.draft_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.draft_rows = torch.zeros(max_reqs, dtype=torch.int64, device=device)
            self.draft_positions = torch.zeros(max(self.k - 1, 0), max_reqs, dtype=torch.int64,
                                               device=device)
            self.draft_slots = torch.full((max(self.k - 1, 0), max_reqs), -1,
                                          dtype=torch.int64, device=device)
            self.slot_indices = torch.arange(max_reqs, device=device)
            # HiSparse spilling: the MLA pages' table and slots, as block_table and the slots
            self.mla_table = self.mla_slots = self.draft_mla_slots = None
            if mla_pages:
                self.mla_table = torch.full_like(self.block_table, -1)
                self.mla_slots = torch.full_like(self.slots, -1)
                self.draft_mla_slots = torch.full_like(self.draft_slots, -1)
        self.hisparse = None if hisparse is None else PaddedHiSparse(
            hisparse.trash_region, max_size, self.q, device)
        self._metas: dict[int, AttentionMetadata] = {}
        self._draft_metas: dict[tuple[int, int], AttentionMetadata] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._draft_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._layouts: dict[tuple[tuple[int, ...], int], _LayoutTensors] = {}
        self._last: _PaddedStep | None = None
        self.num_steps = 0  # steps run through the static buffers
        self.num_replays = 0  # of them, replayed from a graph
        self.num_draft_steps = 0  # steps whose drafts ran through the static buffers
        self.num_draft_replays = 0  # of them, replayed from a graph
        self.num_padding_steps = 0  # all-padding steps of a replica with no rows (DP + EP)
        self.num_padding_replays = 0  # of them, replayed from a graph

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far: target forwards and draft chains."""
        return len(self._graphs) + len(self._draft_graphs)

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
        layout = self._layout(counts, size, input_ids.device)
        src_rows, writes, src_reqs = layout.src_rows, layout.writes, layout.src_reqs
        # 1. the static buffers, by device gathers from the step's metadata
        self.input_ids[:size].copy_(input_ids[src_rows])
        self.positions[:size].copy_(meta.positions[src_rows])
        self.slots[:size].copy_(torch.where(writes, meta.slot_mapping[src_rows], -1))
        table = self.block_table[: size // self.q]  # [slots, W]
        width = min(meta.block_table.shape[1], table.shape[1])  # lookahead blocks past W: unread
        table[:, :width].copy_(meta.block_table[src_reqs, :width])
        table[:, width:] = -1
        if self.mla_table is not None:  # HiSparse spilling
            self.mla_slots[:size].copy_(
                torch.where(writes, meta.mla_slot_mapping[src_rows], -1))
            mla_table = self.mla_table[: size // self.q]
            mla_table[:, :width].copy_(meta.mla_block_table[src_reqs, :width])
            mla_table[:, width:] = -1
        if self.hisparse is not None:
            self.hisparse.fill(meta.hisparse, size // self.q)
        # 2. the forward over them: replayed (captured at start-up), or eager
        self.num_steps += 1
        hidden, replayed = self._run(self._graphs, size, "decode forward", self._target(size))
        self.num_replays += replayed
        self._last = _PaddedStep(size, len(counts), src_rows, layout.out_rows, hidden)
        return hidden[layout.out_rows]

    def _layout(self, counts: Sequence[int], size: int, device: torch.device
                ) -> _LayoutTensors:
        """pad_layout(counts, q, size) on the device: uploaded the first time this batch shape
        runs, then kept (MAX_CACHED_LAYOUTS, the oldest dropped first)."""
        key = (tuple(counts), size)
        cached = self._layouts.get(key)
        if cached is None:
            layout = pad_layout(counts, self.q, size)
            src_rows, writes, src_reqs, out_rows = staging.upload([
                torch.tensor(layout.src_rows), torch.tensor(layout.writes),
                torch.tensor(layout.src_reqs), torch.tensor(layout.out_rows)], device)
            cached = _LayoutTensors(src_rows, writes.bool(), src_reqs, out_rows)
            if len(self._layouts) >= MAX_CACHED_LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
            self._layouts[key] = cached
        return cached

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        """The MTP drafts of the step `forward` ran last (every request drafts: decode-only),
        at its size → drafts [D, k] int64 in inputs' order, as MtpDrafter.propose gives them;
        writes the MTP layer's KV as it does."""
        step = self._last
        assert step is not None and len(inputs.request_ids) == step.num_reqs, (
            "propose follows forward, for the same decode-only step")
        size, num_slots = step.size, step.size // self.q
        # 1. step 0's tokens: the token after each copied row, the emitted one at the
        #    drafting rows
        next_ids = inputs.next_token_ids.index_put((inputs.rows,), inputs.tokens)  # [N]
        self.draft_ids[:size].copy_(next_ids[step.src_rows])
        # 2. the row each slot drafts from: its first (padding slots) or the accepted one
        padded_rows = step.out_rows[inputs.rows]  # [D] in inputs' order
        slot_of = padded_rows // self.q  # [D]
        rows = self.draft_rows[:num_slots]
        rows.copy_(self.slot_indices[:num_slots] * self.q)
        rows.index_copy_(0, slot_of, padded_rows)
        # 3. draft step j's positions and slots: one further each step, padding slots nowhere
        base = self.positions[:size][rows]  # [slots]
        live = self.slot_indices[:num_slots] < step.num_reqs
        for j in range(1, self.k):
            pos = self.draft_positions[j - 1, :num_slots]
            pos.copy_(base + j)
            written = kv_layout.slot_mapping(pos, self.slot_indices[:num_slots],
                                             self.block_table[:num_slots], self.block_size)
            self.draft_slots[j - 1, :num_slots].copy_(torch.where(live, written, -1))
            if self.mla_table is not None:  # HiSparse spilling: the MTP layer's MLA pages
                written = kv_layout.slot_mapping(pos, self.slot_indices[:num_slots],
                                                 self.mla_table[:num_slots], self.block_size)
                self.draft_mla_slots[j - 1, :num_slots].copy_(torch.where(live, written, -1))
        # 4. the chain over them: replayed (captured at start-up), or eager
        self.num_draft_steps += 1
        drafts, replayed = self._run(self._draft_graphs, size, "MTP drafts",
                                     self._drafts(size, step.hidden))
        self.num_draft_replays += replayed
        return drafts[slot_of]  # [D, k]

    @torch.inference_mode()
    def run_padding(self, size: int) -> None:
        """A step of this replica with no rows while the others pad theirs to `size` (DP +
        EP): the forward and, with MTP, the drafts of the all-padding batch of `size`,
        replayed where captured; their dispatches are the others' (the experts held here
        serve their rows). Writes no KV; the outputs are dropped."""
        self.num_padding_steps += 1
        self._fill_padding(size)
        hidden, replayed = self._run(self._graphs, size, "decode forward", self._target(size))
        self.num_padding_replays += replayed
        if self.k:
            self._run(self._draft_graphs, size, "MTP drafts", self._drafts(size, hidden))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every size's forward, and with MTP its drafts, over an all-padding batch
        (largest first), captured where `capture` is on: no step captures afterwards. Writes
        no KV; `_last` and the step counters are as they were (they count steps only)."""
        start = time.perf_counter()
        capturing = self.capture
        sizes = sorted(self.sizes, reverse=True)  # the shared pool is sized by the largest
        for size in tqdm(sizes, desc="capturing CUDA graphs", unit="size", file=sys.stderr,
                         disable=not capturing):
            if capturing and not self.capture:  # a capture failed: steps run eager
                break
            self._fill_padding(size)
            hidden = self._warm(self._graphs, size, "decode forward", self._target(size))
            if self.k:
                self._warm(self._draft_graphs, size, "MTP drafts", self._drafts(size, hidden))
        if capturing:
            logger.info("captured %d decode graphs (%d sizes%s) in %.1f s",
                        len(self._graphs) + len(self._draft_graphs), len(self._graphs),
                        ", with MTP drafts" if self.k else "", time.perf_counter() - start)

    def _fill_padding(self, size: int) -> None:
        """The static buffers of `size` for a batch of padding only: token 0 at position 0,
        reading block 0 (and MLA page 0: reads change nothing), written nowhere; the drafts'
        slots continue from their first rows, writing nowhere; HiSparse slots all trash."""
        num_slots = size // self.q
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slots[:size].fill_(-1)
        self.block_table[:num_slots].zero_()
        if self.mla_table is not None:
            self.mla_slots[:size].fill_(-1)
            self.mla_table[:num_slots].zero_()
        if self.hisparse is not None:
            self.hisparse.fill(None, num_slots)
        self.draft_ids[:size].zero_()
        self.draft_rows[:num_slots].copy_(self.slot_indices[:num_slots] * self.q)
        for j in range(1, self.k):
            self.draft_positions[j - 1, :num_slots].fill_(j)
            self.draft_slots[j - 1, :num_slots].fill_(-1)
            if self.draft_mla_slots is not None:
                self.draft_mla_slots[j - 1, :num_slots].fill_(-1)

    def _target(self, size: int) -> Callable[[], torch.Tensor]:
        """The target forward over the static buffers of `size` → hidden [size, hidden]."""
        meta, ids = self._metadata(size), self.input_ids[:size]
        return lambda: self.model(ids, meta, self.caches)

    def _drafts(self, size: int, hidden: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The MTP draft chain over the static buffers of `size`, from the target's padded
        output `hidden` [size, hidden] (a graph's static output where captured) → drafts
        [size / q, k]."""
        num_slots = size // self.q
        meta, ids, rows = self._metadata(size), self.draft_ids[:size], self.draft_rows[:num_slots]
        return lambda: draft_chain(self.model, self.caches, self.k, ids, hidden, meta, rows,
                                   lambda j: self._draft_metadata(num_slots, j))

    def _run(self, graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], size: int,
             what: str, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """fn() over the static buffers of `size` → (its output, whether replayed). `fn` reads
        only fixed addresses (a graph's static output included: the target's, for the
        drafts)."""
        if not self.capture:
            return fn(), False
        if size not in graphs:  # not warmed up: captured inside this step
            logger.info("capturing the %s of %d tokens in a CUDA graph at a step", what, size)
            if not self._capture(graphs, size, what, fn):
                return fn(), False
        graph, out = graphs[size]
        graph.replay()
        return out, True

    def _warm(self, graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], size: int,
              what: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """fn() of the all-padding batch, captured into graphs[size] where `capture` is on →
        its output (the graph's static output when captured: what the drafts' graph reads)."""
        if self.capture and self._capture(graphs, size, what, fn):
            return graphs[size][1]
        return fn()

    def _capture(self, graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]],
                 size: int, what: str, fn: Callable[[], torch.Tensor]) -> bool:
        """Record fn into graphs[size], in the pool every graph shares; False: it cannot be
        captured, and decode steps run eager from now on (`capture` off)."""
        try:
            graph, out = cudagraph.capture(fn, self._pool)
        except RuntimeError as e:  # a kernel that cannot be captured: serve eager
            if self.must_capture:
                raise RuntimeError(f"capturing the {what} of {size} tokens in a CUDA graph "
                                   f"failed ({e}); under DP + EP every rank must capture alike: "
                                   "run with --enforce-eager") from e
            logger.warning("capturing the %s of %d tokens failed (%s); decode steps run "
                           "eager from now on (--enforce-eager says so at start-up)",
                           what, size, e)
            self.capture = False
            return False
        self._pool = graph.pool()
        graphs[size] = (graph, out)
        return True

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
                hisparse=None if self.hisparse is None else self.hisparse.step(num_reqs),
                mla_block_table=None if self.mla_table is None else self.mla_table[:num_reqs],
                mla_slot_mapping=None if self.mla_slots is None else self.mla_slots[:size],
            )
        return self._metas[size]

    def _draft_metadata(self, num_slots: int, j: int) -> AttentionMetadata:
        """Draft step j's metadata over the static buffers of `num_slots` request slots, one
        row each; seq_lens the bound of its positions (lookahead included)."""
        key = (num_slots, j)
        if key not in self._draft_metas:
            self._draft_metas[key] = AttentionMetadata(
                positions=self.draft_positions[j - 1, :num_slots],
                req_indices=self.slot_indices[:num_slots],
                slot_mapping=self.draft_slots[j - 1, :num_slots],
                block_table=self.block_table[:num_slots],
                query_start_loc=tuple(range(num_slots + 1)),
                seq_lens=(self.max_model_len + self.k - 1,) * num_slots,
                block_size=self.block_size,
                use_dense=False,
                bounded_seq_lens=True,
                hisparse=None if self.hisparse is None else self.hisparse.draft_step(
                    num_slots, self.draft_positions[j - 1, :num_slots]),
                mla_block_table=None if self.mla_table is None else self.mla_table[:num_slots],
                mla_slot_mapping=(None if self.draft_mla_slots is None
                                  else self.draft_mla_slots[j - 1, :num_slots]),
            )
        return self._draft_metas[key]
