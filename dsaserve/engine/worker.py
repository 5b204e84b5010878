"""One worker process per rank: joins the engine's `torch.distributed` world, owns a ModelRunner,
and obeys the engine core's control-plane messages in lock-step with the other ranks.

    engine core (MultiprocExecutor)                    worker rank r (this module)
    ───────────────────────────────                    ───────────────────────────
                                       spawn ──►  init_process_group(file://…, rank r, world)
                                                  ParallelGroups.build → ModelRunner
             gather WorkerReady  ◄── WorkerReady(r, num_blocks)
    ExecuteStep(so) to every rank ──►             runner.execute(so)   (collectives inside)
             gather StepDone     ◄── StepDone(r, output if r == 0 else None)
    SubmitStep(so_k+1) ──────────►                runner.submit(so_k+1): launched, not waited
             gather StepDone     ◄── StepDone(r, step k's output)  (--async-scheduling)
    Flush ───────────────────────►                the last submitted step's output, now
             gather StepDone     ◄── StepDone(r, …)
    CallMethod(name, args) ──────►                getattr(runner, name)(*args)
             gather CallResult   ◄── CallResult(r, value)
    Shutdown ────────────────────►                destroy the process group, exit 0
                  any exception  ◄── WorkerError(r, traceback), exit 1

The control plane is a multiprocessing Pipe per rank carrying pickled dataclasses (`send`/`recv`
below are the only serializer); tensors between ranks travel only through the data plane
(gloo on CPU, NCCL on GPU). Non-zero ranks answer every step with a small ack so that a rank that
fails is noticed on the step it fails, not at the next collective.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from dsaserve.config import EngineConfig
from dsaserve.core import ModelRunnerOutput, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.step_results import PendingStep
from dsaserve.parallel.groups import ParallelGroups, global_rank, process_group_size


# ------------------------------------------------------------------------------------------------
# Messages: engine core → worker
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExecuteStep:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class SubmitStep:
    """--async-scheduling: launch the step, then answer the step submitted before it (whose
    results are read while this one runs); the first one in flight is answered by the next
    SubmitStep or by a Flush."""

    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class Flush:
    """Answer the last submitted step now (the engine has nothing to submit after it)."""


@dataclass(frozen=True)
class CallMethod:
    """Run `getattr(runner, name)(*args)` on every rank (tests, metrics, per-rank accounting)."""

    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    pass


# ------------------------------------------------------------------------------------------------
# Messages: worker → engine core
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerReady:
    rank: int
    num_blocks: int


@dataclass(frozen=True)
class StepDone:
    rank: int
    # rank 0's sampled tokens; None (an ack) from other ranks, or their host-tier copy counts
    output: ModelRunnerOutput | None


@dataclass(frozen=True)
class CallResult:
    rank: int
    value: Any


@dataclass(frozen=True)
class WorkerError:
    """The worker raised; it exits with code 1 right after sending this."""

    rank: int
    traceback: str


ToWorker = ExecuteStep | SubmitStep | Flush | CallMethod | Shutdown
FromWorker = WorkerReady | StepDone | CallResult | WorkerError


def encode(message: ToWorker | FromWorker) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: ToWorker | FromWorker) -> None:
    conn.send_bytes(encode(message))


def recv(conn: Connection) -> ToWorker | FromWorker:
    """Raises EOFError when the other end is gone."""
    return pickle.loads(conn.recv_bytes())


# ------------------------------------------------------------------------------------------------
# The worker process
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs (pickled into the child by multiprocessing)."""

    config: EngineConfig
    rank: int  # within the replica
    world_size: int  # the replica's ranks
    # the file:// store of the process group: fresh per engine, shared by the replicas where EP
    # spans them (groups.process_group_size)
    rendezvous_file: str
    device: str  # "cpu" or "cuda:N" (the executor resolves the device offset)
    num_threads: int | None  # torch CPU threads; None keeps torch's default
    replica: int = 0  # the DP replica this rank belongs to


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry (multiprocessing spawn target). Returns normally only after Shutdown."""
    # Ctrl-C reaches the whole process group; the engine core decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        runner = _start(spec)
        send(conn, WorkerReady(spec.rank, runner.num_blocks))
        steps = _Submitted()
        while True:
            try:
                message = recv(conn)
            except EOFError:
                os._exit(1)  # the engine core is gone: nobody is left to report to
            if isinstance(message, Shutdown):
                runner.close()
                break
            reply = _handle(runner, spec.rank, message, steps)
            if reply is not None:
                send(conn, reply)
    except BaseException:
        try:
            send(conn, WorkerError(spec.rank, traceback.format_exc()))
        except OSError:
            pass
        # Skip interpreter clean-up: a peer may be dead, and tearing down the process group
        # could block in a collective. The engine core terminates the surviving ranks.
        sys.stderr.flush()
        os._exit(1)
    _stop_distributed()


def _start(spec: WorkerSpec) -> ModelRunner:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "gloo"
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    par = spec.config.parallel
    dist.init_process_group(backend, init_method=f"file://{spec.rendezvous_file}",
                            rank=global_rank(par, spec.rank, spec.replica),
                            world_size=process_group_size(par))
    groups = ParallelGroups.build(par, spec.rank, spec.replica)
    return ModelRunner(spec.config, groups=groups, device=device)


class _Submitted:
    """--async-scheduling: the step launched last, whose results this rank has not sent."""

    def __init__(self) -> None:
        self.pending: PendingStep | None = None

    def swap(self, launched: PendingStep | None) -> PendingStep | None:
        previous, self.pending = self.pending, launched
        return previous


def _handle(runner: ModelRunner, rank: int, message: ToWorker,
            steps: _Submitted) -> FromWorker | None:
    if isinstance(message, ExecuteStep):
        return _step_done(runner, rank, runner.execute(message.scheduler_output))
    if isinstance(message, SubmitStep):
        # launch step k + 1 first: reading step k's results (its one sync) then overlaps it
        previous = steps.swap(runner.submit(message.scheduler_output))
        return None if previous is None else _step_done(runner, rank, previous.result())
    if isinstance(message, Flush):
        previous = steps.swap(None)
        if previous is None:
            raise RuntimeError(f"worker rank {rank}: Flush with no step in flight")
        return _step_done(runner, rank, previous.result())
    if isinstance(message, CallMethod):
        return CallResult(rank, getattr(runner, message.name)(*message.args))
    raise TypeError(f"worker rank {rank}: unexpected message {type(message).__name__}")


def _step_done(runner: ModelRunner, rank: int, output: ModelRunnerOutput) -> StepDone:
    """A step's answer: rank 0's output; an ack from the others, or what only they know."""
    if rank != 0 and (runner.copier is not None or runner.connector is not None):
        # only the host-tier copy counts and the P/D reads this rank settled matter
        output = ModelRunnerOutput(sampled_token_ids={},
                                   num_kv_loads_done=output.num_kv_loads_done,
                                   num_kv_stores_done=output.num_kv_stores_done,
                                   kv_recvs_done=output.kv_recvs_done,
                                   kv_recvs_failed=output.kv_recvs_failed)
    keep = rank == 0 or runner.copier is not None or runner.connector is not None
    return StepDone(rank, output if keep else None)


def _stop_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    """Exit as soon as the engine core's process dies, even while blocked in a collective (the
    pipe's EOF is only seen between messages): no worker outlives its engine."""
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
