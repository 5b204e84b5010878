"""benchmarks/decode_host_cpu.py runs end to end on the CPU at a small size (so the command
the decode host numbers came from cannot rot): every row's engine steps are timed and
profiled, the decode steps take the padded (CUDA-graph) path, and the launches are counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: importing triton at collection would compile-import it before
# tests/unit/test_triton_interpret.py imports it interpreted (conftest fails the run then)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the GPU path's host code needs triton")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_host_cpu.py"


def _run(capsys, *args: str) -> str:
    spec = importlib.util.spec_from_file_location("decode_host_cpu", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["decode_host_cpu"] = module
    try:
        spec.loader.exec_module(module)
        assert module.main(["--batch", "2", "--context", "128", "--steps", "3", "--warmup",
                            "2", "--profile-steps", "2", "--top", "60", "--ops", *args]) == 0
    finally:
        sys.modules.pop("decode_host_cpu", None)
    return capsys.readouterr().out


def _ops(out: str) -> list[tuple[int, int]]:
    """Each row's (torch ops, launches) of one step."""
    return [tuple(int(n) for n in part.split(")")[0].split(", "))
            for part in out.split("torch ops, launches: (")[1:]]


def test_smoke_on_cpu(capsys):
    out = _run(capsys)
    # a row per (MTP, scheduling), each a whole engine step
    table = out.split("| b | MTP | scheduling |")[1].splitlines()[2:]
    assert [line.split("|")[2:4] for line in table] == [
        [" - ", " sync "], [" - ", " async "], [" MTP3 ", " sync "], [" MTP3 ", " async "]]
    assert all(float(line.split("|")[4]) > 0 and float(line.split("|")[5]) > 0
               for line in table)
    assert out.count("engine/engine.py:") >= 4 and "update_from_output" in out
    # the decode steps went through the padded path (its replays stubbed), MTP's drafts too
    assert "engine/decode_graph.py" in out and "decode_graph.py:" in out.split("MTP3, sync")[1]
    ops = _ops(out)
    assert len(ops) == 4 and min(n for n, _ in ops) > 0
    # MTP3 adds the rejection sampler's and the draft inputs' ops to a step
    assert ops[2][0] > ops[0][0] and ops[3][0] > ops[1][0]


def test_eager_forward_launches(capsys):
    """--eager: the forward runs, every layer's Triton kernels launched (stubbed)."""
    out = _run(capsys, "--eager", "--mtp", "on", "--scheduling", "async")
    [(num_ops, launches)] = _ops(out)
    assert launches >= 2 * 6 and "model/dsa.py" in out
