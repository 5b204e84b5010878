"""KV-cache events: what an engine tells a router about the blocks its prefix cache holds.

vLLM's `--kv-events-config` semantics: a block becomes findable by its hash → BlockStored; a cached
block is reused for other tokens (evicted) → BlockRemoved. A router that replays these events knows
exactly which prefixes each engine holds (the "precise" prefix index).

    block pool (engine-core thread)        publisher thread               router
    cache_block ─► sink.stored([h]) ─┐
    _evict      ─► sink.removed([h]) ┼─► bounded queue ─► ZMQ PUB ──────► SUB ─► PreciseIndex
                                     ┘   (batched)        [topic, seq, JSON batch]

Every event carries `medium` ("GPU" for the device pool, "CPU" for a host tier) so a host tier can
publish through the same sink; a batch carries the data-parallel replica that produced it (under DP
each replica is its own publisher, on the endpoint's port + replica index, as vLLM does). The pool
never blocks on the network: the sink only appends to a bounded queue, and when the queue is full
the batch is dropped and the sequence gap tells subscribers their view is stale.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Medium = Literal["GPU", "CPU"]
DEFAULT_TOPIC = "kv-events"


# ------------------------------------------------------------------------------------------------
# The events (typed; one JSON codec for the wire)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]  # prefix-cache hashes (dsaserve.kv.prefix_cache), chain order
    block_size: int  # tokens per hashed block: the scheduler block B·DCP
    medium: Medium = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: Medium = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: Medium = "GPU"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float  # wall-clock seconds when the batch was sent
    events: tuple[KVEvent, ...]
    data_parallel_rank: int = 0  # the replica whose pool produced the events


def encode_batch(batch: KVEventBatch) -> bytes:
    events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": [h.hex() for h in e.block_hashes],
                           "block_size": e.block_size, "medium": e.medium})
        elif isinstance(e, BlockRemoved):
            events.append({"type": "BlockRemoved",
                           "block_hashes": [h.hex() for h in e.block_hashes], "medium": e.medium})
        else:
            events.append({"type": "AllBlocksCleared", "medium": e.medium})
    return json.dumps({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                       "events": events}, separators=(",", ":")).encode()


def decode_batch(data: bytes) -> KVEventBatch:
    """Inverse of encode_batch; raises ValueError on anything else."""
    try:
        raw = json.loads(data)
        events: list[KVEvent] = []
        for e in raw["events"]:
            kind = e["type"]
            if kind == "BlockStored":
                events.append(BlockStored(tuple(bytes.fromhex(h) for h in e["block_hashes"]),
                                          int(e["block_size"]), e["medium"]))
            elif kind == "BlockRemoved":
                events.append(BlockRemoved(tuple(bytes.fromhex(h) for h in e["block_hashes"]),
                                           e["medium"]))
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared(e["medium"]))
            else:
                raise ValueError(f"unknown event type {kind!r}")
        return KVEventBatch(float(raw["ts"]), tuple(events), int(raw["data_parallel_rank"]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a KV event batch: {e}") from e


# ------------------------------------------------------------------------------------------------
# Config (vLLM's --kv-events-config JSON)
# ------------------------------------------------------------------------------------------------
# --kv-events-config's keys: (key, JSON type, what the error says it must be)
_KV_EVENTS_KEYS: tuple[tuple[str, type, str], ...] = (
    ("enable_kv_cache_events", bool, "true or false"),
    ("publisher", str, "a string"),
    ("endpoint", str, "a string"),
    ("topic", str, "a string"),
    ("max_queue_size", int, "an integer"),
)


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://127.0.0.1:5557"  # replica i binds port + i
    topic: str = DEFAULT_TOPIC
    max_queue_size: int = 10_000  # batches held for the sender thread before dropping

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @staticmethod
    def from_json(text: str) -> KVEventsConfig:
        """vLLM's JSON; every key type-checked here (a string `"yes"` for a bool, a port past
        65535 were accepted and failed later, or never)."""
        from dsaserve.config import ConfigError

        flag = "--kv-events-config"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: invalid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{flag}: expected a JSON object with keys enable_kv_cache_events, "
                              f"publisher, endpoint, topic, max_queue_size, got {text!r}")
        unknown = sorted(set(raw) - set(KVEventsConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"{flag}: unknown keys {unknown}")
        for key, kind, expected in _KV_EVENTS_KEYS:
            # bool is an int in Python: a `true` queue size is no more a number than "1" is
            if key in raw and (not isinstance(raw[key], kind)
                               or (kind is int and isinstance(raw[key], bool))):
                raise ConfigError(f"{flag}: {key} must be {expected}, got {raw[key]!r}")
        config = KVEventsConfig(**raw)
        if config.publisher not in ("null", "zmq"):
            raise ConfigError(f"{flag}: publisher must be 'null' or 'zmq', "
                              f"got {config.publisher!r}")
        if config.max_queue_size < 1:
            raise ConfigError(f"{flag}: max_queue_size must be >= 1, got {config.max_queue_size}")
        if config.enabled:
            host, _, port = config.endpoint.removeprefix("tcp://").rpartition(":")
            if not (config.endpoint.startswith("tcp://") and host and port.isdigit()):
                raise ConfigError(f"{flag}: endpoint must be tcp://HOST:PORT, "
                                  f"got {config.endpoint!r}")
            if not 1 <= int(port) <= 65535:
                raise ConfigError(f"{flag}: endpoint's port must be in [1, 65535], "
                                  f"got {config.endpoint!r}")
        return config

    def replica_endpoint(self, rank: int) -> str:
        """Replica `rank`'s endpoint: the port shifted by the rank (vLLM's DP convention)."""
        host, _, port = self.endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"


# ------------------------------------------------------------------------------------------------
# The engine side: a sink the block pool calls, and the ZMQ publisher behind it
# ------------------------------------------------------------------------------------------------
class KVEventSink:
    """What a KV tier calls: the GPU block pool with the default medium, a host (CPU) tier with
    medium="CPU" on the same sink. This base class is the disabled sink: every call is a no-op."""

    def stored(self, block_hashes: list[bytes], medium: Medium = "GPU") -> None:
        pass

    def removed(self, block_hashes: list[bytes], medium: Medium = "GPU") -> None:
        pass


NULL_SINK = KVEventSink()


class ZmqKVEventPublisher(KVEventSink):
    """A ZMQ PUB socket on its own thread. `stored`/`removed` run on the engine-core thread and
    only enqueue; the sender thread batches whatever is queued and publishes
    [topic, 8-byte big-endian sequence number, JSON batch]."""

    def __init__(self, endpoint: str, *, block_size: int, data_parallel_rank: int = 0,
                 topic: str = DEFAULT_TOPIC, max_queue_size: int = 10_000) -> None:
        import zmq

        self.endpoint = endpoint
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(max_queue_size)
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:  # fails here (not in the thread) when the port is taken
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            from dsaserve.config import ConfigError

            self._sock.close()
            self._ctx.term()
            raise ConfigError(f"--kv-events-config: cannot bind {endpoint}: {e} (another "
                              "process or replica uses the port; pick a free endpoint)") from e
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stored(self, block_hashes: list[bytes], medium: Medium = "GPU") -> None:
        if block_hashes:
            self._put(BlockStored(tuple(block_hashes), self.block_size, medium))

    def removed(self, block_hashes: list[bytes], medium: Medium = "GPU") -> None:
        if block_hashes:
            self._put(BlockRemoved(tuple(block_hashes), medium))

    def _put(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:  # never block a step on a slow network: subscribers see a seq gap
            self.num_dropped += 1

    def _run(self) -> None:
        seq = 0
        while True:
            first = self._queue.get()
            if first is None:
                break
            events: list[KVEvent] = [first]
            stop = False
            while len(events) < 1024:
                try:
                    e = self._queue.get_nowait()
                except queue.Empty:
                    break
                if e is None:
                    stop = True
                    break
                events.append(e)
            if self.num_dropped:
                seq += 1  # skip a number: subscribers learn that events were lost
                self.num_dropped = 0
            batch = KVEventBatch(time.time(), tuple(events), self.data_parallel_rank)
            self._sock.send_multipart([self._topic, seq.to_bytes(8, "big"), encode_batch(batch)])
            seq += 1
            if stop:
                break
        self._sock.close()
        self._ctx.term()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


def attach_kv_event_publishers(engine: object, config: KVEventsConfig) -> list[ZmqKVEventPublisher]:
    """Give the GPU block pool of every replica of `engine` (an LLMEngine or a DataParallelEngine)
    its own publisher; returns them (the caller closes them). Nothing happens when disabled.

    Called before the engine core starts stepping: the pool is then only touched by that thread.
    Only the GPU pool is wired here; a host tier reports through the same publisher
    (`kv.pool.events`) with medium="CPU".
    """
    if not config.enabled:
        return []
    replicas = getattr(engine, "replicas", None) or [engine]
    publishers: list[ZmqKVEventPublisher] = []
    try:
        for rank, replica in enumerate(replicas):
            kv = replica.scheduler.kv  # type: ignore[attr-defined]
            publisher = ZmqKVEventPublisher(config.replica_endpoint(rank),
                                            block_size=kv.block_size, data_parallel_rank=rank,
                                            topic=config.topic,
                                            max_queue_size=config.max_queue_size)
            kv.pool.events = publisher
            publishers.append(publisher)
    except BaseException:  # a later replica's port is taken: the earlier ones' are given back
        for publisher in publishers:
            publisher.close()
        raise
    return publishers
