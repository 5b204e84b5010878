"""The backends' state as the router sees it: health (active checks with back-off, passive marks
from failed requests), what /kv_info says about their prefix cache, and their load (scraped from
/metrics, plus the requests this router has in flight there).

    healthy ──(check fails / a request cannot connect)──► unhealthy, next check after
       ▲                                                  interval·2^(failures−1), capped
       └──────────────(a check answers 200)──────────────┘ (its cache may be gone: on_recovered)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from dsaserve.router.config import Role, RouterConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSample:
    """What one /metrics scrape of a backend says (vLLM's names)."""

    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_usage: float | None = None  # None: the backend does not report it
    prefix_cache_queries: float = 0.0  # cumulative prompt tokens looked up
    prefix_cache_hits: float = 0.0  # cumulative prompt tokens found


@dataclass
class Backend:
    """Mutable state of one backend; touched only on the router's event loop."""

    url: str
    role: Role = "both"
    healthy: bool = True  # optimistic until the first check: a cold start routes at once
    checked: bool = False  # has a health check answered at least once
    consecutive_failures: int = 0
    next_check: float = 0.0  # monotonic time of the next active check
    last_error: str | None = None
    # /kv_info
    model: str | None = None
    block_size: int | None = None
    kv_events_endpoints: tuple[str, ...] = ()
    # load, as last scraped
    load: LoadSample = field(default_factory=lambda: LoadSample())
    num_active: int = 0  # requests this router has in flight there
    num_routed: int = 0


def backoff_s(consecutive_failures: int, interval_s: float, max_s: float) -> float:
    """Delay before the next check: the interval while healthy, doubling per failure, capped."""
    if consecutive_failures <= 0:
        return interval_s
    return min(interval_s * 2 ** (consecutive_failures - 1), max_s)


def parse_load(metrics_text: str) -> LoadSample:
    """A LoadSample from a backend's Prometheus text, summed over label sets (KV usage averaged)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0,
            "vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    usage: list[float] = []
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += s.value
            elif s.name == "vllm:kv_cache_usage_perc":
                usage.append(s.value)
    return LoadSample(sums["vllm:num_requests_waiting"], sums["vllm:num_requests_running"],
                      sum(usage) / len(usage) if usage else None,
                      sums["vllm:prefix_cache_queries_total"],
                      sums["vllm:prefix_cache_hits_total"])


class BackendPool:
    """Every backend and the loop that keeps their health and load fresh."""

    def __init__(self, config: RouterConfig,
                 on_recovered: Callable[[Backend], None] = lambda b: None,
                 on_info: Callable[[Backend], None] = lambda b: None) -> None:
        self.config = config
        self.backends = [Backend(url.rstrip("/"), role) for url, role in config.roles()]
        self.by_url = {b.url: b for b in self.backends}
        self._on_recovered = on_recovered
        self._on_info = on_info
        key = config.backend_api_key
        auth = {"Authorization": f"Bearer {key}"} if key else None
        self._client = httpx.AsyncClient(timeout=config.health_check_timeout_s, headers=auth)
        self._task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def with_role(self, role: Role) -> list[Backend]:
        return [b for b in self.backends if b.role == role]

    # ---- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """One round of checks (so the first request knows who is up), then the loop."""
        await asyncio.gather(*(self.check(b) for b in self.backends))
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    async def _loop(self) -> None:
        next_scrape = 0.0
        while True:
            now = time.monotonic()
            due = [b for b in self.backends if now >= b.next_check]
            jobs = [self.check(b) for b in due]
            if now >= next_scrape:
                next_scrape = now + self.config.load_scrape_interval_s
                jobs += [self.scrape(b) for b in self.backends if b.healthy and b not in due]
            if jobs:
                await asyncio.gather(*jobs)
            await asyncio.sleep(min(0.1, self.config.load_scrape_interval_s))

    # ---- checks -------------------------------------------------------------------------------
    async def check(self, b: Backend) -> None:
        """GET /health; on the way up also /kv_info (block size, events) and the load."""
        try:
            r = await self._client.get(f"{b.url}/health")
            ok = r.status_code == 200
            error = None if ok else f"/health answered {r.status_code}"
            if ok and (not b.healthy or b.block_size is None):
                await self._fetch_info(b)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        if ok:
            self._mark_up(b)
            await self.scrape(b)
        else:
            self.mark_down(b, error or "unhealthy")

    async def _fetch_info(self, b: Backend) -> None:
        r = await self._client.get(f"{b.url}/kv_info")
        r.raise_for_status()
        info = r.json()
        b.model = info["model"]
        b.block_size = int(info["block_size"])
        endpoints = tuple(info.get("kv_events_endpoints") or ())
        changed = endpoints != b.kv_events_endpoints
        b.kv_events_endpoints = endpoints
        if changed or not b.checked:
            self._on_info(b)

    async def scrape_all(self) -> None:
        """Fresh load of every healthy backend now (for /metrics: counters must not lag)."""
        await asyncio.gather(*(self.scrape(b) for b in self.healthy()))

    async def model_root(self) -> str | None:
        """The model directory a healthy backend serves (its /v1/models `root`), or None."""
        for b in self.healthy():
            try:
                r = await self._client.get(f"{b.url}/v1/models")
                return str(r.json()["data"][0]["root"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                continue
        return None

    async def scrape(self, b: Backend) -> None:
        try:
            r = await self._client.get(f"{b.url}/metrics")
            if r.status_code == 200:
                b.load = parse_load(r.text)
        except (httpx.HTTPError, ValueError):
            pass  # the health check decides; a missed scrape keeps the last load

    def _mark_up(self, b: Backend) -> None:
        was_down = not b.healthy or b.consecutive_failures > 0
        b.healthy, b.checked, b.consecutive_failures, b.last_error = True, True, 0, None
        b.next_check = time.monotonic() + self.config.health_check_interval_s
        if was_down:
            logger.warning("router: backend %s is back", b.url)
            self._on_recovered(b)

    def mark_down(self, b: Backend, error: str) -> None:
        """Take `b` out of rotation (a failed check, or a request that could not reach it)."""
        if b.healthy:
            logger.warning("router: backend %s is down: %s", b.url, error)
        b.healthy, b.checked, b.last_error = False, True, error
        b.consecutive_failures += 1
        b.next_check = time.monotonic() + backoff_s(
            b.consecutive_failures, self.config.health_check_interval_s,
            self.config.health_check_max_backoff_s)
