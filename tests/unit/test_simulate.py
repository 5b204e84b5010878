"""`dsaserve simulate`: the step-time model reproduces its measured parts, the simulation is
deterministic and conserves requests and tokens, and its scheduler is the engine's own: the
same requests give the same schedule and the same KV block usage as a real LLMEngine."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dsaserve.cli import main
from dsaserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.args import resolve_model
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import ModelRunner
from dsaserve.model.make_model import make_model
from dsaserve.plan import costmodel as cm
from dsaserve.plan.cli import load_model
from dsaserve.plan.deployment import parse_deployment
from dsaserve.plan.parts import H200, Curve, Measured
from dsaserve.plan.simtrace import load_traces
from dsaserve.plan.simulate import Simulator, replica_kv_capacity
from dsaserve.plan.steptime import StepTimeModel


# ---- the step-time model -------------------------------------------------------------------------
def test_decode_mla_reproduces_the_measured_curve():
    """At 64 heads over top-2048 keys (a GLM-5.3 DP rank), the sparse MLA part of a decode step
    is the measured kernel time per layer at each measured point."""
    _, model = load_model("glm-5.3")
    times = StepTimeModel(model, parse_deployment("dp8xep").parallel, H200)
    for rows, us in zip(H200.mla_decode_us.xs, H200.mla_decode_us.ys, strict=True):
        step = times.step([(1, 100_000)] * int(rows))
        assert step.mla == pytest.approx(model.num_hidden_layers * us * 1e-6)


def test_step_time_grows_with_work_and_shrinks_with_parallelism():
    _, model = load_model("glm-5.3")
    dp = StepTimeModel(model, parse_deployment("dp8xep").parallel, H200)
    pcp = StepTimeModel(model, parse_deployment("pcp8xdcp8xep8").parallel, H200)
    assert dp.step([(1, 8192)] * 16).total < dp.step([(1, 8192)] * 64).total
    assert dp.step([(1, 8192)] * 16).total < dp.step([(1, 131072)] * 16).total
    prefill = [(8192, 65536)]
    assert pcp.step(prefill).indexer == pytest.approx(dp.step(prefill).indexer / 8)
    assert pcp.step(prefill).total < dp.step(prefill).total
    assert dp.step([]).total == 0.0


def test_weights_in_bf16_price_the_matrices_at_the_bf16_rate():
    """weights=bf16 (the engine as it runs today): a prefill chunk's matrices at the bf16
    matmul rate, a decode step's weight reads at two bytes a parameter except the four of the
    fp32 router and indexer weights_proj (fp8's at the bytes its matrices are held in); and
    the weights twice the HBM: GLM-5.3 in bf16 does not fit eight H200s."""
    _, model = load_model("glm-5.3")
    fp8, bf16 = (parse_deployment(f"tp8 weights={w}") for w in ("fp8", "bf16"))
    assert (fp8.weight_dtype, bf16.weight_dtype) == ("fp8", "bf16")
    f8, b16 = (StepTimeModel(model, d.parallel, H200, weight_dtype=d.weight_dtype)
               for d in (fp8, bf16))
    prefill = [(16384, 16384)]
    ratio = H200.matmul_fp8_tflops.value / H200.matmul_bf16_tflops.value
    # (the lm_head of the one sampled row is a weight read, of bf16 values in both modes)
    fp8_bytes, bf16_bytes = (cm.matrix_bytes(model, fp8.parallel, w) for w in ("fp8", "bf16"))
    assert fp8_bytes.lm_head == bf16_bytes.lm_head
    lm_head = bf16_bytes.lm_head / (H200.hbm_tbps.value * 1e12)
    assert b16.step(prefill).gemm - lm_head == pytest.approx(
        (f8.step(prefill).gemm - lm_head) * ratio, rel=1e-9)
    assert b16.step(prefill).moe == pytest.approx(f8.step(prefill).moe * ratio)
    decode = [(1, 8192)]  # weight reads bound a one-row step
    params = cm.matrix_params(model, fp8.parallel)
    fp32 = {"indexer": model.index_n_heads * model.hidden_size,  # weights_proj
            "moe_shared": model.n_routed_experts * model.hidden_size}  # the router
    for part in ("attn", "indexer", "dense_mlp", "moe_shared", "expert", "lm_head"):
        assert getattr(bf16_bytes, part) == 2 * getattr(params, part) + 2 * fp32.get(part, 0)
    hbm = H200.hbm_tbps.value * 1e12
    for times, held in ((b16, bf16_bytes), (f8, fp8_bytes)):
        assert times.step(decode).gemm == pytest.approx(sum(
            n * getattr(held, part) for n, part in ((78, "attn"), (21, "indexer"),
                                                   (3, "dense_mlp"), (75, "moe_shared"),
                                                   (1, "lm_head"))) / hbm)
    assert b16.step(prefill).indexer == f8.step(prefill).indexer
    assert replica_kv_capacity(model, fp8, H200)[0] > 0
    with pytest.raises(ConfigError, match="weights=bf16.*leave no room for KV"):
        replica_kv_capacity(model, bf16, H200)


def test_weight_only_fp8_reads_like_fp8_and_multiplies_like_bf16():
    """weights=fp8-weight-only (FP8 matrices, bf16 activations, weight-only kernels): the memory
    of fp8; a decode step, bound by weight reads, priced as fp8's plus at most its FLOPs at the
    bf16 rate (exactly fp8's for one row); a prefill chunk, bound by FLOPs, as bf16's."""
    _, model = load_model("glm-5.3")
    specs = {w: parse_deployment(f"tp8 weights={w}") for w in ("fp8", "fp8-weight-only", "bf16")}
    assert specs["fp8-weight-only"].weight_dtype == "fp8-weight-only"
    f8, w8, b16 = (StepTimeModel(model, d.parallel, H200, weight_dtype=d.weight_dtype)
                   for d in specs.values())
    assert (replica_kv_capacity(model, specs["fp8-weight-only"], H200)
            == replica_kv_capacity(model, specs["fp8"], H200))
    par = specs["fp8"].parallel
    flops_per_row = cm.matrix_flops_per_token(model, par) + 2 * cm.matrix_params(model, par).lm_head
    for rows in (1, 16, 64):
        decode = [(1, 8192)] * rows
        fp8_step, w8_step = f8.step(decode), w8.step(decode)
        flop_term = rows * flops_per_row / (H200.matmul_bf16_tflops.value * 1e12)
        assert fp8_step.total <= w8_step.total <= fp8_step.total + flop_term
        assert w8_step.gemm + w8_step.moe < b16.step(decode).gemm + b16.step(decode).moe
        if rows == 1:
            assert (w8_step.gemm, w8_step.moe) == (fp8_step.gemm, fp8_step.moe)
    prefill = [(16384, 16384)]
    assert w8.step(prefill).moe == pytest.approx(b16.step(prefill).moe)
    # (the lm_head of the one sampled row is a weight read: one byte a value, not bf16's two)
    assert w8.step(prefill).gemm == pytest.approx(b16.step(prefill).gemm, rel=1e-3)
    assert w8.step(prefill).gemm > 1.5 * f8.step(prefill).gemm



def test_dsaserve_fp8_prices_each_product_at_its_kernels_rate():
    """weights=fp8-dsaserve (the engine on CUDA): fp8's memory and weight reads; a decode step
    of up to 64 rows as weight-only FP8; MTP3 verification of b = 64 (256 rows) between fp8 and
    weight-only; a 4K prefill's projections each at its kernel's rate (GLM-5.3 at TP8: the
    shared experts' down is 256 wide, so it is dequantized and runs at bf16; x_proj, padded to
    whole blocks, and the rest cuBLAS W8A8) and its experts (128 rows each) at bf16, where a 1K
    prefill's (32 rows each) are W8A8."""
    _, m = load_model("glm-5.3")
    par = parse_deployment("tp8 weights=fp8-dsaserve").parallel
    assert parse_deployment("tp8 weights=fp8-dsaserve").weight_dtype == "fp8-dsaserve"
    f8, ds, w8 = (StepTimeModel(m, par, H200, weight_dtype=w)
                  for w in ("fp8", "fp8-dsaserve", "fp8-weight-only"))
    for rows in (1, 16, 64):
        decode = [(1, 8192)] * rows
        assert ds.step(decode) == w8.step(decode)
    verify = StepTimeModel(m, par, H200, num_drafts=3, weight_dtype="fp8-dsaserve")
    f8_verify, w8_verify = (StepTimeModel(m, par, H200, num_drafts=3, weight_dtype=w)
                            for w in ("fp8", "fp8-weight-only"))
    batch, drafting = [(4, 8192)] * 64, [8192] * 64
    times = [t.step(batch, drafting=drafting).gemm for t in (f8_verify, verify, w8_verify)]
    assert times[0] < times[1] < times[2]

    bf16, fp8 = H200.matmul_bf16_tflops.value * 1e12, H200.matmul_fp8_tflops.value * 1e12
    h, tp, heads, rows = m.hidden_size, 8, m.num_attention_heads, 4096
    q_a, kv_a, wk = m.q_lora_rank * h, m.kv_cache_width * h, m.index_head_dim * h
    q_b = heads * m.qk_head_dim * m.q_lora_rank // tp
    kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank // tp
    o = h * heads * m.v_head_dim // tp
    wq_b, weights_proj = m.index_n_heads * m.index_head_dim * m.q_lora_rank, m.index_n_heads * h
    dense, shared = m.intermediate_size * h // tp, m.moe_intermediate_size * h // tp
    router = m.n_routed_experts * h
    per_row = (78 * (kv_b / bf16 + (q_a + kv_a + q_b + o) / fp8)
               + 21 * (wk / fp8 + wq_b / fp8 + weights_proj / bf16)
               + 3 * 3 * dense / fp8 + 75 * (2 * shared / fp8 + (shared + router) / bf16))
    lm_head = cm.matrix_bytes(m, par, "fp8-dsaserve").lm_head / (H200.hbm_tbps.value * 1e12)
    prefill = [(rows, rows)]
    assert ds.step(prefill).gemm == pytest.approx(2 * rows * per_row + lm_head, rel=1e-9)
    assert f8.step(prefill).gemm < ds.step(prefill).gemm < w8.step(prefill).gemm
    assert ds.step(prefill).moe == w8.step(prefill).moe
    # experts of up to 64 rows are bound by their weight reads on an H200: with HBM 100× as
    # fast, the FLOPs show the kernel (1K prompt: 32 rows per expert, W8A8; 4K: 128, bf16)
    fast = dataclasses.replace(H200, hbm_tbps=Measured(480.0, "TB/s", "test"))
    f8, ds, w8 = (StepTimeModel(m, par, fast, weight_dtype=w)
                  for w in ("fp8", "fp8-dsaserve", "fp8-weight-only"))
    short = [(1024, 1024)]
    assert ds.step(short).moe == f8.step(short).moe < w8.step(short).moe
    assert f8.step(prefill).moe < ds.step(prefill).moe == w8.step(prefill).moe


def test_a_decode_row_reads_each_matrix_at_the_bytes_the_engine_holds():
    """One decode row of GLM-5.3 at TP8 reads each matrix it passes through once, as the engine
    holds it (docs/fp8_weights.md), counted here from the config alone: under fp8 a quantized
    matrix is 1 B a value plus an fp32 scale per 128×128 block, while kv_b_proj (dequantized)
    and lm_head are bf16 and the router and indexer weights_proj fp32; under bf16 every value
    is 2 B but those fp32 ones; so fp8's step rises over 1 B a value by the second byte of the
    bf16 matrices, the three more of the fp32 ones and the scales."""
    _, m = load_model("glm-5.3")
    par = parse_deployment("tp8").parallel
    tp, h, heads, hbm = 8, m.hidden_size, m.num_attention_heads, H200.hbm_tbps.value * 1e12

    def scales(rows: int, cols: int) -> int:
        return 4 * -(-rows // 128) * -(-cols // 128)

    # [rows, cols] per matrix, how the engine holds it (FP8 when the mode does, else bf16;
    # bf16; fp32), whether TP splits it
    attn = [(m.q_lora_rank, h, "fp8", False),
            (m.kv_lora_rank + m.qk_rope_head_dim, h, "fp8", False),
            (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank, "fp8", True),
            (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "bf16", True),  # kv_b
            (h, heads * m.v_head_dim, "fp8", True)]
    indexer = [(m.index_n_heads * m.index_head_dim, m.q_lora_rank, "fp8", False),
               (m.index_head_dim, h, "fp8", False), (m.index_n_heads, h, "fp32", False)]
    dense = [(m.intermediate_size, h, "fp8", True)] * 3
    shared = [(m.n_routed_experts, h, "fp32", False)] + [
        (m.moe_intermediate_size, h, "fp8", True)] * (3 * m.n_shared_experts)
    expert = [(m.moe_intermediate_size, h, "fp8", True)] * 3
    lm_head = [(m.vocab_size, h, "bf16", True)]

    def reads(matrices: list[tuple[int, int, str, bool]], weights: str) -> tuple[int, int]:
        """(values, bytes) one GPU reads of `matrices` under `weights`."""
        values = nbytes = 0
        for rows, cols, held, split in matrices:
            v = rows * cols
            b = (4 * v if held == "fp32" else v + scales(rows, cols)
                 if held == "fp8" and weights == "fp8" else 2 * v)
            values, nbytes = values + v // (tp if split else 1), nbytes + b // (tp if split else 1)
        return values, nbytes

    num_moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    per_step = [(m.num_hidden_layers, attn), (len(m.full_indexer_layers), indexer),
                (m.num_hidden_layers - num_moe, dense), (num_moe, shared), (1, lm_head)]
    k, e = m.num_experts_per_tok, m.n_routed_experts
    touched = e * (1 - (1 - 1 / e) ** k)  # distinct experts one row's k choices reach
    decode = [(1, 8192)]
    steps = {}
    for weights in ("fp8", "bf16"):
        step = StepTimeModel(model=m, par=par, parts=H200, weight_dtype=weights).step(decode)
        gemm = sum(n * reads(mats, weights)[1] for n, mats in per_step)
        moe = num_moe * touched * reads(expert, weights)[1]
        assert step.gemm == pytest.approx(gemm / hbm, rel=1e-12)
        assert step.moe == pytest.approx(moe / hbm, rel=1e-12)
        steps[weights] = step
    # bf16: every value at 2 B, but the fp32 router and weights_proj at 4 B
    w = cm.matrix_params(m, par)
    assert w.attn == reads(attn, "bf16")[0] and w.expert == reads(expert, "bf16")[0]
    router, weights_proj = e * h, m.index_n_heads * h
    old_gemm = ((78 * (w.attn * 2 / hbm) + 21 * ((w.indexer + weights_proj) * 2 / hbm))
                + (3 * (w.dense_mlp * 2 / hbm) + 75 * ((w.moe_shared + router) * 2 / hbm))
                + w.lm_head * 2 / hbm)
    assert steps["bf16"].gemm == pytest.approx(old_gemm, rel=1e-12)
    assert steps["bf16"].moe == num_moe * max(
        2 * k * w.expert / (H200.matmul_bf16_tflops.value * 1e12), touched * w.expert * 2 / hbm)
    # fp8 rises over 1 B a value by the second byte of the bf16-held matrices, the three more
    # bytes of the fp32-held ones, and the FP8 scales
    old = (sum(n * reads(mats, "fp8")[0] for n, mats in per_step)
           + num_moe * touched * reads(expert, "fp8")[0])
    bf16_held = (78 * (heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank // tp)
                 + m.vocab_size * h // tp)
    fp32_held = 21 * weights_proj + 75 * router
    fp8_scales = sum(n * sum(scales(r, c) // (tp if split else 1)
                             for r, c, held, split in mats if held == "fp8")
                     for n, mats in [*per_step, (num_moe * touched, expert)])
    rise = (steps["fp8"].gemm + steps["fp8"].moe) * hbm / old - 1
    assert rise == pytest.approx((bf16_held + 3 * fp32_held + fp8_scales) / old, rel=1e-9)
    assert 0.09 < rise < 0.10  # GLM-5.3 at TP8: mostly the router, lm_head and kv_b_proj


def test_an_mtp_draft_reads_its_eh_proj_as_stored():
    """The MTP layer runs over every row of a step (its step 0, eh_proj held unquantized:
    [hidden, 2·hidden] bf16, replicated, then the layer); a drafting request adds k − 1
    one-row forwards and k reads of the shared lm_head, in every weight mode but fp8-dsaserve,
    whose drafts read the FP8 copy (SpecConfig.draft_lm_head): half the bytes, and its scales."""
    _, m = load_model("glm-5.3")
    par = parse_deployment("tp8").parallel
    hbm = H200.hbm_tbps.value * 1e12
    for weights in cm.WEIGHT_DTYPES:
        held = cm.matrix_bytes(m, par, weights)
        assert held.mtp_proj == 2 * m.hidden_size * 2 * m.hidden_size
        times = StepTimeModel(m, par, H200, num_drafts=3, weight_dtype=weights)
        plain = StepTimeModel(m, par, H200, weight_dtype=weights)
        batch = [(4, 8192)]
        forward = held.attn + held.indexer + held.moe_shared + held.mtp_proj
        step0 = times.step(batch).gemm - plain.step(batch).gemm
        assert step0 == pytest.approx(forward / hbm, rel=1e-9)
        drafted = times.step(batch, drafting=[8192]).gemm - times.step(batch).gemm
        head = held.lm_head
        if weights == "fp8-dsaserve":  # 1 B a value and an fp32 scale per 128 × 128 block
            values, h = head // 2, m.hidden_size
            head = values + 4 * -(-values // h // 128) * -(-h // 128)
        assert drafted == pytest.approx((2 * forward + 3 * head) / hbm, rel=1e-9)


def test_a_draft_vocabulary_prices_its_rows_only():
    """draft-vocab=N (SpecConfig's draft_vocab): each draft reads N rows of the head, under TP
    an equal part of them per rank; the target's lm_head is unchanged."""
    _, m = load_model("glm-5.3")
    for layout in ("dp8xep", "tp8"):
        d = parse_deployment(f"{layout} mtp=3 acceptance=2.9 draft-vocab=32768 "
                             "weights=fp8-dsaserve")
        assert d.draft_vocab == 32768
        sub = StepTimeModel(m, d.parallel, H200, num_drafts=3, weight_dtype=d.weight_dtype,
                            draft_vocab=d.draft_vocab)
        full = StepTimeModel(m, d.parallel, H200, num_drafts=3, weight_dtype=d.weight_dtype)
        batch = [(4, 8192)]
        assert sub.step(batch).gemm == full.step(batch).gemm  # no drafting: the target's head
        held = m.vocab_size // d.parallel.tensor_parallel_size
        keep = 32768 // d.parallel.tensor_parallel_size
        saved = full.step(batch, drafting=[8192]).gemm - sub.step(batch, drafting=[8192]).gemm
        hbm = H200.hbm_tbps.value * 1e12
        assert saved == pytest.approx(3 * (held - keep) * m.hidden_size / hbm, rel=0.01)
    with pytest.raises(ConfigError, match="draft-vocab=N needs mtp=K"):
        parse_deployment("dp8xep draft-vocab=1000")


def test_curve_interpolates_and_extrapolates():
    c = Curve((32, 128), (40.0, 120.0), "us", "test")
    assert c(32) == 40.0 and c(80) == pytest.approx(80.0)
    assert c(256) == pytest.approx(120 + 128 * 80 / 96)
    assert c(16) == pytest.approx(20.0) and c(0) == 0.0


# ---- deployments ---------------------------------------------------------------------------------
def test_deployment_specs():
    d = parse_deployment("pcp8xdcp8xep8 router=load kv=bf16 max-num-seqs=32")
    assert (d.parallel.prefill_context_parallel_size, d.parallel.decode_context_parallel_size,
            d.num_gpus, d.replicas, d.lockstep) == (8, 8, 8, 1, False)
    assert (d.router, d.kv_dtype, d.max_num_seqs) == ("load", "bf16", 32)
    assert parse_deployment("dp8xep").lockstep and not parse_deployment("dp8").lockstep


@pytest.mark.parametrize("spec, words", [
    ("", "empty"), ("dq8", "bad layout term"), ("dp8xep4", "ep4 must span all 8"),
    ("pcp8xdcp4", "dcp must equal"), ("tp8 router=random", "router must be"),
    ("tp8 kv", "key=value"), ("tp8 max-num-seqs=0", "positive"), ("tp8 colour=red", "unknown"),
    ("tp8 weights=int4", "weights must be one of"),
    ("tp8 weights=w8a16", "'fp8-weight-only'"),
    ("dp8xep hisparse", "needs host="),
    ("pcp8xdcp8xep8 hisparse host=48GiB", "without PCP or DCP"), ("tp8 offload=-1", "positive"),
])
def test_bad_deployment_specs_name_the_flag(spec, words):
    with pytest.raises(ConfigError, match="--deployment") as e:
        parse_deployment(spec)
    assert words in str(e.value)


def test_capacity_matches_the_cost_model():
    """KV room per GPU in pages of the whole per-token record (DESIGN §2's 54,728 B)."""
    _, model = load_model("glm-5.3")
    blocks, max_ctx = replica_kv_capacity(model, parse_deployment("pcp8xdcp8xep8"), H200)
    assert blocks * 64 <= max_ctx // 8 < (blocks + 1) * 64  # tokens per rank: whole pages
    assert 54_728 * max_ctx // 8 < 141 * 2**30
    _, dp_ctx = replica_kv_capacity(model, parse_deployment("dp8xep"), H200)
    assert max_ctx == pytest.approx(8 * dp_ctx, rel=1e-6)  # DCP 8 holds 8x the context


# ---- the simulation ------------------------------------------------------------------------------
def _simulate(traces: Path, spec: str, concurrency: int, num_blocks: int = 64, **kw):
    _, model = load_model("tiny-glm5")
    sim = Simulator(model, parse_deployment(spec), H200, load_traces(traces), concurrency,
                    num_blocks=num_blocks, **kw)
    return sim, sim.run()


def test_simulation_is_deterministic_and_conserves_requests_and_tokens(tmp_path, weka_traces):
    traces = weka_traces(tmp_path, sessions=5, turns=4)
    sim, a = _simulate(traces, "dp2xep block-size=16 router=prefix", concurrency=3)
    _, b = _simulate(traces, "dp2xep block-size=16 router=prefix", concurrency=3)
    assert [vars(r) for r in a.records] == [vars(r) for r in b.records]
    assert a.summary() == b.summary()
    sessions = load_traces(traces)
    expected = {f"{s.id}/{k}": t for s in sessions for k, t in enumerate(s.turns)}
    assert {r.request_id for r in a.records} == set(expected) and not a.rejected
    for r in a.records:  # every turn ran to its output length, after its arrival
        t = expected[r.request_id]
        assert (r.prompt_tokens, r.output_tokens) == (t.input_tokens, t.output_tokens)
        assert r.arrival <= r.first_token <= r.finish
    for sched in a.schedulers:  # nothing leaked on either replica
        sched.check_integrity()
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # Turns of a session run in order, each after the previous one ends plus its think time.
    by_id = {r.request_id: r for r in a.records}
    for s in sessions:
        for k in range(1, len(s.turns)):
            prev, cur = by_id[f"{s.id}/{k - 1}"], by_id[f"{s.id}/{k}"]
            assert cur.arrival == pytest.approx(prev.finish + s.turns[k].think_time_s)


def test_prefix_router_keeps_sessions_on_their_replica(tmp_path, weka_traces):
    traces = weka_traces(tmp_path, sessions=3, turns=4)
    _, prefix = _simulate(traces, "dp2 block-size=16 router=prefix", concurrency=3)
    _, rr = _simulate(traces, "dp2 block-size=16 router=round-robin", concurrency=3)
    for result in (prefix, rr):
        assert len(result.records) == 12
    sticky = {r.session: set() for r in prefix.records}
    for r in prefix.records:
        sticky[r.session].add(r.replica)
    assert all(len(replicas) == 1 for replicas in sticky.values())
    assert prefix.summary()["cache_hit_rate"] > rr.summary()["cache_hit_rate"]


def test_too_long_requests_are_rejected_not_run(tmp_path, weka_traces):
    traces = weka_traces(tmp_path, sessions=2, turns=3, first=96, grow=64)
    _, result = _simulate(traces, "tp1 block-size=16", concurrency=2, num_blocks=12)
    assert result.rejected  # 12 blocks × 16 tokens: the third turns (224 tokens) cannot fit
    assert all("max_model_len" in why for _, _, why in result.rejected)
    assert all(r.finish is not None for r in result.records)


def test_schedule_and_kv_usage_equal_the_real_engine(tmp_path, weka_traces):
    """No re-implementation: the simulated replica schedules exactly as an LLMEngine with the
    same configuration does, step by step, with the same free-block counts."""
    traces = weka_traces(tmp_path, sessions=3, turns=1, first=160, out=5)
    sim, _ = _simulate(traces, "tp1 block-size=16 max-num-batched-tokens=128", concurrency=3,
                       num_blocks=24, record_steps=True)
    path = resolve_model("tiny-glm5")
    _, model = load_model("tiny-glm5")
    sched = sim.replicas[0].scheduler.config
    config = EngineConfig(
        model_path=str(path), model=model,
        cache=CacheConfig(block_size=16, num_gpu_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=sched.max_num_seqs,
                                  max_num_batched_tokens=128,
                                  max_model_len=sched.max_model_len))
    engine = LLMEngine(config, ModelRunner(config), tokenizer=None)
    for session in load_traces(traces):
        engine.add_request(f"{session.id}/0", session.prompt(0, model.vocab_size),
                           SamplingParams(max_tokens=session.turns[0].output_tokens,
                                          temperature=0.0, ignore_eos=True))
    real = []
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        real.append((0, dict(so.num_scheduled_tokens), engine.scheduler.kv.num_free_blocks))
        engine.scheduler.update_from_output(so, engine.executor.execute(so))
    engine.check_integrity()
    assert sim.step_log == real
    assert any(len(n) > 1 for _, n, _ in real)  # requests shared steps (a real test)


def test_cli_table_json_and_plot(tmp_path, weka_traces, capsys):
    traces = weka_traces(tmp_path / "w", sessions=3, turns=2)
    args = ["simulate", "--workload", str(traces), "--model", "tiny-glm5", "--hbm-gib", "6",
            "--deployment", "dp2xep block-size=16", "--concurrency", "1,2"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "dp2xep block-size=16" in table and "P90 tok/s/user" in table
    assert main(args + ["--json", "--plot", str(tmp_path / "p.png")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in data["runs"]] == [1, 2]
    assert all(r["requests"] == 6 for r in data["runs"])
    assert "source" in data["parts"]["mla_decode_us"]
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["simulate", "--workload", str(tmp_path), "--deployment", "tp8",
                 "--model", "tiny-glm5"]) == 2
    assert "--workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", str(tmp_path), "--deployment", "tp8",
              "--concurrency", "0"])
    assert "--concurrency" in capsys.readouterr().err


def test_calibration_script_smoke(tmp_path, monkeypatch, capsys):
    """benchmarks/simulate_calibration.py runs the real runner and the model on the same
    sessions (tiny model, CPU), so it is ready for the H200."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_calibration.py"
    spec = importlib.util.spec_from_file_location("simulate_calibration", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "simulate_calibration", bench)
    spec.loader.exec_module(bench)
    steps = tmp_path / "steps.json"
    assert bench.main(["--smoke", "--steps-json", str(steps)]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    rows = [line for line in lines if line.startswith("| 256 | 2 | 4 |")]
    assert len(rows) == 1  # 2 sessions × 2 turns, all compared
    # every measured step recorded, with the model's parts adding up to its prediction
    records = json.loads(steps.read_text())
    assert len(records) == int(rows[0].split(" | ")[6])
    for r in records:
        assert r["kind"] in ("decode", "mixed", "prefill") and r["batch"]
        assert r["first_use"] == []  # the reference backend compiles nothing
        gpu = sum(v for k, v in r["parts_ms"].items() if k != "cpu")
        assert r["predicted_ms"] == pytest.approx(gpu + r["parts_ms"]["cpu"])
    # the same run's steps by kind, measured against priced (mixed steps depend on timing)
    kinds = {line.split(" | ")[2] for line in lines if line.startswith("| 256 | 2 | ")} - {"4"}
    assert {"decode", "prefill"} <= kinds <= {"decode", "mixed", "prefill"}, kinds
    # The simulator is given the runner's own settings: on the CPU its decode steps are eager.
    assert "simulated as --deployment 'tp1 kv=bf16 weights=bf16 enforce-eager'" in out.err
    # the decode host fit refitted from this process's probe (4 rows: 2 contexts × 2 batches)
    assert "probe: eager decode at 0 drafts, host = " in out.err and "(256, 2, " in out.err
    assert "probe: prefill measured − priced " in out.err and " at 256 over 0" in out.err
    # An FP8 checkpoint: the CPU runner dequantizes it at load, so its matrices are bf16 too.
    assert bench.main(["--smoke", "--weights", "fp8", "--no-probe"]) == 0
    assert "simulated as --deployment 'tp1 kv=bf16 weights=bf16 enforce-eager'" in \
        capsys.readouterr().err


def test_calibration_probe_sizes(load_benchmark):
    """The prefill probe's sizes: powers of two from 1,024 up to a whole chunk, none longer
    than the context; each prefilled fresh, and appended to a first turn at depth."""
    sizes = load_benchmark("simulate_calibration").probe_sizes
    assert sizes(8192, 32768) == [1024, 2048, 4096, 8192]
    assert sizes(8192, 8192) == [1024, 2048, 4096, 8192]
    assert sizes(8192, 6000) == [1024, 2048, 4096, 6000]
    assert sizes(8192, 256) == [256]
    turns = load_benchmark("simulate_calibration").probe_turns
    (fresh,), (deep,) = turns(0, 1024), turns(4096, 1024)
    assert [t.input_tokens for t in fresh.turns] == [1024]
    assert [t.input_tokens for t in deep.turns] == [4096, 5120]
    assert deep.turns[1].hash_ids[:64] == deep.turns[0].hash_ids  # the first turn is its prefix


def test_calibration_script_arguments_and_weights(tmp_path, load_benchmark, engine_config,
                                                  capsys):
    """--weights picks the checkpoint's matrices (bf16 unless asked); a runner that keeps an FP8
    checkpoint in FP8 (the engine on CUDA) is simulated as weights=fp8-dsaserve."""
    bench = load_benchmark("simulate_calibration")
    assert bench.parse_args([]).weights == "bf16"
    assert bench.parse_args(["--weights", "fp8", "--mtp", "3"]).weights == "fp8"
    with pytest.raises(SystemExit):
        bench.parse_args(["--weights", "int4"])
    assert "--weights" in capsys.readouterr().err
    config = engine_config(make_model("tiny-glm5", tmp_path / "fp8", fp8=True), num_blocks=8)
    kept = ModelRunner(dataclasses.replace(config, keep_fp8_weights=True))
    assert bench.deployment_spec(kept) == "tp1 kv=bf16 weights=fp8-dsaserve enforce-eager"
    assert parse_deployment(bench.deployment_spec(kept)).weight_dtype == "fp8-dsaserve"
    dequantized = ModelRunner(dataclasses.replace(config, keep_fp8_weights=False))
    assert bench.deployment_spec(dequantized) == "tp1 kv=bf16 weights=bf16 enforce-eager"


def test_calibration_script_hisparse_smoke(load_benchmark, capsys):
    """--hisparse: the runner runs as a HiSparse engine whose GPU MLA pages spill, driven by the
    simulator's own scheduler; the simulator is given the runner's pool, hot rows, window and
    admitted requests, and the measured misses are printed beside the assumed overlap."""
    bench = load_benchmark("simulate_calibration")
    assert bench.main(["--smoke", "--hisparse", "--no-probe"]) == 0
    out = capsys.readouterr()
    assert any(line.startswith("| 256 | 2 | 4 |") for line in out.out.splitlines())
    spec = out.err.split("simulated as --deployment '")[1].split("'")[0]
    assert spec.startswith("tp1 kv=bf16 weights=bf16 enforce-eager hisparse host=")
    d = parse_deployment(spec)
    _, model = load_model("tiny-glm5")
    # The smoke's window: the 256-token context and one block for what is decoded; a pool of
    # two such windows of every cache layer's float32 MLA rows; the engine's hot buffer of
    # (query rows + 1) × top-k; the pool admits exactly the two
    layers = model.num_hidden_layers + model.num_nextn_predict_layers
    assert d.max_model_len == 256 + 64
    assert d.hisparse_host_bytes == 2 * 5 * 64 * layers * model.kv_cache_width * 4
    assert (d.hot_rows, d.overlap, d.max_num_seqs) == (2 * model.index_topk, 0.9, 2)
    # decode rows beyond the hot buffer missed, and the page map spilled
    line = next(x for x in out.err.splitlines() if "HiSparse:" in x and "missed" in x)
    missed, selected = (int(x.replace(",", "")) for x in
                        line.split("HiSparse: ")[1].split(" rows")[0].split(" of "))
    assert 0 < missed <= selected and "priced at 0.900" in line
    assert int(line.split("; ")[-1].split(" MLA blocks spilled")[0].replace(",", "")) > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--host-pool-gib", "1"])
    assert "--host-pool-gib: needs --hisparse" in capsys.readouterr().err


def test_calibration_hisparse_priced_at_the_measured_overlap(load_benchmark, capsys):
    """--overlap measured: the model pass prices the runner's own misses (the overlap that
    the miss counters give) instead of the assumed 0.9; the runner's pass is the same."""
    bench = load_benchmark("simulate_calibration")
    assert bench.main(["--smoke", "--hisparse", "--no-probe", "--overlap", "measured"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines()
                if "HiSparse:" in x and "missed" in x)
    measured = float(line.split("measured overlap ")[1].split(",")[0])
    priced = float(line.split("priced at ")[1].split(";")[0])
    assert priced == pytest.approx(max(measured, 0.0), abs=1e-3) and priced != 0.9
    assert bench.Misses(100, 30, 30).overlap == pytest.approx(0.7)
    assert bench.Misses(0, 5, 0).overlap is None  # nothing through a hot buffer: no figure
    for bad in ("0", "1.5", "some"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--hisparse", "--overlap", bad])
        assert "--overlap" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--overlap", "measured"])
    assert "--overlap: needs --hisparse" in capsys.readouterr().err


def test_mtp_at_synthetic_acceptance(tmp_path, weka_traces):
    """MTP3 at acceptance 2.99 through the engine's own spec-decode scheduling: every turn still
    emits exactly its output length, the scheduler's counters give 2.99 tokens per verify step,
    and a lone session decodes faster per user than without drafts."""
    traces = weka_traces(tmp_path, sessions=2, turns=2, out=300)
    _, mtp = _simulate(traces, "tp1 block-size=16 mtp=3 acceptance=2.99", concurrency=1)
    _, plain = _simulate(traces, "tp1 block-size=16", concurrency=1)
    expected = {f"{s.id}/{k}": t.output_tokens for s in load_traces(traces)
                for k, t in enumerate(s.turns)}
    assert {r.request_id: r.output_tokens for r in mtp.records} == expected
    for sched in mtp.schedulers:
        sched.check_integrity()
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert mtp.summary()["acceptance_length"] == pytest.approx(2.99, abs=0.03)
    assert "acceptance_length" not in plain.summary()
    # Less than the 2.99 tokens a step gives: the measured graphed MTP3 step spends about twice
    # the host time of a plain one (plan/hosttime.py), which dominates this tiny model's step.
    assert mtp.summary()["p90_interactivity"] > 1.3 * plain.summary()["p90_interactivity"]


@pytest.mark.parametrize("spec, words", [
    ("tp1 mtp=3", "go together"), ("tp1 mtp=3 acceptance=5", "[1, 4]"),
])
def test_bad_mtp_specs(spec, words):
    with pytest.raises(ConfigError, match="--deployment") as e:
        parse_deployment(spec)
    assert words in str(e.value)


def test_host_tier_keeps_prefixes_a_small_gpu_pool_evicts(tmp_path, weka_traces):
    """offload=SIZE runs the engine's own OffloadManager: with a GPU pool too small for the
    sessions' histories, later turns find their prefix in the host tier instead of prefilling
    it again; copies land on the host link's clock, and both tiers drain."""
    traces = weka_traces(tmp_path, sessions=4, turns=4)
    spec = "tp1 block-size=16 offload=0.01"
    _, host = _simulate(traces, spec, concurrency=4, num_blocks=30)
    _, plain = _simulate(traces, "tp1 block-size=16", concurrency=4, num_blocks=30)
    for result in (host, plain):
        assert len(result.records) == 16 and not result.rejected
        assert all(r.finish is not None for r in result.records)
    s_host, s_plain = host.summary(), plain.summary()
    assert s_host["host_hit_rate"] > 0 and "host_hit_rate" not in s_plain
    assert s_host["cache_hit_rate"] > s_plain["cache_hit_rate"]
    for sched in host.schedulers:
        sched.check_integrity()
        assert not sched.offload.busy
        assert sched.offload.host.num_free_blocks == sched.offload.host.num_blocks
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    with pytest.raises(ConfigError, match="offload holds"):
        _simulate(traces, "tp1 block-size=16 offload=0.00001", concurrency=1, num_blocks=30)
