"""`dsaserve simulate` with P/D and HiSparse: two engines' real schedulers and connectors with
the KV read priced on the network, and HiSparse admission by host capacity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsaserve.config import ConfigError
from dsaserve.kv.hisparse.admission import hisparse_admission, mla_pages_for, write_tail_pages
from dsaserve.plan import costmodel as cm
from dsaserve.plan.cli import load_model
from dsaserve.plan.deployment import PDDeployment, parse_deployment
from dsaserve.plan.parts import H200, Measured
from dsaserve.plan.simengine import MlaSpilling, engine_capacity
from dsaserve.plan.simtrace import load_traces
from dsaserve.plan.simulate import Simulator

PD = "prefill=dp2 block-size=16; decode=dp2 block-size=16; router=prefix"


def _run(traces: Path, spec: str, concurrency: int, parts=H200, **kw):
    _, model = load_model("tiny-glm5")
    sim = Simulator(model, parse_deployment(spec), parts, load_traces(traces), concurrency,
                    **kw)
    return sim, sim.run()


def _link(latency_us: float, gbps: float = 1e9):
    return dataclasses.replace(H200, network_latency_us=Measured(latency_us, "us", "test"),
                               network_gbps=Measured(gbps, "GB/s", "test"))


def test_pd_spec_parses_both_engines():
    d = parse_deployment("prefill=pcp8xdcp8xep8 offload=512GiB; decode=dp8xep hisparse "
                         "host=48GiB mtp=3 acceptance=2.99; router=prefix")
    assert isinstance(d, PDDeployment) and d.num_gpus == 16
    # both engines picked as `dsaserve router` picks them, unless the decode section says
    assert (d.prefill.router, d.decode.router) == ("prefix", "prefix")
    own = parse_deployment("prefill=dp2; decode=dp2 router=load; router=prefix")
    assert (own.prefill.router, own.decode.router) == ("prefix", "load")
    assert d.decode.hisparse and d.decode.hisparse_host_bytes == 48 * 2**30
    assert d.decode.speculative is not None and d.prefill.offload_bytes == 512 * 2**30


@pytest.mark.parametrize("spec, words", [
    ("prefill=dp8xep", "needs decode="),
    ("prefill=dp8xep; decode=dp8xep; colour=red", "a P/D spec is"),
    ("prefill=dp8xep; decode=dp8xep; router=random", "router must be"),
    ("prefill=dp8xep; prefill=dp8xep; decode=dp8xep", "given twice"),
    ("prefill=dp8xep mtp=3 acceptance=2; decode=dp8xep", "mtp= belongs to the decode"),
    ("prefill=dp8xep hisparse host=8GiB; decode=dp8xep", "hisparse belongs to the decode"),
    ("prefill=dp8xep kv=bf16; decode=dp8xep", "kv= must be the same"),
    ("prefill=dp8xep; decode=dq8", "bad layout term"),
    ("prefill=dp8xep; decode=dp8xep host=48GiB", "host= needs hisparse"),
    ("prefill=dp8xep; decode=dp8xep hisparse host=8GiB overlap=1.5", "overlap must lie"),
])
def test_bad_pd_and_hisparse_specs_name_the_flag(spec, words):
    with pytest.raises(ConfigError, match="--deployment") as e:
        parse_deployment(spec)
    assert words in str(e.value) and spec in str(e.value)


def test_pd_serves_every_turn_and_leaks_no_block(tmp_path, weka_traces):
    """Every turn is prefilled on a prefill replica (blocks held until read), decoded on a
    decode replica after its KV landed, and finishes with its output length; afterwards neither
    engine holds a block, and the producer's connectors hold nothing."""
    traces = weka_traces(tmp_path, sessions=5, turns=3)
    sim, result = _run(traces, PD, concurrency=3, num_blocks=64)
    expected = {f"{s.id}/{k}": t for s in load_traces(traces) for k, t in enumerate(s.turns)}
    assert {r.request_id for r in result.records} == set(expected) and not result.rejected
    for r in result.records:
        assert r.output_tokens == expected[r.request_id].output_tokens
        assert r.arrival < r.prefilled <= r.kv_landed <= r.first_token <= r.finish
        assert r.decode_replica is not None
    assert {r.decode_replica for r in result.records} == {0, 1}  # the load term spreads them
    for engine in sim.engines.values():
        for replica in engine.replicas:
            replica.scheduler.check_integrity()
            assert replica.scheduler.kv.num_free_blocks == replica.scheduler.kv.num_blocks
            assert replica.connector is not None and replica.connector.num_held == 0
    assert set(result.engines) == {"prefill", "decode"}
    s = result.summary()
    assert s["requests"] == 15 and s["kv_transfer_median"] > 0
    assert s["cache_hit_rate"] > 0  # the prefix router keeps sessions on their prefill replica
    assert s["bottleneck"].startswith("P:") and " D:" in s["bottleneck"]


