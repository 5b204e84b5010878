"""The shared-memory transport's copy thread: a READ or WRITE is posted in one step and its bytes
move here while the engine keeps stepping (what UCX does for a NIXL transfer).

    posting thread (the runner)             copy thread (one per transport, started lazily)
    ───────────────────────────             ───────────────────────────────────────────────
    job = copies.submit(pairs, on_done) ──► FIFO queue → each (dst, src) pair copied in chunks
    job.state (a poll: never blocks)          of CHUNK bytes, `cancelled` looked at between
                                              chunks; then on_done() (the notification) →
                                              DONE, or FAILED with the error
    copies.cancel(job) ── returns once the thread is not inside the job
    copies.close()     ── cancels every job, joins the thread

`cancel` is exact: after it returns no byte of the job lands any more (a queued job never
starts, a running one stops at its next chunk boundary, at most CHUNK bytes later), so a
cancelled READ's destination can be given to someone else at once.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CHUNK = 4 << 20  # bytes copied between two looks at `cancelled`: bounds how long a cancel waits


class CopyState(enum.Enum):
    QUEUED = "queued"
    COPYING = "copying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class CopyJob:
    """One posted transfer's copies, in order; `state` is written by the copy thread only once
    the job left it (or by `cancel` while it is queued)."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source), each [n] uint8
    on_done: Callable[[], None]  # on the copy thread once every byte moved (the notification)
    state: CopyState = CopyState.QUEUED
    error: str = ""  # FAILED: what on_done raised
    cancelled: bool = False  # asked to stop: the copy thread leaves it at the next chunk


class CopyThread:
    """Copies posted jobs one after the other on one daemon thread, started at the first job."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cv = threading.Condition()
        self._queue: deque[CopyJob] = deque()
        self._current: CopyJob | None = None  # the job the thread is inside
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
               on_done: Callable[[], None]) -> CopyJob:
        job = CopyJob(list(pairs), on_done)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name}: the copy thread is closed")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()
            self._cv.notify_all()
        return job

    def cancel(self, job: CopyJob) -> None:
        """Stop `job`; on return none of its bytes land any more (waits for the chunk being
        copied, if the thread is inside it). A job already DONE or FAILED stays so."""
        with self._cv:
            if job.state is CopyState.QUEUED:
                self._queue.remove(job)
                job.state = CopyState.CANCELLED
                return
            job.cancelled = True
            while self._current is job:
                self._cv.wait()

    def close(self) -> None:
        """Cancel every job (the one being copied stops at its next chunk) and join the thread."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.state = CopyState.CANCELLED
            self._queue.clear()
            if self._current is not None:
                self._current.cancelled = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return  # closed
                job = self._queue.popleft()
                job.state = CopyState.COPYING
                self._current = job
            state, error = CopyState.CANCELLED, ""
            try:
                if self._copy(job):
                    job.on_done()
                    state = CopyState.DONE
            except Exception as e:  # a failed notification: the poller raises it
                state, error = CopyState.FAILED, str(e)
            with self._cv:
                job.state, job.error = state, error
                self._current = None
                self._cv.notify_all()

    def _copy(self, job: CopyJob) -> bool:
        """Every pair's bytes, in chunks; False when cancelled part-way."""
        for dst, src in job.pairs:
            for start in range(0, dst.numel(), CHUNK):
                if job.cancelled:
                    return False
                self._copy_chunk(dst[start: start + CHUNK], src[start: start + CHUNK])
        return not job.cancelled

    def _copy_chunk(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # [<= CHUNK] uint8 each
