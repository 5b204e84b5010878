"""The router's side of KV events: one ZMQ SUB socket per backend (connected to every replica's
endpoint that the backend advertises at /kv_info), replayed into the PreciseIndex.

A gap in a replica's sequence numbers means the publisher dropped events: the backend's view is
then unknown, so it is forgotten (it refills as blocks are stored again) rather than trusted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dsaserve.kv.events import DEFAULT_TOPIC, decode_batch
from dsaserve.router.prefix_index import PreciseIndex

logger = logging.getLogger(__name__)


def connect_address(endpoint: str, backend_url: str) -> str:
    """A bound endpoint as a subscriber reaches it: a wildcard host becomes the backend's host.

        tcp://*:5557 + http://10.0.0.7:8000 → tcp://10.0.0.7:5557
    """
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in ("*", "0.0.0.0", ""):
        host = backend_url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return f"tcp://{host}:{port}"


class KVEventSubscriber:
    """Follows the KV events of every backend that publishes them."""

    def __init__(self, index: PreciseIndex, topic: str = DEFAULT_TOPIC,
                 on_batch: Callable[[str], None] = lambda backend: None) -> None:
        import zmq.asyncio

        self.index = index
        self._topic = topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._on_batch = on_batch
        self.num_gaps = 0

    def follow(self, backend: str, endpoints: tuple[str, ...]) -> None:
        """(Re)subscribe to `backend`'s endpoints; an empty tuple stops following it."""
        old = self._tasks.pop(backend, None)
        if old is not None:
            old.cancel()
        self.index.forget(backend)
        if endpoints:
            addresses = [connect_address(e, backend) for e in endpoints]
            self._tasks[backend] = asyncio.create_task(self._run(backend, addresses))

    async def _run(self, backend: str, addresses: list[str]) -> None:
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        for address in addresses:
            sock.connect(address)
        last_seq: dict[int, int] = {}  # replica → last sequence number seen
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = decode_batch(frames[2])
                except ValueError as e:
                    logger.warning("router: bad KV event batch from %s: %s", backend, e)
                    continue
                seq = int.from_bytes(frames[1], "big")
                prev = last_seq.get(batch.data_parallel_rank)
                last_seq[batch.data_parallel_rank] = seq
                if prev is not None and seq != prev + 1:
                    # Lost events (or a restarted publisher): what we know may be wrong.
                    self.num_gaps += 1
                    self.index.forget(backend)
                self.index.apply(backend, batch)
                self._on_batch(backend)
        finally:
            sock.close()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.term()
