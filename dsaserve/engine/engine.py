"""The step loop of one engine: scheduler (CPU, tokenizer-free) → model runner → scheduler.

    add_request ─► Scheduler.schedule() ─► SchedulerOutput (typed diff)
                        ▲                          │
                        │                          ▼
    RequestOutput ◄─ Scheduler.update_from_output ◄─ ModelRunner.execute() ─► ModelRunnerOutput

With --async-scheduling (engine/async_scheduler.py) the loop runs one step ahead: step() schedules
and launches step k + 1, then reads step k's results and returns step k's outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsaserve.config import ConfigError, EngineConfig
from dsaserve.core import (
    Completion,
    EngineDeadError,
    EngineStats,
    KVTransferParams,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprob,
)
from dsaserve.engine.async_scheduler import AsyncScheduler
from dsaserve.engine.executor import Executor, InProcessExecutor, MultiprocExecutor
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampling_table import MAX_STOP_IDS
from dsaserve.engine.scheduler import Scheduler
from dsaserve.engine.step_log import StepLog
from dsaserve.engine.step_results import PendingStep
from dsaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dsaserve.disagg.connector import ConnectorScheduler
    from dsaserve.engine.dp import DataParallelEngine

logger = logging.getLogger(__name__)

# How long a core loop waits for new requests between steps that compute nothing while
# transfers are polled (`LLMEngine.only_polling`): a READ's landing is seen within it.
POLL_INTERVAL_S = 0.001


def run_to_completion(engine: LLMEngine | DataParallelEngine, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams],
                      *, cache_salt: str | None = None) -> list[list[int]]:
    """Add every prompt, step until all finish; the output token ids of each, in order."""
    return [list(c.token_ids)
            for c in run_completions(engine, prompts, params, cache_salt=cache_salt)]


def run_completions(engine: LLMEngine | DataParallelEngine, prompts: Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams],
                    *, cache_salt: str | None = None) -> list[Completion]:
    """run_to_completion with each token's logprob entries (where the params ask for them)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p, cache_salt=cache_salt)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[TokenLogprob] | None] = {
        rid: None if p.logprobs is None else [] for rid, p in zip(ids, params, strict=True)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.logprobs is not None:
                    logprobs[out.request_id].extend(out.logprobs)
    return [Completion(tuple(tokens[rid]), None if logprobs[rid] is None
                       else tuple(logprobs[rid])) for rid in ids]


