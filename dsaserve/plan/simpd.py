"""P/D in the simulator: the engine's own connector (scheduler side) on both engines, and the
network that moves a prompt's KV between them.

    prefill replica (producer)                        decode replica (consumer)
    ConnectorScheduler.hold: blocks held   ──params──► check_request (the held blocks, checked
                                                        against the producer's side-channel payload)
                                                       Scheduler._start_recv: WAITING_FOR_REMOTE_KVS
    NIC ◄──────────── READ of (prompt − cached) rows ── NIC   (KVLink: queued per replica, priced)
    kv_sends_done → release: blocks freed  ◄─ landing ─► kv_recvs_done → runs from the last token
"""

from __future__ import annotations

import json

from dsaserve.config import DisaggConfig, ModelConfig
from dsaserve.core import KVRecv
from dsaserve.disagg.connector import ConnectorScheduler, EngineLayout
from dsaserve.plan import costmodel as cm
from dsaserve.plan.deployment import Deployment
from dsaserve.plan.parts import Parts
from dsaserve.plan.simengine import Replica, SimEngine

# Held blocks are freed when read; the simulated consumer always reads them, so the engine's
# wall-clock timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT) must never fire during a long run.
NO_TIMEOUT_S = 1e12


class _Address:
    """The side channel's address without a socket: the simulator hands its payload over."""

    host = "127.0.0.1"
    port = 0

    def close(self) -> None:
        pass


class SimConnector(ConnectorScheduler):
    """The engine's ConnectorScheduler, its side channel replaced by `payload()` in process."""

    def __post_init__(self) -> None:
        self.side_channel = _Address()  # type: ignore[assignment]
        self._publish()


def make_connector(d: Deployment, role: str, engine_id: str) -> SimConnector:
    """A replica's connector: `kv_producer` (prefill) or `kv_consumer` (decode), with one
    metadata entry per rank naming its DCP rank (what the consumer's check reads)."""
    par = d.parallel
    dcp = par.decode_context_parallel_size
    ranks = [json.dumps({"dcp_rank": r % dcp}).encode() for r in range(par.world_size)]
    return SimConnector(
        config=DisaggConfig(kv_role=role, backend="shm", engine_id=engine_id,
                            side_channel_port=0, abort_timeout_s=NO_TIMEOUT_S),
        engine_id=engine_id,
        layout=EngineLayout(block_size=d.block_size, dcp_size=dcp, interleave=1,
                            tp_size=par.tensor_parallel_size),
        rank_metadata=ranks)


def side_channel_payload(replica: Replica) -> dict:
    """What the producer replica's side channel would answer now."""
    assert replica.connector is not None
    return json.loads(replica.connector.payload())


class KVLink:
    """The network between the prefill engine and the decode engine. A read moves positions
    [num_cached, prompt − 1) of every layer (the MTP layer and indexer keys included): each
    consumer rank reads its DCP shard over its own NIC (TP ranks each read theirs), spread over
    the producer's ranks and their NICs. Each replica's NICs serve their reads in order; a read
    lands `network_latency_us` after its bytes."""

    def __init__(self, model: ModelConfig, parts: Parts, prefill: SimEngine,
                 decode: SimEngine) -> None:
        self.bytes_per_token = cm.kv_bytes_per_token(model, decode.deployment.kv_dtype).total
        self.bandwidth = parts.network_gbps.value * 1e9  # per GPU
        self.latency = parts.network_latency_us.value * 1e-6
        self.prefill = prefill
        self.producers = {r.engine_id: r for r in prefill.replicas}
        p, c = prefill.deployment.parallel, decode.deployment.parallel
        consumer_dcp = c.decode_context_parallel_size
        # Seconds per token on the slower side: a consumer rank's bytes over its NIC, or the
        # producer's share of all consumer ranks' bytes over its ranks' NICs.
        per_consumer_rank = self.bytes_per_token / consumer_dcp
        per_producer_rank = per_consumer_rank * c.world_size / p.world_size  # ranks per replica
        self.seconds_per_token = max(per_consumer_rank, per_producer_rank) / self.bandwidth
        self.reads: dict[str, tuple[float, float]] = {}  # request id → (queued, landed)

    def start(self, consumer: Replica, recv: KVRecv, now: float) -> float:
        """Queue `recv` on both replicas' NICs; its landing time (reported to both schedulers
        at their first update at or after it)."""
        remote = recv.remote
        assert remote.remote_engine_id is not None and remote.remote_request_id is not None
        producer = self.producers[remote.remote_engine_id]
        busy = (recv.num_tokens - recv.num_cached) * self.seconds_per_token
        start = max(now, consumer.nic_free, producer.nic_free)
        consumer.nic_free = producer.nic_free = start + busy
        land = start + busy + self.latency
        consumer.add_read("recv", land, recv.request_id)
        producer.add_read("send", land, remote.remote_request_id)
        self.prefill.wake_at(producer, land)  # it may be idle, holding only these blocks
        self.reads[recv.request_id] = (now, land)
        return land
