"""A client that never reads its stream must not stall other streams or the engine: its request is
aborted once its stream holds --max-stream-buffer unread outputs (counted in /metrics), while a
normal client streams to the end; a real uvicorn server and a raw socket that stops reading."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, server_engine_config
from test_server import assert_no_blocks_held
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.api import ServerConfig, create_app
from dsaserve.serve.async_engine import AsyncEngine

pytestmark = pytest.mark.server

# Slack for the normal client: on a loaded CPU it reads slower than the tiny model generates,
# and with 8 its own stream overflowed once (an error event where the usage chunk was due).
MAX_STREAM_BUFFER = 32


@pytest.fixture(scope="module")
def slow_engine(tiny_model_dir: Path):
    # Long generations (the stalled one must outlast every buffer between it and the client).
    llm = LLMEngine.from_config(server_engine_config(
        tiny_model_dir, "--max-model-len", "4096", "--num-gpu-blocks-override", "600"))
    engine = AsyncEngine(llm, max_stream_buffer=MAX_STREAM_BUFFER)
    yield engine
    engine.shutdown()


class _SmallWriteBuffer(H11Protocol):
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=4096)  # asyncio's default: 64 KiB


class SmallBufferServer:
    """uvicorn on 127.0.0.1 with small, fixed send buffers (the socket's and asyncio's), so a client
    that stops reading blocks the server's writes after kilobytes rather than megabytes of
    autotuned buffer: the behaviour under test is the same, the test is faster."""

    def __init__(self, app: object) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # accepted sockets inherit it
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                     http=_SmallWriteBuffer))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._server.force_exit = True  # the stalled connection never drains
        self._thread.join(30)


def overflows(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dsaserve:stream_buffer_overflows_total")


def test_a_client_that_stops_reading_is_aborted_and_stalls_nobody(slow_engine) -> None:
    server = SmallBufferServer(create_app(slow_engine, ServerConfig(served_model_name=MODEL_NAME)))
    stalled = socket.create_connection(("127.0.0.1", server.port))
    try:
        # 1. The stalled client: asks for 4000 tokens, reads the headers, then never again.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": MODEL_NAME, "prompt": "The harbour", "max_tokens": 4000,
                           "ignore_eos": True, "stream": True}).encode()
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert stalled.recv(64).startswith(b"HTTP/1.1 200")
        # 2. A normal client streams meanwhile, to the end, in bounded time.
        start = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "stream": True, "max_tokens": 100, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Describe the station."}]}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 100
        assert time.monotonic() - start < 60
        # 3. The stalled request is aborted (its KV blocks freed) without any read by its client.
        deadline = time.monotonic() + 60
        while overflows(server.url) < 1:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        assert_no_blocks_held(slow_engine)
        stats = slow_engine.stats()
        assert stats.num_running == 0
        # 4. The engine still serves.
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "The ferry", "max_tokens": 5, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        stalled.close()
        server.close()


def test_overflow_reaches_a_late_reader_as_an_error_event(slow_engine) -> None:
    """If the slow client does read again, it gets what was sent before the abort, then an error
    event and [DONE]: never a silently truncated stream."""
    server = SmallBufferServer(create_app(slow_engine, ServerConfig(served_model_name=MODEL_NAME)))
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        before = overflows(server.url)
        body = json.dumps({"model": MODEL_NAME, "prompt": "The harbour", "max_tokens": 4000,
                           "ignore_eos": True, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while overflows(server.url) < before + 1:
            assert time.monotonic() < deadline, "never aborted"
            time.sleep(0.2)
        sock.settimeout(30)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = sock.recv(65536)
            assert chunk, "connection closed before the stream ended"
            data += chunk
        text = data.decode("utf-8", "replace")
        assert '"code":408' in text and "outputs behind" in text
        assert text.rstrip().endswith("0") and "data: [DONE]" in text
        assert_no_blocks_held(slow_engine)
    finally:
        sock.close()
        server.close()
