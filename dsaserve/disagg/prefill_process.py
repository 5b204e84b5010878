"""A prefill engine (kv_producer) in a process of its own, driven over a pipe: the two engines'
agents in two processes, as a P/D deployment runs them, for benchmarks and tests that drive the
decode engine by hand in this process (benchmarks/pd_e2e.py).

    this process                                  the spawned child
    PrefillProcess(config) ──── Pipe ────►  LLMEngine.from_config(config)   (kv_producer)
        ◄────────────────────────────────── Ready
      .prefill(rid, prompt) ── Prefill ───►  offline.prefill: prefilled, its blocks held
        ◄────────────────────── KVTransferParams (their side channel is the child's socket)
      .drain() ─────────────── Drain ─────►  steps until it holds nothing; check_integrity()
        ◄────────────────────── Drained
      .close() ─────────────── Stop ──────►  engine.shutdown(); exits

Between messages the child steps its engine while it has unfinished requests, as a server's core
loop does: that is where it learns that a consumer read its blocks, and frees them. Any
exception in the child is fatal: it reports the traceback, shuts its engine down and exits; the
parent raises PrefillProcessError. Every wait has a timeout and watches the child's sentinel,
so a dead or stuck child is an error in bounded time, never a hang; `close()` (also on garbage
collection and at interpreter exit) stops the child gracefully, then by signal.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import NoReturn, TypeVar

import torch

from dsaserve.config import EngineConfig
from dsaserve.core import KVTransferParams
from dsaserve.disagg import offline
from dsaserve.disagg.launch import die_with_parent, exit_on_sigterm
from dsaserve.disagg.transport import remove_shm_files
from dsaserve.engine.engine import POLL_INTERVAL_S, LLMEngine
from dsaserve.engine.executor import cpu_threads_per_worker, reap

T = TypeVar("T")

TICK_S = 0.01  # `drain`'s tick: how often it calls back while it waits
_STOP_TIMEOUT_S = 30.0  # the child's graceful exit (its engine's shutdown), then SIGTERM, SIGKILL


# ---- the messages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefill:
    request_id: str
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class Drain:
    timeout_s: float


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    pid: int
    agents: tuple[str, ...]  # its ranks' transport agents (a shm agent killed leaves files)


@dataclass(frozen=True)
class Drained:
    pass


@dataclass(frozen=True)
class Failed:
    traceback: str


class PrefillProcessError(RuntimeError):
    """The prefill process failed, died, or did not answer in time."""


# ---- this side ---------------------------------------------------------------------------------
class PrefillProcess:
    """A kv_producer engine built from `config` in a spawned process. Not thread-safe; create
    it from a thread that outlives it (Linux's parent-death signal follows the creating thread).
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0,
                 timeout_s: float = 600.0) -> None:
        if config.disagg is None or not config.disagg.is_producer:
            raise ValueError("PrefillProcess: the config's --kv-transfer-config must have "
                             "kv_role kv_producer")
        if config.parallel.data_parallel_size != 1:
            raise ValueError("PrefillProcess: one engine (--data-parallel-size 1)")
        self._timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        # Not daemonic: the child's engine may spawn worker processes of its own. It ends on
        # Stop, on EOF of its pipe (this process gone), and on SIGTERM when this process dies.
        self._proc: BaseProcess = ctx.Process(target=_serve, args=(config, theirs),
                                              name="dsaserve-prefill")
        self._proc.start()
        theirs.close()  # only the child holds it now: its death makes our end read EOF
        self._agents: list[str] = []  # filled once known; the finalizer sweeps their files
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn, self._agents)
        try:
            ready = self._expect(Ready, start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        self.pid = ready.pid
        self._agents += ready.agents

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def agents(self) -> tuple[str, ...]:
        """The transport agents of its ranks (their shm files are swept once it is stopped)."""
        return tuple(self._agents)

    def prefill(self, request_id: str, prompt: Sequence[int]) -> KVTransferParams:
        """Prefill `prompt` there for one token; the params the decode side needs. Its blocks
        stay held until a consumer has read them (or the producer's timeout)."""
        self._send(Prefill(request_id, tuple(prompt)))
        return self._expect(KVTransferParams, self._timeout_s, f"prefill of {request_id!r}")

    def drain(self, timeout_s: float = 30.0, tick: Callable[[], object] | None = None) -> None:
        """Wait until the engine there holds nothing (its blocks read), then its invariants.
        tick: called every ~10 ms while waiting, e.g. the consumer engine's `step` when it is in
        this process. Without a NIXL progress thread (as on a CPU) the notification a READ
        carries to this producer can still need the consumer agent's progress after the READ
        completed; a consumer that is not stepped would leave it unsent (seen under a loaded CI:
        the drain timed out)."""
        self._send(Drain(timeout_s))
        self._expect(Drained, timeout_s + self._timeout_s, "drain", tick)

    def close(self) -> None:
        """Stop the child (gracefully, then by signal); idempotent."""
        self._finalizer()

    def __enter__(self) -> PrefillProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, message: Prefill | Drain) -> None:
        try:
            self._conn.send(message)
        except OSError:  # BrokenPipeError: the child is gone
            self._raise_dead()

    def _expect(self, kind: type[T], timeout_s: float, what: str,
                tick: Callable[[], object] | None = None) -> T:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise PrefillProcessError(f"prefill process: {what}: no answer within "
                                          f"{timeout_s:.0f} s")
            wait([self._conn, self._proc.sentinel], timeout=left if tick is None else
                 min(left, TICK_S))
            if not self._proc.is_alive() and not self._conn.poll():
                self._raise_dead()
            if tick is not None:
                tick()
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._raise_dead()
        if isinstance(message, Failed):
            self.close()
            raise PrefillProcessError(f"prefill process: {what} raised:\n{message.traceback}")
        if not isinstance(message, kind):
            self.close()
            raise PrefillProcessError(f"prefill process: {what}: expected {kind.__name__}, got "
                                      f"{type(message).__name__}")
        return message

    def _raise_dead(self) -> NoReturn:
        self._proc.join(1.0)
        code = self._proc.exitcode
        self.close()
        raise PrefillProcessError(f"prefill process exited with code {code}")


