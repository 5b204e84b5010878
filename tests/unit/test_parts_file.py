"""Parts and host fits measured on the machine at hand: benchmarks/kernels.py --parts writes the
figures its rows measured in the file `Parts.load` reads (built here through the script's own
writer from rows tagged as its sections tag them), Parts.load refuses what it cannot take with
the file and the field named, and the decode rows of benchmarks/decode.py --rows-json fit the
same host time as the rows themselves."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from dsaserve.config import ConfigError
from dsaserve.plan.hosttime import (
    DECODE_H200,
    H200_HOST,
    PREFILL_HOST_H200,
    HostFits,
    load_decode_rows,
    load_prefill_rows,
)
from dsaserve.plan.parts import H200, Curve, Measured, Parts, parts_json

GPU = "NVIDIA H100 80GB HBM3"
DOCS = Path(__file__).resolve().parents[2] / "docs"
PREFILL_JSON = DOCS / "prefill_host_h200.json"


def _kernel_rows(kernels) -> list:
    """Rows as kernels.py's sections add them: the tagged ones and some that measure no part
    (another draw, 64 heads, the Triton top-k, the plain-PyTorch path, a page-read ceiling)."""
    row = kernels.Row
    return [
        row("copy d2d (read + write)", 1.0, 3.0, "TB/s", part="hbm_tbps"),
        row("matmul bf16 8192^3", 1.8, 610.0, "TFLOP/s", part="matmul_bf16_tflops"),
        row("matmul fp8 8192^3", 1.0, 1100.0, "TFLOP/s", part="matmul_fp8_tflops"),
        row("page reads, 8.25 KB pages in order", 0.2, 2.8, "TB/s"),
        row("prefill gluon ping-pong T=4096 uniform indices", 5.0, 400.0, "TFLOP/s",
            part="mla_prefill_tflops"),
        row("prefill gluon ping-pong T=4096 recent indices", 4.0, 500.0, "TFLOP/s"),
        row("prefill plain-PyTorch T=4096", 90.0, 20.0, "TFLOP/s"),
        row("prefill gluon ping-pong T=16384 uniform indices", 19.0, 420.0, "TFLOP/s",
            part="mla_prefill_tflops"),
        row("decode gluon 32-row b=128 s_q=1, CUDA graph", 0.150, 230.0, "TFLOP/s",
            part="mla_decode_us@128"),
        row("decode plain-PyTorch b=128 s_q=1", 3.0, 10.0, "TFLOP/s"),
        row("decode gluon 32-row b=128 s_q=4, CUDA graph", 0.580, 240.0, "TFLOP/s",
            part="mla_decode_us@512"),
        row("decode gluon 32-row b=32 s_q=1, CUDA graph", 0.052, 170.0, "TFLOP/s",
            part="mla_decode_us@32"),
        row("indexer prefill logits+topk H=64, cuda top-k", 10.0, 700.0, "TFLOP/s"),
        row("indexer prefill logits+topk H=32, cuda top-k", 6.0, 720.0, "TFLOP/s",
            part="indexer_prefill_tflops"),
        row("indexer prefill logits+topk H=32, triton top-k", 7.0, 650.0, "TFLOP/s"),
        row("indexer decode logits+topk b=64 s_q=1, cuda top-k", 0.3, 1.8, "TB/s"),
        row("indexer decode logits+topk b=64 s_q=1, cuda top-k, CUDA graph", 0.2, 2.6, "TB/s",
            part="indexer_decode_tbps"),
    ]


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_kernels_parts_file_replaces_what_its_rows_measured(tmp_path, load_benchmark):
    kernels = load_benchmark("kernels")
    rows = _kernel_rows(kernels)
    command = "python benchmarks/kernels.py --only ceilings,prefill,decode,indexer --heads 32"
    data = kernels.parts_file(rows, GPU, "2026-12-07", command, 80 << 30)
    parts = Parts.load(_write(tmp_path / "parts.json", data))

    assert parts.name == GPU and parts.hbm_bytes == 80 << 30
    kept = parts.kept(H200)
    assert sorted(set(H200.figures()) - set(kept)) == sorted(kernels.MEASURED_PARTS)
    figures, defaults = parts.figures(), H200.figures()
    for name in kept:  # the rest keep the H200's figure, source and all
        assert figures[name] == defaults[name]
    assert parts.hbm_tbps.value == 3.0 and parts.matmul_bf16_tflops.value == 610.0
    assert parts.matmul_fp8_tflops.value == 1100.0
    assert parts.mla_prefill_tflops.value == pytest.approx(410.0)  # uniform draws, T = 4K, 16K
    assert parts.indexer_prefill_tflops.value == 720.0  # 32 heads, the engine's top-k
    assert parts.indexer_decode_tbps.value == 2.6  # the CUDA graph row
    curve = parts.mla_decode_us
    assert curve.xs == (32.0, 128.0, 512.0)
    assert curve.ys == pytest.approx((52.0, 150.0, 580.0))  # µs, from the rows' ms
    assert curve(128) == pytest.approx(150.0)
    for name in kernels.MEASURED_PARTS:  # each names the GPU, the date, the command's run
        source = figures[name].source
        assert GPU in source and "2026-12-07" in source and "kernels.py" in source
    assert "T=16384 uniform" in parts.mla_prefill_tflops.source
    assert data["command"] == command


def test_kernels_parts_file_leaves_out_what_did_not_run(tmp_path, load_benchmark):
    """A --quick decode run (one curve point here) writes no curve; rows of no part, nothing."""
    kernels = load_benchmark("kernels")
    rows = [r for r in _kernel_rows(kernels)
            if r.part in ("hbm_tbps", "mla_decode_us@128", "")]
    data = kernels.parts_file(rows, GPU, "2026-12-07", "python benchmarks/kernels.py")
    assert list(data["figures"]) == ["hbm_tbps"] and "hbm_bytes" not in data
    parts = Parts.load(_write(tmp_path / "parts.json", data))
    assert parts.hbm_bytes == H200.hbm_bytes and parts.mla_decode_us == H200.mla_decode_us
    assert set(H200.figures()) - set(parts.kept(H200)) == {"hbm_tbps"}


def _good() -> dict:
    return parts_json({"hbm_tbps": Measured(3.0, "TB/s", "run"),
                       "mla_decode_us": Curve((32, 128), (50.0, 150.0), "us", "run")},
                      GPU, "2026-12-07", "cmd")


def _with(change) -> dict:
    data = _good()
    change(data)
    return data


@pytest.mark.parametrize("change, words", [
    (lambda d: d["figures"].update(hbm_gbps={"value": 3.0, "unit": "TB/s", "source": "r"}),
     ["figures.hbm_gbps", "not a figure of Parts", "hbm_tbps"]),
    (lambda d: d["figures"]["hbm_tbps"].update(unit="GB/s"),
     ["figures.hbm_tbps", "'GB/s'", "expected 'TB/s'"]),
    (lambda d: d["figures"]["hbm_tbps"].update(value=-1.0), ["figures.hbm_tbps", "positive"]),
    (lambda d: d["figures"]["hbm_tbps"].update(value="3.0"), ["figures.hbm_tbps", "positive"]),
    (lambda d: d["figures"]["hbm_tbps"].update(source=""), ["figures.hbm_tbps", "source"]),
    (lambda d: d["figures"].update(mla_decode_us={"value": 40.0, "unit": "us", "source": "r"}),
     ["figures.mla_decode_us", "xs"]),
    (lambda d: d["figures"].update(hbm_tbps={"xs": [1, 2], "ys": [1, 2], "unit": "TB/s",
                                             "source": "r"}), ["figures.hbm_tbps", "value"]),
    (lambda d: d["figures"]["mla_decode_us"].update(xs=[128, 32]),
     ["figures.mla_decode_us", "increasing"]),
    (lambda d: d["figures"]["mla_decode_us"].update(ys=[50.0]),
     ["figures.mla_decode_us", "increasing"]),
    (lambda d: d.update(hbm_bytes=80.5), ["hbm_bytes", "positive integer"]),
    (lambda d: d.update(gpus="x"), ["unknown keys", "gpus"]),
    (lambda d: d.pop("figures"), ["'figures' object"]),
])
def test_parts_load_errors_name_the_file_and_field(tmp_path, change, words):
    path = _write(tmp_path / "bad.json", _with(change))
    with pytest.raises(ConfigError) as e:
        Parts.load(path)
    for w in [path, *words]:
        assert w in str(e.value)


def test_parts_load_unreadable_files(tmp_path):
    for path, text in ((tmp_path / "missing.json", None), (tmp_path / "x.json", "{not json")):
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError, match="cannot read a parts file") as e:
            Parts.load(path)
        assert str(path) in str(e.value)


# ---- host time from benchmarks/decode.py --rows-json and prefill_host.py --json ---------------
def _decode_rows(decode) -> list:
    """decode.py's rows for DECODE_H200's steps, plus rows the fits must not take: async ones,
    a failed one, and one without kernel times (the CPU)."""
    rows = [decode.Row(r.context, r.batch, r.drafts > 0, r.graph, False, r.wall_ms,
                       r.kernels_ms, 1.0) for r in DECODE_H200]
    return rows + [decode.Row(8192, 64, False, True, True, 2.0, 1.2, 1.0),
                   decode.Row(8192, 16, True, True, False, math.nan, math.nan, math.nan,
                              "failed: out of memory"),
                   decode.Row(40, 1, False, False, False, 3.0, math.nan, 1.0)]


def test_decode_rows_json_fits_as_the_rows_themselves(tmp_path, load_benchmark):
    decode = load_benchmark("decode")
    path = tmp_path / "decode.json"
    decode.write_rows_json(path, _decode_rows(decode), "H100 run, benchmarks/decode.py")
    rows, source = load_decode_rows(path)
    assert rows == DECODE_H200 and source == "H100 run, benchmarks/decode.py"
    loaded = HostFits.load(path)
    direct = HostFits.fit(DECODE_H200, decode_source=source)
    assert loaded == direct
    # the same coefficients as the built-in fit; only the source differs
    for name, fit in loaded.figures().items():
        default = H200_HOST.figures()[name]
        assert {k: v for k, v in fit.items() if k != "source"} == \
            {k: v for k, v in default.items() if k != "source"}
    assert loaded.graphed[0].source == source
    assert loaded.prefill == H200_HOST.prefill  # no prefill file: the default rows


def test_decode_smoke_writes_rows_json(tmp_path, load_benchmark, capsys):
    """The flag end to end on the CPU: its rows have no kernel times, so none is kept; the
    source names the device and the command. Other layer counts than the fits' are refused."""
    decode = load_benchmark("decode")
    path = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--device", "cpu", "--rows-json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["source"].startswith("CPU run, benchmarks/decode.py")
    assert "--rows-json" in data["source"]
    assert "0 of 8 rows" in capsys.readouterr().err  # 2 batches: plain, MTP3, async (both)
    with pytest.raises(SystemExit):
        decode.main(["--layers", "4", "--rows-json", str(path)])
    assert "project from 2 layers" in capsys.readouterr().err


