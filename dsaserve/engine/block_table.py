"""The block table kept on the device across steps, changed only where the scheduler's diff
changes it (vLLM Model Runner V2's BlockTable, in our own words).

A request holds a row from the step it first runs until it ends (finished, preempted, aborted).
The host keeps a mirror of every row (numpy: reading it is never a device read). Each change
is written to the mirror and its flat index queued; the queued entries go to the device in the
step's one pinned upload (kernels/staging.py) as (index, value) pairs and are scattered there by
one index_put_. A step's table is a device gather of its requests' rows, as wide as its longest
request:

    mirror   row 0:  7  8  9 -1 -1       queued (row·C + col): 2        ← 9 appended to row 0
             row 1:  3 -1 -1 -1 -1                             C+1, C+2 ← row 1 cut to 1 block
             row 2:  5  6 -1 -1 -1       (a free row: stale until reused, never gathered)
    device   the same array once `apply` has run the step's pairs
    step     device[rows of the step's requests, :longest]     [R, width]

A decode step sends the blocks it adds (at most 1 + k per request) and R row indices, not R ×
width block ids. Entries past a row's length are −1 (cut and reused rows are cleared), as the
kernels and slot maps read −1 as "no block".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MirroredArray:
    """An int32 host array and its device copy, equal once `apply` has run the pairs that
    `pending` returned. Writes go to the host at once and are queued for the device; only the
    last value of an entry written twice travels (index_put_ with repeated indices is
    unordered on CUDA)."""

    def __init__(self, host: np.ndarray, device: torch.device) -> None:
        assert host.dtype == np.int32
        self.host = host
        self.device = device
        # one blocking copy, at set-up (and when a BlockTable grows)
        self.device_array = torch.from_numpy(host).to(device, copy=True)
        self._queued: list[np.ndarray] = []  # flat indices written since the last `pending`

    def write(self, index: np.ndarray, values: np.ndarray | Sequence[int]) -> None:
        """host.flat[index] = values, queued for the device."""
        self.host.reshape(-1)[index] = values
        self._queued.append(np.asarray(index, dtype=np.int64).reshape(-1))

    def pending(self) -> torch.Tensor:  # [2, n] int64 on the host: flat index, value
        """The entries written since the last call, for the step's upload; the queue empties."""
        if not self._queued:
            return torch.zeros(2, 0, dtype=torch.int64)
        index = np.unique(np.concatenate(self._queued))
        self._queued = []
        values = self.host.reshape(-1)[index].astype(np.int64)
        return torch.from_numpy(np.stack((index, values)))

    def apply(self, pairs: torch.Tensor) -> None:
        """Scatter `pending`'s pairs [2, n] (on the device) into the device copy."""
        if pairs.shape[1]:
            self.device_array.view(-1).index_put_((pairs[0],), pairs[1].to(torch.int32))


    def check_integrity(self) -> None:
        """The device copy equals the host wherever no write is queued (a device read)."""
        same = self.device_array.cpu().numpy() == self.host
        if self._queued:
            same.reshape(-1)[np.concatenate(self._queued)] = True
        assert same.all(), "the device copy is not the host array"


class BlockTable:
    """Rows of block ids per request, mirrored on the host and kept on `device`; grows (rows or
    columns) when a request needs more than it was sized for."""

    def __init__(self, max_rows: int, max_blocks_per_row: int, device: torch.device) -> None:
        self._table = MirroredArray(np.full((max(max_rows, 1), max(max_blocks_per_row, 1)), -1,
                                            dtype=np.int32), device)
        self.row_of: dict[str, int] = {}  # request id → its row
        self._free_rows = list(range(self.max_rows - 1, -1, -1))  # popped from the end
        # [max_rows] blocks of each row in use; of a free row, the entries it may still hold
        self.num_blocks = np.zeros(self.max_rows, dtype=np.int64)

    @property
    def max_rows(self) -> int:
        return self._table.host.shape[0]

    @property
    def max_blocks_per_row(self) -> int:
        return self._table.host.shape[1]

    @property
    def host(self) -> np.ndarray:  # [max_rows, max_blocks_per_row] int32, −1 = none
        return self._table.host

    # ---- the diff ------------------------------------------------------------------------------
    def add(self, request_id: str, block_ids: Sequence[int]) -> None:
        """A request runs for the first time (or again after preemption): its row, filled."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.max_rows, self.max_blocks_per_row)
            row = self._free_rows.pop()
            self.row_of[request_id] = row
        self._set(row, 0, block_ids)

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        row = self.row_of[request_id]
        self._set(row, int(self.num_blocks[row]), block_ids)

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """Keep the row's first `num_blocks` blocks (those of rejected drafts were given
        back)."""
        row = self.row_of[request_id]
        if num_blocks < self.num_blocks[row]:
            self._set(row, num_blocks, ())

    def remove(self, request_id: str) -> None:
        """The request ended or was preempted: its row is free (cleared when reused)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _set(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Row `row` = its first `start` blocks, then `block_ids`; −1 past them."""
        end = start + len(block_ids)
        if end > self.max_blocks_per_row:
            self._grow(self.max_rows, max(end, 2 * self.max_blocks_per_row))
        old = int(self.num_blocks[row])
        cols = np.arange(start, max(end, old), dtype=np.int64)
        values = np.full(len(cols), -1, dtype=np.int32)
        values[: len(block_ids)] = block_ids
        self._table.write(row * self.max_blocks_per_row + cols, values)
        self.num_blocks[row] = end

    def _grow(self, rows: int, cols: int) -> None:
        """A larger table: the mirror copied in, the device copy made from it whole (queued
        writes included)."""
        old = self._table.host
        host = np.full((rows, cols), -1, dtype=np.int32)
        host[: old.shape[0], : old.shape[1]] = old
        self._free_rows = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free_rows
        self.num_blocks = np.concatenate(
            (self.num_blocks, np.zeros(rows - old.shape[0], dtype=np.int64)))
        self._table = MirroredArray(host, self._table.device)

    # ---- the step -----------------------------------------------------------------------------
    def blocks(self, request_id: str) -> np.ndarray:  # [num_blocks] int32, a view of the mirror
        row = self.row_of[request_id]
        return self.host[row, : self.num_blocks[row]]

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:  # [R] int64
        return np.fromiter((self.row_of[rid] for rid in request_ids), dtype=np.int64,
                           count=len(request_ids))

    def pending(self) -> torch.Tensor:  # [2, n] int64: flat index, block id (host)
        """The entries changed since the last step, for the step's upload."""
        return self._table.pending()

    def apply(self, pairs: torch.Tensor) -> None:
        """The changed entries (`pending`, uploaded) written into the device table."""
        self._table.apply(pairs)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:  # [R, width] int32
        """The step's table on the device: rows [R] (on the device), `width` columns."""
        return self._table.device_array[:, :width].index_select(0, rows)

    def check_integrity(self) -> None:
        """Rows in use and free rows partition the table; entries past a used row's blocks are
        −1; the device copy equals the mirror wherever no change waits for the next step (a
        device read: for tests)."""
        used = sorted(self.row_of.values())
        assert len(used) == len(set(used)), "a row held by two requests"
        assert sorted(used + self._free_rows) == list(range(self.max_rows)), "rows lost"
        for row in used:
            assert (self.host[row, self.num_blocks[row]:] == -1).all(), f"row {row}: stale tail"
        self._table.check_integrity()
