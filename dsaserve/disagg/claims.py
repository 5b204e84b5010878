"""A P/D consumer giving back its claims on a prefill engine's held requests, off the engine
core's thread.

A decode request's first side-channel check claims the held request it names
(`ConnectorScheduler.claim`). When that request will not READ after all, the consumer says so
over the same side channel, with a "release" question the producer answers on its side-channel
thread:

    consumer (engine core)                  sender thread              producer side channel
    ──────────────────────                  ─────────────              ─────────────────────
    refused after its check ──► release(free=False) ─► question ─────► claim dropped; blocks
                                                                       held for another decode
                                                                       request (or the timeout)
    aborted / failed with no ──► release(free=True) ──► question ─────► blocks freed at the next
    READ of it in flight                                               step (as if read)
    shut down: every claim
    not read, once every rank
    cancelled its READs     ──► release(free=True) ──► question ─────► (the same)

The engine core only queues the message: a producer that is slow or gone costs the sender
thread a timeout and a log line, never a step; a shutdown waits for the last ones briefly
(`ConnectorScheduler.give_back_claims`), then goes on.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass

from dsaserve.core import KVTransferParams
from dsaserve.disagg.transport import TransferError, fetch_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Release:
    """Decode request `by` gives back its claim on `params`' held request; `free`: it will never
    READ it and none of its READs is in flight, so the producer may free the blocks now."""

    by: str
    params: KVTransferParams
    free: bool

    def question(self) -> bytes:
        return json.dumps({"release": self.params.remote_request_id, "by": self.by,
                           "engine": self.params.remote_engine_id, "free": self.free}).encode()


class ReleaseSender:
    """One daemon thread that sends queued `Release`s, each with `timeout_s`; failures and
    refusals are logged (the producer's abort timeout frees the blocks instead)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Release] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.num_released = 0  # answered "released"
        self.num_failed = 0  # refused, or the producer could not be reached

    def send(self, release: Release) -> None:
        """Queue `release` (never blocks); the thread starts with the first one."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kv-claim-release")
                self._thread.start()
        self._queue.put(release)

    @property
    def num_pending(self) -> int:
        """Releases queued or being sent, not yet answered or failed."""
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued release was answered or failed; False after `timeout_s`."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(
                lambda: not self._queue.unfinished_tasks, timeout_s)

    def _run(self) -> None:
        while True:
            release = self._queue.get()
            try:
                self._send_one(release)
            except Exception:  # never let one message end the thread
                logger.exception("P/D: sending a claim release failed")
            finally:
                self._queue.task_done()

    def _send_one(self, r: Release) -> None:
        p = r.params
        if p.remote_host is None or p.remote_port is None:
            return  # not checkable, so never claimed
        try:
            answer = json.loads(fetch_metadata(p.remote_port, p.remote_host, self.timeout_s,
                                               r.question()))
        except (TransferError, ValueError) as e:
            self.num_failed += 1
            logger.warning("P/D: cannot give back decode request %s's claim on %s's request "
                           "%s (%s); the prefill engine's timeout frees its blocks", r.by,
                           p.remote_engine_id, p.remote_request_id, e)
            return
        if isinstance(answer, dict) and answer.get("released") is True:
            self.num_released += 1
        else:
            self.num_failed += 1
            logger.warning("P/D: the prefill engine %s refused decode request %s's release of "
                           "request %s (freed or expired meanwhile)", p.remote_engine_id,
                           r.by, p.remote_request_id)