def _stop(proc: BaseProcess, conn: Connection, agents: list[str]) -> None:
    """The finalizer: ask the child to exit, make sure it did, close our end, sweep the shm
    files of its agents (left behind only if it was killed)."""
    if proc.is_alive():
        try:
            conn.send(Stop())
        except OSError:
            pass
        proc.join(_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()  # SIGTERM: its engine still shuts down (exit_on_sigterm)
        reap([proc], _STOP_TIMEOUT_S)
    conn.close()
    for agent in agents:
        remove_shm_files(agent)


# ---- the child ---------------------------------------------------------------------------------
def _serve(config: EngineConfig, conn: Connection) -> None:
    die_with_parent()
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # exit through `finally`: engine shut down
    # the decode engine's process beside it: half the cores each, on a GPU too (its step's
    # host work slowed 50× with both processes' threads spinning over every core)
    torch.set_num_threads(cpu_threads_per_worker(2))
    engine = None
    try:
        engine = LLMEngine.from_config(config)
        assert isinstance(engine, LLMEngine)  # no data-parallel replicas (checked by the parent)
        conn.send(Ready(os.getpid(), _agents(engine)))
        while True:
            busy = engine.has_unfinished_requests()
            # holding blocks for readers only: a short wait between polling steps
            if busy and not conn.poll(POLL_INTERVAL_S if engine.only_polling else 0):
                engine.step()  # as a server's core loop: read notifications free held blocks
                continue
            message = conn.recv()  # EOFError: the parent is gone
            if isinstance(message, Stop):
                return
            if isinstance(message, Prefill):
                conn.send(offline.prefill(engine, message.request_id, message.prompt))
            elif isinstance(message, Drain):
                _drain(engine, message.timeout_s)
                conn.send(Drained())
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")
    except EOFError:
        return
    except Exception:  # (SIGTERM's SystemExit is no failure to report: we were stopped)
        try:
            conn.send(Failed(traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if engine is not None:
            engine.shutdown()


def _agents(engine: LLMEngine) -> tuple[str, ...]:
    connector = engine.connector
    assert connector is not None
    return tuple(json.loads(base64.b64decode(json.loads(m)["transport"]))["agent"]
                 for m in connector.rank_metadata)


def _drain(engine: LLMEngine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"drain: requests still unfinished after {timeout_s:.0f} s "
                               "(blocks held that no consumer read?)")
        engine.step()
    engine.check_integrity()

