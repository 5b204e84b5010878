"""benchmarks/long_prefill.py under PCP2 (two gloo worker processes, tiny model): the path the
H200 command takes with --prefill-context-parallel-size, kept from rotting."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parallel


def _tokens(text: str) -> dict[str, str]:
    """prompt length → the greedy token after it, from the first table."""
    rows = [line.split("|") for line in text.splitlines() if line.startswith(("| 128 |",
                                                                              "| 384 |"))]
    return {r[1].strip(): r[-2].strip() for r in rows}


def test_long_prefill_pcp2_smoke(tmp_path, monkeypatch):
    """Sync, then --async-scheduling (chunk k + 1 launched while chunk k runs): the same
    tokens after each prompt."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "long_prefill.py"
    spec = importlib.util.spec_from_file_location("long_prefill", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "long_prefill", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    tokens = {}
    for scheduling, flags in (("sync", []), ("async", ["--async-scheduling"])):
        out = tmp_path / f"{scheduling}.md"
        assert bench.main(["--smoke", "--pcp", "2", "--lengths", "128,384",
                           "--max-num-batched-tokens", "128", "--out", str(out), *flags]) == 0
        text = out.read_text()
        assert "PCP 2" in text and f"{scheduling} scheduling" in text and "| 384 |" in text
        assert "| 2 | 256 | 128 |" in text  # the third chunk of the 384-token prompt
        tokens[scheduling] = _tokens(text)
    assert len(tokens["sync"]) == 2 and tokens["async"] == tokens["sync"]
