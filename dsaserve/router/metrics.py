"""The router's Prometheus series (its own registry; the backends keep vLLM's names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsaserve.router.backends import Backend

PREFIX = "dsaserve_router_"
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class _BackendCollector(Collector):
    def __init__(self, backends: Callable[[], list[Backend]]) -> None:
        self._backends = backends

    def collect(self) -> Iterator[Metric]:
        series = [
            ("backend_healthy", "1 while the backend is in rotation.", lambda b: float(b.healthy)),
            ("backend_active_requests", "Requests this router has in flight on the backend.",
             lambda b: float(b.num_active)),
            ("backend_waiting_requests", "The backend's waiting requests, as last scraped.",
             lambda b: b.load.num_waiting),
            ("backend_kv_cache_usage_perc", "Backend KV usage, as last scraped (-1: unknown).",
             lambda b: -1.0 if b.load.kv_usage is None else b.load.kv_usage),
        ]
        for name, doc, value in series:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["backend"])
            for b in self._backends():
                g.add_metric([b.url], value(b))
            yield g
        # The backends' prefix-cache counters under vLLM's names, one series per backend, so a
        # benchmark that reads the hit rate from the URL it drives works through the router.
        counters = [("prefix_cache_queries", "Prompt tokens looked up (per backend).",
                     lambda b: b.load.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found cached (per backend).",
                     lambda b: b.load.prefix_cache_hits)]
        for name, doc, value in counters:
            c = CounterMetricFamily("vllm:" + name, doc, labels=["backend"])
            for b in self._backends():
                c.add_metric([b.url], value(b))
            yield c


class RouterMetrics:
    def __init__(self, backends: Callable[[], list[Backend]]) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_BackendCollector(backends))
        self.routed = Counter(PREFIX + "requests", "Requests routed, by backend.", ["backend"],
                              registry=r)
        self.prefix_match_tokens = Histogram(
            PREFIX + "prefix_match_tokens",
            "Prefix-cache hit length (tokens) the chosen backend was scored with.",
            buckets=TOKEN_BUCKETS, registry=r)
        self.prefix_match_ratio = Histogram(
            PREFIX + "prefix_match_ratio", "Matched fraction of the request's blocks.",
            buckets=RATIO_BUCKETS, registry=r)
        self.proxy_errors = Counter(PREFIX + "proxy_errors",
                                    "Failed forwards, by backend and kind (connect, timeout, "
                                    "status_5xx, stream, no_kv_transfer_params).",
                                    ["backend", "kind"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to another backend.",
                               registry=r)
        self.rejected = Counter(PREFIX + "rejected",
                                "Requests refused by the router (queue_full, no_backend).",
                                ["reason"], registry=r)
        self.queued = Gauge(PREFIX + "queued_requests", "Requests waiting for a forwarding slot.",
                            registry=r)
        self.pd_prefill_seconds = Histogram(
            PREFIX + "pd_prefill_seconds",
            "P/D: time of the prefill step (the prefill engine's answer, retries included).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
            registry=r)
        self.kv_event_batches = Counter(PREFIX + "kv_event_batches",
                                        "KV event batches received, by backend.", ["backend"],
                                        registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
