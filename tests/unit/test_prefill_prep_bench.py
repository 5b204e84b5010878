"""benchmarks/prefill_prep.py runs end to end on the CPU at tiny size (so the documented
command cannot rot), and its phases are the runner's: before the forward, after it, and the
first layer's plans, each measured and within the step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_prep.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("prefill_prep", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefill_prep"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("prefill_prep", None)


def test_cases(bench):
    assert bench.parse_case("4K") == bench.Case(4096, 1)
    assert bench.parse_case("512x8") == bench.Case(512, 8)
    assert bench.parse_case("100") == bench.Case(100, 1)
    for bad in ("1M", "x8", "512x0", "0"):
        with pytest.raises(Exception, match="--cases"):
            bench.parse_case(bad)
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])


def test_smoke_on_cpu(bench, tmp_path, capsys):
    out = tmp_path / "table.md"
    assert bench.main(["--smoke", "--profile", "--top", "5", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 64 |")
            or line.startswith("| 4 × 32 |")]
    assert len(rows) == 2
    for row in rows:  # min / median of each phase: measured, min ≤ median
        for cell in row.strip("|").split("|")[1:]:
            lo, med = (float(x) for x in cell.split("/"))
            assert 0 < lo <= med
    profiled = capsys.readouterr().err
    assert profiled.count("| own ms | calls | function |") == 2  # one table per case
    assert profiled.count(" | ") >= 2 * 5 * 2  # each with its 5 functions


def test_phases_split_the_step(bench, tmp_path):
    """The clock's phases are parts of the step: the forward it stands in for runs between
    them, and each step it times is the runner's (it advances the runner's requests)."""
    clock = bench.PhaseClock(bench.make_runner([bench.Case(48, 2)], tmp_path))
    case = bench.Case(48, 2)
    before, after, plans = clock.step(case)
    assert min(before, after, plans) > 0
    assert clock.meta is not None and clock.meta.num_tokens == 96
    assert set(clock.runner.requests) == set(clock.last) and len(clock.last) == 2
    clock.step(case)  # the previous requests ended: the same blocks serve again
    assert set(clock.runner.requests) == set(clock.last)
