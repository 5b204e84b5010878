"""`dsaserve serve [MODEL]`: the OpenAI-compatible server, started with vLLM's flag names.

    dsaserve serve                      # the built-in tiny model on 127.0.0.1:8000
    dsaserve serve /models/glm-5.3 --served-model-name glm-5.3 --max-model-len 131072 \\
        --kv-cache-dtype fp8_ds_mla --api-key "$KEY" --host 0.0.0.0
    dsaserve serve --pd 'prefill: -pcp 2 -dcp 2 ; decode: -dp 2'   # P/D on one machine
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from typing import TYPE_CHECKING, Any

from dsaserve.config import ConfigError
from dsaserve.engine.args import (
    add_engine_args,
    engine_config_from_args,
    int_at_least,
    json_flag,
)
from dsaserve.kv.events import KVEventsConfig
from dsaserve.model.presets import DEFAULT_MODEL
from dsaserve.serve.prompt import TOKENIZER_MODES, check_chat_flags, load_chat_template
from dsaserve.serve.tools.registry import REASONING_PARSERS, TOOL_PARSERS

if TYPE_CHECKING:  # the HTTP stack loads only when serving (generate and plan need none of it)
    from dsaserve.serve.api import ServerConfig

_PROG = "dsaserve serve"


def _port(text: str) -> int:
    port = int_at_least(0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _api_key(text: str) -> str:
    # An empty key (`--api-key "$KEY"` with KEY unset) would silently serve without one.
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty key (omit the flag to serve "
                                         "without one)")
    return text


def chat_template_arg(text: str) -> str:
    """Checked at parse time (a missing file or bad template fails at once); the flag keeps its
    text so that `--pd` can pass it on."""
    try:
        load_chat_template(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--chat-template: ")) from e
    return text


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help=f"model directory or built-in preset (default: {DEFAULT_MODEL})")
    p.add_argument("--model", default=None, help="same as MODEL")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; 0.0.0.0 exposes it)")
    s.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: MODEL as given)")
    s.add_argument("--api-key", type=_api_key, default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health "
                   "(default: $DSASERVE_API_KEY, else $VLLM_API_KEY, else none)")
    s.add_argument("--max-request-body-bytes", type=int_at_least(1), default=32 * 2**20,
                   help="larger request bodies get a 413 before they are parsed "
                   "(default: %(default)s, 32 MiB)")
    s.add_argument("--max-stream-buffer", type=int_at_least(1), default=1024,
                   help="engine outputs a stream may hold for a client that is not reading; past "
                   "it the request is aborted (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, refuse new requests (503) and let those in flight "
                   "finish for up to this long, then end them (default: %(default)s; 0: at once)")
    s.add_argument("--kv-events-config", default=None, metavar="JSON",
                   type=json_flag("--kv-events-config", KVEventsConfig.from_json),
                   help="publish prefix-cache BlockStored/BlockRemoved events for a router, "
                   "vLLM's form: '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\","
                   "\"endpoint\":\"tcp://127.0.0.1:5557\"}' (DP replica i binds port + i)")
    c = p.add_argument_group("chat prompts (docs/serving.md)")
    c.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default="auto",
                   help="deepseek_v32: write chat prompts with DeepSeek-V3.2's encoding; auto "
                   "(default): that for a deepseek_v32 checkpoint without a chat template, else "
                   "the chat template")
    c.add_argument("--chat-template", type=chat_template_arg, default=None,
                   metavar="PATH_OR_TEMPLATE",
                   help="the Jinja chat template (a file's path, or the template's text) used "
                   "instead of the tokenizer's")
    t = p.add_argument_group("tool calling and reasoning (docs/serving.md)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the model's tool calls into tool_calls for requests with tools "
                   "(tool_choice \"auto\"); needs --tool-call-parser")
    t.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format: glm45 / glm47 (GLM), deepseek_v32")
    t.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split <think>…</think> into reasoning_content: glm45 / glm47 (GLM), "
                   "deepseek_v3 (DeepSeek-V3.2), deepseek_r1")
    d = p.add_argument_group("P/D on one machine (docs/disagg.md)")
    d.add_argument("--pd", default=None, metavar="'prefill: FLAGS ; decode: FLAGS'",
                   help="start a prefill and a decode server of MODEL with these flags and serve "
                   "`dsaserve router` in P/D mode (prefill, then decode) on --host/--port")
    d.add_argument("--pd-kv-backend", choices=("auto", "nixl", "shm"), default="auto",
                   help="--pd: the KV transport (default: %(default)s: NIXL when importable)")
    d.add_argument("--pd-start-timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="--pd: how long the servers may take to become healthy")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the top-level CLI; unknown or abbreviated flags are errors."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__.splitlines()[0], allow_abbrev=False)
    return _configure(p)


def kv_events_config_from_args(args: argparse.Namespace) -> KVEventsConfig:
    text = getattr(args, "kv_events_config", None)
    return KVEventsConfig.from_json(text) if text else KVEventsConfig()


def server_config_from_args(args: argparse.Namespace, model: str,
                            kv_events_endpoints: tuple[str, ...] = ()) -> ServerConfig:
    from dsaserve.serve.api import ServerConfig
    from dsaserve.serve.auth import api_key_from_env

    check_tool_flags(args)
    return ServerConfig(served_model_name=args.served_model_name or model,
                        api_key=args.api_key or api_key_from_env(),
                        host=args.host, port=args.port, kv_events_endpoints=kv_events_endpoints,
                        max_request_body_bytes=args.max_request_body_bytes,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        tokenizer_mode=getattr(args, "tokenizer_mode", "auto"),
                        chat_template=load_chat_template(getattr(args, "chat_template", None)))


def check_tool_flags(args: argparse.Namespace) -> None:
    """--enable-auto-tool-choice without a parser would accept tools it cannot read (vLLM refuses
    it too); --chat-template would be ignored by DeepSeek-V3.2's encoder."""
    check_chat_flags(getattr(args, "tokenizer_mode", "auto"), getattr(args, "chat_template", None))
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice: needs --tool-call-parser "
                          f"({', '.join(sorted(TOOL_PARSERS))})")


