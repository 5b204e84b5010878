"""Real servers for the server tests: uvicorn on 127.0.0.1 (a free port) in a background thread,
driving a real engine on the tiny model. Engines are built from command-line flags, so the flag
parsing that `dsaserve serve` uses is exercised too."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from dsaserve.config import EngineConfig
from dsaserve.engine.args import add_engine_args, engine_config_from_args
from dsaserve.serve.api import ServerConfig, create_app
from dsaserve.serve.async_engine import AsyncEngine

# Small enough to start fast, large enough for 32 concurrent requests of a few hundred tokens.
TEST_FLAGS = ["--block-size", "16", "--num-gpu-blocks-override", "256", "--max-model-len", "512",
              "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--device", "cpu"]
MODEL_NAME = "tiny-test"


def server_engine_config(model_dir: Path, *flags: str) -> EngineConfig:
    parser = add_engine_args(argparse.ArgumentParser())
    return engine_config_from_args(parser.parse_args([*TEST_FLAGS, *flags]), str(model_dir))




class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread, on a port bound before it starts."""

    def __init__(self, app: object) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=3600)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


@contextmanager
def serve(engine: AsyncEngine, **server_config: object) -> Iterator[LiveServer]:
    server = LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL_NAME,
                                                        **server_config)))
    try:
        yield server
    finally:
        server.close()
