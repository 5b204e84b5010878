"""benchmarks/prefill_host.py runs end to end on the CPU at tiny size (so the GPU command cannot
rot), and its fit of host time over layers does what its table claims."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_host.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("prefill_host", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefill_host"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("prefill_host", None)


def test_fit_and_lengths(bench):
    # host = 3 + 0.5·layers exactly: the fit gives it back
    assert bench.fit_line([2, 4, 8], [4.0, 5.0, 7.0]) == pytest.approx((3.0, 0.5))
    assert bench.fit_line([4, 4], [1.0, 3.0]) == (2.0, 0.0)  # one layer count: no slope
    assert [bench.parse_length(x) for x in ("1K", "4096", "16k")] == [1024, 4096, 16384]
    with pytest.raises(Exception, match="--lengths"):
        bench.parse_length("1M")


def test_smoke_on_cpu(bench, tmp_path):
    out, js = tmp_path / "table.md", tmp_path / "rows.json"
    assert bench.main(["--smoke", "--lengths", "16,32", "--repeats", "1", "--out", str(out),
                       "--json", str(js)]) == 0
    text = out.read_text()
    for length in (16, 32):
        for layers in (2, 4):
            assert f"| {length} | {layers} |" in text
    assert "host = a + b·layers" in text and "ops per layer" in text
    data = json.loads(js.read_text())
    assert len(data["rows"]) == 4 and set(data["fits"]) == {"16", "32"}
    assert all(r["wall_ms"] > 0 and r["busy_ms"] > 0 and r["kernels"] > 0 for r in data["rows"])
    prefill, decode = data["ops"]
    # the reference backend's ops grow with layers; it launches no Triton kernels
    assert prefill["kind"] == "prefill" and prefill["ops_per_layer"] > 50
    assert prefill["launches_per_layer"] == 0 and decode["ops_per_layer"] > 50


def test_bad_flags(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--layers", "0,2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--repeats", "0"])
    with pytest.raises(SystemExit):  # timed CPU rows need the reference backend
        bench.parse_args(["--device", "cpu", "--attention-backend", "triton"])
