"""`dsaserve router --backend URL [--backend URL ...]`: the prefix- and load-aware front door.

    dsaserve router --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --port 8000
    dsaserve router --backend ... --prefix-index precise     # follow the backends' KV events
    dsaserve router --backend ... --policy round-robin       # the baseline
    dsaserve router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
                    --decode http://127.0.0.1:8201             # P/D: vLLM's two-step protocol
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dsaserve.router.config import RouterConfig
from dsaserve.router.scoring import (
    DEFAULT_ACTIVE_WEIGHT,
    DEFAULT_KV_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
    DEFAULT_QUEUE_WEIGHT,
    ScoringWeights,
)
from dsaserve.serve.auth import api_key_from_env

_DEFAULTS = RouterConfig(backends=("http://127.0.0.1:8000",))


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from dsaserve.serve.cli import _port, chat_template_arg
    from dsaserve.serve.prompt import TOKENIZER_MODES

    d = _DEFAULTS
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a `dsaserve serve` base URL (repeat for each backend)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="P/D: a prefill engine (`serve --kv-transfer-config` with a KV "
                        "connector); repeat for each; needs --decode")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="P/D: a decode engine; repeat for each; needs --prefill")
    p.add_argument("--host", default=d.host,
                   help="address to listen on (default: %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=_port, default=d.port, help="(default: %(default)s)")
    p.add_argument("--policy", choices=["prefix", "load", "round-robin"], default=d.policy,
                   help="prefix: weighted prefix + load scores (llm-d's); load: load scores only; "
                   "round-robin: the baseline (default: %(default)s)")
    p.add_argument("--prefix-index", choices=["approximate", "precise"], default=d.prefix_index,
                   help="approximate: the hashes this router sent each backend (LRU); precise: "
                   "the backends' KV events (`serve --kv-events-config`) (default: %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="model directory to tokenize with (default: the backends' model)")
    p.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default="auto",
                   help="the backends' --tokenizer-mode, to render chat prompts as they do "
                   "(default: %(default)s)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None,
                   metavar="PATH_OR_TEMPLATE", help="the backends' --chat-template")
    w = p.add_argument_group("scorer weights (llm-d's defaults)")
    w.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT)
    w.add_argument("--queue-weight", type=float, default=DEFAULT_QUEUE_WEIGHT)
    w.add_argument("--kv-cache-weight", type=float, default=DEFAULT_KV_WEIGHT)
    w.add_argument("--active-request-weight", type=float, default=DEFAULT_ACTIVE_WEIGHT)
    p.add_argument("--backend-api-key", default=None, metavar="KEY",
                   help="the backends' --api-key, for the router's own calls to them (default: "
                        "$DSASERVE_API_KEY, else $VLLM_API_KEY); clients send their own")
    lim = p.add_argument_group("limits and faults")
    lim.add_argument("--prefix-index-capacity", type=int, default=d.prefix_index_capacity,
                     help="approximate index: block hashes kept per backend (LRU)")
    lim.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                     help="forwarded at once (default: %(default)s)")
    lim.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                     help="waiting for a slot; beyond it 429 (default: %(default)s)")
    lim.add_argument("--max-retries", type=int, default=d.max_retries,
                     help="other backends tried when one fails before streaming")
    lim.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                     help="seconds of silence tolerated from a backend (default: %(default)s)")
    lim.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s)
    lim.add_argument("--health-check-interval", type=float, default=d.health_check_interval_s,
                     help="seconds between checks; doubled per failure (default: %(default)s)")
    lim.add_argument("--health-check-max-backoff", type=float,
                     default=d.health_check_max_backoff_s)
    lim.add_argument("--load-scrape-interval", type=float, default=d.load_scrape_interval_s,
                     help="seconds between /metrics scrapes (default: %(default)s)")
    p.set_defaults(func=run)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="prefix- and load-aware router over `serve`s",
                              description=__doc__.splitlines()[0], allow_abbrev=False)
    return _configure(p)


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ConfigError naming the flag."""
    from dsaserve.serve.prompt import load_chat_template

    return RouterConfig(
        backends=tuple(u.rstrip("/") for u in args.backend),
        prefill_backends=tuple(u.rstrip("/") for u in args.prefill),
        decode_backends=tuple(u.rstrip("/") for u in args.decode), policy=args.policy,
        prefix_index=args.prefix_index, tokenizer=args.tokenizer, host=args.host, port=args.port,
        tokenizer_mode=args.tokenizer_mode,
        chat_template=load_chat_template(args.chat_template),
        weights=ScoringWeights(prefix=args.prefix_weight, queue=args.queue_weight,
                               kv=args.kv_cache_weight, active=args.active_request_weight),
        prefix_index_capacity=args.prefix_index_capacity,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests, max_retries=args.max_retries,
        request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
        health_check_interval_s=args.health_check_interval,
        health_check_max_backoff_s=args.health_check_max_backoff,
        load_scrape_interval_s=args.load_scrape_interval,
        backend_api_key=args.backend_api_key or api_key_from_env())


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsaserve.router.app import create_router_app

    config = router_config_from_args(args)
    app = create_router_app(config)
    over = (f"{len(config.prefill_backends)} prefill + {len(config.decode_backends)} decode "
            f"backends (P/D)" if config.disaggregated else f"{len(config.backends)} backends")
    print(f"dsaserve: routing ({config.policy}, {config.prefix_index} index) over {over} on "
          f"http://{config.host}:{config.port}", file=sys.stderr)
    uvicorn.run(app, host=config.host, port=config.port,
                timeout_keep_alive=config.timeout_keep_alive_s, timeout_graceful_shutdown=30,
                log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dsaserve.router.cli ...`: the same as `dsaserve router ...`."""
    from dsaserve.config import ConfigError

    parser = _configure(argparse.ArgumentParser(prog="dsaserve router", allow_abbrev=False,
                                                description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
