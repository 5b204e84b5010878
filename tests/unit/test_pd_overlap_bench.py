"""benchmarks/pd_overlap.py (the running requests' decode step while a P/D READ is in flight)
runs end to end on the CPU at tiny size over shared memory, into KV pages and into a spilling
HiSparse engine's host pool (so the H200 command cannot rot); with the copy thread slowed down
the READs span steps, and those steps are the ones counted as in flight."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dsaserve.disagg.shmcopy import CopyThread


def test_quantile(load_benchmark) -> None:
    bench = load_benchmark("pd_overlap")
    assert bench.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bench.quantile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9) == \
        pytest.approx(9.1)
    assert bench.quantile([4.0], 0.9) == 4.0
    assert bench.quantile([], 0.5) != bench.quantile([], 0.5)  # NaN


def test_smoke_on_cpu(load_benchmark, tmp_path: Path) -> None:
    bench = load_benchmark("pd_overlap")
    out = tmp_path / "overlap.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    for into in ("pages", "host-pool"):
        assert f"| shm | {into} | 2 | 2,048 | 2 |" in text


def test_steps_with_a_read_in_flight(load_benchmark, model_dirs, monkeypatch) -> None:
    """Each shm copy job waits 20 ms before it copies: the READs outlive the posting step, the
    running requests decode a token in every step meanwhile (the benchmark checks it), and the
    READ time is the posting step plus the in-flight steps; the bytes READ are the layouts'."""
    bench = load_benchmark("pd_overlap")
    real = CopyThread._copy

    def slow(thread: CopyThread, job) -> bool:
        time.sleep(0.02)
        return real(thread, job)

    monkeypatch.setattr(CopyThread, "_copy", slow)
    args = bench.parse_args(["--smoke", "--decode-budget", "400", "--tokens", "512",
                             "--inflight", "1,2"])
    rows = bench.run_pair(args, model_dirs["tiny-glm5"], torch.device("cpu"), "shm", "pages")
    assert [(r.tokens, r.inflight, r.batch) for r in rows] == [(512, 1, 2), (512, 2, 2)]
    for r in rows:
        assert len(r.idle_ms) == args.steps and min(r.idle_ms) > 0
        assert r.busy_ms and min(r.busy_ms) > 0
        assert r.read_ms == pytest.approx(r.post_ms + sum(r.busy_ms))
        # positions [0, prompt − 1) of each READ request: an fp32 MLA row (576 wide) on the 4
        # layers and the MTP layer, an fp32 indexer key (128 wide) on the layers with their
        # own indexer (0 and 2; 1 and 3 share theirs) and the MTP layer
        row_bytes = 5 * 576 * 4 + 3 * 128 * 4
        assert r.nbytes == r.inflight * (r.tokens - 1) * row_bytes
        line = bench.row_line(r)
        assert "landed in the post step" not in line and f"| {len(r.busy_ms)} |" in line


def test_posting_step_profiled(load_benchmark, model_dirs, tmp_path: Path, capsys) -> None:
    """--profile-post: each row's posting step under cProfile (its host functions printed) and
    the torch profiler (a trace per row, the connector's post among its host functions)."""
    bench = load_benchmark("pd_overlap")
    args = bench.parse_args(["--smoke", "--tokens", "512", "--inflight", "1",
                             "--profile-post", str(tmp_path / "traces")])
    rows = bench.run_pair(args, model_dirs["tiny-glm5"], torch.device("cpu"), "shm", "pages")
    assert [(r.tokens, r.inflight) for r in rows] == [(512, 1)]
    # a trace for each measured row, none for the warm-up's (the device call keeps few files)
    assert [f.name for f in (tmp_path / "traces").iterdir()] == ["post_B2_512x1.json"]
    assert (tmp_path / "traces" / "post_B2_512x1.json").stat().st_size > 0
    err = capsys.readouterr().err
    assert "posting step B2_512x1: " in err and "connector.py" in err


def test_bad_flags(load_benchmark) -> None:
    bench = load_benchmark("pd_overlap")
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--into", "vram"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--batch", "0"])
    with pytest.raises(SystemExit):  # shared memory cannot move GPU caches
        bench.parse_args(["--device", "cuda", "--transports", "shm"])
