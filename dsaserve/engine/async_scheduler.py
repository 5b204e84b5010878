"""--async-scheduling: the scheduler runs one step ahead of the results it has read.

The engine schedules step k + 1 while the device runs step k, so the scheduler cannot wait for
step k's sampled tokens. Each request that step k samples gets a placeholder output token at
schedule time (`PLACEHOLDER_TOKEN_ID`, counted in `num_output_placeholders`), and its computed
count advances at once; step k + 1 then computes from the placeholder, whose value the runner
takes on the device from step k's samples (engine/runner.py). Step k's results arrive one
engine step later and replace the placeholders, oldest first:

    output_token_ids   … t5 t6 | P7 P8          schedule(k+1): P8 appended; step k + 1 reads P7
    update(k)          … t5 t6 t7 | P8          P7 → t7, stop rules applied to t7
    t7 is a stop       … t5 t6 t7               P8 dropped; the request ends, and its blocks (the
                                                slot where step k + 1 writes t7's KV included)
                                                are freed; step k + 1's token is discarded

A request whose placeholder reaches max_tokens or max_model_len is not scheduled again (the
stop rules on lengths need no token value); a stop token costs one discarded step. Block hashes
cover only tokens known on the host (kv/manager.py), and a request that ends is rolled back to
the tokens sync scheduling would have computed, so the prefix cache never holds a placeholder's
block. Preemption keeps the placeholder: the request waits until its token arrives (it is
re-admitted only in a later step, which always comes after that token's update).
"""

from __future__ import annotations

from collections import deque

from dsaserve.core import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SchedulerOutput,
)
from dsaserve.engine.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """A Scheduler whose `update_from_output(k)` is called after `schedule()` of step k + 1."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.num_spec:
            raise ValueError("AsyncScheduler: speculative decoding is not supported")
        # per scheduled step not yet updated: (request, whether the step samples it), in order
        self._in_flight: deque[list[tuple[Request, bool]]] = deque()

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        step: list[tuple[Request, bool]] = []
        for request_id, n in so.num_scheduled_tokens.items():
            req = self.requests[request_id]
            req.num_computed_tokens += n  # their KV is written by the time anything reads it
            samples = req.num_computed_tokens == req.num_tokens
            if samples:
                req.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
                req.num_output_placeholders += 1
            step.append((req, samples))
        self._in_flight.append(step)
        return so

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Step k's tokens replace the requests' oldest placeholders (`scheduler_output` is
        step k's, the oldest not updated); one output per request that got a token."""
        outputs = self.take_aborted_outputs()
        step = self._in_flight.popleft()
        for req, samples in step:
            if req.is_finished:
                continue  # stopped or aborted while the step ran: what it computed is dropped
            if samples:
                tokens = runner_output.sampled_token_ids.get(req.request_id)
                if not tokens:
                    raise RuntimeError(f"runner output: no sampled token for request "
                                       f"{req.request_id!r}, which the step samples")
                outputs.append(self._resolve(req, tokens[0]))
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)  # computed blocks of host-known tokens
        return outputs

    def _resolve(self, req: Request, token: int) -> RequestOutput:
        """The oldest placeholder becomes `token`; the stop rules apply to it. A request that
        stops drops the later placeholder and gives back every block."""
        at = req.num_output_tokens
        assert req.output_token_ids[at] == PLACEHOLDER_TOKEN_ID, "no placeholder to resolve"
        req.output_token_ids[at] = token
        req.num_output_placeholders -= 1
        was_running = req.status == RequestStatus.RUNNING
        self._check_stop(req)
        if req.is_finished:
            del req.output_token_ids[at + 1 :]
            req.num_output_placeholders = 0
            # as if the later step never ran: the last token's KV is not computed
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            (self.running if was_running else self.waiting).remove(req)
            self._release(req)
        return self._make_output(req, (token,))

    def check_integrity(self) -> None:
        """The base invariants, and: placeholders only at the end of a request's outputs, at
        most one per step in flight."""
        super().check_integrity()
        for req in self.requests.values():
            n = req.num_output_placeholders
            if not 0 <= n <= len(self._in_flight):
                raise AssertionError(f"async: {req.request_id!r} has {n} placeholders with "
                                     f"{len(self._in_flight)} steps in flight")
            outs = req.output_token_ids
            if PLACEHOLDER_TOKEN_ID in outs[: len(outs) - n] or any(
                    t != PLACEHOLDER_TOKEN_ID for t in outs[len(outs) - n :]):
                raise AssertionError(f"async: {req.request_id!r} placeholders not at the end")