def test_decode_rows_missing_a_kind_is_an_error(tmp_path, load_benchmark):
    """--fastest-only or a CPU run leaves kinds out: the error names the one missing."""
    decode = load_benchmark("decode")
    path = tmp_path / "decode.json"
    decode.write_rows_json(path, [r for r in _decode_rows(decode) if r.graph],
                           "H100 run, benchmarks/decode.py")
    with pytest.raises(ConfigError, match="eager steps at 0 drafts"):
        HostFits.load(path)
    one_context = [r for r in _decode_rows(decode) if r.context == 8192]
    decode.write_rows_json(path, one_context, "H100 run")
    with pytest.raises(ConfigError, match=">= 2 contexts"):
        HostFits.load(path)


def test_decode_rows_file_errors(tmp_path):
    path = tmp_path / "decode.json"
    row = {"context": 8192, "batch": 1, "drafts": 0, "graph": True, "wall_ms": 1.0,
           "kernels_ms": 0.5}
    for bad, words in (({"rows": [row]}, "'source'"),
                       ({"source": "s", "rows": [{**row, "graph": 1}]}, "rows[0]: graph"),
                       ({"source": "s", "rows": [{**row, "wall_ms": None}]}, "rows[0]: wall_ms"),
                       ({"source": "s", "rows": [{**row, "drafts": 2}]}, "drafts 2")):
        _write(path, bad)
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_decode_rows(path)


