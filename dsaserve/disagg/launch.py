"""`dsaserve serve --pd 'prefill: FLAGS ; decode: FLAGS'`: a whole P/D deployment on one machine.

    dsaserve serve MODEL --port 8000 --pd 'prefill: -pcp 2 -dcp 2 ; decode: -dp 2'

starts a prefill server (kv_producer) and a decode server (kv_consumer) as two processes on
127.0.0.1, each `dsaserve serve MODEL FLAGS` with the connector's `--kv-transfer-config` added,
waits until both are healthy, then serves `dsaserve router` in front of them on --host/--port
(its P/D mode: vLLM's two-step protocol, docs/router.md). Ending the router (Ctrl-C, SIGTERM)
stops both servers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

from dsaserve.config import ConfigError
from dsaserve.serve.ports import free_ports

FLAG = "--pd"
_SIDES = ("prefill", "decode")
_OWN_FLAGS = ("--kv-transfer-config", "--port", "--host", "--model")


def server_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """A server's environment: `env`, with half this machine's cores as its OMP_NUM_THREADS
    unless set (torch's threads, and its workers' share, engine/executor.py): two servers
    each spinning threads over every core slowed P/D's host work 25-50× (docs/disagg.md)."""
    out = dict(env)
    if "OMP_NUM_THREADS" not in out:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        out["OMP_NUM_THREADS"] = str(max(1, cores // len(_SIDES)))
    return out


def parse_pd_spec(spec: str) -> dict[str, list[str]]:
    """'prefill: FLAGS ; decode: FLAGS' → {"prefill": [...], "decode": [...]}."""
    out: dict[str, list[str]] = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        name, sep, flags = part.partition(":")
        name = name.strip()
        if not sep or name not in _SIDES:
            raise ConfigError(f"{FLAG}: expected 'prefill: FLAGS ; decode: FLAGS', got part "
                              f"{part.strip()!r}")
        if name in out:
            raise ConfigError(f"{FLAG}: {name!r} given twice")
        try:
            out[name] = shlex.split(flags)
        except ValueError as e:
            raise ConfigError(f"{FLAG}: {name}: {e}") from None
        own = [f for f in out[name] if f.split("=")[0] in _OWN_FLAGS]
        if own:
            raise ConfigError(f"{FLAG}: {name}: {own[0]} is set by the launcher")
    for name in _SIDES:
        out.setdefault(name, [])
    return out


def server_commands(model: str, spec: dict[str, list[str]], ports: dict[str, int],
                    side_channel_port: int, backend: str) -> dict[str, list[str]]:
    """The two `dsaserve serve` command lines."""
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    out = {}
    for name in _SIDES:
        extra = {"backend": backend}
        if name == "prefill":
            extra["side_channel_port"] = side_channel_port
        kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": roles[name],
                         "kv_connector_extra_config": extra})
        out[name] = [sys.executable, "-m", "dsaserve.serve.cli", model, *spec[name],
                     "--host", "127.0.0.1", "--port", str(ports[name]),
                     "--kv-transfer-config", kv]
    return out


def wait_healthy(name: str, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the `name` server answers /health; a ConfigError naming --pd where it exits with
    a usage error (status 2: a flag of its FLAGS, printed by it), else a RuntimeError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() == 2:
            raise ConfigError(f"{FLAG}: the {name} server refused its flags (its error is above)")
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not healthy within {timeout_s:.0f} s")


def stop(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM (the servers drain), then SIGKILL whatever is still there."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def die_with_parent() -> None:
    """In a child (before exec, or first thing in a spawned one): SIGTERM when the launcher
    dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The top-level `serve` flags both servers take: the served name, the tool-call and
    reasoning parsers (both servers see each request: the prefill one would refuse its tools
    without them), and the chat prompt's (both must render the same ids)."""
    flags = []
    if args.served_model_name:
        flags += ["--served-model-name", args.served_model_name]
    if getattr(args, "enable_auto_tool_choice", False):
        flags.append("--enable-auto-tool-choice")
    for name in ("tool_call_parser", "reasoning_parser", "chat_template"):
        if (value := getattr(args, name, None)) is not None:
            flags += [f"--{name.replace('_', '-')}", value]
    if getattr(args, "tokenizer_mode", "auto") != "auto":
        flags += ["--tokenizer-mode", args.tokenizer_mode]
    return flags


def run_pd(args: argparse.Namespace, model: str) -> int:
    import uvicorn

    from dsaserve.router.app import create_router_app
    from dsaserve.router.config import RouterConfig
    from dsaserve.serve.prompt import load_chat_template

    spec = parse_pd_spec(args.pd)
    # uvicorn re-raises the SIGTERM it caught once it has stopped: exit through `finally`
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    for flags in spec.values():
        flags += shared_flags(args)
    *http, side_channel = free_ports(len(_SIDES) + 1)  # distinct: held until all are bound
    ports = dict(zip(_SIDES, http, strict=True))
    commands = server_commands(model, spec, ports, side_channel, args.pd_kv_backend)
    procs: list[subprocess.Popen] = []
    try:
        for name in _SIDES:
            print(f"dsaserve: {name}: {shlex.join(commands[name])}", file=sys.stderr)
            procs.append(subprocess.Popen(commands[name], env=server_env(os.environ),
                                          preexec_fn=die_with_parent))
        urls = {name: f"http://127.0.0.1:{ports[name]}" for name in _SIDES}
        for name, proc in zip(_SIDES, procs, strict=True):
            wait_healthy(name, urls[name], proc, args.pd_start_timeout)
        router = RouterConfig(prefill_backends=(urls["prefill"],),
                              decode_backends=(urls["decode"],), host=args.host, port=args.port,
                              tokenizer_mode=args.tokenizer_mode,
                              chat_template=load_chat_template(args.chat_template))
        print(f"dsaserve: P/D router on http://{args.host}:{args.port} (prefill "
              f"{urls['prefill']}, decode {urls['decode']})", file=sys.stderr)
        uvicorn.run(create_router_app(router), host=args.host, port=args.port,
                    timeout_keep_alive=router.timeout_keep_alive_s, log_level="warning")
    finally:
        stop(procs)
    return 0
