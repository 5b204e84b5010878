"""The router's pure parts: scorers, the pick, both prefix indexes, the KV event codec and the
engine-side hook in the block pool, health back-off and load parsing."""

from __future__ import annotations

import pytest

from dsaserve.config import ConfigError
from dsaserve.kv.block_pool import BlockPool
from dsaserve.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    KVEventSink,
    ZmqKVEventPublisher,
    decode_batch,
    encode_batch,
)
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.router.backends import LoadSample, backoff_s, parse_load
from dsaserve.router.config import RouterConfig
from dsaserve.router.events import connect_address
from dsaserve.router.prefix_index import ApproximateIndex, PreciseIndex
from dsaserve.router.scoring import (
    Candidate,
    ScoringWeights,
    kv_score,
    longest_prefix_match,
    min_max_scores,
    pick,
    prefix_score,
    score_candidates,
)

H = [bytes([i]) * 32 for i in range(8)]


# ---- scorers ------------------------------------------------------------------------------------
def test_longest_prefix_match_stops_at_the_first_miss() -> None:
    held = {H[0], H[1], H[3]}
    assert longest_prefix_match(H[:4], held.__contains__) == 2  # H[3] is useless without H[2]
    assert longest_prefix_match(H[:4], lambda h: False) == 0
    assert longest_prefix_match(H[:4], lambda h: True) == 4
    assert longest_prefix_match([], lambda h: True) == 0


def test_prefix_score_is_the_matched_fraction() -> None:
    assert prefix_score(3, 4) == 0.75
    assert prefix_score(0, 0) == 0.0


def test_min_max_scores_prefer_the_least_loaded() -> None:
    assert min_max_scores([0, 5, 10]) == [1.0, 0.5, 0.0]
    assert min_max_scores([3, 3]) == [1.0, 1.0]  # nothing to prefer
    assert min_max_scores([]) == []


def test_kv_score() -> None:
    assert kv_score(0.25) == 0.75
    assert kv_score(None) == 0.5
    assert kv_score(1.5) == 0.0


def test_weighted_sum_uses_llm_d_default_weights() -> None:
    w = ScoringWeights()
    assert (w.prefix, w.queue, w.kv, w.active) == (3.0, 2.0, 2.0, 0.0)
    cands = [Candidate(4, 0, 0.5, 0), Candidate(0, 2, 0.0, 1)]
    # a: 3·1 + 2·1 + 2·0.5 = 6;  b: 0 + 0 + 2·1 = 2
    assert score_candidates(cands, 4, w) == [6.0, 2.0]
    # with the active-request scorer on: a gains 1·1 (fewer in flight), b 0
    assert score_candidates(cands, 4, ScoringWeights(active=1.0)) == [7.0, 2.0]


def test_pick_follows_the_prefix_when_load_is_even() -> None:
    w = ScoringWeights()
    cands = [Candidate(1, 0, 0.1, 1), Candidate(9, 0, 0.1, 1)]
    assert pick(cands, 10, w) == 1


def test_pick_balances_new_sessions_by_load() -> None:
    w = ScoringWeights()
    # No prefix anywhere: the backend with fewer requests in flight wins ...
    assert pick([Candidate(0, 0, 0.0, 2), Candidate(0, 0, 0.0, 1)], 8, w) == 1
    # ... on a full tie, fewer in flight, then fewer routed, then the lowest index.
    assert pick([Candidate(0, 0, 0.0, 0, 5), Candidate(0, 0, 0.0, 0, 4)], 8, w) == 1
    assert pick([Candidate(0, 0, 0.0, 0, 4), Candidate(0, 0, 0.0, 0, 4)], 8, w) == 0


def test_a_long_prefix_outweighs_a_busier_backend_but_not_a_flooded_one() -> None:
    w = ScoringWeights()
    sticky = [Candidate(9, 0, 0.2, 3), Candidate(0, 0, 0.1, 2)]  # one more in flight
    assert pick(sticky, 10, w) == 0
    flooded = [Candidate(9, 40, 0.95, 30), Candidate(0, 0, 0.1, 2)]  # queue, KV and active all bad
    assert pick(flooded, 10, w) == 1


def test_pick_without_candidates_raises() -> None:
    with pytest.raises(ValueError):
        pick([], 4, ScoringWeights())