def test_prefill_host_json_fits_as_its_rows():
    """docs/prefill_host_h200.json is the run PREFILL_HOST_H200 holds (to its two decimals)."""
    rows, source = load_prefill_rows(PREFILL_JSON)
    assert [r.layers for r in rows] == [r.layers for r in PREFILL_HOST_H200]
    for got, want in zip(rows, PREFILL_HOST_H200, strict=True):
        assert got.wall_ms == pytest.approx(want.wall_ms, abs=5e-4)
        assert got.busy_ms == pytest.approx(want.busy_ms, abs=5e-4)
    assert "prefill_host_h200.json" in source
    fits = HostFits.load(prefill_rows=PREFILL_JSON)
    assert fits.prefill.per_step == pytest.approx(H200_HOST.prefill.per_step, abs=2e-5)
    assert fits.prefill.per_layer == pytest.approx(H200_HOST.prefill.per_layer, abs=2e-6)
    assert fits.graphed == H200_HOST.graphed  # no decode file: the default rows


def test_default_decode_rows_are_the_h200_file():
    """docs/decode_rows_h200.json is the run DECODE_H200 holds (to 0.1 µs), and fits the same
    host time to within what that rounding moves."""
    rows, source = load_decode_rows(DOCS / "decode_rows_h200.json")
    assert [(r.context, r.batch, r.drafts, r.graph) for r in rows] == \
        [(r.context, r.batch, r.drafts, r.graph) for r in DECODE_H200]
    for got, want in zip(rows, DECODE_H200, strict=True):
        assert got.wall_ms == pytest.approx(want.wall_ms, abs=5e-5)
        assert got.kernels_ms == pytest.approx(want.kernels_ms, abs=5e-5)
    assert "H200" in source and "2026-12-06" in source
    fits = HostFits.load(DOCS / "decode_rows_h200.json")
    for kind in ("graphed", "eager"):
        for k, fit in getattr(fits, kind).items():
            default = getattr(H200_HOST, kind)[k]
            for b, e in ((1, 128), (8, 8 * 512), (64, 64 * 2048)):
                assert fit(b, e) == pytest.approx(default(b, e), rel=2e-3)


