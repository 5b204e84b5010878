"""benchmarks/hisparse_engine.py runs end to end on the CPU at tiny size (so the H200 command
cannot rot): HiSparse's greedy tokens equal the all-GPU engine's in every step-time row, from
the same batches, the concurrency each engine reaches is what `dsaserve plan`'s functions
predict, the long request's table is filled, and the same request through P/D into a decode
engine below one window of MLA pages gives the same tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "hisparse_engine.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("hisparse_engine", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hisparse_engine"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("hisparse_engine", None)


def _cells(text: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith(f"| {first}")]


def test_smoke_on_cpu(bench, tmp_path):
    out = tmp_path / "table.md"
    # asserts tokens and plan inside; --ties: the two engines' batches compared as well
    assert bench.main(["--smoke", "--ties", "--out", str(out)]) == 0
    text = out.read_text()
    steps = _cells(text, "48 |") + _cells(text, "160 |")
    assert [(r[0], r[1]) for r in steps] == [("48", "1"), ("48", "3"), ("160", "1"), ("160", "3")]
    assert all(r[-1] == "yes; batches equal" for r in steps)
    # every request of these contexts reads through a hot buffer of one top-k (16 rows): misses
    assert all(float(r[5].replace(",", "")) > 0 for r in steps)
    # three long decoders over one window of MLA pages and their tails: pages spilled
    assert all(int(r[6].replace(",", "")) > 0 for r in steps if r[1] == "3")
    (full,), (hs,) = _cells(text, "all-GPU |"), _cells(text, "HiSparse |")
    assert full[1:4] == ["2", "2", "yes"] and hs[3] == "yes"
    assert int(hs[1]) == int(hs[2].split()[0]) > 2 * int(full[1])
    long, pd = _cells(text, "384 |")
    assert float(long[1]) > 0 and float(long[2]) > 0 and long[4] == "—"
    # through P/D into a decode engine far below the request's window: the same tokens, its
    # GPU KV pool smaller than the request's KV
    assert "HiSparse decode engine with 2 MLA pages (one window of the request: 25)" in text
    assert float(pd[2]) > 0 and pd[-1] == "yes"
    mib = [float(c.split()[0]) for c in pd[5:7]]
    assert mib[0] < mib[1]


def test_flags(bench):
    assert [bench.parse_tokens(x, "--long") for x in ("4096", "8K", "1M")] == \
        [4096, 8192, 1 << 20]
    assert bench.human(131072) == "128K" and bench.human(1 << 20) == "1M"
    args = bench.parse_args(["--batches", "1,4", "--contexts", "8K", "--sections", "step"])
    assert (args.batches, args.contexts, args.sections) == ([1, 4], [8192], ["step"])
    for bad in (["--sections", "steps"], ["--batches", "0"], ["--long", "1G"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_parting_gaps(bench):
    """--ties: the all-GPU engine's gap at the first token where the two engines part; inf
    where HiSparse's token is not among its five most likely."""
    def steps(tokens, top=()):
        return bench.Steps(1.0, 0.0, 0, tokens, list(top))

    top = [((5, -0.5), (7, -0.52)), ((1, -0.1), (2, -3.0))]
    a = steps([[5, 1], [5, 1], [5, 1]], [top, top, top])
    row = bench.StepRow(8192, 3, a, steps([[5, 1], [7, 4], [5, 9]]))
    assert not row.tokens_equal
    gaps = row.parting_gaps()
    assert gaps[0] == pytest.approx(0.02) and gaps[1] == float("inf") and len(gaps) == 2
    assert row.equal_note() == ("2 of 3 part, widest all-GPU gap at the parting inf nats; "
                              "batches equal")
    assert bench.StepRow(8192, 3, steps(a.tokens), steps([[5, 1], [7, 4], [5, 1]])
                         ).equal_note() == "NO"
