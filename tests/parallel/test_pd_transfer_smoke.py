"""benchmarks/pd_transfer.py runs end to end (two processes, every byte checked), so its table
cannot rot."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import sys
from pathlib import Path

import pytest

from dsaserve.disagg.transport import nixl_available

pytestmark = pytest.mark.parallel
NO_NIXL = "nixl not installed (pip install 'dsaserve[nixl]')"


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
    # posting: both forms timed over 2 and 4 region pairs
    assert "| shm | 2 | " in out and "| shm | 4 | " in out


@pytest.mark.parametrize("transport", [
    "shm",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason=NO_NIXL)),
])
def test_pd_e2e_smoke(capsys, monkeypatch, transport):
    """benchmarks/pd_e2e.py: the prefill engine in a spawned process, the decode engine here,
    through the connector; the table printed, the prefill process gone afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "pd_e2e", raising=False)
    bench = importlib.import_module("pd_e2e")
    assert bench.FULL_RECORD == 54_728
    before = set(mp.active_children())
    assert bench.main(["--smoke", "--transport", transport]) == 0
    assert set(mp.active_children()) <= before  # the prefill process was stopped and reaped
    out = capsys.readouterr().out
    assert f"the engines in two processes (4 layers + MTP, fp8_ds_mla, {transport}," in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 48 |")
            or line.startswith("| 96 |")]
    assert len(rows) == 2
    for row in rows:  # a first token timed, the prompt's KV moved (MiB)
        assert float(row[2]) > 0 and float(row[4]) > 0
