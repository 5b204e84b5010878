"""The router's configuration: one frozen dataclass, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dsaserve.config import ConfigError
from dsaserve.router.scoring import ScoringWeights
from dsaserve.serve.prompt import check_chat_flags

Policy = Literal["prefix", "load", "round-robin"]
PrefixIndexKind = Literal["approximate", "precise"]
Role = Literal["both", "prefill", "decode"]  # aggregated `serve`, or one side of a P/D pair


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()  # base URLs of aggregated `dsaserve serve` processes
    # P/D disaggregation (docs/router.md): each request is prefilled on one of `prefill_backends`
    # (kv_transfer_params do_remote_decode, one token) and decoded on one of `decode_backends`,
    # which pulls the KV through the connector. Both or neither, and not with `backends`.
    prefill_backends: tuple[str, ...] = ()
    decode_backends: tuple[str, ...] = ()
    policy: Policy = "prefix"  # prefix: weighted prefix + load; load: weights without prefix
    prefix_index: PrefixIndexKind = "approximate"  # precise: replay the backends' KV events
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    tokenizer: str | None = None  # model directory; default: the first backend's /v1/models root
    # The backends' --tokenizer-mode and --chat-template (its text): the router renders chat
    # prompts as they do (serve/prompt.py chat_format_for)
    tokenizer_mode: str = "auto"
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    # An LRU bound per backend on the approximate index (32-byte hashes: ~100 B per entry).
    prefix_index_capacity: int = 200_000
    max_concurrent_requests: int = 256  # forwarded at once; more wait in the queue
    max_queued_requests: int = 1024  # waiting for a slot; more get 429 at once
    max_retries: int = 1  # other backends tried when one fails before anything was streamed
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # the longest silence tolerated from a backend (per read)
    health_check_interval_s: float = 2.0  # while healthy; an unhealthy one backs off from this
    health_check_max_backoff_s: float = 30.0
    health_check_timeout_s: float = 2.0
    load_scrape_interval_s: float = 0.5  # /metrics of every healthy backend
    # Agent sessions idle between turns for minutes; a short keep-alive would cut their connections.
    timeout_keep_alive_s: int = 3600
    # Sent on the router's own calls (/kv_info, /metrics, /v1/models) to backends started with
    # --api-key; proxied requests carry the client's own Authorization header.
    backend_api_key: str | None = field(default=None, repr=False)

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_backends)

    def roles(self) -> list[tuple[str, Role]]:
        """Every backend URL with its role, in flag order."""
        return ([(u, "both") for u in self.backends]
                + [(u, "prefill") for u in self.prefill_backends]
                + [(u, "decode") for u in self.decode_backends])

    def __post_init__(self) -> None:
        check_chat_flags(self.tokenizer_mode, self.chat_template)
        if bool(self.prefill_backends) != bool(self.decode_backends):
            missing = "--decode" if self.prefill_backends else "--prefill"
            raise ConfigError(f"{missing}: P/D routing needs at least one --prefill and one "
                              f"--decode backend")
        if self.backends and self.prefill_backends:
            raise ConfigError("--backend: not with --prefill/--decode (a router serves either "
                              "aggregated backends or one P/D deployment)")
        if not self.backends and not self.prefill_backends:
            raise ConfigError("--backend: give at least one backend URL (or --prefill and "
                              "--decode URLs)")
        flags = {"both": "--backend", "prefill": "--prefill", "decode": "--decode"}
        for url, role in self.roles():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{flags[role]}: expected http://HOST:PORT, got {url!r}")
        urls = [u for u, _ in self.roles()]
        if len(set(urls)) != len(urls):
            raise ConfigError("--backend: a backend is listed twice")
        if self.policy not in ("prefix", "load", "round-robin"):
            raise ConfigError(f"--policy: expected prefix, load or round-robin, "
                              f"got {self.policy!r}")
        if self.prefix_index not in ("approximate", "precise"):
            raise ConfigError(f"--prefix-index: expected approximate or precise, "
                              f"got {self.prefix_index!r}")
        w = self.weights
        if min(w.prefix, w.queue, w.kv, w.active) < 0:
            raise ConfigError("--*-weight: weights must be >= 0")
        for name in ("prefix_index_capacity", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
        for name in ("max_queued_requests", "max_retries"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 0")
        for name in ("connect_timeout_s", "request_timeout_s", "health_check_interval_s",
                     "health_check_max_backoff_s", "health_check_timeout_s",
                     "load_scrape_interval_s"):
            if getattr(self, name) <= 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"--{flag}: must be > 0")