class LLMEngine:
    """One engine: a scheduler driving the ranks of one model replica through an executor.
    Not thread-safe: one owner thread calls every method."""

    def __init__(self, config: EngineConfig, executor: Executor | ModelRunner,
                 tokenizer: Tokenizer | None, *, dp_rank: int = 0) -> None:
        self.config = config
        if isinstance(executor, ModelRunner):
            executor = InProcessExecutor(executor)
        self.executor: Executor = executor
        # The local runner of a single-process engine (tests inspect it); None with workers.
        self.runner = executor.runner if isinstance(executor, InProcessExecutor) else None
        self.tokenizer = tokenizer
        # The host KV tier: as many blocks as the smallest rank has; a block is all ranks' shards.
        host = executor.call("host_tier_spec") if config.offload.enabled else [(0, 0)]
        sched = config.scheduler
        if config.hisparse is not None:  # admission by host capacity (kv/hisparse/admission.py)
            admits = min(executor.call("hisparse_spec"))
            sched = dataclasses.replace(sched, max_num_seqs=min(sched.max_num_seqs, admits))
        # HiSparse spilling: every rank has the same MLA page count (the flag's)
        mla_pages = min(executor.call("hisparse_mla_pages")) if config.hisparse else 0
        # and the host pool its kept blocks must fit beside the admitted windows
        host_pool = min(executor.call("hisparse_host_spec"),
                        key=lambda a: a.num_host_blocks) if mla_pages else None
        self.connector = self._kv_connector(dp_rank)
        # --async-scheduling: steps launched whose results are not read yet (at most one
        # between calls of step)
        self._in_flight: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        self.async_scheduling = sched.async_scheduling
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(sched, config.cache, executor.num_blocks,
                                   dcp_size=config.parallel.decode_context_parallel_size,
                                   num_speculative_tokens=config.num_speculative_tokens,
                                   num_host_blocks=min(n for n, _ in host),
                                   host_block_bytes=sum(b for _, b in host),
                                   connector=self.connector, num_mla_pages=mla_pages,
                                   hisparse_buffer_rows=config.hisparse_buffer_rows,
                                   hisparse_host=host_pool)
        # the tokenizer's EOS first (vLLM's model EOS), then the config's others
        eos = list(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.insert(0, tokenizer.eos_token_id)
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        # --step-log: a JSON line per step (engine/step_log.py); the runners time their steps
        self.step_log = None if config.step_log is None else StepLog(
            config.step_log, async_scheduling=self.async_scheduling, dp_rank=dp_rank)

    def _kv_connector(self, dp_rank: int) -> ConnectorScheduler | None:
        """P/D: the connector's scheduler half, with every rank's transport metadata."""
        disagg = self.config.disagg
        if disagg is None:
            return None
        from dsaserve.disagg.connector import ConnectorScheduler, EngineLayout

        p = self.config.parallel
        engine_id = disagg.engine_id or uuid.uuid4().hex
        if p.data_parallel_size > 1:
            engine_id = f"{engine_id}-dp{dp_rank}"
        return ConnectorScheduler(
            disagg, engine_id,
            EngineLayout(self.config.cache.block_size, p.decode_context_parallel_size,
                         p.cp_kv_cache_interleave_size, p.tensor_parallel_size),
            self.executor.call("kv_connector_metadata"), dp_rank=dp_rank)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine | DataParallelEngine:
        """world 1: the runner in this process; world > 1: one worker process per rank;
        --data-parallel-size > 1: a DataParallelEngine of that many such engines."""
        check_device(config.device)
        if config.parallel.data_parallel_size > 1:
            from dsaserve.engine.dp import DataParallelEngine  # dp builds on this module

            return DataParallelEngine.from_config(config)
        executor: Executor = (InProcessExecutor(ModelRunner(config))
                              if config.parallel.world_size == 1 else MultiprocExecutor(config))
        try:
            tokenizer = Tokenizer.from_pretrained(config.model_path)
        except (OSError, ValueError):
            tokenizer = None  # token-id-only use (benchmarks, tests) needs none
        try:
            return cls(config, executor, tokenizer)
        except BaseException:
            executor.shutdown()  # no worker outlives a failed start
            raise

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, cache_salt: str | None = None,
                    kv_transfer_params: KVTransferParams | None = None,
                    kv_remote: dict | None = None) -> None:
        """Queue a request; raises RequestError (a client's mistake) before anything is allocated,
        so a bad request never reaches (and never fails) a step that other requests share.
        `kv_remote`: the prefill engine's side-channel answer for a P/D decode request, already
        read (disagg.connector.fetch_remote); without it it is read here."""
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        num_stops = len(params.min_tokens_stop_ids(self.eos_token_ids, vocab))
        if num_stops > MAX_STOP_IDS:  # masked before min_tokens from a row of that width
            raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS} ids with the EOS ids "
                               f"when min_tokens > 0, got {num_stops}")
        max_logprobs = self.config.scheduler.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise RequestError(f"logprobs: {params.logprobs} exceeds the engine's "
                               f"--max-logprobs {max_logprobs}")
        try:  # hashed as UTF-8 into the first block: a lone surrogate would fail a shared step
            (cache_salt or "").encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError("cache_salt: a lone UTF-16 surrogate is not valid Unicode") from e
        kv_transfer_params = self._check_kv_transfer(request_id, prompt_token_ids,
                                                     kv_transfer_params, kv_remote)
        try:
            self.scheduler.add_request(Request(
                request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                sampling_params=params, arrival_time=time.monotonic(), cache_salt=cache_salt,
                eos_token_ids=self.eos_token_ids, kv_transfer_params=kv_transfer_params,
            ))
        except RequestError:
            if kv_transfer_params is not None and kv_transfer_params.do_remote_prefill:
                # refused after its check: its claim given back. Only then: a plain request
                # refused for an id in use must not touch the live decode request's state
                assert self.connector is not None
                self.connector.forget(request_id)
            raise

    def _check_kv_transfer(self, request_id: str, prompt_token_ids: Sequence[int],
                           params: KVTransferParams | None,
                           kv_remote: dict | None) -> KVTransferParams | None:
        """P/D params checked before anything is allocated: RequestError (→ 400) for a request
        this engine cannot serve, or whose remote KV is not (or no longer) there."""
        if params is None or not (params.do_remote_decode or params.do_remote_prefill):
            return None
        if self.connector is None:
            raise RequestError("kv_transfer_params: this engine has no P/D connector "
                               "(--kv-transfer-config with kv_connector NixlConnector)")
        if params.do_remote_decode and not self.connector.config.is_producer:
            raise RequestError("kv_transfer_params: do_remote_decode on an engine whose kv_role "
                               f"is {self.connector.config.kv_role!r}")
        if params.do_remote_prefill:
            if request_id in self.scheduler.requests:
                if kv_remote is not None:  # its fetch claimed the held request: give it back
                    self.connector.refused(request_id, params, kv_remote)
                raise RequestError(f"request id {request_id!r} is already in use")
            self.connector.check_request(request_id, params, len(prompt_token_ids),
                                         kv_remote)
        return params

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_requests([request_id])

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            self.launch_next_step()
            return self.finish_oldest_step()
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        schedule_ms = 1e3 * (time.perf_counter() - started)
        runner_output = self.executor.execute(scheduler_output)
        if self.step_log is not None:
            self.step_log.record(scheduler_output, runner_output, schedule_ms)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    # ---- --async-scheduling: step k + 1 launched while step k runs, then step k's results ------
    def launch_next_step(self) -> None:
        """Schedule and launch step k + 1 (its inputs that continue from step k are taken on
        the device from step k's samples)."""
        self.submit_step(*self.schedule_next_step())

    def schedule_next_step(self) -> tuple[SchedulerOutput, bool]:
        """--async-scheduling, the first half of `launch_next_step`: step k + 1 scheduled →
        (it, whether it must reach the ranks even if idle)."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self.step_log is not None:
            self.step_log.scheduled(scheduler_output, 1e3 * (time.perf_counter() - started))
        # P/D READs, held blocks' read notifications and host-tier copies in flight are
        # polled by every step, empty ones too
        offload, connector = self.scheduler.offload, self.connector
        poll = (bool(self.scheduler.receiving) or (offload is not None and offload.busy)
                or (connector is not None and connector.num_held > 0))
        return scheduler_output, poll

    def submit_step(self, scheduler_output: SchedulerOutput, poll: bool) -> None:
        """The second half: the step sent to the ranks (an idle one only if `poll`)."""
        self._in_flight.append((scheduler_output, self.executor.submit(scheduler_output,
                                                                       poll=poll)))

    def finish_oldest_step(self) -> list[RequestOutput]:
        """Read step k's results into the scheduler → step k's outputs (none while only one step
        was launched: only the requests aborted meanwhile)."""
        if len(self._in_flight) == 1:
            return self.scheduler.take_aborted_outputs()
        scheduler_output, pending = self._in_flight.popleft()
        runner_output = pending.result()
        if self.step_log is not None:
            self.step_log.record(scheduler_output, runner_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def only_polling(self) -> bool:
        """Work remains but the last step computed nothing: only transfers in flight (P/D
        READs, held blocks' readers, host-tier copies) that each step polls. A core loop then
        waits up to POLL_INTERVAL_S for new requests before the next step rather than spinning
        a core that the processes beside it need (docs/disagg.md: a P/D prefill process's
        spinning loop and both processes' torch threads slowed the decode side's host work)."""
        return self.scheduler.last_step_empty and self.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.executor.call("check_block_table")  # the device block table is the host's
        if self.config.disagg is not None:  # P/D: no staging buffer held past its READs
            self.executor.call("check_connector")
        if self.config.hisparse is not None:  # host pool, hot buffers, mirror bytes per rank
            mla = self.scheduler.mla
            self.executor.call("check_hisparse", None if mla is None else (
                dict(mla.page_of), mla.pending_changes()))

    def shutdown(self) -> None:
        """Stop the worker processes, or release the in-process runner's weights and KV cache
        (idempotent; a DataParallelEngine shuts each replica down here too)."""
        # 1. live requests aborted: their blocks freed, claims of P/D requests not yet
        #    receiving given back
        try:
            self.scheduler.abort_requests(list(self.scheduler.requests))
        except Exception:  # a core that died mid-step: its workers must still be stopped
            logger.exception("shutdown: aborting the live requests failed")
        # 2. a producer's side channel stops answering
        if self.connector is not None:
            self.connector.close()
        # 3. --step-log: the lines still waiting for their GPU time (rank 0's runner waits
        #    for its last events)
        if self.step_log is not None:
            self._close_step_log()
        # 4. every rank cancels its P/D READs in flight (nothing lands in freed memory), then
        #    closes its transport
        self.executor.shutdown()
        # 5. only now, with no READ in flight: the claims on prefill engines' blocks not fully
        #    read given back, so those engines free them at once, not at their abort timeout
        #    (bounded: a producer gone or silent is logged)
        if self.connector is not None:
            self.connector.give_back_claims()
        self.runner = None

    def _close_step_log(self) -> None:
        assert self.step_log is not None
        log, self.step_log = self.step_log, None  # shutdown is idempotent
        try:
            times = self.executor.call("drain_step_times")[0]
        except (EngineDeadError, RuntimeError):  # a dead core: its lines without GPU times
            logger.exception("shutdown: the step log's last GPU times were not read")
            times = ()
        log.close(times)

    # ---- offline convenience ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 *, cache_salt: str | None = None) -> list[list[int]]:
        """Run prompts to completion; returns the output token ids of each, in order."""
        return run_to_completion(self, prompts, params, cache_salt=cache_salt)

    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]],
                               params: SamplingParams | Sequence[SamplingParams],
                               *, cache_salt: str | None = None) -> list[Completion]:
        """generate, each prompt's tokens with their logprob entries (SamplingParams.logprobs)."""
        return run_completions(self, prompts, params, cache_salt=cache_salt)


def check_device(device: str) -> None:
    """--device names a device this machine has: a ConfigError naming the flag, where torch
    would fail deep inside the model's build (an AssertionError without CUDA)."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    if index >= (count := torch.cuda.device_count()):
        raise ConfigError(f"--device: {device} is not available (this machine has {count} CUDA "
                          "devices)")
