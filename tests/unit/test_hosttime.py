"""The simulator's host-time term (plan/hosttime.py): the fit reproduces every measured decode
row and every prefill row of the H200 runs, projects to more layers as stated,
and moves simulated latency the way the engine's host time does."""

from __future__ import annotations

import dataclasses

import pytest

from dsaserve.config import ConfigError
from dsaserve.plan.cli import load_model
from dsaserve.plan.deployment import parse_deployment
from dsaserve.plan.hosttime import (
    DECODE_H200,
    H200_HOST,
    MEASURED_LAYERS,
    PREFILL_HOST_H200,
    PREFILL_PROMPT,
    HostFits,
    HostTimeModel,
)
from dsaserve.plan.parts import H200
from dsaserve.plan.simtrace import load_traces
from dsaserve.plan.simulate import Simulator
from dsaserve.plan.steptime import StepTimeModel

LONG = 1.0  # s of kernels: a prefill chunk whose kernels hide all issue work
GAP = H200.kernel_overhead_us.value * 1e-6
# Residual bounds of the step's wall time (kernels + fitted host). Eager rows fit within 8.2 %,
# graphed rows within 2.2 % but for one pair: at batch 8 the graphed MTP3 step measured faster
# at 32,768 tokens (4.43 ms) than at 8,192 (4.97 ms) for more kernel time, which no host model
# that grows with context reproduces; the fit splits the two (7.5 % below the first, 6.7 %
# above the second), and only they get the wider bound.
GRAPHED_TOLERANCE, EAGER_TOLERANCE = 0.05, 0.10
NON_MONOTONIC_PAIR, PAIR_TOLERANCE = {(8192, 8, 3, True), (32768, 8, 3, True)}, 0.08
# The prefill rows: a line through three points whose host time is not linear in layers
# (0.95, 0.99, 1.99 ms at 2, 4, 6): each row's host within 0.5 ms of the fit (the 4-layer row is
# 0.32 ms below it), each step's wall (busy + fitted host) within 2 % (at most 1.1 % off).
PREFILL_HOST_TOLERANCE_S, PREFILL_WALL_TOLERANCE = 0.5e-3, 0.02


def _measured_model(row) -> HostTimeModel:
    return HostTimeModel(MEASURED_LAYERS, row.drafts, row.graph, 64, GAP)


@pytest.mark.parametrize("row", DECODE_H200, ids=lambda r: f"c{r.context}-b{r.batch}-k{r.drafts}"
                         f"-{'graph' if r.graph else 'eager'}")
def test_fit_reproduces_each_measured_decode_row(row):
    host = _measured_model(row).step([row.context] * row.batch, prefill=False,
                                     drafting=row.drafts > 0)
    wall = row.kernels_ms * 1e-3 + host
    tolerance = GRAPHED_TOLERANCE if row.graph else EAGER_TOLERANCE
    if (row.context, row.batch, row.drafts, row.graph) in NON_MONOTONIC_PAIR:
        tolerance = PAIR_TOLERANCE
    assert wall == pytest.approx(row.wall_ms * 1e-3, rel=tolerance)


