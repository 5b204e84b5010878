"""Executors: how the engine core reaches the model runners of its ranks.

The engine core always talks to an executor, never to a runner, so a one-rank engine and a
world of worker processes look the same to it:

    InProcessExecutor   world 1: the ModelRunner lives in this process (no IPC at all)
    MultiprocExecutor   world = pcp × tp: one spawned worker process per rank (engine/worker.py)

A step is split in two so that several engines (data-parallel replicas) compute at once:
`execute_async(so)` hands the step to every rank and returns; `collect()` waits for it.

Failure detection: while waiting, the executor watches every worker's pipe AND its process
sentinel, so a worker that is killed, crashes or runs out of memory is noticed at once (a rank
blocked in a collective with a dead peer would otherwise wait forever). The executor then stops
every other worker and raises EngineDeadError; it is dead from then on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, Protocol, TypeVar

import torch

from dsaserve.config import EngineConfig
from dsaserve.core import EngineDeadError, ModelRunnerOutput, SchedulerOutput
from dsaserve.disagg.receiving import RecvTally
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.step_results import PendingOutput, PendingStep
from dsaserve.engine.worker import (
    CallMethod,
    CallResult,
    ExecuteStep,
    Flush,
    FromWorker,
    Shutdown,
    StepDone,
    SubmitStep,
    ToWorker,
    WorkerError,
    WorkerReady,
    WorkerSpec,
    encode,
    recv,
    run_worker,
)
from dsaserve.kv.copier import merge_rank_outputs

_FAILURE_GRACE_S = 0.5  # after one failure, how long peers get to report theirs (the root cause)
_SHUTDOWN_TIMEOUT_S = 5.0  # graceful exit of every worker, then SIGTERM, then SIGKILL
_TERMINATE_TIMEOUT_S = 2.0

Reply = TypeVar("Reply", WorkerReady, StepDone, CallResult)


class Executor(Protocol):
    """What the engine core needs from its ranks."""

    world_size: int
    num_blocks: int  # KV blocks the scheduler may hand out (the minimum over ranks)

    def execute_async(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, scheduler_output: SchedulerOutput, *, poll: bool = False
               ) -> PendingStep: ...

    def call(self, name: str, *args: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


# ------------------------------------------------------------------------------------------------
# world 1: the runner in this process
# ------------------------------------------------------------------------------------------------
class InProcessExecutor:
    """Wraps a local ModelRunner; `execute_async` runs the step at once (there is no other process
    to overlap with) and `collect` hands back its output."""

    world_size = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner: ModelRunner | None = runner
        self.num_blocks = runner.num_blocks
        self._pending: ModelRunnerOutput | None = None

    def execute_async(self, scheduler_output: SchedulerOutput) -> None:
        if self.runner is None:
            raise EngineDeadError("the engine was shut down")
        if self._pending is not None:
            raise RuntimeError("execute_async: the previous step was not collected")
        self._pending = self.runner.execute(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        output, self._pending = self._pending, None
        if output is None:
            raise RuntimeError("collect: no step in flight (call execute_async first)")
        return output

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_async(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput, *, poll: bool = False) -> PendingStep:
        """--async-scheduling: launch the step; its output is read later (engine/engine.py)."""
        if self.runner is None:
            raise EngineDeadError("the engine was shut down")
        return self.runner.submit(scheduler_output)

    def call(self, name: str, *args: Any) -> list[Any]:
        if self.runner is None:
            raise EngineDeadError("the engine was shut down")
        return [getattr(self.runner, name)(*args)]

    def shutdown(self) -> None:
        """Drop the runner: its weights and KV cache are freed once nothing else holds them."""
        if self.runner is not None:
            self.runner.close()
        self.runner = None


# ------------------------------------------------------------------------------------------------
# world > 1 (or a DP replica): one worker process per rank
# ------------------------------------------------------------------------------------------------
def worker_device(device: str, rank: int, device_offset: int = 0) -> str:
    """The device of `rank`: the engine's GPUs are consecutive from the configured one.

        device "cuda:2", device_offset 4 (DP replica 1 of world 4), rank 3  →  "cuda:9"
        device "cpu"                                                        →  "cpu"
    """
    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type != "cuda":
        raise ValueError(f"--device: workers run on cpu or cuda, got {device!r}")
    return f"cuda:{(d.index or 0) + device_offset + rank}"


def cpu_threads_per_worker(num_workers: int) -> int:
    """Torch threads per worker so that the workers of every replica share the cores without
    oversubscription (spin-waiting threads fighting for cores slow everything down): this
    process's cores, or its OMP_NUM_THREADS where that is fewer (`serve --pd` gives each of
    its two servers half), split between them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    budget = os.environ.get("OMP_NUM_THREADS", "")
    if budget.isdigit() and int(budget) > 0:
        cores = min(cores or 1, int(budget))
    return max(1, (cores or 1) // num_workers)


class StartAbandoned(EngineDeadError):
    """DP + EP: this replica gave up its start-up because another replica's failed."""


class MultiprocExecutor:
    """Spawns `pcp × tp` workers, waits until each has built its runner, then drives them in
    lock-step. Not thread-safe: one owner thread calls every method.

    `device_offset` shifts the GPUs of this engine (DP replica i uses offset i·world).
    Workers are stopped by `shutdown()`, when the executor is garbage-collected, at interpreter
    exit, and when the engine core's process dies (each worker watches its parent).
    """

    def __init__(self, config: EngineConfig, *, device_offset: int = 0, replica: int = 0,
                 rendezvous_file: str | None = None, abort: threading.Event | None = None,
                 poll_interval_s: float = 0.5) -> None:
        """`replica`, `rendezvous_file`: where EP spans the DP replicas their workers join one
        process group through this shared store (engine/dp.py owns it); otherwise each engine
        makes its own. `abort`: set when another replica failed to start, whose workers ours
        would wait for in the process group's rendezvous: the start-up then fails too."""
        self.world_size = config.parallel.world_size
        self._abort = abort
        # DP + EP: the other replicas' workers; one of them dying leaves ours blocked in a
        # collective with it, so their sentinels end a wait as our own do (watch_peers)
        self._peers: list[BaseProcess] = []
        self._poll_interval_s = poll_interval_s
        self._dead_reason: str | None = None
        self._in_flight = False  # a step was sent and not yet collected
        # --async-scheduling: steps submitted whose results are not read, oldest first. The
        # workers answer a step when the next one is submitted (or at a Flush), so all but the
        # last of them have their answers on the way.
        self._unread: deque[_SubmittedStep] = deque()
        # P/D: each rank polls its own READs; a prompt's KV arrived once every rank reported it
        self._recvs = RecvTally(self.world_size)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        # a directory only when the store is ours to remove
        self._rendezvous_dir = ("" if rendezvous_file is not None
                                else tempfile.mkdtemp(prefix="dsaserve-rendezvous-"))
        store = rendezvous_file or os.path.join(self._rendezvous_dir, "store")
        # Registered before anything starts, holding no reference to self: runs exactly once, on
        # shutdown(), on garbage collection or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns,
                                           self._rendezvous_dir)
        num_replicas = config.parallel.data_parallel_size
        # on a GPU too: the host work of a step (plans, tables, transfer descriptors) ran 50×
        # slower with every worker's torch threads spinning over all the cores (P/D's READ
        # descriptors: 367 ms instead of 7 ms, docs/disagg.md)
        threads = cpu_threads_per_worker(self.world_size * num_replicas)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(self.world_size):
                spec = WorkerSpec(
                    config=config, rank=rank, world_size=self.world_size,
                    rendezvous_file=store,
                    device=worker_device(config.device, rank, device_offset), num_threads=threads,
                    replica=replica,
                )
                ours, theirs = ctx.Pipe()
                # daemon: multiprocessing's own exit handler terminates them as a last resort.
                proc = ctx.Process(target=run_worker, args=(spec, theirs), daemon=True,
                                   name=f"dsaserve-worker-{device_offset + rank}")
                proc.start()
                theirs.close()  # only the child holds it now: its death makes our end read EOF
                self._procs.append(proc)
                self._conns.append(ours)
            ready = self._gather(WorkerReady)
        except BaseException:
            self._kill_all()
            raise
        self._abort = None  # started: only a start-up is abandoned
        self.num_blocks = min(r.num_blocks for r in ready)

    def watch_peers(self, procs: Sequence[BaseProcess]) -> None:
        """DP + EP: the workers of the other replicas, whose death fails this engine too."""
        self._peers = list(procs)

    @property
    def procs(self) -> tuple[BaseProcess, ...]:
        return tuple(self._procs)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs if p.pid is not None)

    # ---- the step --------------------------------------------------------------------------------
    def execute_async(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step to every rank; they start at once (in lock-step through collectives)."""
        # requests that ended while receiving: their ranks' earlier reports are void (an id
        # may come back at once; every rank cancels the READs at the start of this step)
        self._recvs.forget(scheduler_output.finished_request_ids)
        self._broadcast(ExecuteStep(scheduler_output))
        self._in_flight = True

    def collect(self) -> ModelRunnerOutput:
        """Wait for every rank's answer to the step in flight; rank 0's output is the engine's."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if not self._in_flight:
            raise RuntimeError("collect: no step in flight (call execute_async first)")
        self._in_flight = False
        return self._step_output()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_async(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput, *, poll: bool = False) -> PendingStep:
        """--async-scheduling: every rank launches the step and answers the one submitted before
        it; this step's output is read by `result()` of what is returned, in submission order.
        A step with nothing for the ranks is not sent, unless `poll` (P/D READs or host-tier
        copies in flight, which each step polls)."""
        if scheduler_output.is_idle and not poll:
            return PendingOutput([], [], None)
        self._recvs.forget(scheduler_output.finished_request_ids)  # as execute_async
        self._broadcast(SubmitStep(scheduler_output))
        step = _SubmittedStep(self)
        self._unread.append(step)
        return step

    def _read(self, step: _SubmittedStep) -> ModelRunnerOutput:
        """The output of `step`, the oldest submitted step not read."""
        if not self._unread or self._unread[0] is not step:
            raise RuntimeError("async steps' results are read in the order they were submitted")
        if len(self._unread) == 1:  # the last one sent: the workers hold its answer
            self._broadcast(Flush())
        output = self._step_output()
        self._unread.popleft()
        return output

    def _step_output(self) -> ModelRunnerOutput:
        """Every rank's answer to one step → the engine's output (rank 0's, with what the other
        ranks alone know merged in)."""
        replies = self._gather(StepDone)
        output = replies[0].output
        assert output is not None, "rank 0 answered a step without its output"
        merged = merge_rank_outputs(output, [r.output for r in replies[1:]])
        done, failed = self._recvs.merge([r.output for r in replies if r.output is not None])
        return replace(merged, kv_recvs_done=done, kv_recvs_failed=failed)

    def call(self, name: str, *args: Any) -> list[Any]:
        """`getattr(runner, name)(*args)` on every rank; the results in rank order. An exception on
        any rank is fatal, like one in a step (ranks could otherwise diverge)."""
        if len(self._unread) > 1:
            raise RuntimeError(f"call {name!r}: a submitted step's answer is unread")
        self._broadcast(CallMethod(name, tuple(args)))
        return [reply.value for reply in self._gather(CallResult)]

    def shutdown(self) -> None:
        """Stop every worker (gracefully, then by signal); idempotent."""
        if self._dead_reason is None:
            self._dead_reason = "the engine was shut down"
        self._finalizer()

    # ---- the control plane -----------------------------------------------------------------------
    def _broadcast(self, message: ToWorker) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._in_flight:
            raise RuntimeError(f"{type(message).__name__}: the previous step was not collected")
        if self._unread and isinstance(message, ExecuteStep):
            raise RuntimeError("ExecuteStep: submitted steps are in flight (--async-scheduling)")
        for rank, proc in enumerate(self._procs):  # a rank that died while we were idle
            if not proc.is_alive():
                self._fail(rank)
        data = encode(message)  # pickled once for every rank
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:  # BrokenPipeError: the worker is gone
                self._fail(rank)

    def _gather(self, kind: type[Reply]) -> list[Reply]:
        """One `kind` reply from every rank, in rank order. Waits on the pipes and the process
        sentinels together, so a dead worker ends the wait as surely as an answer does."""
        replies: list[Reply | None] = [None] * self.world_size
        while missing := [r for r, reply in enumerate(replies) if reply is None]:
            wait([self._conns[r] for r in missing] + [self._procs[r].sentinel for r in missing]
                 + [p.sentinel for p in self._peers], timeout=self._poll_interval_s)
            if self._abort is not None and self._abort.is_set():
                self._kill_all()
                self._dead_reason = "start-up abandoned: another data-parallel replica failed"
                raise StartAbandoned(self._dead_reason)
            if dead := [p for p in self._peers if not p.is_alive()]:
                self._kill_all()
                self._dead_reason = (f"worker {dead[0].name} of another data-parallel replica "
                                     f"exited with code {dead[0].exitcode} (the replicas share "
                                     "their experts and step together)")
                raise EngineDeadError(self._dead_reason)
            for rank in missing:
                conn = self._conns[rank]
                if conn.poll():  # a message, or EOF
                    try:
                        message = recv(conn)
                    except (EOFError, OSError):
                        self._fail(rank)
                    replies[rank] = self._expect(rank, message, kind)
                elif not self._procs[rank].is_alive():
                    self._fail(rank)
        return [reply for reply in replies if reply is not None]

    def _expect(self, rank: int, message: FromWorker, kind: type[Reply]) -> Reply:
        if isinstance(message, WorkerError):
            self._fail(rank, message)
        if not isinstance(message, kind):
            self._fail(rank, WorkerError(rank, f"protocol error: expected {kind.__name__}, got "
                                               f"{type(message).__name__}"))
        return message

    # ---- failure ---------------------------------------------------------------------------------
    def _fail(self, rank: int, report: WorkerError | None = None) -> NoReturn:
        """Stop every worker and raise EngineDeadError naming the root cause.

        Failures come in bursts: when one rank is killed, its peers' collectives fail too and they
        report errors. A rank that exited without a report (killed, crashed, OOM) is the root
        cause, so it is named first; the grace period lets it surface when a peer's report
        happened to arrive first.
        """
        reports = {rank: report} if report is not None else {}
        if report is not None:
            others = [p.sentinel for r, p in enumerate(self._procs) if r != rank]
            if others:
                wait(others, timeout=_FAILURE_GRACE_S)  # returns at the first death, if any
        else:
            self._procs[rank].join(_FAILURE_GRACE_S)  # reap it, to read its exit code
        codes = {r: p.exitcode for r, p in enumerate(self._procs)}  # before we stop anyone
        for r, code in codes.items():
            if code is not None and r not in reports and (late := _pending_report(self._conns[r])):
                reports[r] = late
        self._kill_all()
        lines = [f"worker rank {r} exited with code {code}" for r, code in codes.items()
                 if code is not None and r not in reports]
        by_traceback: dict[str, list[int]] = {}
        for r in sorted(reports):
            by_traceback.setdefault(reports[r].traceback, []).append(r)
        for tb, ranks in by_traceback.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_join(ranks)}"
            lines.append(f"worker {who} raised:\n{tb.rstrip()}")
        if not lines:
            lines = [f"worker rank {rank} closed its pipe"]
        self._dead_reason = "\n".join(lines)
        raise EngineDeadError(self._dead_reason)

    def _kill_all(self) -> None:
        """Survivors may be blocked in a collective with a dead peer: no graceful exit for them."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        reap(self._procs, _TERMINATE_TIMEOUT_S)
        if self._dead_reason is None:
            self._dead_reason = "the engine's workers were stopped"
        self._finalizer()


class _SubmittedStep:
    """A step submitted to the workers (--async-scheduling); `result()` reads its output once."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor: MultiprocExecutor | None = executor
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._executor is not None:
            self._output, self._executor = self._executor._read(self), None
        assert self._output is not None
        return self._output


