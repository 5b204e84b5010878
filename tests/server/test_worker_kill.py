"""A worker rank killed mid-stream under PCP2 and under DP2 (gloo workers on the CPU), behind a real
HTTP server: every open stream ends with an error event and [DONE] within 10 s, /health fails, new
requests get 503, and no worker process is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, serve, server_engine_config

from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine

pytestmark = [pytest.mark.server, pytest.mark.parallel]


def worker_pids(engine) -> tuple[int, ...]:
    replicas = getattr(engine, "replicas", [engine])  # a DataParallelEngine or one LLMEngine
    return tuple(pid for r in replicas for pid in r.executor.pids)


class Stream(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "The harbour town", "max_tokens": 480,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        self.ended_at = time.monotonic()


@pytest.mark.parametrize("layout", [("-pcp", "2"), ("-dp", "2")], ids=["pcp2", "dp2"])
def test_killed_worker_ends_every_stream_and_the_server_refuses(tiny_model_dir: Path,
                                                                layout) -> None:
    engine = AsyncEngine(LLMEngine.from_config(server_engine_config(tiny_model_dir, *layout)))
    try:
        pids = engine.call_in_core(worker_pids)
        assert len(pids) == 2
        with serve(engine) as server:
            streams = [Stream(server.url) for _ in range(3)]
            for s in streams:
                s.start()
            assert all(s.started.wait(60) for s in streams)
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            for s in streams:
                s.join(30)
                assert s.ended_at is not None and s.ended_at - killed_at < 10
                assert s.events[-1] == "[DONE]"
                error = json.loads(s.events[-2])["error"]
                assert error["code"] == 500 and "engine failed" in error["message"]
            assert httpx.get(f"{server.url}/health").status_code == 503
            r = httpx.post(f"{server.url}/v1/completions", timeout=10,
                           json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        for pid in pids:  # every worker exited and was reaped: no orphan, no zombie
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                assert time.monotonic() < deadline, f"worker {pid} is still there"
                time.sleep(0.1)
    finally:
        engine.shutdown()
