"""Per-request sampling parameters kept on the device across steps, changed only by the
scheduler's diff (vLLM Model Runner V2's persistent sampling state, in our own words).

A request's row is its row of the block table (engine/block_table.py): written once when the
request is added, queued for the device and sent in the step's one pinned upload with the
block table's changes. A step's parameters are a device gather of its sampling requests' rows,
so building them costs the same few ops whatever the batch:

    mirror   row 0:  0.0  0  1.0   0   -1 -1 -1 -1   (greedy)              [max_rows, 4 + S]
             row 1:  0.8  0  0.9  45    2  7 -1 -1   (temperature, top-p,   int32, the fp32
                                                      min_tokens 5 after a   values stored as
                                                      40-token prompt: EOS   their bits
                                                      2, stop id 7)
             row 2:  1.0  5  1.0   0   -1 -1 -1 -1   (top-k)
             cols    temperature, top_k, top_p, min_end, stop ids (−1: padding)
    step     device[rows of the step's sampling requests]  → SamplingBatch [R] × 3 (+ [R, S]
             stop ids and min_end − the position of the row's token: min_tokens_left)

min_end = prompt length + min_tokens: the position of the first token that may be a stop id
(the token at position t is output t − prompt length). The runner gives each sampling row the
position of its token as the device has it (the host's schedule, moved back on the device by
rejected drafts under async MTP: engine/runner.py `_sample`), so the mask follows the tokens
really emitted, however far the host's count lags. S grows to the
largest stop set of a request (at most MAX_STOP_IDS).

The host flags of a step (some row samples / uses top-k / top-p / masks stop ids) are bounds
over the live requests, counted as they come and go: a feature no live request uses is skipped
for the step. A request stops counting as masking once its host-known tokens reach min_end
(the device's, which run ahead, are past it too).

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

_TEMPERATURE, _TOP_K, _TOP_P, _MIN_END = range(4)
_STOPS = 4  # the first stop-id column
MAX_STOP_IDS = 128  # ids a request may keep from sampling before min_tokens (a 400 past it)
_MIX = 0x9E3779B97F4A7C15  # spreads (engine seed, step) over the 64-bit seed space


def _fit(size: int, need: int) -> int:
    """`size`, or when `need` is past it, max(need, 2 · size): a table grows by doubling."""
    return size if need <= size else max(need, 2 * size)


class SamplingTable:
    """Rows of (temperature, top_k, top_p, min_end, stop ids) per live request at `row` (the
    block table's), on `device`; the seeded requests' generators; the step generator. Stop ids
    outside [0, vocab_size) are left out (no row samples them)."""

    def __init__(self, max_rows: int, device: torch.device, seed: int,
                 vocab_size: int = 2**31 - 1) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._table = MirroredArray(np.zeros((max(max_rows, 1), _STOPS + 4), dtype=np.int32),
                                    device)
        self._params: dict[str, tuple[int, SamplingParams]] = {}  # live request → (row, params)
        self._generators: dict[str, torch.Generator] = {}  # seeded live requests
        self.num_sampled = 0  # live requests that are not greedy
        self.num_top_k = 0
        self.num_top_p = 0
        # live requests with min_tokens stop ids → (min_end, the ids: their row's), and those
        # that may still mask (their host-known tokens short of min_end)
        self._stops: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._masking: set[str] = set()
        self._logprobs: Counter[int] = Counter()  # live requests by SamplingParams.logprobs
        self._seed = seed
        self._num_steps = 0
        self._step_generator = torch.Generator(device=device)

    @property
    def num_masking(self) -> int:
        """Live requests whose stop ids may still be masked (the host flag of min_tokens)."""
        return len(self._masking)

    # ---- the diff ------------------------------------------------------------------------------
    def add(self, request_id: str, row: int, params: SamplingParams,
            num_prompt_tokens: int = 0, eos_token_ids: tuple[int, ...] = (),
            num_tokens: int = 0) -> None:
        """A request runs for the first time (or again after preemption, its `num_tokens`
        known tokens past its prompt): its row written, and a seeded request's generator
        (re)started from its seed."""
        self.remove(request_id)
        stops = params.min_tokens_stop_ids(eos_token_ids, self.vocab_size)
        rows, cols = self._table.host.shape
        if row >= rows or _STOPS + len(stops) > cols:
            self._grow(_fit(rows, row + 1), _STOPS + _fit(cols - _STOPS, len(stops)))
            cols = self._table.host.shape[1]
        temperature, top_k, top_p = row_values(params)
        min_end = num_prompt_tokens + params.min_tokens if stops else 0
        values = np.full(cols, -1, dtype=np.int32)
        values[:_STOPS] = np.array([temperature, 0.0, top_p, 0.0],
                                   dtype=np.float32).view(np.int32)
        values[_TOP_K], values[_MIN_END] = top_k, min_end
        values[_STOPS : _STOPS + len(stops)] = stops
        self._table.write(np.arange(cols) + cols * row, values)
        self._params[request_id] = (row, params)
        if params.seed is not None and not params.greedy:
            self._generators[request_id] = make_generator(params, self.device, params.seed)
        self._count(temperature, top_k, top_p, +1)
        if stops:
            self._stops[request_id] = (min_end, stops)
            if num_tokens < min_end:
                self._masking.add(request_id)
        if params.logprobs is not None:
            self._logprobs[params.logprobs] += 1

    def tokens_known(self, request_id: str, num_tokens: int) -> None:
        """The host knows `num_tokens` of the request's tokens: at min_end it masks no more
        (its row's values say so too; only the flag's count changes)."""
        if request_id in self._masking and num_tokens >= self._stops[request_id][0]:
            self._masking.discard(request_id)

    def remove(self, request_id: str) -> None:
        """The request ended or was preempted (its row is the block table's to reuse)."""
        entry = self._params.pop(request_id, None)
        if entry is not None:
            self._count(*row_values(entry[1]), -1)
            self._generators.pop(request_id, None)
            self._stops.pop(request_id, None)
            self._masking.discard(request_id)
            n = entry[1].logprobs
            if n is not None:
                self._logprobs[n] -= 1
                if not self._logprobs[n]:
                    del self._logprobs[n]

    def _count(self, temperature: float, top_k: int, top_p: float, sign: int) -> None:
        self.num_sampled += sign * (temperature > 0)
        self.num_top_k += sign * (top_k > 0)
        self.num_top_p += sign * (top_p < 1)

    def _grow(self, rows: int, cols: int) -> None:
        """A larger table (new stop columns −1: no id), the device copy made from the mirror
        whole (queued writes included)."""
        old = self._table.host
        host = np.zeros((rows, cols), dtype=np.int32)
        host[:, _STOPS:] = -1
        host[: old.shape[0], : old.shape[1]] = old
        self._table = MirroredArray(host, self.device)

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

    def batch(self, request_ids: Sequence[str], rows: torch.Tensor,
              positions: torch.Tensor | None = None) -> SamplingBatch:
        """The step's parameters for `request_ids`, whose table rows are `rows` [R] (on the
        device); `positions` [R] int64 on the device: the position of the token each row
        samples (a verifying request's first row), needed when some live request masks
        (`num_masking`). Call once per step that samples: each call starts the next step's
        generator."""
        if not (self.num_sampled or self._masking):  # nothing to read, nothing to draw
            return SamplingBatch(None, None, None, any_sampled=False, any_top_k=False,
                                 any_top_p=False, seeded=(), generator=None)
        params = self._table.device_array.index_select(0, rows)  # [R, 4 + S] int32
        stop_ids = left = None
        if self._masking:
            assert positions is not None, "min_tokens: the rows' positions are needed"
            stop_ids = params[:, _STOPS:].long()  # [R, S]
            left = params[:, _MIN_END].long() - positions  # [R]
        if not self.num_sampled:  # every row greedy: no draws
            return SamplingBatch(None, None, None, any_sampled=False, any_top_k=False,
                                 any_top_p=False, seeded=(), generator=None,
                                 stop_ids=stop_ids, min_tokens_left=left)
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
            any_top_p=self.num_top_p > 0, seeded=seeded, generator=self._step_generator,
            stop_ids=stop_ids, min_tokens_left=left)

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
        assert self._masking <= self._stops.keys() <= self._params.keys()
        host = self._table.host
        for rid, (row, p) in self._params.items():
            t, k, top_p = row_values(p)
            assert host[row].view(np.float32)[[_TEMPERATURE, _TOP_P]].tolist() == [
                np.float32(t), np.float32(top_p)] and host[row, _TOP_K] == k, f"row {row}"
            min_end, stops = self._stops.get(rid, (0, ()))
            # its stop ids: its stop_token_ids and EOS ids (the table does not keep those)
            own = {t for t in p.stop_token_ids if 0 <= t < self.vocab_size}
            assert (own <= set(stops) if p.min_tokens else not stops), f"row {row}: stop ids"
            assert host[row, _MIN_END] == min_end, f"row {row}: min_end"
            padded = list(stops) + [-1] * (host.shape[1] - _STOPS - len(stops))
            assert host[row, _STOPS:].tolist() == padded, f"row {row}: stop ids"
        self._table.check_integrity()
