"""P/D consumer: READs posted in one step and polled, without blocking, in the following ones.

    step k                       step k+1 … k+n                     step k+n+1
    ──────                       ──────────────                     ──────────
    post the READs (KVRecv) ──►  poll each once: still in flight ─► all DONE: notify the
    request WAITING_FOR_         (other requests decode meanwhile)   producer, report it in
    REMOTE_KVS, not scheduled                                        kv_recvs_done → it runs

vLLM's model (the worker's `get_finished` → `finished_recving`): the scheduler keeps the request
out of the batch until every rank reported it. A READ that fails, or a request whose READs are
not all done within `transfer_timeout_s`, is reported failed (the scheduler ends it with the
reason) — but only once none of its READs is still in flight, so that its blocks are never given
back while bytes can still land in them (a timed-out READ is cancelled first).

An abort goes the other way: the scheduler frees the request's blocks and id at once, and each
rank cancels its READs at the start of the next step (`PostedRead.cancel`, before anything else
of that step can write into those blocks); a cancel returns once nothing of the READ can land.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.core import ModelRunnerOutput
from dsaserve.disagg.staging import StagedPair, StagingBuffer, StagingPool, scatter_staged
from dsaserve.disagg.transport import KVTransport, Transfer, TransferError


@dataclass
class StagedReads:
    """A request's staged pairs (disagg/staging.py) of one staging pool: the buffer their READs
    land in, and per pair its plan, its offset in the buffer and the byte views its rows are
    scattered into once all landed."""

    pool: StagingPool
    buffer: StagingBuffer
    scatters: list[tuple[StagedPair, int, list[dict[str, list[torch.Tensor]]]]] = field(
        default_factory=list)

    def settle(self, landed: bool) -> None:
        """None of the request's READs is in flight any more: the rows scattered into their
        slots if they all `landed`, then the buffer given back (failed or cancelled: unused)."""
        if landed:
            for sp, base, targets in self.scatters:
                scatter_staged(sp, self.buffer.tensor[base: base + sp.nbytes], targets)
        self.pool.give(self.buffer)


@dataclass
class ReadTimes:
    """A consumer rank's READs so far, on its host clock: where a request's wait for its KV
    goes (posting the READs, then in flight until a poll finds them all landed)."""

    requests: int = 0  # requests whose READs all landed
    post_s: float = 0.0  # building and posting their READs (descriptors, NIXL requests)
    in_flight_s: float = 0.0  # from the end of posting to the poll that found them landed
    polls: int = 0  # polls of those requests (one per step while in flight)


@dataclass
class PostedRead:
    """One request's READs on one rank, from the step that posted them until they settle."""

    request_id: str
    deadline: float  # time.monotonic() after which what is still in flight is given up
    transfers: list[Transfer] = field(default_factory=list)  # still in flight
    error: str | None = None  # the first failure; the request fails once nothing is in flight
    producer: str = ""  # the prefill engine's rank 0, notified once every READ landed
    notify: bytes = b""
    # staged pairs: one buffer per staging pool they use (the caches' pool, a host pool's)
    staged: list[StagedReads] = field(default_factory=list)
    post_s: float = 0.0  # host time posting the READs
    posted_at: float = 0.0  # time.perf_counter() when posting ended
    polls: int = 0

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def poll(self, transport: KVTransport, now: float) -> bool:
        """Poll each READ still in flight once (never blocks); True when none is left (done, or
        failed: `error`). Past the deadline the rest are cancelled and the request fails."""
        self.polls += 1
        still = []
        for xfer in self.transfers:
            try:
                if not transport.poll(xfer):
                    still.append(xfer)
            except TransferError as e:
                self.fail(str(e))
        if still and now > self.deadline:
            for xfer in still:
                transport.cancel(xfer)
            self.fail(f"{len(still)} READ(s) not done within the transfer timeout "
                      "(is the prefill engine alive?)")
            still = []
        self.transfers = still
        return not still

    def cancel(self, transport: KVTransport) -> None:
        """Give up every READ still in flight; on return none of them writes any more."""
        for xfer in self.transfers:
            transport.cancel(xfer)
        self.transfers = []


@dataclass
class RecvTally:
    """The engine's view over its ranks: a prompt's KV arrived when every rank read its share,
    and failed when any rank failed — reported once every rank has settled it (ranks settle in
    different steps: each polls its own READs)."""

    num_ranks: int
    _settled: dict[str, int] = field(default_factory=dict)  # request id → ranks settled
    _errors: dict[str, str] = field(default_factory=dict)

    def merge(self, outputs: list[ModelRunnerOutput]) -> tuple[tuple[str, ...], dict[str, str]]:
        """This step's ranks' reports (one output per rank) → (arrived, failed with reason)."""
        for out in outputs:
            for rid in out.kv_recvs_done:
                self._settled[rid] = self._settled.get(rid, 0) + 1
            for rid, reason in out.kv_recvs_failed.items():
                self._settled[rid] = self._settled.get(rid, 0) + 1
                self._errors.setdefault(rid, reason)
        done: list[str] = []
        failed: dict[str, str] = {}
        for rid in [r for r, n in self._settled.items() if n >= self.num_ranks]:
            del self._settled[rid]
            if rid in self._errors:
                failed[rid] = self._errors.pop(rid)
            else:
                done.append(rid)
        return tuple(done), failed

    def forget(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Requests that ended (aborted while receiving): the ranks' earlier reports are void,
        so that a new request under the same id starts from no rank settled."""
        for rid in request_ids:
            self._settled.pop(rid, None)
            self._errors.pop(rid, None)
