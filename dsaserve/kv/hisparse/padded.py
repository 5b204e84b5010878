"""HiSparse steps of the padded decode path (engine/decode_graph.py): one `HiSparseStep` per
capture size over static buffers, every shape and Python int fixed by the size, so that a CUDA
graph captured at a size's first step replays every later one.

Every request slot of the padded batch is tracked and resolved; a slot whose request reads its
GPU pages (context within the hot buffer) or is padding takes the trash region T (the runtime's
region `max_requests`, no request's), and its rows resolve nothing (row_region −1: an empty
union, so no fetch and no hot-slot write):

    slot               0 (hot)    1 (pages)   2 (hot)    3 (padding)
    tracked region     c0         c1          c2         T
    hot region         c0         T           c2         T
    rows (q = 2)       0 0        −1 −1       2 2        −1 −1     row_region: the slot, or −1
    row_hot            1 1        0 0         1 1        0 0

The hot and the page path both run for every row and row_hot picks (`padded`): one graph per
size whatever mix of hot and page-reading requests a step has, at the price of the page path's
sparse MLA in all-hot steps and a residency step over empty unions in all-page ones.

A step fills the buffers by device copies from its own `HiSparseStep` (built from host lists by
`HiSparseRuntime.step`): slot r holds request r (pad_layout keeps the requests' order), so the
step's per-request tensors scatter to their request index. The MTP draft steps (one row per
slot) reuse the slots' regions and mirrored_upto, as `ModelRunner._moved_rows` leaves them for
a decode-only step (a request reads through its buffer in the draft steps as in the target
step, and the first position the step wrote is its first row's), and track from the draft
positions.
"""

from __future__ import annotations

import torch

from dsaserve.kv.hisparse.runtime import HiSparseStep


class PaddedHiSparse:
    """The static HiSparse buffers of a `DecodeGraphs` (its largest size; a size uses their
    first rows); `q` rows per request slot; `trash_region`: the runtime's."""

    def __init__(self, trash_region: int, max_size: int, q: int, device: torch.device) -> None:
        self.q = q
        self.trash = trash_region
        num_slots = max_size // q

        def full(n: int, value: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.full((n,), value, dtype=dtype, device=device)

        with torch.inference_mode():  # written inside the model's inference-mode forward
            # per request slot
            self.tracked_regions = full(num_slots, self.trash)  # [slots]
            self.tracked_from = full(num_slots, 0)  # [slots] first position the step writes
            self.hot_regions = full(num_slots, self.trash)  # [slots]
            self.mirrored_upto = full(num_slots, 0)  # [slots]
            self.slot_hot = full(num_slots, 0, torch.bool)  # [slots]
            self.slot_indices = torch.arange(num_slots, device=device)  # tracked = hot = all
            self.slot_region = full(num_slots, -1)  # [slots] draft rows: the slot, or −1
            self.first_rank = full(num_slots, 0)  # [slots] draft rows: one per slot
            # per padded row (row i in slot i // q, rank i % q)
            self.row_slot = torch.arange(max_size, device=device) // q
            self.row_rank = torch.arange(max_size, device=device) % q
            self.row_region = full(max_size, -1)  # [size]
            self.row_hot = full(max_size, 0, torch.bool)  # [size]
        self._steps: dict[int, HiSparseStep] = {}

    def fill(self, step: HiSparseStep | None, num_slots: int) -> None:
        """The buffers of `num_slots` request slots from the step's own description (None: no
        request is tracked); slots past its requests are padding."""
        ns = num_slots
        self.tracked_regions[:ns].fill_(self.trash)
        self.tracked_from[:ns].zero_()
        self.hot_regions[:ns].fill_(self.trash)
        self.mirrored_upto[:ns].zero_()
        self.slot_hot[:ns].zero_()
        if step is not None:
            self.tracked_regions.index_copy_(0, step.tracked_requests, step.tracked_regions)
            self.tracked_from.index_copy_(0, step.tracked_requests, step.tracked_from)
            self.hot_regions.index_copy_(0, step.hot_requests, step.hot_regions)
            self.mirrored_upto.index_copy_(0, step.hot_requests, step.mirrored_upto)
            self.slot_hot.index_fill_(0, step.hot_requests, True)
        self.slot_region[:ns].copy_(torch.where(self.slot_hot[:ns], self.slot_indices[:ns], -1))
        size = ns * self.q
        self.row_hot[:size].copy_(self.slot_hot[self.row_slot[:size]])
        self.row_region[:size].copy_(torch.where(self.row_hot[:size], self.row_slot[:size], -1))

    def step(self, num_slots: int) -> HiSparseStep:
        """The target step's description over the buffers: one object per size."""
        if num_slots not in self._steps:
            ns, size = num_slots, num_slots * self.q
            self._steps[ns] = HiSparseStep(
                tracked_regions=self.tracked_regions[:ns], tracked_requests=self.slot_indices[:ns],
                tracked_from=self.tracked_from[:ns], hot_regions=self.hot_regions[:ns],
                hot_requests=self.slot_indices[:ns], mirrored_upto=self.mirrored_upto[:ns],
                row_region=self.row_region[:size], row_rank=self.row_rank[:size],
                row_hot=self.row_hot[:size], max_rows=self.q, num_hot=ns, num_reqs=ns,
                padded=True)
        return self._steps[num_slots]

    def draft_step(self, num_slots: int, positions: torch.Tensor) -> HiSparseStep:
        """A draft step's, one row per slot at `positions` [slots] (a static buffer): what
        the draft rows rewrite from there on is stale."""
        ns = num_slots
        return HiSparseStep(
            tracked_regions=self.tracked_regions[:ns], tracked_requests=self.slot_indices[:ns],
            tracked_from=positions, hot_regions=self.hot_regions[:ns],
            hot_requests=self.slot_indices[:ns], mirrored_upto=self.mirrored_upto[:ns],
            row_region=self.slot_region[:ns], row_rank=self.first_rank[:ns],
            row_hot=self.slot_hot[:ns], max_rows=self.q, num_hot=ns, num_reqs=ns, padded=True)
