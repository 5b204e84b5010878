"""benchmarks/pd_transfer.py runs end to end (two processes, every byte checked), so its table
cannot rot."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parallel


def test_pd_transfer_smoke(capsys, monkeypatch):
    # The spawned consumer imports the script by name: put its folder on the path it inherits.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "pd_transfer", raising=False)
    bench = importlib.import_module("pd_transfer")
    assert bench.glm53_bytes_per_token() == 78 * 656 + 21 * 132 + 788 == 54_728
    # shm only: NIXL between two processes is tested in test_kv_transport_2p.py (CI time).
    assert bench.main(["--smoke", "--backends", "shm", "--tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "| shm | 1,024 |" in out and "| nixl |" not in out
    assert "| 1,024 | 64 | 2 |" in out  # whole pages: rank 0 holds 2 pages of 64 tokens
    # the connector's choice: whole pages zero-copy, 2 pages × (MLA, indexer) segments; at
    # interleave 1 staged: MLA rows of the 2 adjacent pages in one, each page's FP8 values and
    # scales apart, against 128 rows × 3 zero-copy segments
    assert "| shm | 1,024 | 64 | zero-copy | 4 | " in out
    assert "| shm | 1,024 | 1 | staged | 5 | " in out and " | 384 | " in out


def test_pd_e2e_smoke(capsys, monkeypatch):
    """benchmarks/pd_e2e.py: two engines through the connector, the table printed."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "pd_e2e", raising=False)
    bench = importlib.import_module("pd_e2e")
    assert bench.FULL_RECORD == 54_728
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 48 |" in out and "| 96 |" in out