def test_fit_residuals_summary():
    """Most rows fit far better than their bound: the median residual is small."""
    residuals = sorted(
        abs(row.kernels_ms * 1e-3 + _measured_model(row).step(
            [row.context] * row.batch, prefill=False, drafting=row.drafts > 0)
            - row.wall_ms * 1e-3) / (row.wall_ms * 1e-3) for row in DECODE_H200)
    assert residuals[len(residuals) // 2] < 0.02
    # the batch-8 rows of graphed MTP3 and of eager plain steps, and the 8K eager batch-1 row
    assert sum(r > 0.05 for r in residuals) <= 5


def test_fit_coefficients_are_non_negative_and_ordered():
    for fits in (H200_HOST.graphed, H200_HOST.eager):
        for f in fits.values():
            assert min(f.fixed, f.per_request, f.per_entry) >= 0.0
    for k in (0, 3):  # graphs save host time at every batch and context measured
        for row in DECODE_H200:
            b, e = row.batch, row.batch * -(-row.context // 64)
            assert H200_HOST.graphed[k](b, e) < H200_HOST.eager[k](b, e)
    assert H200_HOST.graphed[3](1, 128) > H200_HOST.graphed[0](1, 128)  # drafts cost host time


@pytest.mark.parametrize("row", PREFILL_HOST_H200, ids=lambda r: f"layers{r.layers}")
def test_prefill_fit_reproduces_each_measured_prefill_row(row):
    """The measured step (one 4K prompt, alone, no drafts) at the measured layer count."""
    host = HostTimeModel(row.layers, 0, True, 64, GAP).step(
        [PREFILL_PROMPT], prefill=True, drafting=False, long_kernels=row.busy_ms * 1e-3)
    assert host == pytest.approx(H200_HOST.prefill(row.layers))  # nothing added for one 4K request
    assert host == pytest.approx(row.host_ms * 1e-3, abs=PREFILL_HOST_TOLERANCE_S)
    assert row.busy_ms * 1e-3 + host == pytest.approx(row.wall_ms * 1e-3,
                                                      rel=PREFILL_WALL_TOLERANCE)


def test_prefill_fit_coefficients_and_projection_to_78_layers():
    """host = 0.269 ms + 0.260 ms per layer (docs/prefill_host_h200.json): 20.6 ms at GLM-5.3's
    78 layers, per layer a small part, not the ~0.46 s the 2-layer extrapolation gave."""
    fit = H200_HOST.prefill
    assert fit.per_step == pytest.approx(0.269e-3, abs=0.001e-3)
    assert fit.per_layer == pytest.approx(0.2603e-3, abs=0.0001e-3)
    assert fit(78) == pytest.approx(20.57e-3, abs=0.01e-3)
    assert HostTimeModel(78, 0, True, 64, GAP).step([PREFILL_PROMPT], True, False, LONG) == \
        pytest.approx(fit(78))
    # residuals of a least-squares line sum to zero over its rows
    assert sum(fit(r.layers) - r.host_ms * 1e-3 for r in PREFILL_HOST_H200) == \
        pytest.approx(0.0, abs=1e-9)


def test_mixed_step_adds_the_eager_decode_parts_of_its_other_requests():
    """A prefill or mixed step with long kernels: the prefill fit at L layers, plus the eager
    decode fit (at the measured layers, unscaled) beyond the measured step's one 4K request;
    its drafts' host work hides under the kernels."""
    eager = H200_HOST.eager
    ctx = [65536] * 32
    entries = 32 * 1024
    for layers in (2, 78):
        plain = HostTimeModel(layers, 0, True, 64, GAP).step(ctx, True, False, LONG)
        more = eager[0](32, entries) - eager[0](1, PREFILL_PROMPT // 64)
        assert plain == pytest.approx(H200_HOST.prefill(layers) + more)
        assert HostTimeModel(layers, 3, True, 64, GAP).step(ctx, True, True, LONG) == \
            pytest.approx(plain)
        assert HostTimeModel(layers, 3, False, 64, GAP).step(ctx, True, False, LONG) == \
            pytest.approx(plain)
    # what grows with layers is the prefill fit's per-layer part alone
    many, two = (HostTimeModel(n, 0, True, 64, GAP).step(ctx, True, False, LONG) for n in (78, 2))
    assert many - two == pytest.approx(76 * H200_HOST.prefill.per_layer)
    # a shorter request than the measured one costs no less than the measured step
    assert HostTimeModel(78, 0, True, 64, GAP).step([512], True, False, LONG) == \
        pytest.approx(H200_HOST.prefill(78))


@pytest.mark.parametrize("layers", [2, 78])
@pytest.mark.parametrize("drafts", [0, 3])
def test_short_prefill_step_pays_the_eager_decode_host_of_its_requests(layers, drafts):
    """A step of a few new tokens has no long kernels to hide its issue work under: its host
    time is the eager decode step's of the same requests (drafts included), at least the
    exposed part; the longer the kernels, the more of the issue work hides, down to the
    exposed part."""
    ctx = [16384, 8192]
    eager = HostTimeModel(layers, drafts, False, 64, GAP).step(ctx, False, drafts > 0)
    model = HostTimeModel(layers, drafts, True, 64, GAP)
    exposed = model.step(ctx, True, drafts > 0, LONG)
    assert eager > exposed
    assert model.step(ctx, True, drafts > 0, 0.0) == pytest.approx(eager)
    half = (eager - exposed) / 2
    assert model.step(ctx, True, drafts > 0, half) == pytest.approx(eager - half)
    assert model.step(ctx, True, drafts > 0, 2 * (eager - exposed)) == pytest.approx(exposed)


def test_probe_residual_is_interpolated_over_prefill_shapes():
    """A probe's residuals (PrefillFit.by_shape): linear over tokens at each probed depth, then
    over depth, the nearest end's value beyond them; added to the exposed part of a prefill
    step of that shape."""
    fit = dataclasses.replace(H200_HOST.prefill, by_shape=(
        (0, 1024, 1e-3), (0, 4096, -2e-3), (8192, 1024, 3e-3), (8192, 4096, 4e-3)))
    assert H200_HOST.prefill.residual(5000, 100) == 0.0
    assert [fit.residual(n) for n in (1, 1024, 2048, 4096, 10**6)] == \
        pytest.approx([1e-3, 1e-3, 0.0, -2e-3, -2e-3])
    assert [fit.residual(n, 8192) for n in (512, 2048, 10**6)] == \
        pytest.approx([3e-3, 3e-3 + 1e-3 / 3, 4e-3])
    assert fit.residual(2048, 4096) == pytest.approx((0.0 + 3e-3 + 1e-3 / 3) / 2)
    assert fit.residual(2048, 10**6) == fit.residual(2048, 8192)
    probed = HostTimeModel(2, 0, True, 64, GAP, dataclasses.replace(H200_HOST, prefill=fit))
    plain = HostTimeModel(2, 0, True, 64, GAP)
    for tokens, cached in ((512, 0), (2048, 4096), (8192, 16384)):
        assert probed.step([cached + tokens], True, False, LONG, tokens, cached) - \
            plain.step([cached + tokens], True, False, LONG, tokens, cached) == \
            pytest.approx(fit.residual(tokens, cached))


def test_projection_to_more_layers():
    """Graphed decode host time barely grows with layers (a launch gap each), eager decode host
    time grows with the forwards it runs."""
    ctx = [8192] * 16
    two = HostTimeModel(2, 0, True, 64, GAP)
    many = HostTimeModel(78, 0, True, 64, GAP)
    assert many.step(ctx, False, False) == pytest.approx(two.step(ctx, False, False) + 76 * GAP)
    g = H200_HOST.graphed[0](16, 16 * 128)
    e2 = HostTimeModel(2, 0, False, 64, GAP).step(ctx, False, False)
    e78 = HostTimeModel(78, 0, False, 64, GAP).step(ctx, False, False)
    assert e78 - g == pytest.approx((e2 - g) * 78 / 2)
    # MTP3 eager: 2 + 3 forwards measured → 78 + 3 projected
    e3 = HostTimeModel(2, 3, False, 64, GAP).step(ctx, False, True)
    e3_78 = HostTimeModel(78, 3, False, 64, GAP).step(ctx, False, True)
    g3 = H200_HOST.graphed[3](16, 16 * 128)
    assert e3_78 - g3 == pytest.approx((e3 - g3) * 81 / 5)


def test_drafts_between_measured_counts_interpolate():
    ctx = [8192] * 4
    h = [HostTimeModel(2, k, True, 64, GAP).step(ctx, False, k > 0) for k in (0, 1, 3)]
    assert h[1] == pytest.approx(h[0] + (h[2] - h[0]) / 3)


def test_step_is_kernels_plus_host_unless_async():
    """The engine is synchronous per step: the step is the kernels + host. With async
    scheduling the host work hides under the kernels: max of the two."""
    _, model = load_model("glm-5.3")
    par = parse_deployment("dp8xep").parallel
    sync = StepTimeModel(model, par, H200).step([(1, 65536)] * 32)
    assert sync.cpu > 0 and sync.total == pytest.approx(sync.gpu + sync.cpu)
    over = StepTimeModel(model, par, H200, async_scheduling=True).step([(1, 65536)] * 32)
    assert over.total == pytest.approx(max(over.gpu, over.cpu)) and over.total < sync.total
    eager = StepTimeModel(model, par, H200, graphs=False).step([(1, 65536)] * 32)
    assert eager.gpu == pytest.approx(sync.gpu) and eager.cpu > 10 * sync.cpu
    assert eager.bound == "cpu"  # 78 eager layers: the host bounds the step


def test_host_term_raises_simulated_itl(tmp_path, weka_traces):
    """Simulated inter-token latency moves as the engine's host time does: eager decode is
    slower than graphed, graphed slower than with the host hidden under the kernels."""
    traces = weka_traces(tmp_path, sessions=2, turns=2, out=64)
    itl = {}
    for opts in ("", " enforce-eager", " async-scheduling"):
        model_dir, model = load_model("tiny-glm5")
        sim = Simulator(model, parse_deployment("tp1 block-size=16" + opts), H200,
                        load_traces(traces), 2)
        result = sim.run()
        itl[opts.strip()] = 1 / result.summary()["p90_interactivity"]
    assert itl["enforce-eager"] > itl[""] > itl["async-scheduling"]


def test_step_flags_parse():
    d = parse_deployment("tp1 enforce-eager async-scheduling")
    assert d.enforce_eager and d.async_scheduling
    plain = parse_deployment("tp1")
    assert not plain.enforce_eager and not plain.async_scheduling
    pd = parse_deployment("prefill=tp1; decode=tp1 enforce-eager")
    assert pd.decode.enforce_eager and not pd.prefill.enforce_eager
    with pytest.raises(ConfigError, match="enforce-eager"):
        parse_deployment("tp1 eager=1")


def test_refit_from_other_rows_changes_the_model():
    """The fit is a function of the table: a run twice as host-heavy fits twice the host."""
    import dataclasses

    doubled = tuple(dataclasses.replace(r, wall_ms=r.kernels_ms + 2 * (r.wall_ms - r.kernels_ms))
                    for r in DECODE_H200)
    fits = HostFits.fit(doubled)
    assert fits.graphed[0](1, 128) == pytest.approx(2 * H200_HOST.graphed[0](1, 128), rel=0.05)
    prefill = tuple(dataclasses.replace(r, wall_ms=r.busy_ms + 2 * r.host_ms)
                    for r in PREFILL_HOST_H200)
    assert HostFits.fit(prefill=prefill).prefill(78) == pytest.approx(2 * H200_HOST.prefill(78))


def test_the_fits_are_the_same_in_every_process():
    """The fits come out bit for bit the same in fresh processes (LAPACK's lstsq did not: its
    last bits moved from run to run, and so did the simulator's step times)."""
    import subprocess
    import sys

    code = "from dsaserve.plan import hosttime as h; print(repr(h.H200_HOST))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(3)}
    assert len(runs) == 1
