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
block; its full blocks are then registered as sync scheduling registers them (those its last
steps completed were placeholders at every earlier update). Preemption keeps the placeholder:
the request waits until its token arrives (it is re-admitted only in a later step, which
always comes after that token's update).

With MTP (k drafts) a step emits 1 to 1 + v tokens for a request verifying v drafts, which is
unknown when the next step is scheduled. The host assumes every draft accepted: 1 + v
placeholders, the computed count advanced by all the step's rows, and k placeholder drafts
(proposed on the device), so the next step verifies 1 + k rows with blocks for that worst
case; the runner moves those rows back on the device by the drafts really rejected
(engine/runner.py). The update then resolves the 1 + v placeholders:

    output_token_ids   … t5 | P P P P | P P P P      step k verified 3 drafts; k + 1 in flight
    update(k): 2 kept  … t5 t6 t7 | P P P P          2 placeholders deleted, computed − 2
"""

from __future__ import annotations

from collections import deque

from dsaserve.core import (
    PLACEHOLDER_TOKEN_ID,
    KVTransferParams,
    ModelRunnerOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SchedulerOutput,
)
from dsaserve.engine.scheduler import Scheduler, token_logprobs


class AsyncScheduler(Scheduler):
    """A Scheduler whose `update_from_output(k)` is called after `schedule()` of step k + 1."""

    @property
    def _write_lag(self) -> int:
        """A step in flight counts as all drafts accepted; the next step's rows move back on the
        device by those rejected: up to k positions below num_computed_tokens are written
        (HiSparse keeps their MLA pages: kv/hisparse/mla_pages.py)."""
        return self.num_spec

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # per scheduled step not yet updated: (request, output tokens the step may emit for it:
        # its placeholders, 0 when it does not sample), in order
        self._in_flight: deque[list[tuple[Request, int]]] = deque()

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        step: list[tuple[Request, int]] = []
        spec = so.scheduled_spec_token_ids
        for request_id, n in so.num_scheduled_tokens.items():
            req = self.requests[request_id]
            # their KV is written by the time anything reads it; with drafts, as if every
            # draft is accepted (the update takes the rejected ones back)
            num_drafts = len(spec.get(request_id, ()))
            req.num_computed_tokens += n
            span = 0
            if req.num_computed_tokens - num_drafts == req.num_tokens:  # the step samples
                span = 1 + num_drafts
                req.output_token_ids += [PLACEHOLDER_TOKEN_ID] * span
                req.num_output_placeholders += span
                # the drafts the step proposes stay on the device for the next step
                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.num_spec
            step.append((req, span))
        self._in_flight.append(step)
        return so

    def _pop_victim(self, req: Request) -> Request | None:
        """The newest running request, but not a P/D producer's request with a token in
        flight: once that token is read its blocks may be held for its consumers (sync
        scheduling would have decided before this step), so it keeps them; if `req` is such a
        one and nothing newer may go, it waits for a later step (None)."""
        for i in reversed(range(len(self.running))):
            victim = self.running[i]
            if not self._may_hold(victim):
                del self.running[i]
                return victim
            if victim is req:
                return None
        raise AssertionError(f"{req.request_id!r} is not running")

    def _may_hold(self, req: Request) -> bool:
        """A P/D producer's request whose step in flight may end it (its blocks then held)."""
        return (req.num_output_placeholders > 0 and self.connector is not None
                and self.connector.should_hold(req))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Step k's tokens replace the requests' oldest placeholders (`scheduler_output` is
        step k's, the oldest not updated); one output per request that got a token."""
        outputs = self.take_aborted_outputs()
        if self.offload is not None:  # host-tier copies done; loaded prefixes start running
            self._finish_transfers(runner_output)
        if self.connector is not None:  # P/D consumer: prompts whose READs settled
            outputs += self._finish_remote(runner_output)
        step = self._in_flight.popleft()
        for req, span in step:
            if req.is_finished:
                continue  # stopped or aborted while the step ran: what it computed is dropped
            if span:
                tokens = runner_output.sampled_token_ids.get(req.request_id)
                if not tokens or len(tokens) > span:
                    raise RuntimeError(f"runner output: {len(tokens or ())} tokens for request "
                                       f"{req.request_id!r}, which the step samples (1 to "
                                       f"{span} expected)")
                if span > 1:
                    self._count_spec(span - 1, len(tokens) - 1)
                outputs.append(self._resolve(req, span, tokens, runner_output))
            if req.status == RequestStatus.RUNNING:
                self._cache_blocks(req)  # computed blocks of host-known tokens
        return outputs

    def _resolve(self, req: Request, span: int, tokens: list[int],
                 runner_output: ModelRunnerOutput) -> RequestOutput:
        """The oldest `span` placeholders become `tokens` (1 to span of them), the stop rules
        applied to each; the placeholders of drafts rejected are taken back, and with them
        the computed count (it counted them accepted). A request that stops drops the later
        placeholders and gives back every block."""
        at = req.num_output_tokens
        outs = req.output_token_ids
        assert outs[at : at + span] == [PLACEHOLDER_TOKEN_ID] * span, "no placeholders to resolve"
        was_running = req.status is RequestStatus.RUNNING
        if self._none_stops(req, tokens, at):  # most steps: every token at once
            emitted = list(tokens)
            outs[at : at + len(tokens)] = tokens
            req.num_output_placeholders -= len(tokens)
        else:
            emitted = []
            for token in tokens:  # each placeholder in turn becomes its token (no list shift)
                outs[at + len(emitted)] = token
                req.num_output_placeholders -= 1
                emitted.append(token)
                self._check_stop(req)
                if req.status.finished:
                    break
        params = None
        if req.status.finished:
            del outs[at + len(emitted) :]
            req.num_output_placeholders = 0
            req.spec_token_ids = []
            # as if the later steps never ran: the last token's KV is not computed
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            (self.running if was_running else self.waiting).remove(req)
            if was_running:
                # the full blocks the last steps computed, findable as sync scheduling leaves
                # them (a later turn extending this conversation hits them): earlier updates
                # could not, their tokens being placeholders then. No step in flight writes
                # them: it writes at or past the last token's position.
                self._rollback_blocks(req, req.num_tokens)
                self._cache_blocks(req)
            if self.connector is not None and self.connector.should_hold(req):
                params = self._hold_finished(req, was_running)
            else:
                self._release(req)
        else:
            num_rejected = span - len(emitted)
            if num_rejected:  # the rejected drafts' placeholders go
                del outs[at + len(emitted) : at + span]
                req.num_output_placeholders -= num_rejected
            if was_running:
                req.num_computed_tokens -= num_rejected  # and their rows
                if not req.num_output_placeholders:  # no later step continues from its drafts
                    req.spec_token_ids = list(
                        runner_output.draft_token_ids.get(req.request_id, ()))
                self._rollback_blocks(req, req.num_tokens)
        new_tokens = tuple(emitted)
        return self._make_output(req, new_tokens, params, None
                                 if req.sampling_params.logprobs is None
                                 else token_logprobs(req, new_tokens, runner_output))

    def _hold_finished(self, req: Request, was_running: bool) -> KVTransferParams:
        """P/D producer: the prompt's last step was read, so its KV is written; its blocks
        are held for the consumers as sync scheduling holds them (the blocks past its tokens
        given back, its full computed blocks findable), whatever step is in flight. A step
        launched after it only writes positions past the prompt (a stop token's KV), which no
        consumer reads."""
        assert was_running, "a producer's request with a token in flight is never preempted"
        return self._hold(req)

    def check_integrity(self) -> None:
        """The base invariants, and: placeholders only at the end of a request's outputs, at
        most 1 + k per step in flight; drafts held as placeholders only while a step that
        proposes them is in flight."""
        super().check_integrity()
        for req in self.requests.values():
            n = req.num_output_placeholders
            if not 0 <= n <= len(self._in_flight) * (1 + self.num_spec):
                raise AssertionError(f"async: {req.request_id!r} has {n} placeholders with "
                                     f"{len(self._in_flight)} steps in flight")
            outs = req.output_token_ids
            if PLACEHOLDER_TOKEN_ID in outs[: len(outs) - n] or any(
                    t != PLACEHOLDER_TOKEN_ID for t in outs[len(outs) - n :]):
                raise AssertionError(f"async: {req.request_id!r} placeholders not at the end")
            if PLACEHOLDER_TOKEN_ID in req.spec_token_ids and not n:
                raise AssertionError(f"async: {req.request_id!r} holds drafts no step proposes")
