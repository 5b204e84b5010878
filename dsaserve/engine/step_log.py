"""--step-log PATH: the engine appends one JSON line per step that computed tokens, in step
order, so that a running engine's decode speed can be read as benchmarks/decode.py measures
it (dsaserve/bench/steplog.py summarises a log into that table).

A line is complete once the step's results are read (sync: at once; --async-scheduling: one
engine step later) and, on a GPU, its device time has come back: rank 0's runner records CUDA
events around the step (engine/step_timer.py) and reads them only once they have passed, so
a line is written one or two steps after its step, or at shutdown. Nothing waits for the
device. Fields (times in ms):

    step              engine steps with tokens, from 0 (per DP replica: `dp_rank`)
    interval_ms       since the previous line's step's results were read: the step's wall
                      time as a caller sees it; steps with no tokens and idle time between
                      steps count in it (null: the first line)
    schedule_ms       host time of the scheduler's schedule() for this step
    launch_ms         host time of the runner's launch: the diff applied, the batch built,
                      forward, sampling and drafts launched (the results' copy not included)
    num_reqs, num_tokens            scheduled (SchedulerOutput)
    num_decode_rows, num_prefill_rows   rows of requests decoding (last token + drafts), others
    num_drafts        drafts verified;  num_accepted: of them accepted
    num_sampling_reqs requests that got tokens;  num_sampled: tokens they got
    padded_size       the padded path's size (null: eager as it is); graph, draft_graph:
                      replayed from a CUDA graph;  async: --async-scheduling
    gpu_forward_ms    CUDA events around the target forward on the stream (null off CUDA)
    gpu_step_ms       forward start → the step's sampling and drafts done (not the copy)
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from dsaserve.core import ModelRunnerOutput, SchedulerOutput, StepGpuTime


@dataclass
class _Line:
    fields: dict[str, Any]
    complete: bool  # its GPU time is in (or will never come)


class StepLog:
    """One engine's (one DP replica's) writer; the engine calls `record` for each step whose
    results it read, in order."""

    def __init__(self, path: str, *, async_scheduling: bool, dp_rank: int = 0) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115  (closed by close())
        self.async_scheduling = async_scheduling
        self.dp_rank = dp_rank
        self.num_steps = 0
        self._last_read: float | None = None
        # lines whose GPU time has not come back yet, in step order, and them by runner index
        self._waiting: deque[_Line] = deque()
        self._by_index: dict[int, _Line] = {}
        # --async-scheduling: schedule() time of steps launched and not yet read
        self._schedule_ms: dict[int, float] = {}

    def restart_clock(self) -> None:
        """The next line's interval counts from now (a caller driving a runner directly:
        benchmarks/decode.py, after its warm-up steps)."""
        self._last_read = time.perf_counter()

    def scheduled(self, so: SchedulerOutput, schedule_ms: float) -> None:
        """--async-scheduling: step `so` was scheduled (its line comes when it is read)."""
        self._schedule_ms[id(so)] = schedule_ms

    def record(self, so: SchedulerOutput, out: ModelRunnerOutput,
               schedule_ms: float | None = None) -> None:
        """Step `so`'s results were read: its line, written once its GPU time is known."""
        now = time.perf_counter()
        if schedule_ms is None:
            schedule_ms = self._schedule_ms.pop(id(so), None)
        if so.is_empty:
            self.take_gpu_times(out.gpu_times)
            return
        interval = None if self._last_read is None else 1e3 * (now - self._last_read)
        self._last_read = now
        stats = out.step_stats
        sampled = {rid: len(t) for rid, t in out.sampled_token_ids.items() if t}
        fields: dict[str, Any] = {
            "step": self.num_steps, "dp_rank": self.dp_rank,
            "interval_ms": None if interval is None else round(interval, 4),
            "schedule_ms": None if schedule_ms is None else round(schedule_ms, 4),
            "launch_ms": None if stats is None else round(stats.launch_ms, 4),
            "num_reqs": len(so.num_scheduled_tokens),
            "num_tokens": so.total_num_scheduled_tokens,
            "num_decode_rows": None if stats is None else stats.num_decode_rows,
            "num_prefill_rows": None if stats is None else stats.num_prefill_rows,
            "num_drafts": sum(map(len, so.scheduled_spec_token_ids.values())),
            # a verifying request's tokens: its accepted drafts, then the target's own
            "num_accepted": sum(n - 1 for rid, n in sampled.items()
                                if so.scheduled_spec_token_ids.get(rid)),
            "num_sampling_reqs": len(sampled), "num_sampled": sum(sampled.values()),
            "padded_size": None if stats is None else stats.padded_size,
            "graph": stats is not None and stats.graph,
            "draft_graph": stats is not None and stats.draft_graph,
            "async": self.async_scheduling, "gpu_forward_ms": None, "gpu_step_ms": None,
        }
        self.num_steps += 1
        timed = stats is not None and stats.timed
        line = _Line(fields, complete=not timed)
        self._waiting.append(line)
        if timed:
            self._by_index[stats.index] = line
        # after the line exists: a step the GPU finished before the runner polled brings its
        # own time with its output (a small graphed step on a fast GPU)
        self.take_gpu_times(out.gpu_times)

    def close(self, gpu_times: tuple[StepGpuTime, ...] = ()) -> None:
        """Shutdown: the last GPU times (the runner's drain), then every line left."""
        self.take_gpu_times(gpu_times)
        for line in self._waiting:
            line.complete = True
        self._write_complete()
        self._file.close()

    def take_gpu_times(self, gpu_times: tuple[StepGpuTime, ...]) -> None:
        """GPU times that came with an output of a step that has no line (a caller driving
        a runner directly: benchmarks/decode.py's pipeline's last launch)."""
        for t in gpu_times:
            line = self._by_index.pop(t.index, None)
            if line is None:  # a step with no line (not read: launched at shutdown)
                continue
            line.fields["gpu_forward_ms"] = round(t.forward_ms, 4)
            line.fields["gpu_step_ms"] = round(t.step_ms, 4)
            line.complete = True
        self._write_complete()

    def _write_complete(self) -> None:
        """Lines leave in step order: the oldest first, once it is complete."""
        while self._waiting and self._waiting[0].complete:
            self._file.write(json.dumps(self._waiting.popleft().fields) + "\n")
