"""benchmarks/prefill_host_cpu.py runs end to end on the CPU at a small size (so the command
the 4K host numbers came from cannot rot): the GPU path's host functions are timed and the
stubbed launches counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: importing triton at collection would compile-import it before
# tests/unit/test_triton_interpret.py imports it interpreted (conftest fails the run then)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the GPU path's host code needs triton")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_host_cpu.py"


def test_smoke_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("prefill_host_cpu", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefill_host_cpu"] = module
    try:
        spec.loader.exec_module(module)
        assert module.main(["--tokens", "256", "--repeats", "1", "--ops"]) == 0
    finally:
        sys.modules.pop("prefill_host_cpu", None)
    out = capsys.readouterr().out
    # the GPU path ran: the indexer's step plan and the runner's metadata were timed, and
    # every layer launched Triton kernels (stubbed)
    assert "indexer.py _step_plan" in out and "runner.py _metadata" in out
    launches = int(out.split("torch ops, launches: (")[1].split(")")[0].split(", ")[1])
    assert launches >= 2 * 6