def _pending_report(conn: Connection) -> WorkerError | None:
    """The error report a dead worker left in its pipe, if any."""
    try:
        if conn.poll():
            message = recv(conn)
            return message if isinstance(message, WorkerError) else None
    except (EOFError, OSError):
        pass
    return None


def _join(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _join_within(procs: Sequence[BaseProcess], timeout_s: float) -> list[BaseProcess]:
    """Join `procs` within `timeout_s` overall → the ones still alive."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    return [proc for proc in procs if proc.is_alive()]


def reap(procs: Sequence[BaseProcess], timeout_s: float) -> None:
    """Join `procs` within `timeout_s` overall; SIGKILL whatever is left, then join that."""
    for proc in _join_within(procs, timeout_s):
        proc.kill()
        proc.join()


def _stop_workers(procs: list[BaseProcess], conns: list[Connection], rendezvous_dir: str) -> None:
    """The executor's finalizer: ask the live workers to exit, make sure they did, free the rest."""
    for proc, conn in zip(procs, conns, strict=True):
        if proc.is_alive():
            try:
                conn.send_bytes(encode(Shutdown()))
            except OSError:
                pass
    for proc in _join_within(procs, _SHUTDOWN_TIMEOUT_S):
        proc.terminate()
    reap(procs, _TERMINATE_TIMEOUT_S)
    for conn in conns:
        conn.close()
    if rendezvous_dir:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
