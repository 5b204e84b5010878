"""Prometheus metrics under vLLM's names, so dashboards and benchmark scrapers work unmodified.

Two sources feed one registry per app (tests build several apps in one process):
- the engine's accounting (`EngineStats`), read at scrape time through a collector: requests running
  and waiting, KV usage, prefix-cache queries and hits, preemptions, tokens scheduled per step, and
  with speculative decoding vLLM's spec_decode counters (drafts, draft tokens, accepted tokens,
  accepted per position);
- per-request figures recorded by the server (`RequestTracker`): TTFT, inter-token latency and
  end-to-end latency on the server's clock; the request's phases from the engine core's
  timestamps carried on its outputs (RequestOutput.queued_time, scheduled_time, output_time);
  prompt / generation token counters and histograms, max_tokens and n, and finished requests by
  reason.
Every series carries a `model_name` label (the served model name), as vLLM's do.

A request's phases, as vLLM's RequestStateStats counts them (times of the engine core, which
runs in the server's process, so on the server's monotonic clock):

    server arrival ── engine queued ── first scheduled ── first token ─── last token ── end
                      |──── queue ────|──── prefill ────|───── decode ─────|
                                      |────────────── inference ───────────|
    |─────────────────────────────── e2e (server) ─────────────────────────────────────|

A preempted request's phases are not split again: its first scheduling ends its queue time, and
the wait after a preemption counts in the prefill or decode it interrupted. The phases are
observed for requests that got at least one token (one aborted while queued has none).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dsaserve.core import CountHistogram, EngineStats, RequestOutput

PREFIX = "vllm:"  # vLLM's namespace: what existing dashboards and benchmark scrapers query

# Seconds; dense where interactive serving lives, long tails for 1M-token prefills.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# A request's phases (queue, prefill, decode, inference): vLLM gives them its E2E buckets.
PHASE_BUCKETS = E2E_BUCKETS
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for request_params_n


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to `max_value` (max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


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
        yield _histogram(PREFIX + "iteration_tokens_total",
                         "Tokens scheduled per engine step (prompt, output and draft tokens).",
                         self._model_name, s.iteration_tokens)
        if s.num_host_blocks:
            c = CounterMetricFamily(PREFIX + "kv_offload_total_bytes",
                                    "Bytes copied between GPU and host KV, all ranks.",
                                    labels=["model_name", "transfer_type"])
            c.add_metric([self._model_name, "GPU_to_CPU"], float(s.offload_bytes_stored))
            c.add_metric([self._model_name, "CPU_to_GPU"], float(s.offload_bytes_loaded))
            yield c


def _histogram(name: str, doc: str, model_name: str, h: CountHistogram) -> HistogramMetricFamily:
    """An engine histogram in the exposition format (cumulative buckets, then +Inf)."""
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative = list(itertools.accumulate(h.counts))
    family.add_metric([model_name], [(floatToGoString(b), c) for b, c in zip(
        h.bounds, cumulative, strict=False)] + [("+Inf", cumulative[-1])], h.total)
    return family


class ServerMetrics:
    """The registry of one server app and the request-level series it records
    (`max_model_len` bounds the token-count buckets, as in vLLM)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 max_model_len: int = 1 << 20) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

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
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from the engine queueing the request to its first "
                                    "scheduling.", PHASE_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from the first scheduling to the first token.",
                                      PHASE_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from the first token to the last.", PHASE_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time from the first scheduling to the last token.",
                                        PHASE_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens of a finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens a finished request generated.",
                                                   token_buckets)
        self.request_max_tokens = histogram("request_params_max_tokens",
                                            "max_tokens of a finished request.", token_buckets)
        self.request_n = histogram("request_params_n", "n of a finished request.", N_BUCKETS)

    def track(self, arrival_time: float | None = None, *, max_tokens: int | None = None,
              n: int = 1) -> RequestTracker:
        """Start timing one request (arrival defaults to now, on the monotonic clock); its
        sampling parameters are observed when it finishes."""
        return RequestTracker(self, time.monotonic() if arrival_time is None else arrival_time,
                              max_tokens, n)

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)


class RequestTracker:
    """Timings of one request. TTFT at its first tokens, ITL between later outputs, E2E at the end
    (the server's times); its phases at the end, from the engine's times on its outputs.

    Times are monotonic seconds; callers may pass `now` explicitly (tests do).
    """

    def __init__(self, metrics: ServerMetrics, arrival_time: float,
                 max_tokens: int | None = None, n: int = 1) -> None:
        self._m = metrics
        self.arrival_time = arrival_time
        self._max_tokens = max_tokens
        self._n = n
        self._last_token_time: float | None = None
        self._num_generation_tokens = 0
        self._finished = False
        # the engine core's times (RequestOutput): queued, first scheduled, first and last token
        self._queued_time = 0.0
        self._scheduled_time: float | None = None
        self._first_token_time: float | None = None
        self._engine_last_token_time = 0.0

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        """One engine output of the request: its tokens, and the engine's times."""
        if self._scheduled_time is None and out.scheduled_time is not None:
            self._queued_time, self._scheduled_time = out.queued_time, out.scheduled_time
        if out.new_token_ids:
            if self._first_token_time is None:
                self._first_token_time = out.output_time
            self._engine_last_token_time = out.output_time
        self.on_tokens(len(out.new_token_ids), now)

    def on_tokens(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self._last_token_time is None:
            self._m.ttft.observe(now - self.arrival_time)
        else:
            self._m.itl.observe(now - self._last_token_time)
        self._last_token_time = now
        self._num_generation_tokens += num_tokens
        self._m.generation_tokens.inc(num_tokens)

    def on_finish(
        self, finish_reason: str, num_prompt_tokens: int, now: float | None = None
    ) -> None:
        """Count the request once, whatever path ends it (engine, stop string, disconnect)."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic() if now is None else now
        m = self._m
        m.e2e.observe(now - self.arrival_time)
        m.prompt_tokens.inc(num_prompt_tokens)
        m._success.labels(m.model_name, finish_reason).inc()
        m.request_prompt_tokens.observe(num_prompt_tokens)
        m.request_generation_tokens.observe(self._num_generation_tokens)
        if self._max_tokens is not None:
            m.request_max_tokens.observe(self._max_tokens)
        m.request_n.observe(self._n)
        scheduled, first = self._scheduled_time, self._first_token_time
        if scheduled is not None and first is not None:
            last = self._engine_last_token_time
            m.queue_time.observe(scheduled - self._queued_time)
            m.prefill_time.observe(first - scheduled)
            m.decode_time.observe(last - first)
            m.inference_time.observe(last - scheduled)