def check_listen_address(host: str, port: int) -> None:
    """--host and --port can be listened on: bound once here (and closed), so that an address
    this machine does not have, or a port in use, is a usage error before the engine is built;
    uvicorn found it only after the model loaded, with a message naming neither flag."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:  # UnicodeError: an over-long label
        raise ConfigError(f"--host: cannot resolve {host!r} ({e})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"--host: {host} is not an address of this machine "
                                  f"({e.strerror})") from None
            hint = "; another process uses the port" if e.errno == errno.EADDRINUSE else ""
            raise ConfigError(f"--port: cannot listen on {host}:{port} "
                              f"({e.strerror}{hint})") from None


def model_from_args(args: argparse.Namespace) -> str:
    """MODEL and --model name the same thing; giving two different ones is an error."""
    if args.model_positional and args.model and args.model_positional != args.model:
        raise ConfigError(f"--model: {args.model!r} contradicts MODEL {args.model_positional!r}")
    return args.model_positional or args.model or DEFAULT_MODEL


def run(args: argparse.Namespace) -> int:
    """Build the engine, serve until interrupted, then stop the engine core. Raises ConfigError for
    a bad flag combination (the top-level CLI prints it as a usage error)."""
    import uvicorn

    from dsaserve.engine.engine import LLMEngine
    from dsaserve.kv.events import attach_kv_event_publishers
    from dsaserve.serve.api import create_app
    from dsaserve.serve.async_engine import AsyncEngine
    from dsaserve.serve.drain import DrainingServer

    model = model_from_args(args)
    check_tool_flags(args)  # before the engine is built: a bad flag fails at once
    check_listen_address(args.host, args.port)
    if getattr(args, "pd", None) is not None:
        from dsaserve.disagg.launch import run_pd

        return run_pd(args, model)
    engine_config = engine_config_from_args(args, model)
    kv_events = kv_events_config_from_args(args)
    llm = LLMEngine.from_config(engine_config)
    try:  # before the engine core starts: the pools are then touched by its thread only
        publishers = attach_kv_event_publishers(llm, kv_events)
    except BaseException:
        llm.shutdown()
        raise
    server_config = server_config_from_args(args, model,
                                            tuple(p.endpoint for p in publishers))
    engine = AsyncEngine(llm, max_stream_buffer=args.max_stream_buffer)
    try:
        app = create_app(engine, server_config)
        print(f"dsaserve: serving {server_config.served_model_name} ({engine_config.model_path}) "
              f"on http://{server_config.host}:{server_config.port}", file=sys.stderr)
        if app.state.chat_format.renderer == "deepseek_v32":
            print(f"dsaserve: chat prompts are written in DeepSeek-V3.2's encoding "
                  f"(--tokenizer-mode {args.tokenizer_mode})", file=sys.stderr)
        # The drain has let requests finish (or ended them); uvicorn's own wait is a backstop.
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                timeout_keep_alive=server_config.timeout_keep_alive_s,
                                timeout_graceful_shutdown=10, log_level="warning")
        DrainingServer(config, app.state.drain, args.shutdown_timeout,
                       on_timeout=engine.shutdown).run()
    finally:
        engine.shutdown()
        for publisher in publishers:
            publisher.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dsaserve.serve.cli [MODEL] [flags]`: the same as `dsaserve serve`."""
    parser = _configure(argparse.ArgumentParser(prog=_PROG, description=__doc__.splitlines()[0],
                                                allow_abbrev=False))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ConfigError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