def test_ttft_includes_the_kv_transfer(tmp_path, weka_traces):
    """One session at a time: every turn's TTFT is the zero-latency link's plus the latency,
    and a slow link adds its bytes' time too."""
    traces = weka_traces(tmp_path, sessions=2, turns=3)
    _, fast = _run(traces, PD, concurrency=1, parts=_link(0.0), num_blocks=64)
    _, late = _run(traces, PD, concurrency=1, parts=_link(250_000.0), num_blocks=64)
    _, slow = _run(traces, PD, concurrency=1, parts=_link(0.0, gbps=1e-3), num_blocks=64)
    by_id = {r.request_id: r for r in fast.records}
    for r in late.records:
        assert r.ttft == pytest.approx(by_id[r.request_id].ttft + 0.25)
    for r in slow.records:
        assert r.kv_landed - r.prefilled > 0.1  # ≥ 96 tokens × 3,676 B at 1 MB/s
        assert r.ttft > by_id[r.request_id].ttft + 0.1


def _hbm_for(kv_room: int, weights: int = 3_022_596) -> int:
    """HBM whose KV room (× 0.9 − weights − the 4 GiB reserve) is `kv_room` bytes."""
    return int((kv_room + weights + 4 * 2**30) / 0.9) + 1


def test_hisparse_admits_more_concurrent_decodes_at_the_same_hbm(tmp_path, weka_traces):
    """At the same HBM, HBM-only KV holds about four 600-token requests (the rest wait or are
    preempted); HiSparse keeps only indexer keys and hot buffers on the GPU, so all eight
    decode together, as many as its host pool admits."""
    traces = weka_traces(tmp_path, sessions=8, turns=1, first=400, out=200)
    parts = dataclasses.replace(H200, hbm_bytes=_hbm_for(10_000_000))
    spec = "tp1 block-size=16 max-model-len=1024"
    hs_spec = spec + " hisparse host=0.1GiB max-num-seqs=8"
    running, preempted = {}, {}
    for s in (spec, hs_spec):
        sim, result = _run(traces, s, concurrency=8, parts=parts, record_steps=True)
        assert len(result.records) == 8 and all(r.finish is not None for r in result.records)
        running[s] = max(len(n) for _, n, _ in sim.step_log)
        preempted[s] = result.schedulers[0].num_preemptions
    assert running[spec] < running[hs_spec] == 8
    assert preempted[spec] > 0 and preempted[hs_spec] == 0
    # Admission is the engine's function: a smaller pool admits fewer at once.
    _, model = load_model("tiny-glm5")
    small = engine_capacity(model, parse_deployment(spec + " hisparse host=0.02GiB"), parts)
    assert small.max_num_seqs == 0.02 * 2**30 // (1024 * 3280)


def test_spilling_schedulers_hand_out_mla_pages_as_the_engine(tmp_path, weka_traces):
    """`spilling` (what a calibrated runner's MLA pages need): each replica's scheduler spills
    long decoders' older pages as the engine's does, with fewer pages than the sessions' blocks;
    every turn still ends at its output length, as without the page map, and every page,
    block and kept host block comes back."""
    traces = weka_traces(tmp_path, sessions=4, turns=3, out=20)  # prompts of 96, 144, 192
    spec = "tp1 block-size=16 hisparse host=0.1GiB hot-rows=32 max-model-len=256"
    _, model = load_model("tiny-glm5")
    host = hisparse_admission(int(0.1 * 2**30),
                              cm.kv_bytes_per_token(model, "fp8_ds_mla").mla_all_layers, 256, 16)
    pages = mla_pages_for(4, 256, 16, write_tail_pages(0, 16))  # one window and 4 tails: 20
    spilling = MlaSpilling(pages, 32, host)
    sim, spilled = _run(traces, spec, concurrency=4, num_blocks=64, spilling=spilling)
    _, plain = _run(traces, spec, concurrency=4, num_blocks=64)
    assert ({r.request_id: r.output_tokens for r in spilled.records}
            == {r.request_id: r.output_tokens for r in plain.records})
    assert len(spilled.records) == 12 and all(r.finish is not None for r in spilled.records)
    sched = sim.replicas[0].scheduler
    assert sched.mla is not None and sched.mla.num_pages == pages and sched.mla.num_spills > 0
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    with pytest.raises(ConfigError, match="only with hisparse"):
        _run(traces, "tp1 block-size=16", concurrency=1, num_blocks=64, spilling=spilling)