# ---- indexes ------------------------------------------------------------------------------------
def test_approximate_index_is_lru_bounded_per_backend() -> None:
    idx = ApproximateIndex(capacity=3)
    idx.record("a", H[:3])
    idx.record("a", [H[0]])  # touched: now the most recent
    idx.record("a", [H[3]])  # evicts the least recent, H[1]
    assert [idx.holds("a", h) for h in H[:4]] == [True, False, True, True]
    assert not idx.holds("b", H[0])
    assert idx.num_blocks("a") == 3
    idx.forget("a")
    assert idx.num_blocks("a") == 0


def test_precise_index_replays_events_per_replica_and_medium() -> None:
    idx = PreciseIndex()
    idx.apply("a", KVEventBatch(0.0, (BlockStored((H[0], H[1]), 16),), data_parallel_rank=0))
    idx.apply("a", KVEventBatch(0.0, (BlockStored((H[1],), 16, "CPU"),), data_parallel_rank=1))
    idx.apply("a", KVEventBatch(0.0, (BlockRemoved((H[1],)),), data_parallel_rank=0))
    assert idx.holds("a", H[0]) and idx.holds("a", H[1])  # replica 1 still holds H[1] on CPU
    idx.apply("a", KVEventBatch(0.0, (AllBlocksCleared("CPU"),), data_parallel_rank=1))
    assert idx.holds("a", H[0]) and not idx.holds("a", H[1])
    assert not idx.holds("b", H[0])


# ---- events -------------------------------------------------------------------------------------
def test_event_batches_round_trip() -> None:
    batch = KVEventBatch(12.5, (BlockStored((H[0], H[1]), 64, "GPU"), BlockRemoved((H[2],), "CPU"),
                                AllBlocksCleared("GPU")), data_parallel_rank=3)
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(ValueError):
        decode_batch(b'{"events": [{"type": "Nope"}], "ts": 0, "data_parallel_rank": 0}')
    with pytest.raises(ValueError):
        decode_batch(b"not json")


class _Recorder(KVEventSink):
    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def stored(self, block_hashes: list[bytes], medium: str = "GPU") -> None:
        assert medium == "GPU"
        self.log += [("stored", h) for h in block_hashes]

    def removed(self, block_hashes: list[bytes], medium: str = "GPU") -> None:
        assert medium == "GPU"
        self.log += [("removed", h) for h in block_hashes]


def test_block_pool_reports_registration_and_eviction() -> None:
    sink = _Recorder()
    pool = BlockPool(2, enable_caching=True, events=sink)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, H[0]) and pool.cache_block(b, H[1])
    assert pool.cache_block(a, H[0])  # re-caching its own hash: a no-op, no second event
    pool.free([a, b])  # freed blocks stay cached: no event
    assert sink.log == [("stored", H[0]), ("stored", H[1])]
    pool.allocate(1)  # reuses the least recently freed block (b: freed in reverse order)
    assert sink.log[-1] == ("removed", H[1])
    pool.check_integrity()


def test_kv_events_config_from_vllm_json() -> None:
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://127.0.0.1:5557"}')
    assert c.enabled and c.replica_endpoint(2) == "tcp://127.0.0.1:5559"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled
    for bad in ('{"publisher": "kafka"}', '{"nope": 1}', "[1"):
        with pytest.raises(ConfigError):
            KVEventsConfig.from_json(bad)


def test_a_taken_kv_events_port_is_a_flag_error() -> None:
    import zmq

    from dsaserve.serve.ports import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PUB)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(endpoint)
    try:
        with pytest.raises(ConfigError, match=r"--kv-events-config: cannot bind tcp://"):
            ZmqKVEventPublisher(endpoint, block_size=16)
    finally:
        squatter.close()
        ctx.term()
    ZmqKVEventPublisher(endpoint, block_size=16).close()  # free again: it binds