def test_default_parts_are_the_h200_file():
    """docs/parts_h200.json's figures are the defaults (rounded to 4-5 digits), sources and
    all; the memory is that run's H200's."""
    parts = Parts.load(DOCS / "parts_h200.json")
    assert parts.hbm_bytes == H200.hbm_bytes
    theirs = H200.figures()
    measured = set(H200.figures()) - set(parts.kept(H200))
    assert measured == {"mla_decode_us", "mla_prefill_tflops", "indexer_prefill_tflops",
                        "indexer_decode_tbps", "matmul_bf16_tflops", "matmul_fp8_tflops",
                        "hbm_tbps"}
    for name in measured:
        got, want = parts.figures()[name], theirs[name]
        assert got.source == want.source and got.unit == want.unit
        if isinstance(got, Curve):
            assert got.xs == want.xs and got.ys == pytest.approx(want.ys, rel=2e-4)
        else:
            assert got.value == pytest.approx(want.value, rel=2e-4)


def test_prefill_host_json_without_4k_rows_is_an_error(tmp_path):
    data = json.loads(PREFILL_JSON.read_text())
    for r in data["rows"]:
        r["prompt"] = 1024
    with pytest.raises(ConfigError, match="no rows of a 4096-token prompt"):
        load_prefill_rows(_write(tmp_path / "p.json", data))


# ---- the calibration and `dsaserve simulate` with them ----------------------------------------
def _three_files(tmp_path, load_benchmark) -> tuple[str, str, str]:
    kernels, decode = load_benchmark("kernels"), load_benchmark("decode")
    parts = _write(tmp_path / "parts.json",
                   kernels.parts_file(_kernel_rows(kernels), GPU, "2026-12-07", "cmd"))
    rows = tmp_path / "decode.json"
    decode.write_rows_json(rows, _decode_rows(decode), "H100 run, benchmarks/decode.py")
    return parts, str(rows), str(PREFILL_JSON)


