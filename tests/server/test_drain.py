"""SIGTERM drains a real `python -m dsaserve.serve.cli` process: requests in flight finish within
--shutdown-timeout, new ones (and /health) get 503 meanwhile, one that outlasts the timeout ends
with an error event and [DONE], and the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_cli import free_port

pytestmark = pytest.mark.server

SHUTDOWN_TIMEOUT_S = 6.0


def start_server(model_dir: Path, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsaserve.serve.cli", str(model_dir), "--port", str(port),
           "--served-model-name", "tiny", "--block-size", "16", "--num-gpu-blocks-override", "400",
           "--max-model-len", "4096", "--device", "cpu", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


class Stream(threading.Thread):
    """One streaming completion read to its end; `started` once its first token arrived."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "The harbour town", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        self.ended_at = time.monotonic()


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_model_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tiny_model_dir, port, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        short, long = Stream(url, 40), Stream(url, 3500)  # long: far beyond the timeout
        short.start(), long.start()
        assert short.started.wait(60) and long.started.wait(60)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the handler runs between two bytecodes of the main thread
        # New requests, on new connections, are refused with OpenAI's error body.
        refused = httpx.post(f"{url}/v1/completions", timeout=10,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        # The short request finishes normally, well within the timeout.
        short.join(60)
        assert short.events[-1] == "[DONE]"
        assert json.loads(short.events[-2])["usage"]["completion_tokens"] == 40
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in short.events[:-2]]
        assert finish[-1] == "length"
        # The long one is ended at the timeout: an error event, then [DONE].
        long.join(60)
        assert long.ended_at is not None
        assert long.events[-1] == "[DONE]"
        error = json.loads(long.events[-2])["error"]
        assert "shut down" in error["message"]
        assert SHUTDOWN_TIMEOUT_S - 1 < long.ended_at - sigterm_at < SHUTDOWN_TIMEOUT_S + 10
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "SIGTERM: draining 2 request(s)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