def test_connect_address_replaces_a_wildcard_host() -> None:
    assert connect_address("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert connect_address("tcp://127.0.0.1:5557", "http://x:1") == "tcp://127.0.0.1:5557"


# ---- backends -----------------------------------------------------------------------------------
def test_backoff_doubles_and_caps() -> None:
    assert [backoff_s(n, 1.0, 5.0) for n in range(5)] == [1.0, 1.0, 2.0, 4.0, 5.0]


def test_parse_load_reads_vllm_gauges() -> None:
    text = ('vllm:num_requests_waiting{model_name="m"} 3.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            '# TYPE vllm:prefix_cache_hits counter\n'
            'vllm:prefix_cache_hits_total{model_name="m"} 48.0\n')
    assert parse_load(text) == LoadSample(3.0, 2.0, 0.25, 0.0, 48.0)
    assert parse_load("") == LoadSample()


def test_router_config_rejects_bad_flags() -> None:
    for kwargs in ({"backends": ()}, {"backends": ("localhost:1",)},
                   {"backends": ("http://a:1", "http://a:1")},
                   {"backends": ("http://a:1",), "policy": "random"},
                   {"backends": ("http://a:1",), "max_concurrent_requests": 0},
                   {"backends": ("http://a:1",), "weights": ScoringWeights(prefix=-1)}):
        with pytest.raises(ConfigError):
            RouterConfig(**kwargs)


def test_router_hashes_equal_the_engines() -> None:
    """The router calls the engine's own hash chain; the salt changes every block's hash."""
    ids = list(range(40))
    plain = request_block_hashes(ids, 16, None)
    salted = request_block_hashes(ids, 16, "tenant")
    assert len(plain) == 2 and not set(plain) & set(salted)


def test_each_dp_replica_publishes_on_its_own_port_and_the_subscriber_follows() -> None:
    """attach_kv_event_publishers on a two-replica engine: replica i binds port + i and tags its
    batches with its rank; the router's subscriber folds both into the backend's precise view."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from dsaserve.kv.events import attach_kv_event_publishers
    from dsaserve.kv.manager import KVCacheManager
    from dsaserve.router.events import KVEventSubscriber

    with socket.socket() as s:  # two consecutive free ports are likely above a free one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    managers = [KVCacheManager(8, 16, enable_caching=True) for _ in range(2)]
    engine = SimpleNamespace(replicas=[SimpleNamespace(scheduler=SimpleNamespace(kv=m))
                                       for m in managers])
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://127.0.0.1:{port}")
    publishers = attach_kv_event_publishers(engine, config)
    try:
        assert [p.endpoint for p in publishers] == [f"tcp://127.0.0.1:{port}",
                                                    f"tcp://127.0.0.1:{port + 1}"]
        index = PreciseIndex()

        async def run() -> None:
            sub = KVEventSubscriber(index)
            sub.follow("b", tuple(p.endpoint for p in publishers))
            deadline = asyncio.get_running_loop().time() + 10
            # PUB drops what it sends before the SUB has joined: publish until it lands.
            while not (index.holds("b", H[0]) and index.holds("b", H[1])):
                assert asyncio.get_running_loop().time() < deadline, "no events arrived"
                for m, h in zip(managers, H[:2], strict=True):
                    (block,) = m.pool.allocate(1)
                    m.pool.cache_block(block, h)
                    m.pool.free([block])
                await asyncio.sleep(0.05)
            await sub.close()

        asyncio.run(run())
        assert index.num_blocks("b") >= 2
    finally:
        for p in publishers:
            p.close()
    assert attach_kv_event_publishers(engine, KVEventsConfig()) == []  # disabled: nothing bound


def test_the_router_sends_the_backends_key_on_its_own_calls(monkeypatch) -> None:
    """Backends started with --api-key guard /kv_info and /metrics: the router's own client
    carries --backend-api-key (or the same environment variables serve reads), never logged."""
    import argparse
    import asyncio

    from dsaserve.router.backends import BackendPool
    from dsaserve.router.cli import add_parser, router_config_from_args

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--backend", "http://127.0.0.1:9"])
    config = router_config_from_args(args)
    assert config.backend_api_key == "from-env" and "from-env" not in repr(config)
    backends = BackendPool(RouterConfig(backends=("http://127.0.0.1:9",), backend_api_key="k"))
    assert backends._client.headers["authorization"] == "Bearer k"
    asyncio.run(backends._client.aclose())
    monkeypatch.delenv("VLLM_API_KEY")
    plain = BackendPool(RouterConfig(backends=("http://127.0.0.1:9",)))
    assert "authorization" not in plain._client.headers
    asyncio.run(plain._client.aclose())