def test_calibration_smoke_with_this_machines_files(tmp_path, load_benchmark, monkeypatch,
                                                    capsys):
    """Every Simulator of the run (warm-up, measured, modelled) prices steps with the files'
    parts and host fits, and stderr says which figures came from them."""
    parts, rows, prefill = _three_files(tmp_path, load_benchmark)
    bench = load_benchmark("simulate_calibration")
    given = []

    class Recording(bench.Simulator):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            given.append((self.parts, self.entry.times.cpu.fits))

    monkeypatch.setattr(bench, "Simulator", Recording)
    assert bench.main(["--smoke", "--no-probe", "--parts", parts, "--decode-rows", rows,
                       "--prefill-rows", prefill]) == 0
    out = capsys.readouterr()
    rows_256 = [line for line in out.out.splitlines() if line.startswith("| 256 | 2 | ")]
    assert len([line for line in rows_256 if line.startswith("| 256 | 2 | 4 |")]) == 1
    want_parts = Parts.load(parts)
    want_fits = HostFits.load(rows, prefill)
    # warm-up, measured, modelled and the files' modelled run
    assert len(given) == 4 and all(p == want_parts and f == want_fits for p, f in given)
    # With the probe (the default), its runs price with the files' fits, and the calibration's
    # with the files' fits but for the runner's own kind (eager, no drafts on the CPU), which
    # the probe refits; the last modelled run keeps the files' fits for the last two columns.
    given.clear()
    assert bench.main(["--smoke", "--parts", parts, "--decode-rows", rows,
                       "--prefill-rows", prefill]) == 0
    # 2 contexts × 2 batches × 2 passes of decode, 4 passes of two prefill shapes, then the 4
    # runs
    probe, calibration = given[:16], given[16:]
    assert len(probe) == 16 and all(f == want_fits for _, f in probe)
    assert [f == want_fits for _, f in calibration] == [False, False, False, True]
    own = calibration[0][1]
    assert own.eager[0] != want_fits.eager[0] and "probe" in own.eager[0].source
    # the prefill fit's residual measured at the probe's shapes (the 256-token context: fresh,
    # and 128 tokens over 128 cached), its per-step and per-layer parts kept
    assert (own.prefill.per_step, own.prefill.per_layer) == \
        (want_fits.prefill.per_step, want_fits.prefill.per_layer)
    assert [(d, n) for d, n, _ in own.prefill.by_shape] == [(0, 256), (128, 128)]
    assert not want_fits.prefill.by_shape
    assert "probe" in own.prefill.source
    assert own == dataclasses.replace(want_fits, eager={**want_fits.eager, 0: own.eager[0]},
                                      prefill=own.prefill)
    capsys.readouterr()
    kept = ", ".join(want_parts.kept(H200))
    assert f"parts from {parts} ({GPU}): mla_decode_us, mla_prefill_tflops, " in out.err
    assert f"hbm_tbps; the H200's: {kept}\n" in out.err and kept.startswith("nvlink_gbps")
    assert f"decode host fits: from {rows}" in out.err
    assert f"prefill host fit: from {prefill}" in out.err
    # a file it cannot take: the error, no run
    assert bench.main(["--smoke", "--decode-rows", str(tmp_path / "none.json")]) == 2
    assert "none.json: cannot read it" in capsys.readouterr().err


def test_simulate_cli_takes_a_parts_file(tmp_path, load_benchmark, weka_traces, capsys):
    from dsaserve.cli import main

    parts, _, _ = _three_files(tmp_path, load_benchmark)
    traces = weka_traces(tmp_path / "w", sessions=2, turns=2)
    args = ["simulate", "--workload", str(traces), "--model", "tiny-glm5", "--hbm-gib", "6",
            "--deployment", "tp1", "--json"]
    assert main(args + ["--parts", parts]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["parts"]["hbm_tbps"]["value"] == 3.0 and GPU in data["parts"]["hbm_tbps"]["source"]
    assert data["parts"]["nvlink_gbps"] == json.loads(json.dumps(
        H200.figures()["nvlink_gbps"].__dict__))
    assert f"parts from {parts} ({GPU}); H200's: nvlink_gbps" in out.err
    bad = _write(tmp_path / "bad.json", _with(lambda d: d["figures"]["hbm_tbps"].update(
        unit="GB/s")))
    assert main(args + ["--parts", bad]) == 2
    assert "figures.hbm_tbps: unit 'GB/s'" in capsys.readouterr().err


def test_kernels_compares_with_flashmla_per_draw_on_its_gpu_only(load_benchmark):
    """FlashMLA's figures are per index draw and from CUDA graphs, measured on an H200 beside
    these kernels: a ratio (> 1: ours faster) only on that GPU, none for a case it lacks."""
    kernels = load_benchmark("kernels")
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    uniform = kernels.FLASHMLA_PREFILL_TFLOPS[(4096, "uniform")]
    recent = kernels.FLASHMLA_PREFILL_TFLOPS[(4096, "recent")]
    assert uniform < recent  # FlashMLA's own speed depends on the draw
    assert kernels.flashmla_note(uniform / 2, uniform, True, h200).startswith("0.50x FlashMLA")
    decode = kernels.FLASHMLA_DECODE_GRAPH_US[(32, 1)]
    assert kernels.flashmla_note(decode / 2, decode, False, h200).startswith("2.00x FlashMLA")
    assert "no ratio on this GPU" in kernels.flashmla_note(500.0, recent, True, h100)
    assert kernels.flashmla_note(500.0, None, True, h200) == "no FlashMLA figure for this case"
