"""Per-request sampling parameters kept on the device across steps, changed only by the
scheduler's diff (vLLM Model Runner V2's persistent sampling state, in our own words).

A request's row is its row of the block table (engine/block_table.py): written once when the
request is added, queued for the device and sent in the step's one pinned upload with the
block table's changes. A step's parameters are a device gather of its sampling requests' rows,
so building them costs the same few ops whatever the batch:

    mirror   row 0:  0.0   0   1.0       (greedy)              [max_rows, 3] int32, the fp32
             row 1:  0.8   0   0.9       (temperature, top-p)  values stored as their bits
             row 2:  1.0   5   1.0       (top-k)
    step     device[rows of the step's sampling requests]  → SamplingBatch [R] × 3

The host flags of a step (some row samples / uses top-k / top-p) are bounds over the live
requests, counted as they come and go: a feature no live request uses is skipped for the step.
Seeded requests keep their own generator (their draws are reproducible whatever the batch);
the others draw from one generator per step, seeded from the engine seed and the step's number
so that every rank of a replica draws the same noise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.block_table import MirroredArray
from dsaserve.engine.sampler import SamplingBatch, make_generator, row_values

_TEMPERATURE, _TOP_K, _TOP_P = range(3)
_MIX = 0x9E3779B97F4A7C15  # spreads (engine seed, step) over the 64-bit seed space


class SamplingTable:
    """Rows of (temperature, top_k, top_p) per live request at `row` (the block table's), on
    `device`; the seeded requests' generators; the step generator."""

    def __init__(self, max_rows: int, device: torch.device, seed: int) -> None:
        self.device = device
        self._table = MirroredArray(np.zeros((max(max_rows, 1), 3), dtype=np.int32), device)
        self._params: dict[str, tuple[int, SamplingParams]] = {}  # live request → (row, params)
        self._generators: dict[str, torch.Generator] = {}  # seeded live requests
        self.num_sampled = 0  # live requests that are not greedy
        self.num_top_k = 0
        self.num_top_p = 0
        self._logprobs: Counter[int] = Counter()  # live requests by SamplingParams.logprobs
        self._seed = seed
        self._num_steps = 0
        self._step_generator = torch.Generator(device=device)

    # ---- the diff ------------------------------------------------------------------------------
    def add(self, request_id: str, row: int, params: SamplingParams) -> None:
        """A request runs for the first time (or again after preemption): its row written, and a
        seeded request's generator (re)started from its seed."""
        self.remove(request_id)
        if row >= self._table.host.shape[0]:
            self._grow(max(row + 1, 2 * self._table.host.shape[0]))
        temperature, top_k, top_p = row_values(params)
        values = np.array([temperature, 0.0, top_p], dtype=np.float32).view(np.int32)
        values[_TOP_K] = top_k
        self._table.write(np.arange(3) + 3 * row, values)
        self._params[request_id] = (row, params)
        if params.seed is not None and not params.greedy:
            self._generators[request_id] = make_generator(params, self.device, params.seed)
        self._count(temperature, top_k, top_p, +1)
        if params.logprobs is not None:
            self._logprobs[params.logprobs] += 1

    def remove(self, request_id: str) -> None:
        """The request ended or was preempted (its row is the block table's to reuse)."""
        entry = self._params.pop(request_id, None)
        if entry is not None:
            self._count(*row_values(entry[1]), -1)
            self._generators.pop(request_id, None)
            n = entry[1].logprobs
            if n is not None:
                self._logprobs[n] -= 1
                if not self._logprobs[n]:
                    del self._logprobs[n]

    def _count(self, temperature: float, top_k: int, top_p: float, sign: int) -> None:
        self.num_sampled += sign * (temperature > 0)
        self.num_top_k += sign * (top_k > 0)
        self.num_top_p += sign * (top_p < 1)

    def _grow(self, rows: int) -> None:
        host = np.zeros((rows, 3), dtype=np.int32)
        old = self._table.host
        host[: old.shape[0]] = old
        self._table = MirroredArray(host, self.device)  # queued writes are in its copy

    @property
    def top_logprobs_width(self) -> int:
        """How many most likely tokens a step reports per emitted token: the largest
        SamplingParams.logprobs of the live requests (a host-known bound, like the flags; at
        most --max-logprobs + 1 distinct values to look at); 0: no step top-k."""
        return max(self._logprobs, default=0)

    def row_of(self) -> dict[str, int]:
        """Live request → its row."""
        return {rid: row for rid, (row, _) in self._params.items()}

    # ---- the step -----------------------------------------------------------------------------
    def pending(self) -> torch.Tensor:  # [2, n] int64: flat index, value (host)
        """The entries changed since the last step, for the step's upload."""
        return self._table.pending()

    def apply(self, pairs: torch.Tensor) -> None:
        """The changed entries (`pending`, uploaded) written into the device table."""
        self._table.apply(pairs)

    def batch(self, request_ids: Sequence[str], rows: torch.Tensor) -> SamplingBatch:
        """The step's parameters for `request_ids`, whose table rows are `rows` [R] (on the
        device). Call once per step that samples: each call starts the next step's generator."""
        if not self.num_sampled:  # every row greedy: nothing to read, nothing to draw
            return SamplingBatch(None, None, None, any_sampled=False, any_top_k=False,
                                 any_top_p=False, seeded=(), generator=None)
        params = self._table.device_array.index_select(0, rows)  # [R, 3] int32
        seeded: tuple[tuple[int, torch.Generator], ...] = ()
        if self._generators:  # a loop over the step's requests only when some are seeded
            seeded = tuple((r, self._generators[rid]) for r, rid in enumerate(request_ids)
                           if rid in self._generators)
        self._step_generator.manual_seed((self._seed * _MIX + self._num_steps) % 2**64)
        self._num_steps += 1
        return SamplingBatch(
            temperature=params[:, _TEMPERATURE].view(torch.float32),
            top_k=params[:, _TOP_K].long(),
            top_p=params[:, _TOP_P].view(torch.float32),
            any_sampled=self.num_sampled > 0, any_top_k=self.num_top_k > 0,
            any_top_p=self.num_top_p > 0, seeded=seeded, generator=self._step_generator)

    def check_integrity(self) -> None:
        """The counts are the live requests'; each live row holds its request's values; the
        device copy equals the mirror wherever no change waits (a device read: for tests)."""
        rows = [row for row, _ in self._params.values()]
        assert len(rows) == len(set(rows)), "a row held by two requests"
        values = [row_values(p) for _, p in self._params.values()]
        assert self.num_sampled == sum(t > 0 for t, _, _ in values)
        assert self.num_top_k == sum(k > 0 for _, k, _ in values)
        assert self.num_top_p == sum(p < 1 for _, _, p in values)
        assert self._generators.keys() <= self._params.keys()
        assert self._logprobs == Counter(
            p.logprobs for _, p in self._params.values() if p.logprobs is not None)
        host = self._table.host
        for row, p in self._params.values():
            t, k, top_p = row_values(p)
            assert host[row].view(np.float32)[[_TEMPERATURE, _TOP_P]].tolist() == [
                np.float32(t), np.float32(top_p)] and host[row, _TOP_K] == k, f"row {row}"
        self._table.check_integrity()