def test_hisparse_misses_cost_host_link_time():
    """A decode row past its hot buffer pays (1 − overlap) × top-k rows of 656 B per MLA layer
    on the host link; within the buffer, nothing."""
    _, model = load_model("glm-5.3")
    from dsaserve.plan.steptime import HiSparseReads, StepTimeModel
    par = parse_deployment("dp8xep").parallel
    plain = StepTimeModel(model, par, H200)
    hs = StepTimeModel(model, par, H200, hisparse=HiSparseReads(hot_rows=10_240, overlap=0.9))
    assert hs.step([(1, 8_000)] * 4).host == 0.0
    step = hs.step([(1, 100_000)] * 4)
    rows = 4 * 0.1 * 2048 * (model.num_hidden_layers + 1)
    assert step.host == pytest.approx(rows * 656 / 55e9)
    assert step.total == pytest.approx(plain.step([(1, 100_000)] * 4).total + step.host)


def test_seed_table_script_smoke(monkeypatch, capsys):
    """benchmarks/seed_table.py runs end to end on a few GLM-5.3 sessions (CI keeps it working;
    docs/simulate.md has the full run)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "seed_table.py"
    spec = importlib.util.spec_from_file_location("seed_table", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "seed_table", bench)
    spec.loader.exec_module(bench)
    assert bench.main(["--sessions", "2", "--turns", "2", "--concurrency", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "Interactivity at equal throughput" in out and "The 1M row" in out
    assert out.count("KV xfer med s") == 3  # one table per deployment
    # --async-scheduling: every engine with the flag, the router part without
    assert bench.with_engine_flag("prefill=dp8 offload=64GiB; decode=dp8; router=prefix",
                                  "async-scheduling") == (
        "prefill=dp8 offload=64GiB async-scheduling; decode=dp8 async-scheduling; router=prefix")
    assert bench.with_engine_flag("dp2xtp8 router=prefix", "async-scheduling") == (
        "dp2xtp8 router=prefix async-scheduling")
    assert bench.main(["--sessions", "2", "--turns", "2", "--concurrency", "1",
                       "--async-scheduling"]) == 0
    assert "async-scheduling; decode=" in capsys.readouterr().out
    # --reference-weights: the reference's engines in that mode, the baselines as they were
    assert bench.main(["--sessions", "2", "--turns", "2", "--concurrency", "1",
                       "--reference-weights", "fp8-dsaserve"]) == 0
    out = capsys.readouterr().out
    assert "offload=512GiB weights=fp8-dsaserve; decode=" in out
    assert out.count("weights=fp8-dsaserve") == 2 * out.count("pcp8xdcp8xep8")  # P and D


def test_seed_table_reads_the_baseline_at_its_best_segment(monkeypatch):
    """A baseline that collapses past its knee (c64: less throughput than c32, 9 tok/s/user)
    is read on its own segments in order of concurrency and at its points of more throughput,
    the best of them: sorting its points by throughput would join c64 to c8 and make up a
    segment that halves the baseline (docs/simulate.md's 2.49× against 2 × TP8 was read off
    one)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "seed_table.py"
    spec = importlib.util.spec_from_file_location("seed_table", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "seed_table", bench)
    spec.loader.exec_module(bench)
    # (throughput per GPU, interactivity) at c8, c16, c32, c64
    curve = [(3000.0, 40.0), (4000.0, 30.0), (5000.0, 20.0), (3500.0, 9.0)]
    assert bench._at(curve, 3200.0) == pytest.approx(38.0)  # c8-c16, not c8-c64's 27.8
    assert bench._at(curve, 4500.0) == pytest.approx(25.0)  # c16-c32, not c32-c64's 18.1
    assert bench._at(curve, 3400.0) == pytest.approx(36.0)  # not c64's collapse beside it
    # below every segment: its c8 point gives more throughput at 40 tok/s/user
    assert bench._at(curve, 2000.0) == 40.0
    assert bench._at(curve, 5500.0) is None  # more throughput than it ever gives
    # the async run's 2 × TP8 (c8 3,528 at 111.2, c64 collapsed to 3,319 at 8.8): at 3,398
    # tok/s/GPU it offers c8's 111.2, not 26.4 read off a c64-c8 segment
    tp8 = [(3528.0, 111.2), (4977.0, 60.0), (5795.0, 30.0), (3319.0, 8.8)]
    assert bench._at(tp8, 3398.0) == pytest.approx(111.2)
    assert bench._at([(3000.0, 40.0), (3000.0, 30.0)], 3000.0) == 40.0
