"""The host-tier scripts run end to end on CPU at tiny sizes, so they cannot rot between
GPU runs: benchmarks/offload.py --smoke and the agentic replay."""

from __future__ import annotations

import pytest


def test_offload_benchmark_smoke(tmp_path, load_benchmark) -> None:
    bench = load_benchmark("offload")
    out = tmp_path / "offload.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    for header in ("| tokens | GiB | store D2H (GB/s)", "| prefix | recompute",
                   "| median step, no copies (ms) | with copies (ms)"):
        assert header in text
    assert bench.FULL_RECORD == 54_728  # GLM-5.3's whole per-token record (DESIGN §2)
    with pytest.raises(SystemExit):  # an unknown table names the flag, before any work
        bench.main(["--smoke", "--tables", "decode,bogus"])


def test_agentic_replay_smoke(monkeypatch, tmp_path, capsys) -> None:
    from dsaserve.bench import offload_replay

    monkeypatch.setenv("DSASERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert offload_replay.main(["--sessions", "3", "--turns", "2", "--concurrency", "3",
                                "--gpu-blocks", "30"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    off, on = rows[-2].split(" | "), rows[-1].split(" | ")
    assert off[0] == "| off" and off[4] == "0"  # no host hits without the tier
    assert int(on[4]) > 0  # with it, evicted history comes back from the host


def test_hisparse_benchmark_smoke(tmp_path, load_benchmark) -> None:
    bench = load_benchmark("hisparse")
    out = tmp_path / "hisparse.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| overlap | all-GPU (ms) | HiSparse (ms)")
    missed = [float(r.split(" | ")[4].replace(",", "")) for r in rows[1:]]
    assert len(missed) == 5 and missed[-1] < missed[0]  # more overlap, fewer misses
