"""Data parallelism: several independent engine replicas behind one engine-shaped front.

    DataParallelEngine ── add_request ──► the least loaded replica (the request stays there)
        │
        ├─ replica 0: LLMEngine = Scheduler + MultiprocExecutor (workers on devices 0 .. W−1)
        ├─ replica 1: LLMEngine = Scheduler + MultiprocExecutor (workers on devices W .. 2W−1)
        └─ ...

Replicas share no KV and no prefix cache: each request is pinned to one replica for its whole
life, and aborts follow it there. A step schedules every replica, sends every step, then collects
them all, so the replicas compute concurrently while this process waits. The public API is
LLMEngine's, so the server and the CLI drive either without knowing which.

With `--enable-expert-parallel` the routed experts are sharded over every rank of every replica
(vLLM's DP + EP; `ParallelConfig.ep_spans_replicas`): the replicas' workers join one process
group (one rendezvous store, made here) and every MoE layer dispatches over all of them. The
replicas then step in lock-step: whenever one has work, every replica runs the step, an idle one
with an empty step whose experts serve the others' rows (parallel/lockstep.py); one replica's
worker dying fails every replica (their collectives would wait for it). A step that is
decode-only on every replica is padded to one size on all of them, chosen here from every
replica's scheduler output (engine/dp_padding.py), so that its dispatches need no exchange of
row counts and can replay CUDA graphs.
"""

from __future__ import annotations

import functools
import operator
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import fields, replace

