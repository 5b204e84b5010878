"""The short soak (benchmarks/soak.py) in CI: 16 streaming clients for 20 s against a real server
process on the tiny model, with random disconnects and aborts. Nothing fails that the test did not
cause, the RSS of the server stays within 10 % after the warm-up, and its KV cache ends at zero.

RSS needs about a minute of this load to settle (allocator high-water marks; docs/reliability.md),
so 20 s can show a few percent of growth that is not a leak: the issue's 5 % target is checked on
the 300 s run there; here the bound catches a leak of a few hundred KiB per request."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server


def load_soak():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_short_soak(tiny_model_dir: Path, tmp_path: Path) -> None:
    soak = load_soak()
    proc, url = soak.start_server(str(tiny_model_dir), soak.DEFAULT_SERVER_ARGS,
                                  tmp_path / "server.log")
    try:
        report = asyncio.run(soak.soak(url, str(tiny_model_dir), "none", proc.pid, clients=16,
                                       duration_s=20, warmup_s=8, headers={}, seed=1))
    finally:
        proc.terminate()
        proc.wait(60)
    soak.print_report(report)
    assert report.errors == 0, report.error_examples
    assert report.served >= 20 and report.disconnects >= 1 and report.aborts >= 1
    assert report.end.kv_usage == 0 and report.end.running == report.end.waiting == 0
    assert report.rss_growth is not None and report.rss_growth < 0.10
    assert proc.returncode == 0  # and it drained and stopped cleanly on SIGTERM
