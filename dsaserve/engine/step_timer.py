"""--step-log, the runner's half: each step's GPU time from CUDA events on its stream, read
without a host sync.

    launch k:   start ─ forward ─ fwd_end ─ sampling, drafts ─ end   (recorded on the stream)
    launch k+1: poll(): steps whose `end` has passed (event.query(), no wait) → StepGpuTime

An event pair's elapsed time is read only once its later event has passed, so the log never
waits for the device; a step's time reaches the engine with the output of a later step (or
`drain` at shutdown, which does wait). The elapsed times are the stream's: an eager forward
whose launches the GPU waits for counts those waits too (a graph replay has none). Off CUDA
there are no events: `record_*` do nothing and the steps' GPU times are unknown.
"""

from __future__ import annotations

from collections import deque

import torch

from dsaserve.core import StepGpuTime


class StepTimer:
    """The launched steps' event triples, oldest first, until each has passed."""

    def __init__(self, device: torch.device) -> None:
        self.timed = device.type == "cuda"
        # (step index, start, forward end, step end)
        self._launched: deque[tuple[int, torch.cuda.Event, torch.cuda.Event,
                                    torch.cuda.Event]] = deque()
        self._start: torch.cuda.Event | None = None
        self._forward_end: torch.cuda.Event | None = None

    def _record(self) -> torch.cuda.Event | None:
        if not self.timed:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def record_start(self) -> None:
        """Before the target forward is launched."""
        self._start = self._record()

    def record_forward_end(self) -> None:
        """After the forward (a graph replay or the eager layers) is launched."""
        self._forward_end = self._record()

    def record_end(self, index: int) -> None:
        """After the step's sampling and drafts are launched (before its results' copy)."""
        end = self._record()
        if end is not None:
            assert self._start is not None and self._forward_end is not None
            self._launched.append((index, self._start, self._forward_end, end))
        self._start = self._forward_end = None

    def poll(self) -> tuple[StepGpuTime, ...]:
        """The steps whose last event has passed, oldest first (a stream's events pass in
        order); nothing waits."""
        done = []
        while self._launched and self._launched[0][3].query():
            done.append(self._elapsed(*self._launched.popleft()))
        return tuple(done)

    def drain(self) -> tuple[StepGpuTime, ...]:
        """Every launched step's time, waiting for the last (shutdown only)."""
        if self._launched:
            self._launched[-1][3].synchronize()
        return self.poll()

    @staticmethod
    def _elapsed(index: int, start: torch.cuda.Event, forward_end: torch.cuda.Event,
                 end: torch.cuda.Event) -> StepGpuTime:
        return StepGpuTime(index, start.elapsed_time(forward_end), start.elapsed_time(end))
