"""A P/D consumer giving back its claims on a prefill engine's held requests, off the engine
core's thread.

A decode request's first side-channel check claims the held request it names
(`ConnectorScheduler.claim`). When that request will not READ after all, the consumer says so
over the same side channel, with a "release" question the producer answers on its side-channel
thread:

    consumer (engine core)                  sender threads             producer side channel
    ──────────────────────                  ──────────────             ─────────────────────
    refused after its check ──► release(free=False) ─► question ─────► claim dropped; blocks
                                                                       held for another decode
                                                                       request (or the timeout)
    aborted / failed with no ──► release(free=True) ──► question ─────► blocks freed at the next
    READ of it in flight                                               step (as if read)
    shut down: every claim
    not read, once every rank
    cancelled its READs     ──► release(free=True) ──► question ─────► (the same)

The engine core only queues the message: a producer that is slow or gone costs a sender thread
a timeout and a log line, never a step, and never holds up the releases to other producers; a
shutdown waits for the last ones briefly (`ConnectorScheduler.give_back_claims`), then goes on.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from dataclasses import dataclass

from dsaserve.core import KVTransferParams
from dsaserve.disagg.transport import TransferError, fetch_metadata

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]  # a producer's side channel: (host, port)


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
    """Sends queued `Release`s on daemon threads, each with `timeout_s`; failures and refusals
    are logged (the producer's abort timeout frees the blocks instead).

    Releases to one producer (its side channel's endpoint) go one at a time, in the order
    queued; releases to different producers do not wait for each other. Threads start on
    demand, at most `max_threads`, each stops after `idle_s` with nothing to send, so a decode
    engine that talked to many producers over its life keeps none for them. A thread sends one
    release, then takes the next endpoint in turn (round robin):

        queued:   A: a1 a2   B: b1   C: c1          turn: A B C
        thread 1: a1 ──────── (A silent: its timeout) ────────► a2 ─── …
        thread 2: b1 ─► answered, c1 ─► answered, idle (a2 waits for a1: A's in order)

    So a silent producer holds one thread for `timeout_s` per release, and a release to another
    producer waits only while all `max_threads` are sending, then for its turn."""

    MAX_THREADS = 8
    IDLE_S = 5.0

    def __init__(self, timeout_s: float, *, max_threads: int | None = None,
                 idle_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_threads = self.MAX_THREADS if max_threads is None else max_threads
        self.idle_s = self.IDLE_S if idle_s is None else idle_s
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {self.max_threads}")
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)  # `_ready` not empty, or closed
        self._all_sent = threading.Condition(self._lock)  # `_num_pending` fell to 0
        # endpoint → its releases not yet taken by a thread, in order; an endpoint is in
        # `_ready` iff it has some and no thread is sending to it (in `_sending`)
        self._queues: dict[Endpoint, deque[Release]] = {}
        self._ready: deque[Endpoint] = deque()
        self._sending: set[Endpoint] = set()
        self._num_threads = 0
        self._num_idle = 0  # threads waiting for an endpoint
        self._num_pending = 0  # queued or being sent
        self._closed = False
        self.num_released = 0  # answered "released"
        self.num_failed = 0  # refused, the producer could not be reached, or sent after close

    def send(self, release: Release) -> None:
        """Queue `release` (never blocks); a thread starts if none is free and the cap allows.
        After `close`, dropped with a warning."""
        p = release.params
        if p.remote_host is None or p.remote_port is None:
            return  # not checkable, so never claimed
        endpoint = (p.remote_host, p.remote_port)
        with self._lock:
            if self._closed:
                self.num_failed += 1
                logger.warning("P/D: not giving back decode request %s's claim on %s's request "
                               "%s: shut down; the prefill engine's timeout frees its blocks",
                               release.by, p.remote_engine_id, p.remote_request_id)
                return
            queued = self._queues.setdefault(endpoint, deque())
            queued.append(release)
            self._num_pending += 1
            if len(queued) > 1 or endpoint in self._sending:
                return  # it follows the releases before it to this producer
            self._ready.append(endpoint)
            if len(self._ready) > self._num_idle and self._num_threads < self.max_threads:
                self._num_threads += 1
                threading.Thread(target=self._run, daemon=True, name="kv-claim-release").start()
            else:
                self._has_work.notify()

    @property
    def num_pending(self) -> int:
        """Releases queued or being sent, not yet answered or failed."""
        with self._lock:
            return self._num_pending

    @property
    def num_threads(self) -> int:
        """Sender threads alive (sending, or idle for less than `idle_s`)."""
        with self._lock:
            return self._num_threads

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued release was answered or failed; False after `timeout_s` in
        all (however many producers are silent)."""
        with self._lock:
            return self._all_sent.wait_for(lambda: not self._num_pending, timeout_s)

    def close(self) -> None:
        """Accept no more releases (`send` drops them); those queued before still go, so a
        producer slow to answer still frees its blocks once it does. Idle threads stop now,
        the others once they have sent them."""
        with self._lock:
            self._closed = True
            self._has_work.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._num_idle += 1
                self._has_work.wait_for(lambda: self._ready or self._closed, self.idle_s)
                self._num_idle -= 1
                if not self._ready:  # idle for `idle_s`, or closed with nothing left
                    self._num_threads -= 1
                    return
                endpoint = self._ready.popleft()
                self._sending.add(endpoint)
                release = self._queues[endpoint].popleft()
            try:
                self._send_one(release)
            except Exception:  # never let one message end the thread
                logger.exception("P/D: sending a claim release failed")
            finally:
                with self._lock:
                    self._sending.discard(endpoint)
                    if self._queues[endpoint]:
                        self._ready.append(endpoint)  # its next release, in turn
                    else:
                        del self._queues[endpoint]
                    self._num_pending -= 1
                    if not self._num_pending:
                        self._all_sent.notify_all()

    def _send_one(self, r: Release) -> None:
        p = r.params
        assert p.remote_host is not None and p.remote_port is not None  # `send` checked
        try:
            answer = json.loads(fetch_metadata(p.remote_port, p.remote_host, self.timeout_s,
                                               r.question()))
        except (TransferError, ValueError) as e:
            with self._lock:
                self.num_failed += 1
            logger.warning("P/D: cannot give back decode request %s's claim on %s's request "
                           "%s (%s); the prefill engine's timeout frees its blocks", r.by,
                           p.remote_engine_id, p.remote_request_id, e)
            return
        with self._lock:
            if isinstance(answer, dict) and answer.get("released") is True:
                self.num_released += 1
                return
            self.num_failed += 1
        logger.warning("P/D: the prefill engine %s refused decode request %s's release of "
                       "request %s (freed or expired meanwhile)", p.remote_engine_id,
                       r.by, p.remote_request_id)
