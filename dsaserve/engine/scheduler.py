"""The scheduler: decides, each step, how many tokens of which requests the runner computes.

It speaks tokens, not phases. Every request has `num_computed_tokens` catching up with
`num_tokens`; a prefill, a chunk of one, a prefix hit and a decode are all "n tokens this step":

    tokens      | prompt ............................ | out out |
    computed    |==== prefix hit ====|== earlier ==|   ← num_computed_tokens
    this step                                      |-- n --|   n = min(remaining, budget)

A step (`schedule`): running requests first, oldest first, each capped by the token budget; when
the KV pool runs dry, the newest running request is preempted (blocks freed, recomputed later
from scratch, usually hitting its own cached blocks) and the allocation retried. Then waiting
requests in FIFO order, while budget and `max_num_seqs` allow. The result is a typed diff for the
runner: new requests in full, running ones as changes. `update_from_output` then advances the
computed counts, appends sampled tokens, applies the stop rules and frees what finished.

Speculative decoding (MTP, k drafts) is still "n tokens this step". A decode request with drafts
schedules its last token plus the drafts; every step that samples also reserves k − 1 lookahead
slots, where the MTP layer's later draft steps write their keys:

    positions   | computed ............ | t  d1 d2 d3 | + k − 1 lookahead (MTP draft steps)
    this step                           |--- 1 + k ---|
    after       | computed ............ | t  d1 | x |     d1 accepted, d2 rejected: x emitted

`num_computed_tokens` then advances by the step's inputs whose KV is valid (t, d1), the emitted
tokens (d1, x) are appended with the stop rules applied to each, and blocks past the request's
tokens are given back (they held rejected drafts or lookahead only; full blocks are cached only up
to the computed tokens, so a rejected token never enters the prefix cache).

HiSparse spilling (`num_mla_pages`, kv/hisparse/mla_pages.py): after a running request's blocks
are allocated, the blocks it reads or writes on the GPU this step get MLA pages, long decoders'
older pages spilling to make room (a shortage preempts, as a KV shortage does); a waiting
request is admitted, or a P/D arrival starts its read, only while the pages and blocks hold
every active request to the end of its window (`spilling_holds`: requests of max_model_len,
`dsaserve plan`'s concurrency at once; a shared cached prefix counted once) and when its
pages can be found. A spilled block stays in the
prefix cache (its rows kept in the host pool after its request ends); a hit on it gives it a page
again, which the runner fills from the host rows. Kept host blocks are evicted, least recently
freed first, before the admitted windows would not fit the pool (`hisparse_host`).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from dsaserve.config import CacheConfig, ConfigError, SchedulerConfig
from dsaserve.core import (
    CachedRequestData,
    CountHistogram,
    EngineStats,
    KVRecv,
    KVTransferParams,
    ModelRunnerOutput,
    NewRequestData,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
    SchedulerOutput,
    TokenLogprob,
)
from dsaserve.kv.hisparse.admission import (
    HiSparseAdmission,
    SharedBlocks,
    host_blocks_to_evict,
    min_mla_pages,
    mla_pages_for,
    pd_decode_prefill_tokens,
    shared_blocks,
    shared_windows,
    spilling_holds,
    write_tail_pages,
)
from dsaserve.kv.hisparse.mla_pages import MlaPageMap, reads_through_buffer, receives_spilled
from dsaserve.kv.manager import KVCacheManager, cdiv
from dsaserve.kv.offload import OffloadManager

if TYPE_CHECKING:
    from dsaserve.disagg.connector import ConnectorScheduler


def iteration_token_buckets(max_num_batched_tokens: int, max_decode_tokens: int
                            ) -> tuple[int, ...]:
    """Bounds of the tokens-per-step histogram (vllm:iteration_tokens_total): vLLM's grid
    1, 8, 16, 32, … (doubling) below the step budget, the largest decode batch
    (max_num_seqs × (1 + drafts): the largest CUDA-graph size by default, past which a step runs
    unpadded) and the budget, which ends the list.

        budget 512, 32 decode rows:  1 8 16 32 64 128 256 512
        budget 8192, 48 decode rows: 1 8 16 32 48 64 … 4096 8192
    """
    grid = [1, *(8 << i for i in range(max_num_batched_tokens.bit_length()))]
    bounds = {n for n in grid if n < max_num_batched_tokens}
    bounds |= {min(max_decode_tokens, max_num_batched_tokens), max_num_batched_tokens}
    return tuple(sorted(bounds))


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        dcp_size: int = 1,
        num_speculative_tokens: int = 0,
        *,
        num_host_blocks: int = 0,
        host_block_bytes: int = 0,
        connector: ConnectorScheduler | None = None,
        num_mla_pages: int = 0,
        hisparse_buffer_rows: int = 0,
        hisparse_host: HiSparseAdmission | None = None,
    ) -> None:
        if dcp_size < 1:
            raise ConfigError(f"--decode-context-parallel-size: must be >= 1, got {dcp_size}")
        self.config = scheduler_config
        self.block_size = cache_config.block_size * dcp_size  # the scheduler (virtual) block
        self.num_spec = num_speculative_tokens
        # The MTP draft steps after the last sampled position write k − 1 positions further.
        self.num_lookahead = max(num_speculative_tokens - 1, 0)
        needed = cdiv(scheduler_config.max_model_len + self.num_lookahead, self.block_size)
        if num_blocks < needed:
            # Otherwise a lone request could outgrow the pool and preempt itself forever.
            raise ConfigError(
                f"--num-gpu-blocks-override: {num_blocks} blocks of {self.block_size} tokens "
                "cannot hold "
                f"one request of --max-model-len {scheduler_config.max_model_len} "
                f"and {self.num_lookahead} lookahead tokens (needs {needed})"
            )
        self.kv = KVCacheManager(num_blocks, self.block_size, cache_config.enable_prefix_caching,
                                 drop_last_hit=num_speculative_tokens > 0)
        # HiSparse spilling (kv/hisparse/mla_pages.py): fewer MLA pages than blocks
        self.mla: MlaPageMap | None = None
        self.hisparse_buffer_rows = hisparse_buffer_rows
        # the runtime's host pool (blocks, window), where spilled blocks' kept rows must fit
        self.hisparse_host = hisparse_host
        self._step = 0
        self._last_scheduled: dict[str, int] = {}  # request id → the last step that ran it
        # (the requests and hits it was counted for, their shared blocks): `_mla_pages_hold`
        self._shared_memo: tuple[tuple, SharedBlocks] | None = None
        # P/D (disagg/connector.py): finished prefills' blocks held for their consumers, and
        # decode requests whose prompt KV the runner is reading from a prefill engine
        self.connector = connector
        # The longest prompt this engine may prefill itself: None (any within max_model_len)
        # but on a P/D decode engine with fewer MLA pages than one window (_mla_page_map)
        self.local_prefill_tokens: int | None = None
        if num_mla_pages:
            self.mla = self._mla_page_map(num_mla_pages, num_blocks)
        # The host KV tier (kv/offload.py), when the engine has one: it needs the block keys.
        self.offload: OffloadManager | None = None
        if num_host_blocks:
            self.offload = OffloadManager(self.kv, num_host_blocks, host_block_bytes)
        self.receiving: dict[str, Request] = {}
        self._kv_recvs: list[KVRecv] = []
        # aborted while receiving, until a step tells the runner to cancel their READs
        self._recvs_to_cancel: set[str] = set()
        self.requests: dict[str, Request] = {}  # every live (waiting or running) request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; preemption takes from the tail
        self.num_preemptions = 0
        # the last schedule() computed no token (while work remains: transfers being polled)
        self.last_step_empty = False
        # What the runner holds per request: how many tokens and blocks it was sent.
        self._runner_num_tokens: dict[str, int] = {}
        self._runner_num_blocks: dict[str, int] = {}
        self._finished_ids: list[str] = []  # the runner must drop these at the next step
        # P/D into HiSparse spilling: requests whose host window the runner reserved for the read
        self._runner_reserved: set[str] = set()
        # HiSparse spilling: requests sent to the runner as new in this step; their computed
        # prefix reaches the host pool only when the runner adds them (mirrored from their
        # pages), so none of their blocks may spill before then
        self._added_this_step: set[str] = set()
        self._aborted_outputs: list[RequestOutput] = []
        # vLLM's spec_decode counters (cumulative)
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_per_pos = [0] * num_speculative_tokens
        # tokens scheduled per step, bucketed (cumulative; EngineStats.iteration_tokens)
        self.iteration_token_bounds = iteration_token_buckets(
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_num_seqs * (1 + num_speculative_tokens))
        self.iteration_token_counts = [0] * (len(self.iteration_token_bounds) + 1)
        self.iteration_tokens_sum = 0

    # positions below num_computed_tokens a step may still write (engine/async_scheduler.py)
    _write_lag = 0

    def _mla_page_map(self, num_pages: int, num_blocks: int) -> MlaPageMap:
        """The page map of HiSparse spilling, its size checked against the pool and against
        one request's window (a prefill reads its GPU pages). A P/D decode engine may have
        fewer: what it receives long arrives spilled (its rows in the host pool, only the
        write tail on pages), so only the prompts it prefills itself (short arrivals read
        their pages too) are bounded by its pages, at `local_prefill_tokens`."""
        flag = "--attention-config: hisparse_config.device_mla_pages"
        if num_pages > num_blocks:
            raise ConfigError(f"{flag} {num_pages} exceeds the {num_blocks} KV blocks")
        needed = min_mla_pages(self.config.max_model_len + self.num_lookahead, self.block_size)
        consumer = self.connector is not None and self.connector.config.is_decode_engine
        if num_pages < needed and consumer:
            # a short arrival (up to the hot buffer's rows) reads its pages, beside one tail
            least = mla_pages_for(
                1, pd_decode_prefill_tokens(self.hisparse_buffer_rows, self.num_lookahead),
                self.block_size, write_tail_pages(self.num_spec, self.block_size))
            if num_pages < least:
                raise ConfigError(
                    f"{flag} {num_pages} is too few for a P/D decode engine: a prompt of the "
                    f"hot buffer's {self.hisparse_buffer_rows} rows reads its pages beside a "
                    f"decoder's write tail (needs {least} pages of {self.block_size} tokens)")
            self.local_prefill_tokens = num_pages * self.block_size - self.num_lookahead
        elif num_pages < needed:
            # A prefill reads its GPU pages: a lone request of max_model_len must fit.
            raise ConfigError(
                f"{flag} {num_pages} cannot hold one request of --max-model-len "
                f"{self.config.max_model_len} and {self.num_lookahead} lookahead tokens "
                f"(needs {needed} pages of {self.block_size} tokens)")
        mla = MlaPageMap(num_pages, self.kv.pool, write_lag=self._write_lag)
        self.kv.on_free = mla.freed
        return mla

    # ---- intake ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. A prompt must leave room for one output token within max_model_len;
        generation then stops at max_model_len with reason "length"."""
        max_len = self.config.max_model_len
        if not request.prompt_token_ids:
            raise RequestError(f"request {request.request_id!r}: prompt is empty")
        if request.num_prompt_tokens >= max_len:
            raise RequestError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is {max_len}"
            )
        limit = self.local_prefill_tokens
        if limit is not None and not _remote(request) and request.num_prompt_tokens > limit:
            raise RequestError(
                f"prompt has {request.num_prompt_tokens} tokens; this P/D decode engine "
                f"prefills at most {limit} itself (--attention-config: hisparse_config."
                f"device_mla_pages {self.mla.num_pages if self.mla else 0} of {self.block_size} "
                "tokens): send it through the prefill engine (kv_transfer_params "
                "do_remote_prefill)")
        if request.request_id in self.requests or (
                self.connector is not None and request.request_id in self.connector.held):
            raise RequestError(f"request id {request.request_id!r} is already in use")
        fresh = request.status == RequestStatus.WAITING and not request.num_computed_tokens
        if not fresh or request.block_ids:
            raise RequestError(f"request {request.request_id!r} is not a fresh request")
        if not _remote(request):  # between steps, not in the step that admits it
            self.kv.update_hashes(request)
        # a P/D arrival's prompt is hashed once its READs are posted (`_hash_receiving`): its
        # lookup (`_start_recv`) hashes only the blocks it walks
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str] | tuple[str, ...]) -> None:
        """End waiting or running requests now; unknown or already finished ids are ignored.
        Their outputs (reason "abort") come with the next `update_from_output` or from
        `take_aborted_outputs`; the runner learns through `finished_request_ids`."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                continue
            receiving = self.receiving.pop(request_id, None) is not None
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:  # its load holds its blocks
                self.waiting.remove(req)
            # a P/D request aborted before its READs were posted never reads its claimed blocks:
            # the prefill engine frees them now (READs posted: each rank's cancel notifies it)
            unread = req.status == RequestStatus.WAITING
            req.status = RequestStatus.FINISHED_ABORTED
            self._release(req, unread=unread)
            if receiving:
                # P/D READs in flight: the runner cancels them at the start of the next step,
                # before anything of that step writes (a cancel is final), so the blocks, the
                # host window and the id are free now
                self._kv_recvs = [r for r in self._kv_recvs if r.request_id != request_id]
                if request_id not in self._finished_ids:
                    self._finished_ids.append(request_id)
                self._recvs_to_cancel.add(request_id)
            self._aborted_outputs.append(self._make_output(req, ()))

    def take_aborted_outputs(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        return outputs

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's work: at most max_num_batched_tokens tokens over at most max_num_seqs
        requests, never 0 tokens for a scheduled request; requests that ended or were preempted
        since the last call are listed in finished_request_ids for the runner to drop."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        num_preempted_before = self.num_preemptions
        self._added_this_step.clear()
        now = time.monotonic()  # the first scheduling of a request (its queue time ends)

        # 1. running requests, oldest first; KV shortage preempts the newest
        cached: list[CachedRequestData] = []
        spec: dict[str, tuple[int, ...]] = {}
        new: list[NewRequestData] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            req_tokens = req.num_tokens  # read once (a property): passed on below
            if req.num_output_placeholders and self._ends_with_token_in_flight(req, req_tokens):
                i += 1  # async: the step in flight samples its last token
                continue
            num_known = req_tokens - req.num_computed_tokens
            assert num_known > 0, f"running request {req.request_id!r} has nothing to compute"
            drafts = self._drafts_to_verify(req) if req.spec_token_ids else ()
            n = min(num_known + len(drafts), budget)
            drafts = drafts[: n - num_known] if n > num_known else ()
            if not self._allocate_or_preempt(req, n + self._lookahead(n, num_known)):
                break  # req itself was preempted (or waits): nothing after it gets KV
            if self.mla is not None and not self._mla_pages_or_preempt(req, n):
                break
            num_scheduled[req.request_id] = n
            if req.scheduled_time is None:  # its prefix came from the host tier or a P/D read
                req.scheduled_time = now
            if drafts:
                spec[req.request_id] = drafts
            budget -= n
            if req.request_id in self._runner_num_tokens:
                cached.append(self._cached_request_data(req, req_tokens))
            else:  # its prefix came from the host tier: the runner has not seen it yet
                new.append(self._new_request_data(req))
            i += 1

        # 2. waiting requests, FIFO; none in a step that had to preempt (memory is short). One
        #    whose prefix continues in the host tier starts its load and makes way.
        if self.num_preemptions == num_preempted_before:
            while self.waiting and budget > 0 and self._num_active() < self.config.max_num_seqs:
                req = self.waiting[0]
                if self._fail_unprefillable(req):
                    continue
                load = self._start_recv(req)
                if load is None:
                    load = self._start_load(req)
                if load is not None:
                    if load:
                        continue
                    break  # its blocks come back when copies land: wait rather than recompute
                n = self._admit(req, budget)
                if n == 0:
                    break  # head of line blocks: FIFO order is kept
                num_scheduled[req.request_id] = n
                if req.scheduled_time is None:  # not a preempted request's resumption
                    req.scheduled_time = now
                budget -= n
                new.append(self._new_request_data(req))

        # 3. the diff, with the host-tier copies to start, the MLA pages that moved and the
        #    HiSparse host blocks kept, restored or given back (room for this step's windows)
        if self.mla is not None and self.hisparse_host is not None:
            self.mla.evict_host_kept(host_blocks_to_evict(
                self.hisparse_host, self._num_active(), self.mla.num_host_kept))
        keep, restore, drop = self.mla.take_host_changes() if self.mla else ((), (), ())
        self._last_scheduled.update(dict.fromkeys(num_scheduled, self._step))
        self._step += 1
        if num_tokens := self.config.max_num_batched_tokens - budget:
            self.iteration_token_counts[bisect.bisect_left(self.iteration_token_bounds,
                                                           num_tokens)] += 1
            self.iteration_tokens_sum += num_tokens
        finished, self._finished_ids = tuple(self._finished_ids), []
        self._recvs_to_cancel.clear()
        stores, loads = self.offload.take_transfers() if self.offload else ((), ())
        recvs, self._kv_recvs = tuple(self._kv_recvs), []
        self.last_step_empty = not num_scheduled
        return SchedulerOutput(
            new_requests=tuple(new),
            cached_requests=tuple(cached),
            num_scheduled_tokens=num_scheduled,
            finished_request_ids=finished,
            scheduled_spec_token_ids=spec,
            kv_stores=stores,
            kv_loads=loads,
            kv_recvs=recvs,
            mla_pages=self.mla.take_changes() if self.mla is not None else (),
            host_keep=keep,
            host_restore=restore,
            host_drop=drop,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Advance the requests of `scheduler_output` by what the runner computed; one output per
        request that got a token or finished (aborted ones included)."""
        outputs = self.take_aborted_outputs()
        if self.offload is not None:
            self._finish_transfers(runner_output)
        if self.connector is not None:
            # every rank cancelled the READs of the requests that ended before this step, and
            # notified their producers: the claims of those aborted while receiving end
            self.connector.cancelled(scheduler_output.finished_request_ids)
            outputs += self._finish_remote(runner_output)
            self._hash_receiving()
        # ~64 requests a decode step: each field read once per request (dict and property
        # reads are a visible part of a step's host time)
        spec = scheduler_output.scheduled_spec_token_ids
        sampled = runner_output.sampled_token_ids
        proposed = runner_output.draft_token_ids
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted after schedule(); its output is already in `outputs`
            # 1. the scheduled known tokens are now in the KV cache (drafts: only accepted ones)
            drafts = spec.get(request_id, ()) if spec else ()
            num_computed = req.num_computed_tokens + n - len(drafts)
            num_tokens = req.num_tokens
            req.num_computed_tokens = num_computed
            if num_computed > num_tokens:
                raise RuntimeError(
                    f"request {request_id!r}: {num_computed} tokens computed of {num_tokens}"
                )
            # 2. tokens are emitted exactly when every known token is computed: 1 + the
            #    accepted drafts (whose KV is then valid too)
            tokens = sampled.get(request_id) or []
            new_tokens: tuple[int, ...] = ()
            if num_computed == num_tokens:
                if not tokens:
                    raise RuntimeError(
                        f"runner output: no sampled token for request {request_id!r}, "
                        "all of whose tokens are computed"
                    )
                if len(tokens) > len(drafts) + 1:
                    raise RuntimeError(
                        f"runner output: {len(tokens)} tokens for request {request_id!r} "
                        f"which verified {len(drafts)} drafts (1 to {len(drafts) + 1} expected)"
                    )
                if drafts:
                    self._count_spec(len(drafts), len(tokens) - 1)
                new_tokens = self._append_tokens(req, tokens)
                # every kept token but the last was an input of this step (its KV is written)
                req.num_computed_tokens += len(new_tokens) - 1
                num_tokens += len(new_tokens)
            elif tokens:
                raise RuntimeError(
                    f"runner output: a token for request {request_id!r} mid-prefill "
                    f"({num_computed} of {num_tokens} computed)"
                )
            # 3. drafts for the next step; blocks that held only rejected drafts go back; full
            #    computed blocks become findable (and go to the host tier); finished requests
            #    give back their blocks
            finished = req.status.finished
            if req.spec_token_ids or proposed:
                req.spec_token_ids = [] if finished else list(proposed.get(request_id, ()))
            self._rollback_blocks(req, num_tokens)
            self._cache_blocks(req)
            params = None
            if finished:
                self.running.remove(req)
                if self.connector is not None and self.connector.should_hold(req):
                    params = self._hold(req)
                else:
                    self._release(req)
            if new_tokens or finished:
                outputs.append(self._make_output(
                    req, new_tokens, params, None if req.sampling_params.logprobs is None
                    else token_logprobs(req, new_tokens, runner_output)))
        return outputs

    def decode_context_lens(self, so: SchedulerOutput) -> list[int] | None:
        """Of the step `so` just scheduled, called before its update: each request's context
        length after it, if every request computes only its last known token and the drafts
        it verifies, as the runner sees it (runner.py `_padded_size`: the tokens sent to it;
        under --async-scheduling a request continuing from a step in flight qualifies); []
        for a step with no tokens; None if some request computes other rows (a prompt chunk).
        What engine/dp.py pads DP + EP decode steps by (engine/dp_padding.py)."""
        starts = {d.request_id: d.num_computed_tokens
                  for d in (*so.new_requests, *so.cached_requests)}
        lens: list[int] = []
        for request_id, n in so.num_scheduled_tokens.items():
            start = starts[request_id]
            drafts = len(so.scheduled_spec_token_ids.get(request_id, ()))
            # the runner samples it: its rows reach its last known token, or start past them
            if n != 1 + drafts or start + 1 < self._runner_num_tokens[request_id]:
                return None
            lens.append(start + n)
        return lens

    # ---- helpers of the step --------------------------------------------------------------------
    def _drafts_to_verify(self, req: Request) -> tuple[int, ...]:
        """The request's drafts that could still become output: a step emits at most
        drafts + 1 tokens, and the request ends at max_tokens or max_model_len."""
        if not req.spec_token_ids:
            return ()
        room = min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.config.max_model_len - req.num_tokens)
        return tuple(req.spec_token_ids[: max(room - 1, 0)])

    def _ends_with_token_in_flight(self, req: Request, num_tokens: int) -> bool:
        """--async-scheduling: the token an in-flight step samples for `req` (of `num_tokens`
        tokens, placeholders included) reaches max_tokens or max_model_len, so nothing is left
        to schedule (always False without placeholders: such a request has finished)."""
        return req.num_output_placeholders > 0 and (
            len(req.output_token_ids) >= req.sampling_params.max_tokens
            or num_tokens >= self.config.max_model_len)

    def _lookahead(self, n: int, num_known: int) -> int:
        """Slots past the scheduled tokens the MTP draft steps write: k − 1 when this step
        samples (its n tokens reach the request's `num_known` uncomputed known ones), else 0."""
        return self.num_lookahead if n >= num_known else 0

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[int, ...]:
        """Append emitted tokens one at a time with the stop rules: a stop in the middle of an
        accepted run drops the rest."""
        if self._none_stops(req, tokens, req.num_output_tokens):  # most steps: all at once
            req.output_token_ids += tokens
            return tuple(tokens)
        return self._append_each(req, tokens)

    def _append_each(self, req: Request, tokens: list[int]) -> tuple[int, ...]:
        """`_append_tokens` without its fast path: every token checked in turn."""
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            self._check_stop(req)
            if req.status.finished:
                return tuple(tokens[: i + 1])
        return tuple(tokens)

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        for pos in range(num_accepted):
            self.spec_num_accepted_per_pos[pos] += 1

    def _rollback_blocks(self, req: Request, num_tokens: int) -> None:
        """Give back blocks past the request's `num_tokens` tokens (reserved for drafts that were
        rejected or for lookahead); the runner learns through the next diff's num_kept_blocks."""
        if len(req.block_ids) <= cdiv(num_tokens, self.block_size):
            return  # none: most steps (no lookahead held, no draft rejected)
        kept = self.kv.free_blocks_after(req, num_tokens)
        known = self._runner_num_blocks.get(req.request_id)
        if known is not None and kept < known:
            self._runner_num_blocks[req.request_id] = kept

    def _cache_blocks(self, req: Request) -> None:
        """The request's full computed blocks become findable, and go to the host tier."""
        self.kv.cache_full_blocks(req)
        if self.offload is not None:
            self.offload.offer(req)

    def _allocate_or_preempt(self, req: Request, n: int) -> bool:
        """Allocate KV for `n` more tokens of running `req`, preempting the newest running
        requests until it fits; False if `req` itself had to go (or must wait)."""
        while self.kv.allocate_slots(req, n) is None:
            victim = self._pop_victim(req)
            if victim is None:
                return False  # req waits (with its blocks) for a later step
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _mla_pages_or_preempt(self, req: Request, n: int) -> bool:
        """HiSparse spilling: give running `req`'s blocks this step reads or writes on the GPU
        an MLA page (all of them, or only the write tail when it reads through its hot
        buffer), spilling long decoders' older pages, preempting the newest running requests
        while that is not enough; False if `req` itself had to go."""
        assert self.mla is not None
        blocks = req.block_ids
        if reads_through_buffer(req.num_computed_tokens, n, self.hisparse_buffer_rows,
                                1 + self.num_spec):
            blocks = blocks[self.mla.write_tail(req, self.block_size):]
        while not self.mla.make_resident(blocks, self._mla_victims()):
            victim = self._pop_victim(req)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _pop_victim(self, req: Request) -> Request | None:
        """The running request to preempt so that running `req` gets KV: the newest (`req`
        itself at worst, which ends the step's running requests); None: none may go, `req`
        waits for a later step."""
        return self.running.pop()

    def _mla_victims(self) -> Iterator[int]:
        """Spill candidates among the running requests whose computed rows the runner has
        mirrored: not one it has not added yet (a prefix hit, a host-tier load or a P/D read
        arriving), whose fresh host window gets only the rows of resident pages."""
        assert self.mla is not None
        mirrored = [r for r in self.running if r.request_id in self._runner_num_tokens
                    and r.request_id not in self._added_this_step]
        return self.mla.victims(mirrored, self._last_scheduled, self.block_size,
                                self.hisparse_buffer_rows)

    def _preempt(self, req: Request) -> None:
        """Free all of `req`'s KV; it returns to the FRONT of the queue and later recomputes its
        prompt and its outputs so far (its cached full blocks usually survive as prefix hits)."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._forget_in_runner(req.request_id)

    def _num_active(self) -> int:
        """Requests holding a seat: running, or loading their prefix from the host tier."""
        return (len(self.running) + len(self.receiving)
                + (self.offload.num_loading if self.offload else 0))

    def _start_load(self, req: Request) -> bool | None:
        """If waiting `req`'s prefix continues in the host tier and the GPU pool has room for its
        whole remaining prompt, allocate its blocks and start the load: it leaves the queue and
        waits (WAITING_FOR_REMOTE_KVS) while others run; True then. False when the room is only
        held by copies in flight (it waits for them), None when there is nothing to load or no
        room (it is admitted, or not, as usual)."""
        if self.offload is None:
            return None
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        host_hits = self.offload.lookup(req, len(hits))
        if not host_hits:
            return None
        # Room for the rest of the prompt too: a load never lands only to be preempted.
        num_free_hits = sum(1 for b in hits if self.kv.pool.ref_count(b) == 0)
        need = cdiv(req.num_tokens, self.block_size) - len(hits)
        room = self.kv.num_free_blocks - num_free_hits
        if need > room:
            return False if need <= room + self.offload.num_gpu_blocks_releasing() else None
        blocks = self.kv.allocate_slots(req, len(host_hits) * self.block_size, hits)
        assert blocks is not None, "the room was checked"
        self.waiting.popleft()
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens + len(host_hits) * self.block_size
        self.offload.start_load(req, blocks[len(hits):], host_hits)
        return True

    def _start_recv(self, req: Request) -> bool | None:
        """P/D consumer: if waiting `req` takes its prompt's KV from a prefill engine, allocate
        blocks for the whole prompt (its own cached prefix reused, not moved) and hand the runner
        the read: it waits (WAITING_FOR_REMOTE_KVS) until the rows landed; True then. False when
        the pool has no room yet, or (HiSparse spilling) while `_mla_pages_hold` does not hold
        it, the rule of a local admission; None when it reads nothing remote."""
        if self.connector is None or not _remote(req):
            return None
        usable = None
        if self.local_prefill_tokens is not None and receives_spilled(
                req.num_tokens, self.hisparse_buffer_rows):
            # below one window, a long arrival's spilled hits could need more pages to restore
            # than there are: its prefix up to the first one is kept, the rest READ again
            assert self.mla is not None
            usable = self.mla.page_of.__contains__
        hits, num_hit_tokens = self.kv.get_computed_blocks(req, usable, lazy=True)
        if self.mla is not None and not self._mla_pages_hold(req, hits):
            return False  # it would be preempted once the active ones grow, as a local one
        if self.mla is not None and not self.mla.can_provide(
                self._recv_pages_needed(req, num_hit_tokens, hits), self._mla_victims(),
                keep=hits):
            return False
        if self.kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits) is None:
            return False
        if self.mla is not None:
            self._recv_mla_pages(req, len(hits))
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        self.receiving[req.request_id] = req
        self._kv_recvs.append(self.connector.recv(req, num_hit_tokens))
        return True

    def _fail_unprefillable(self, req: Request) -> bool:
        """A P/D decode engine below one window: waiting `req`, which would prefill here (a
        received request preempted since recomputes its prompt and outputs), ends with an
        error if that is longer than its pages let it prefill, rather than wait at the head
        of the queue for pages that never come; True then. Admission by whole windows
        (`spilling_holds`) should leave no preemption to get here."""
        limit = self.local_prefill_tokens
        if limit is None or _remote(req) or req.num_tokens <= limit:
            return False
        self.waiting.popleft()
        req.status = RequestStatus.FINISHED_ABORTED
        self._release(req)
        self._aborted_outputs.append(replace(
            self._make_output(req, ()),
            error=f"preempted with {req.num_tokens} tokens, more than this P/D decode engine "
                  f"can recompute itself ({limit}: --attention-config hisparse_config."
                  "device_mla_pages)"))
        return True

    def _recv_pages_needed(self, req: Request, num_hit_tokens: int, hits: list[int]) -> int:
        """HiSparse spilling: MLA pages a P/D request's arrival takes: its write tail's, or every
        new block's when it is short, and its spilled hits' (restored from the host pool)."""
        assert self.mla is not None
        restored = self.mla.num_missing(hits)
        if receives_spilled(req.num_tokens, self.hisparse_buffer_rows):
            tail = cdiv(req.num_tokens, self.block_size) - (req.num_tokens - 1) // self.block_size
            return tail + restored
        return self.kv.num_new_blocks(req, req.num_tokens - num_hit_tokens, len(hits)) + restored

    def _recv_mla_pages(self, req: Request, num_hits: int) -> None:
        """HiSparse spilling, a P/D request's blocks just allocated (disagg/hostplan.py): a
        long one's received blocks below its write tail start spilled (their MLA rows are READ
        straight into the host pool; no GPU page is taken or written), its hits and write tail
        get pages; a short one (it reads its GPU pages) gets a page for every block. The runner
        reserves its host window when it reads, so it learns of the request's end."""
        assert self.mla is not None
        blocks = req.block_ids
        if receives_spilled(req.num_tokens, self.hisparse_buffer_rows):
            tail = (req.num_tokens - 1) // self.block_size  # the block the first step writes
            self.mla.start_spilled(blocks[num_hits:tail])
            blocks = blocks[:num_hits] + blocks[tail:]
        if not self.mla.make_resident(blocks, self._mla_victims()):
            raise RuntimeError("MLA pages: fewer than can_provide counted")
        self._runner_reserved.add(req.request_id)

    def _finish_remote(self, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """P/D: prompts whose KV arrived start running (computed up to the last prompt token,
        recomputed for its logits); failed reads end their request with the reason; held blocks
        every consumer read, or whose time is up, are freed."""
        assert self.connector is not None
        outputs = []
        for request_id in runner_output.kv_recvs_done:
            req = self.receiving.pop(request_id, None)
            if req is None:
                continue
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_tokens - 1
            req.kv_transfer_params = None  # read once: a preemption recomputes locally
            self.connector.received(request_id)  # its claim ends with the READ's notification
            # blocks received spilled are findable too: their rows are in the host window
            self.kv.cache_full_blocks(req)
            self.running.append(req)
        for request_id, reason in runner_output.kv_recvs_failed.items():
            req = self.receiving.pop(request_id, None)
            if req is None:
                continue
            req.status = RequestStatus.FINISHED_ABORTED
            self._release(req, unread=True)  # every rank settled: none of its READs in flight
            outputs.append(replace(self._make_output(req, ()), error=reason))
        for req in self.connector.release(runner_output.kv_sends_done):
            self.kv.free(req)
        return outputs

    def _hash_receiving(self) -> None:
        """P/D arrivals whose READs were posted: their prompts hashed now, while the READs are
        in flight, rather than before them in `add_request` (a 128K prompt: 2,048 blocks,
        4–5 ms of the time to its first token). A no-op for those already hashed; one whose
        READs landed was hashed when its blocks were registered (`_finish_remote`)."""
        for req in self.receiving.values():
            self.kv.update_hashes(req)

    def _hold(self, req: Request) -> KVTransferParams:
        """P/D producer: finished `req` leaves the scheduler, but its blocks stay with the
        connector until its consumers have read them."""
        assert self.connector is not None
        if self.offload is not None:
            self.offload.forget(req)
        del self.requests[req.request_id]
        self._forget_in_runner(req.request_id)
        return self.connector.hold(req)

    def _finish_transfers(self, runner_output: ModelRunnerOutput) -> None:
        """Retire copies every rank finished; requests whose prefix landed start running (newest:
        sent to the runner in full at their first step)."""
        assert self.offload is not None
        for req in self.offload.finish(runner_output):
            req.status = RequestStatus.RUNNING
            self.kv.cache_full_blocks(req)  # the loaded blocks are GPU prefix hits from now on
            self.running.append(req)

    def _admit(self, req: Request, budget: int) -> int:
        """Try to start waiting `req`: prefix lookup, allocation; the tokens scheduled, 0 if not."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        remaining = req.num_tokens - num_hit_tokens  # >= 1: a hit never covers the last token
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            return 0
        if self.mla is not None and not self._mla_pages_hold(req, hits):
            return 0  # it would be preempted once the running ones grow: wait for one to end
        lookahead = self.num_lookahead if n == remaining else 0
        # a prefill reads its GPU pages: its new blocks and spilled hits (restored) need them
        if self.mla is not None and not self.mla.can_provide(
                self.kv.num_new_blocks(req, n + lookahead, len(hits))
                + self.mla.num_missing(hits), self._mla_victims(), keep=hits):
            return 0  # wait until pages are given back
        if self.kv.allocate_slots(req, n + lookahead, hits) is None:
            return 0
        if self.mla is not None and not self.mla.make_resident(req.block_ids,
                                                               self._mla_victims()):
            raise RuntimeError("MLA pages: fewer than can_provide counted")
        self.waiting.popleft()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        return n

    def _mla_pages_hold(self, req: Request, hits: list[int]) -> bool:
        """HiSparse spilling: whether the pages and blocks hold waiting `req` (admitted locally,
        or a P/D arrival about to start its read), with its prefix hits `hits`, beside the
        active requests to the end of their windows (`spilling_holds`, the rule
        `size_mla_pages` sizes "auto" and `dsaserve plan`'s concurrency by): admitted past it,
        a request is preempted later, once the active ones' windows outgrow the blocks or
        their tails the pages. A cached prefix they share is one set of blocks, whose pages
        stay resident (`shared_windows`)."""
        assert self.mla is not None
        requests = [*self.running, *self.receiving.values(), req]
        # a running request reads its pages until its prompt (or its recomputed outputs) is
        # in; one arrived over P/D decodes from its first step. Waiting `req` counts as the
        # prefill it may be: a short P/D arrival reads its GPU pages as a prefill does, and a
        # long one leaves that room too (the plan's one prefill window beside the tails), for
        # a local request or a recomputation beside the arrivals. On a P/D decode engine
        # below one window a long arrival is no prefill and leaves no window's room: a local
        # prompt is bounded by the pages and waits for them, and a received one longer than
        # they are is never recomputed here (`_fail_unprefillable`)
        below_window_arrival = (self.local_prefill_tokens is not None and _remote(req)
                                and receives_spilled(req.num_tokens, self.hisparse_buffer_rows))
        prefills = [i for i, r in enumerate(self.running) if self._prefilling(r)]
        if self._prefilling(req) and not below_window_arrival:
            prefills.append(len(requests) - 1)
        longest = max(prefills, key=lambda i: requests[i].num_tokens, default=None)
        tables = [*(r.block_ids for r in requests[:-1]), hits]
        # the shared blocks change only with the requests (and the waiting one's hits): kept,
        # so that a request waiting at the head does not walk every table at every step
        key = (tuple(r.request_id for r in requests), tuple(hits),
               None if longest is None else requests[longest].request_id)
        if self._shared_memo is None or self._shared_memo[0] != key:
            self._shared_memo = (key, shared_blocks(tables, longest))
        window_blocks, pinned = shared_windows(
            tables, [cdiv(self._window_tokens(r), self.block_size) for r in requests], longest,
            self._shared_memo[1])
        return spilling_holds(
            len(requests),
            0 if longest is None else requests[longest].num_tokens + self.num_lookahead,
            window_blocks, block_size=self.block_size,
            tail_pages=write_tail_pages(self.num_spec, self.block_size),
            num_mla_pages=self.mla.num_pages, num_blocks=self.kv.num_blocks,
            pinned_pages=pinned)

    @staticmethod
    def _prefilling(req: Request) -> bool:
        """More than the last known token left to compute (placeholders are not known)."""
        return req.num_computed_tokens + 1 < req.num_tokens - req.num_output_placeholders

    def _window_tokens(self, req: Request) -> int:
        """Positions `req` writes by its end: prompt and max_tokens within max_model_len, and
        the MTP lookahead."""
        end = min(req.num_prompt_tokens + req.sampling_params.max_tokens,
                  self.config.max_model_len)
        return end + self.num_lookahead

    def _new_request_data(self, req: Request) -> NewRequestData:
        token_ids = tuple(req.all_token_ids)
        self._added_this_step.add(req.request_id)
        self._runner_num_tokens[req.request_id] = len(token_ids)
        self._runner_num_blocks[req.request_id] = len(req.block_ids)
        return NewRequestData(
            request_id=req.request_id,
            token_ids=token_ids,
            sampling_params=req.sampling_params,
            block_ids=tuple(req.block_ids),
            num_computed_tokens=req.num_computed_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            eos_token_ids=req.eos_token_ids,
        )

    def _cached_request_data(self, req: Request, num_tokens: int) -> CachedRequestData:
        """What changed for the runner: the tokens the host knows since the last diff (async
        scheduling: placeholders are not sent; the runner takes them on the device), the new
        blocks, and the computed length (`num_tokens`: the request's, read by the caller)."""
        request_id = req.request_id
        known_tokens = self._runner_num_tokens[request_id]
        known_blocks = self._runner_num_blocks[request_id]
        num_known = num_tokens - req.num_output_placeholders
        self._runner_num_tokens[request_id] = num_known
        self._runner_num_blocks[request_id] = len(req.block_ids)
        return CachedRequestData.of(  # one per running request per step: the cheap form
            request_id=request_id,
            new_token_ids=_tokens_between(req, known_tokens, num_known),
            new_block_ids=tuple(req.block_ids[known_blocks:]),
            num_computed_tokens=req.num_computed_tokens,
            num_kept_blocks=known_blocks,
        )

    def _none_stops(self, req: Request, tokens: list[int], num_output: int) -> bool:
        """Whether appending `tokens` after `num_output` output tokens, each checked by
        `_check_stop`, leaves `req` running: none is an EOS (unless ignore_eos) or stop id and
        the last stays below max_tokens and max_model_len. A cheap sufficient test (an EOS
        below min_tokens answers False: `_check_stop` decides then), so the caller may skip
        the per-token checks (~1 µs a token)."""
        params = req.sampling_params
        num_output += len(tokens)
        if (num_output >= params.max_tokens
                or req.num_prompt_tokens + num_output >= self.config.max_model_len):
            return False
        eos = () if params.ignore_eos else req.eos_token_ids
        stops = req.stop_ids
        for t in tokens:  # 1 to k + 1 of them: a loop, not a generator
            if t in eos or t in stops:
                return False
        return True

    def _check_stop(self, req: Request) -> None:
        """Stop rules after a token is appended: EOS / stop ids (not before min_tokens, where
        the runner masks them out of sampling) give "stop", a stop id (or an EOS id other than
        the first) recorded as the request's stop_token_id; max_tokens or reaching
        max_model_len give "length"."""
        params = req.sampling_params
        num_output = req.num_output_tokens  # placeholders of async steps after it not counted
        last = req.output_token_ids[num_output - 1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                # the model's own EOS (the first) reports none; another of the model's EOS ids
                # reports itself, as vLLM's stop_reason does (it adds them to stop_token_ids)
                req.stop_token_id = None if last == req.eos_token_ids[0] else last
                return
            if last in req.stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_token_id = last  # EOS, checked first, reports none (vLLM's order)
                return
        num_tokens = req.num_prompt_tokens + num_output
        if num_output >= params.max_tokens or num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    def _release(self, req: Request, unread: bool = False) -> None:
        """A finished or aborted request leaves: blocks freed, the runner told. `unread`: a P/D
        request that will never read its prompt's KV, none of its READs in flight
        (`ConnectorScheduler.forget`)."""
        self.kv.free(req)
        if self.connector is not None:
            self.connector.forget(req.request_id, unread=unread)
        if self.offload is not None:
            self.offload.forget(req)
        del self.requests[req.request_id]
        self._forget_in_runner(req.request_id)

    def _forget_in_runner(self, request_id: str) -> None:
        self._last_scheduled.pop(request_id, None)
        if self.mla is not None:
            self.mla.forget(request_id)
        known = self._runner_num_tokens.pop(request_id, None) is not None
        if known:
            del self._runner_num_blocks[request_id]
        if known or request_id in self._runner_reserved:
            self._runner_reserved.discard(request_id)
            self._finished_ids.append(request_id)

    @staticmethod
    def _make_output(req: Request, new_tokens: tuple[int, ...],
                     kv_transfer_params: KVTransferParams | None = None,
                     logprobs: tuple[TokenLogprob, ...] | None = None) -> RequestOutput:
        finished = req.status.finished
        # RequestOutput.of: one per request per step, ~4x cheaper than RequestOutput(...)
        return RequestOutput.of(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            kv_transfer_params=kv_transfer_params,
            error=None,
            # a request that asked gets entries (none for no new token); others get None
            logprobs=(logprobs or ()) if req.sampling_params.logprobs is not None else None,
            stop_token_id=req.stop_token_id if finished else None,
            queued_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            output_time=time.monotonic(),
        )

    # ---- introspection --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Requests live, host-tier copies still in flight, P/D blocks held (they hold blocks
        until done) or P/D READs of aborted requests the runner has yet to cancel (a step tells
        it; the producer learns then that it may free its blocks)."""
        return (bool(self.requests) or (self.offload is not None and self.offload.busy)
                or (self.connector is not None and self.connector.num_held > 0)
                or bool(self._recvs_to_cancel))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.receiving) + (
                len(self.offload.loading_requests()) if self.offload else 0),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_num_drafts,
            spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=sum(self.spec_num_accepted_per_pos),
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_num_accepted_per_pos),
            iteration_tokens=CountHistogram(self.iteration_token_bounds,
                                            tuple(self.iteration_token_counts),
                                            self.iteration_tokens_sum),
            **(self._offload_stats() if self.offload else {}),
            **(dict(num_mla_pages=self.mla.num_pages, num_mla_pages_free=self.mla.num_free_pages,
                    hisparse_mla_spills=self.mla.num_spills) if self.mla else {}),
        )

    def _offload_stats(self) -> dict[str, int]:
        o = self.offload
        assert o is not None
        return dict(
            offload_queries=o.queries, offload_hits=o.hits,
            offload_bytes_stored=o.blocks_stored * o.host_block_bytes,
            offload_bytes_loaded=o.blocks_loaded * o.host_block_bytes,
            num_host_blocks_used=o.num_used_blocks, num_host_blocks=o.host.num_blocks,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError on any broken invariant: pool bookkeeping, exact reference counts
        over live requests, queue membership and per-request token/block consistency, and — once
        no request is live — every block free (nothing leaked)."""
        live = list(self.requests.values())
        held = [h.request for h in self.connector.held.values()] if self.connector else []
        self.kv.check_integrity(live + held, self.offload.gpu_holds() if self.offload else None)
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        loading = self.offload.loading_requests() if self.offload else []
        if self.offload is not None:
            self.offload.check_integrity(self.requests)
        if sorted(running_ids + waiting_ids + [r.request_id for r in loading]
                  + list(self.receiving)) != sorted(self.requests):
            raise AssertionError(
                f"scheduler: running {running_ids} + waiting {waiting_ids} (+ loading) != live "
                f"requests {sorted(self.requests)}"
            )
        if self.connector is not None:  # a claim held only by a live request that may READ
            self.connector.check_integrity(waiting_ids, list(self.receiving))
        if self.mla is not None:
            self.mla.check_integrity(self.running, self.block_size, self.hisparse_buffer_rows,
                                     self.receiving.values())
            if self.hisparse_host is not None and host_blocks_to_evict(
                    self.hisparse_host, self._num_active(), self.mla.num_host_kept):
                raise AssertionError("scheduler: admitted windows and kept blocks exceed the "
                                     "HiSparse host pool")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"scheduler: {len(self.running)} running > max_num_seqs")
        for req in self.running:
            if req.status != RequestStatus.RUNNING:
                raise AssertionError(f"scheduler: {req.request_id!r} running with {req.status}")
            if not 0 <= req.num_computed_tokens < req.num_tokens:
                raise AssertionError(
                    f"scheduler: {req.request_id!r} computed {req.num_computed_tokens} of "
                    f"{req.num_tokens} tokens"
                )
            if len(req.spec_token_ids) > self.num_spec:
                raise AssertionError(f"scheduler: {req.request_id!r} has too many drafts")
            if len(req.block_ids) < cdiv(req.num_computed_tokens, self.block_size):
                raise AssertionError(
                    f"scheduler: {req.request_id!r} has {len(req.block_ids)} blocks for "
                    f"{req.num_computed_tokens} computed tokens"
                )
        for req in self.waiting:
            if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"scheduler: {req.request_id!r} waiting with {req.status}")
            if req.spec_token_ids:
                raise AssertionError(f"scheduler: waiting {req.request_id!r} holds drafts")
            if req.block_ids or req.num_computed_tokens:
                raise AssertionError(
                    f"scheduler: waiting {req.request_id!r} holds {len(req.block_ids)} blocks "
                    f"and {req.num_computed_tokens} computed tokens"
                )
        if not self._runner_num_tokens.keys() | self._runner_reserved <= self.requests.keys():
            raise AssertionError("scheduler: the runner view names requests that ended")
        for req in loading:
            if req.request_id in self._runner_num_tokens:
                raise AssertionError(f"scheduler: loading {req.request_id!r} known to the runner")
        for req in self.receiving.values():
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise AssertionError(f"scheduler: receiving {req.request_id!r} is {req.status}")
        busy = self.offload is not None and self.offload.busy
        if not live and not busy and not held and self.kv.num_free_blocks != self.kv.num_blocks:
            raise AssertionError(
                f"scheduler: no live request but {self.kv.num_blocks - self.kv.num_free_blocks} "
                "blocks are in use (leaked)"
            )


def _tokens_between(req: Request, start: int, end: int) -> tuple[int, ...]:
    """req.all_token_ids[start:end] (end >= the prompt's length) without copying the (possibly
    1M-token) prompt."""
    num_prompt = len(req.prompt_token_ids)
    if start >= num_prompt:
        return tuple(req.output_token_ids[start - num_prompt : end - num_prompt])
    return tuple(req.prompt_token_ids[start:]) + tuple(req.output_token_ids[: end - num_prompt])


def token_logprobs(req: Request, new_tokens: tuple[int, ...],
                   runner_output: ModelRunnerOutput) -> tuple[TokenLogprob, ...] | None:
    """The request's logprob entries for `new_tokens` (a prefix of what the runner emitted for
    it: a stop drops the rest), its own SamplingParams.logprobs of the step's top-W; None when
    it did not ask."""
    n = req.sampling_params.logprobs
    if n is None:
        return None
    lps = runner_output.logprobs.get(req.request_id, [])
    top = runner_output.top_logprobs.get(req.request_id, [])
    if len(lps) < len(new_tokens) or (n and len(top) < len(new_tokens)):
        raise RuntimeError(f"runner output: logprobs of {len(lps)} tokens and top-{n} of "
                           f"{len(top)} for request {req.request_id!r}, which emits "
                           f"{len(new_tokens)}")
    return tuple(TokenLogprob(t, lps[i], top[i][:n] if n else ())
                 for i, t in enumerate(new_tokens))


def _remote(request: Request) -> bool:
    """A P/D decode request: its prompt's KV comes from a prefill engine."""
    params = request.kv_transfer_params
    return params is not None and bool(params.do_remote_prefill)