from dsaserve.config import EngineConfig
from dsaserve.core import (
    Completion,
    CountHistogram,
    EngineDeadError,
    EngineStats,
    KVTransferParams,
    ModelRunnerOutput,
    RequestError,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from dsaserve.engine import dp_padding
from dsaserve.engine.engine import LLMEngine, run_completions, run_to_completion
from dsaserve.engine.executor import MultiprocExecutor, StartAbandoned
from dsaserve.tokenizer import Tokenizer


def _sum(values: list) -> int | tuple[int, ...] | CountHistogram:
    """Counts add up; per-position tuples (spec-decode acceptance) add up elementwise;
    histograms merge (each replica's steps are observations of one distribution)."""
    if values and isinstance(values[0], tuple):
        return tuple(sum(column) for column in zip(*values, strict=True))
    return functools.reduce(operator.add, values)


def pick_replica(loads: Sequence[tuple[int, int]]) -> int:
    """The replica for a new request, from each replica's (unfinished requests, used KV blocks):
    fewest unfinished requests, then fewest used blocks, ties to the lowest index."""
    return min(range(len(loads)), key=lambda i: (*loads[i], i))


class DataParallelEngine:
    """`data_parallel_size` LLMEngines, each with its own scheduler and worker processes (even at
    world 1: replicas must run in separate processes to compute at the same time).
    Not thread-safe: one owner thread calls every method."""

    def __init__(self, config: EngineConfig, replicas: Sequence[LLMEngine],
                 tokenizer: Tokenizer | None, *, rendezvous_dir: str | None = None) -> None:
        """`rendezvous_dir`: DP + EP's shared store (NCCL sets communicators up through it at
        their first collective), removed at shutdown or when this engine is collected."""
        self.config = config
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self._finalizer = (None if rendezvous_dir is None else
                           weakref.finalize(self, shutil.rmtree, rendezvous_dir, True))
        # request id → replica index, for every request added and not yet finished or aborted
        self._owner: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> DataParallelEngine:
        """Start every replica at once (worker start-up dominates); replica i's workers use the
        devices from offset i·world."""
        world, num = config.parallel.world_size, config.parallel.data_parallel_size
        shared = config.parallel.ep_spans_replicas
        store_dir = tempfile.mkdtemp(prefix="dsaserve-rendezvous-") if shared else None
        store = None if store_dir is None else os.path.join(store_dir, "store")
        # every replica at once: with DP + EP their workers join one process group, which
        # waits for all of them, so the first replica to fail abandons the others' start-up
        abort = threading.Event() if shared else None
        with ThreadPoolExecutor(num, thread_name_prefix="dp-start") as pool:
            futures = [pool.submit(MultiprocExecutor, config, device_offset=i * world,
                                   replica=i, rendezvous_file=store, abort=abort)
                       for i in range(num)]
            if abort is not None:
                done, _ = wait_for(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    abort.set()
        # the root cause first: the replicas that gave up because of it say so in their own
        errors = sorted((f.exception() for f in futures if f.exception() is not None),
                        key=lambda e: isinstance(e, StartAbandoned))
        if errors:
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            for f in futures:
                if f.exception() is None:
                    f.result().shutdown()
            raise errors[0]
        executors = [f.result() for f in futures]
        if shared:
            for i, executor in enumerate(executors):
                executor.watch_peers([p for j, e in enumerate(executors) if j != i
                                      for p in e.procs])
        try:
            tokenizer: Tokenizer | None = Tokenizer.from_pretrained(config.model_path)
        except (OSError, ValueError):
            tokenizer = None  # token-id-only use (benchmarks, tests) needs none
        try:
            replicas = [LLMEngine(config, executor, tokenizer, dp_rank=i)
                        for i, executor in enumerate(executors)]
        except BaseException:
            for executor in executors:
                executor.shutdown()
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        return cls(config, replicas, tokenizer, rendezvous_dir=store_dir)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, cache_salt: str | None = None,
                    kv_transfer_params: KVTransferParams | None = None,
                    kv_remote: dict | None = None) -> None:
        """Pin the request to the least loaded replica; raises RequestError like LLMEngine (ids
        are unique across replicas, not only within one)."""
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        index = pick_replica([self._load(r) for r in self.replicas])
        self.replicas[index].add_request(request_id, prompt_token_ids, params,
                                         cache_salt=cache_salt,
                                         kv_transfer_params=kv_transfer_params,
                                         kv_remote=kv_remote)
        self._owner[request_id] = index

    def abort_request(self, request_id: str) -> None:
        """Unknown or finished ids are ignored. The "abort" output comes with a later step."""
        index = self._owner.pop(request_id, None)
        if index is not None:
            self.replicas[index].abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        try:
            outputs = self._step_async() if self.config.scheduler.async_scheduling else (
                self._step_sync())
        except EngineDeadError:
            self.shutdown()  # one dead replica ends the engine: stop the others' workers too
            raise
        # finished requests leave their replica (aborted ones left at abort_request, and their
        # id may already name a new request)
        for out in outputs:
            if out.finished and out.finish_reason != "abort":
                self._owner.pop(out.request_id, None)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """--async-scheduling: every replica launches step k + 1 before any reads step k's
        results (a replica with nothing to run sends nothing to its workers, unless DP + EP
        and another replica runs a step)."""
        scheduled = [replica.schedule_next_step() for replica in self.replicas]
        if self.config.parallel.ep_spans_replicas and any(
                poll or not so.is_idle for so, poll in scheduled):
            scheduled = [(so, True) for so in self._pad_together([so for so, _ in scheduled])]
        for replica, (so, poll) in zip(self.replicas, scheduled, strict=True):
            replica.submit_step(so, poll)
        return [out for replica in self.replicas for out in replica.finish_oldest_step()]

    def _step_sync(self) -> list[RequestOutput]:
        """Schedule every replica, start those with work, then collect each."""
        # 1. schedule every replica (this process, CPU only)
        scheduled, schedule_ms = [], []
        for r in self.replicas:
            started = time.perf_counter()
            scheduled.append(r.scheduler.schedule())
            schedule_ms.append(1e3 * (time.perf_counter() - started))
        # 2. start every replica with something to run or forget: they compute concurrently
        busy = [not so.is_empty or bool(so.finished_request_ids) or bool(so.kv_recvs)
                or bool(r.scheduler.receiving)  # P/D READs in flight: polled each step
                or (r.scheduler.connector is not None and r.scheduler.connector.num_held > 0)
                for r, so in zip(self.replicas, scheduled, strict=True)]
        if self.config.parallel.ep_spans_replicas and any(busy):
            busy = [True] * len(busy)  # DP + EP: every replica in every step (lock-step)
            scheduled = self._pad_together(scheduled)
        for replica, so, b in zip(self.replicas, scheduled, busy, strict=True):
            if b:
                replica.executor.execute_async(so)
        # 3. collect each, advance its scheduler (aborted requests come out of idle ones too)
        outputs: list[RequestOutput] = []
        for replica, so, b, ms in zip(self.replicas, scheduled, busy, schedule_ms, strict=True):
            runner_output = (replica.executor.collect() if b
                             else ModelRunnerOutput(sampled_token_ids={}))
            if replica.step_log is not None:
                replica.step_log.record(so, runner_output, ms)
            outputs += replica.scheduler.update_from_output(so, runner_output)
        return outputs

    def _pad_together(self, scheduled: list[SchedulerOutput]) -> list[SchedulerOutput]:
        """DP + EP, every replica's step just scheduled → the same steps, with the size every
        replica pads it to where it is decode-only (or empty) on all of them."""
        size = dp_padding.common_size(self.config, [
            r.scheduler.decode_context_lens(so)
            for r, so in zip(self.replicas, scheduled, strict=True)])
        if size is None:
            return scheduled
        return [replace(so, dp_padded_size=size) for so in scheduled]

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    @property
    def only_polling(self) -> bool:
        """LLMEngine.only_polling over every replica."""
        return (all(r.scheduler.last_step_empty for r in self.replicas)
                and self.has_unfinished_requests())

    def stats(self) -> EngineStats:
        """The sum over replicas (kv_cache_usage is then the pooled usage)."""
        parts = [r.stats() for r in self.replicas]
        return EngineStats(**{f.name: _sum([getattr(p, f.name) for p in parts])
                              for f in fields(EngineStats)})

    def check_integrity(self) -> None:
        """Every replica's invariants, and the pinning: each live request of replica i is pinned
        to i, and every pinned request is live in its replica."""
        live: dict[str, int] = {}
        for i, replica in enumerate(self.replicas):
            replica.check_integrity()
            for request_id in replica.scheduler.requests:
                live[request_id] = i
        if live != self._owner:
            raise AssertionError(f"data parallel: live requests by replica {live} != pinned "
                                 f"{self._owner}")

    def shutdown(self) -> None:
        """Stop every replica's workers (idempotent)."""
        for replica in self.replicas:
            replica.shutdown()
        if self._finalizer is not None:
            self._finalizer()

    # ---- offline convenience --------------------------------------------------------------------
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

    @staticmethod
    def _load(replica: LLMEngine) -> tuple[int, int]:
        stats = replica.stats()
        return (stats.num_running + stats.num_waiting,
                stats.num_total_blocks - stats.num_free_blocks)
