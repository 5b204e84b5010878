"""The multi-GPU benchmark script runs end to end (gloo, tiny model), so it is ready for the day a
machine of several GPUs is lent; its exactness check must pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parallel


def test_cp_multi_gpu_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("DSASERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_multi_gpu.py"
    spec = importlib.util.spec_from_file_location("cp_multi_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cp_multi_gpu", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "table.md"
    assert bench.main(["--device", "cpu", "--gpus", "2", "--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    assert "identical" in text and "| PCP2×DCP2×EP2 | 2 |" in text
    assert "DCP 2: 8192 blocks" in text  # 1M tokens in virtual blocks of 64·2
