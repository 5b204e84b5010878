"""The runner-side half of the host KV tier: copies blocks between this rank's GPU caches and its
host pool, in the order the scheduler issued the jobs, and says how many of each kind are done.

    step k:  runner.execute(so)
               1. start so.kv_stores (GPU → host) and so.kv_loads (host → GPU) on copy streams,
                  after the work already queued on the compute stream (stores read blocks that
                  earlier steps wrote)
               2. the forward runs meanwhile on the compute stream
               3. poll: every job whose event has fired → num_*_done (a prefix of the job ids)

No CPU-GPU synchronisation: completion is `event.query()`. Safety comes from the scheduler: a
block being loaded belongs to no scheduled request until its load is reported done, and a block
being stored stays referenced (never reallocated, so never rewritten) until its store is done.
On CPU the copies are synchronous and every job is done as soon as it starts; the state machine
is the same, which is what CI tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import torch

from dsaserve.core import KVTransfer, ModelRunnerOutput, SchedulerOutput
from dsaserve.kv.host_pool import HostKVPool

# The most bytes one host↔GPU copy moves. A copy engine runs its copies in order, whole: the
# step's own small transfers (inputs in, sampled tokens out) queued behind a 20 MB layer copy
# would wait ~0.5 ms at 45 GB/s, behind a 2 MiB piece ~45 µs (the decode step measured
# 0.6 ms slower under copies; whether pieces remove it is owed: docs/offload.md). Bandwidth
# with pieces: 42.4 / 48.5 GB/s load / store on an H100, as whole runs gave on the H200.
COPY_PIECE_BYTES = 2 << 20


def host_runs(host_block_ids: tuple[int, ...],
              max_len: int | None = None) -> list[tuple[int, int, int]]:
    """Runs of consecutive host ids as (position in the job, first host id, length), each at most
    `max_len` long (None: unbounded).

        host ids  7 8 9 3 4 12   →   (0, 7, 3) (3, 3, 2) (5, 12, 1)
        max_len 2                →   (0, 7, 2) (2, 9, 1) (3, 3, 2) (5, 12, 1)
    """
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_block_ids):
        if runs and runs[-1][1] + runs[-1][2] == h and (max_len is None or runs[-1][2] < max_len):
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, h, 1))
    return runs


class KVCopier:
    """Starts copy jobs and tracks their completion, per kind, in job-id order."""

    def __init__(self, pool: HostKVPool, device: torch.device,
                 piece_bytes: int | None = COPY_PIECE_BYTES) -> None:
        self.pool = pool
        self.device = device
        self.piece_bytes = piece_bytes  # the most one copy moves (None: a whole run)
        cuda = device.type == "cuda"
        # Separate streams: a long store never delays a load (each has its own copy engine).
        self._streams = {k: torch.cuda.Stream(device) if cuda else None for k in ("load", "store")}
        self._pending: dict[str, deque[tuple[int, torch.cuda.Event | None]]] = {
            "load": deque(), "store": deque()}
        self._next = {"load": 0, "store": 0}  # the job id each kind expects next
        self.num_done = {"load": 0, "store": 0}
        self.bytes_copied = {"load": 0, "store": 0}

    # ---- the step --------------------------------------------------------------------------------
    def start(self, so: SchedulerOutput) -> None:
        for job in so.kv_stores:
            self._start("store", job)
        for job in so.kv_loads:
            self._start("load", job)

    def poll(self) -> tuple[int, int]:
        """(loads done, stores done) so far; a job counts once every job before it counts."""
        for kind, pending in self._pending.items():
            while pending and (pending[0][1] is None or pending[0][1].query()):
                pending.popleft()
                self.num_done[kind] += 1
        return self.num_done["load"], self.num_done["store"]

    def wait_for_one(self) -> None:
        """Block until the oldest copy in flight lands: for a step with nothing to compute, so
        that an engine waiting only on copies sleeps instead of spinning empty steps."""
        pending = [p[0][1] for p in self._pending.values() if p and p[0][1] is not None]
        if pending:
            pending[0].synchronize()

    def report(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        loads, stores = self.poll()
        return replace(output, num_kv_loads_done=loads, num_kv_stores_done=stores)

    @property
    def num_in_flight(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def drain(self) -> None:
        """Wait for every job (tests, shutdown); never on the step path."""
        for stream in self._streams.values():
            if stream is not None:
                stream.synchronize()
        self.poll()

    # ---- one job ---------------------------------------------------------------------------------
    def _start(self, kind: str, job: KVTransfer) -> None:
        if job.job_id != self._next[kind]:
            raise RuntimeError(f"kv {kind} job {job.job_id} arrived, expected {self._next[kind]}")
        if len(job.gpu_block_ids) != len(job.host_block_ids):
            raise ValueError(f"kv {kind} job {job.job_id}: gpu and host block lists differ")
        self._next[kind] += 1
        stream = self._streams[kind]
        event = None
        if stream is None:
            self._copy(kind, job)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._copy(kind, job)
                event = torch.cuda.Event()
                event.record(stream)
        self._pending[kind].append((job.job_id, event))
        self.bytes_copied[kind] += len(job.gpu_block_ids) * self.pool.block_bytes

    def _copy(self, kind: str, job: KVTransfer) -> None:
        ids = torch.tensor(job.gpu_block_ids, dtype=torch.int64)  # [n] GPU block ids
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        for region in self.pool.regions:
            page_bytes = region.gpu[0].numel() * region.gpu.element_size()
            runs = host_runs(job.host_block_ids, None if self.piece_bytes is None
                             else max(1, self.piece_bytes // page_bytes))
            if kind == "store":
                staged = region.gpu.index_select(0, ids)  # [n, page] on the device
                for start, first, n in runs:
                    region.host[first : first + n].copy_(staged[start : start + n],
                                                         non_blocking=True)
            else:
                if len(runs) == 1 and self.device.type != "cuda":
                    first, n = runs[0][1], runs[0][2]
                    staged = region.host[first : first + n]
                else:
                    staged = torch.empty(len(ids), region.gpu.shape[1], dtype=torch.uint8,
                                         device=self.device)  # [n, page]
                    for start, first, n in runs:
                        staged[start : start + n].copy_(region.host[first : first + n],
                                                        non_blocking=True)
                region.gpu.index_copy_(0, ids, staged)


def merge_rank_outputs(output: ModelRunnerOutput,
                       others: list[ModelRunnerOutput | None]) -> ModelRunnerOutput:
    """Rank 0's output with the copy-job counts every rank has reached: a block is loaded (or
    stored) only when every rank's shard of it is."""
    counts = [o for o in others if o is not None]
    if not counts:
        return output
    # (P/D reads are tallied over ranks and steps by the executor: disagg/receiving.py)
    return replace(
        output,
        num_kv_loads_done=min([output.num_kv_loads_done] + [o.num_kv_loads_done for o in counts]),
        num_kv_stores_done=min(
            [output.num_kv_stores_done] + [o.num_kv_stores_done for o in counts]),
    )
