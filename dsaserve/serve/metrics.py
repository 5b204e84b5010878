"""Prometheus metrics under vLLM's names, so dashboards and benchmark scrapers work unmodified.

Two sources feed one registry per app (tests build several apps in one process):
- the engine's accounting (`EngineStats`), read at scrape time through a collector: requests running
  and waiting, KV usage, prefix-cache queries and hits, preemptions, and with speculative decoding
  vLLM's spec_decode counters (drafts, draft tokens, accepted tokens, accepted per position);
- per-request timings seen by the server (`RequestTracker`): TTFT, inter-token latency, end-to-end
  latency, prompt / generation token counters and finished requests by reason.
Every series carries a `model_name` label (the served model name), as vLLM's do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsaserve.core import EngineStats

PREFIX = "vllm:"  # vLLM's namespace: what existing dashboards and benchmark scrapers query

# Seconds; dense where interactive serving lives, long tails for 1M-token prefills.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Exposes the latest EngineStats snapshot; counters are cumulative in the engine itself."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage: 1 = every block in use.", s.kv_cache_usage),
        ]
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV blocks.", s.num_preemptions),
        ]
        if s.num_host_blocks:  # the host KV tier (docs/offload.md)
            gauges.append(("kv_offload_cpu_usage_perc",
                           "Host KV tier usage: 1 = every host block holds KV.",
                           s.num_host_blocks_used / s.num_host_blocks))
            counters += [
                ("external_prefix_cache_queries",
                 "Prompt tokens looked up in the host KV tier.", s.offload_queries),
                ("external_prefix_cache_hits",
                 "Prompt tokens found in the host KV tier (after the GPU hit).", s.offload_hits),
            ]
        if s.num_mla_pages:  # HiSparse spilling (docs/hisparse.md)
            gauges.append(("hisparse_mla_pages_usage_perc",
                           "GPU MLA pages in use (HiSparse): 1 = every page maps a block.",
                           1 - s.num_mla_pages_free / s.num_mla_pages))
            counters.append(("hisparse_mla_spilled_blocks",
                             "Blocks whose GPU MLA page spilled to the HiSparse host pool.",
                             s.hisparse_mla_spills))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self._model_name], float(value))
            yield g
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is configured
            counters += [
                ("spec_decode_num_drafts", "Verification steps of requests with drafts.",
                 s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.",
                 s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_decode_num_accepted_tokens),
            ]
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model_name], float(value))
            yield c
        if s.spec_decode_num_accepted_tokens_per_pos:
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.",
                                    labels=["model_name", "position"])
            for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                c.add_metric([self._model_name, str(pos)], float(value))
            yield c
        if s.num_host_blocks:
            c = CounterMetricFamily(PREFIX + "kv_offload_total_bytes",
                                    "Bytes copied between GPU and host KV, all ranks.",
                                    labels=["model_name", "transfer_type"])
            c.add_metric([self._model_name, "GPU_to_CPU"], float(s.offload_bytes_stored))
            c.add_metric([self._model_name, "CPU_to_GPU"], float(s.offload_bytes_loaded))
            yield c


class ServerMetrics:
    """The registry of one server app and the request-level series it records."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last token.", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens",
                                     "Prompt tokens of finished requests (cached ones included).",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)

    def track(self, arrival_time: float | None = None) -> RequestTracker:
        """Start timing one request (arrival defaults to now, on the monotonic clock)."""
        return RequestTracker(self, time.monotonic() if arrival_time is None else arrival_time)

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)


class RequestTracker:
    """Timings of one request. TTFT at its first tokens, ITL between later outputs, E2E at the end.

    Times are monotonic seconds; callers may pass `now` explicitly (tests do).
    """

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self._m = metrics
        self.arrival_time = arrival_time
        self._last_token_time: float | None = None
        self._finished = False

    def on_tokens(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self._last_token_time is None:
            self._m.ttft.observe(now - self.arrival_time)
        else:
            self._m.itl.observe(now - self._last_token_time)
        self._last_token_time = now
        self._m.generation_tokens.inc(num_tokens)

    def on_finish(
        self, finish_reason: str, num_prompt_tokens: int, now: float | None = None
    ) -> None:
        """Count the request once, whatever path ends it (engine, stop string, disconnect)."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic() if now is None else now
        self._m.e2e.observe(now - self.arrival_time)
        self._m.prompt_tokens.inc(num_prompt_tokens)
        self._m._success.labels(self._m.model_name, finish_reason).inc()
