"""`dsaserve plan`: DESIGN.md §2 numbers from the GLM-5.3 config, references, CLI behaviour."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from dsaserve.config import ConfigError, ModelConfig, ParallelConfig
from dsaserve.model.presets import preset_config
from dsaserve.plan import cli
from dsaserve.plan import costmodel as cm
from dsaserve.plan.hardware import GIB, MIB, gpu_spec

if TYPE_CHECKING:
    import torch

N_1M = 1_048_576


@pytest.fixture(scope="module")
def glm() -> ModelConfig:
    return ModelConfig.from_hf(preset_config("glm-5.3"))


def _layout(
    tp: int = 1, pcp: int = 1, dcp: int = 1, dp: int = 1, ep: bool = False
) -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp, data_parallel_size=dp, enable_expert_parallel=ep,
    )


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


# ---- KV bytes and request memory --------------------------------------------------------------
def test_kv_bytes_per_token_glm53(glm: ModelConfig) -> None:
    fp8 = cm.kv_bytes_per_token(glm, "fp8_ds_mla")
    assert (fp8.mla_row, fp8.indexer_key) == (656, 132)
    assert (fp8.num_layers, fp8.num_indexer_layers, fp8.num_mtp_layers) == (78, 21, 1)
    assert (fp8.mla, fp8.indexer, fp8.mtp) == (78 * 656, 21 * 132, 656 + 132)
    assert fp8.total == 54_728
    bf16 = cm.kv_bytes_per_token(glm, "bf16")
    assert (bf16.mla_row, bf16.indexer_key) == (576 * 2, 128 * 2)
    assert bf16.total == 78 * 1152 + 21 * 256 + 1152 + 256


def test_one_million_token_request(glm: ModelConfig) -> None:
    kv = cm.kv_bytes_per_token(glm, "fp8_ds_mla")
    whole = cm.request_kv_bytes_per_gpu(kv, N_1M, dcp=1)
    assert whole == 54_728 * MIB
    assert round(whole / GIB, 1) == 53.4
    per_gpu = cm.request_kv_bytes_per_gpu(kv, N_1M, dcp=8)
    assert per_gpu * 8 == whole and round(per_gpu / GIB, 1) == 6.7
    # an odd context: the owner of the most tokens holds ceil(N / 8) of them
    assert cm.request_kv_bytes_per_gpu(kv, 17, dcp=8) == 3 * 54_728


def test_max_context_per_layout(glm: ModelConfig) -> None:
    kv = cm.kv_bytes_per_token(glm, "fp8_ds_mla")
    room = 15 * GIB
    assert cm.max_context_tokens(room, kv, dcp=1) == room // 54_728
    assert cm.max_context_tokens(room, kv, dcp=8) == 8 * (room // 54_728)
    assert cm.max_context_tokens(-1, kv, dcp=8) == 0
    fits = cm.max_context_tokens(room, kv, dcp=8)
    assert cm.request_kv_bytes_per_gpu(kv, fits, 8) <= room
    assert cm.request_kv_bytes_per_gpu(kv, fits + 8, 8) > room


# ---- sparse MLA roofline ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "nbytes", "flops", "mb", "intensity"),
    [(8, 1_369_088, 35_651_584, 1.37, 26), (64, 1_490_944, 285_212_672, 1.49, 191)],
)
def test_sparse_mla_intensity(
    glm: ModelConfig, heads: int, nbytes: int, flops: int, mb: float, intensity: int
) -> None:
    c = cm.sparse_mla_cost(glm, "fp8_ds_mla", heads)
    assert c.kv_bytes == 2048 * 660 and round(c.kv_bytes / 1e6, 2) == 1.35
    assert c.flops_per_row_head == 2 * 576 + 2 * 512 == 2176
    assert (c.bytes, c.flops) == (nbytes, flops)
    assert round(c.bytes / 1e6, 2) == mb
    assert round(c.intensity) == intensity


def test_ridge_points() -> None:
    assert round(gpu_spec("h200").ridge_flop_per_byte) == 206
    assert gpu_spec("H100").ridge_flop_per_byte == pytest.approx(989 / 3.35)
    assert gpu_spec("b200").ridge_flop_per_byte == pytest.approx(2250 / 8)
    with pytest.raises(ConfigError, match="--gpu"):
        gpu_spec("a100")


# ---- prefill FLOPs and the crossover ----------------------------------------------------------
def _reference_crossover(model: ModelConfig, tp: int, pcp: int, limit: int) -> int:
    """Sum per-query FLOPs position by position (no closed forms) and find the first crossing."""
    p = np.arange(limit, dtype=np.float64)  # [limit] query positions
    idx = np.cumsum((p + 1) * 2 * 32 * (128 + 1) * 21 / pcp)
    mla = np.cumsum(np.minimum(p + 1, 2048) * 2176 * (64 // tp) * 78 / pcp)
    return int(np.argmax(idx >= mla)) + 1


@pytest.mark.parametrize(("tp", "pcp", "approx"), [(8, 1, 32_000), (1, 8, 256_000)])
def test_crossover_tp8_vs_pcp8(glm: ModelConfig, tp: int, pcp: int, approx: int) -> None:
    f = cm.prefill_flops(glm, _layout(tp=tp, pcp=pcp, dcp=pcp))
    assert f.indexer_per_key == 2 * 32 * 129 * 21 / pcp
    assert f.crossover == _reference_crossover(glm, tp, pcp, limit=300_000)
    assert f.indexer(f.crossover) >= f.mla(f.crossover)
    assert f.indexer(f.crossover - 1) < f.mla(f.crossover - 1)
    # DESIGN.md's "≈32K at TP8, ≈256K at PCP8" is the asymptotic form 2·K·b/a.
    assert abs(f.asymptotic_crossover - approx) < 0.01 * approx
    assert abs(f.crossover - approx) < 0.04 * approx


def test_crossover_depends_on_tp_only(glm: ModelConfig) -> None:
    """PCP divides both curves; TP divides only MLA (the indexer is replicated)."""
    base = cm.prefill_flops(glm, _layout()).crossover
    assert cm.prefill_flops(glm, _layout(pcp=8, dcp=8)).crossover == base
    assert cm.prefill_flops(glm, _layout(pcp=4, dcp=1, dp=2)).crossover == base
    assert cm.prefill_flops(glm, _layout(tp=8)).crossover < base // 7


# ---- weights ----------------------------------------------------------------------------------
def _checkpoint_bytes_fp8(model: torch.nn.Module) -> int:
    """Bytes the engine holds for an FP8 checkpoint of an HF model, by MODEL_SPEC.md §1.3's
    naming rule: norms, embedding and lm_head stay bf16, the router and the indexer's
    weights_proj and k_norm fp32 (the engine computes them in fp32); other matrices are e4m3 +
    fp32 block scales, except kv_b_proj, which the engine dequantizes (model/fp8.py)."""
    fp32 = ("mlp.gate.weight", "indexer.weights_proj", "indexer.k_norm")
    keep_bf16 = ("norm", "embed_tokens", "lm_head", "kv_b_proj")
    total = 0
    for name, p in model.named_parameters():
        shapes = [tuple(p.shape)]
        if p.dim() == 3:  # HF fuses experts: [E, out, in]; checkpoints store one matrix each
            e, rows, cols = p.shape
            n = 2 if name.endswith("gate_up_proj") else 1
            shapes = [(rows // n, cols)] * (e * n)
        for shape in shapes:
            if any(k in name for k in fp32):
                total += 4 * math.prod(shape)
            elif len(shape) == 1 or any(k in name for k in keep_bf16):
                total += 2 * math.prod(shape)
            else:
                rows, cols = shape
                total += rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
    return total


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_weights_match_transformers(preset: str) -> None:
    """HF drops the MTP layer, so compare without it; the fp32 router bias is an HF buffer."""
    transformers = pytest.importorskip("transformers")
    raw = preset_config(preset)
    raw["num_nextn_predict_layers"] = 0
    cls = {"tiny-glm5": "GlmMoeDsa", "tiny-dsv32": "DeepseekV32"}[preset]
    hf_cfg = getattr(transformers, f"{cls}Config")(
        **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    )
    model = getattr(transformers, f"{cls}ForCausalLM")(hf_cfg)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    ours = cm.weight_bytes(ModelConfig.from_hf(raw), "fp8")
    assert ours.num_params == sum(p.numel() for p in model.parameters()) + bias
    assert ours.total == _checkpoint_bytes_fp8(model) + 4 * bias


def _part(name: str, shape: tuple[int, ...]) -> str:
    """The plan's tensor group (costmodel.Part) of an engine parameter, by its name; an FP8
    matrix's block scales go with it."""
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if len(shape) == 1:
        return "vector"  # norms and biases
    for key, part in (("indexer.", "indexer"), ("self_attn.", "attn"),
                      ("shared_experts.", "moe_shared"), ("mlp.gate.", "moe_shared"),
                      ("mlp.experts.", "expert"), ("eh_proj", "mtp_proj"), ("mlp.", "dense_mlp")):
        if key in name:
            return part
    raise AssertionError(f"{name}: no group")


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_weight_bytes_are_the_built_models_per_group(preset: str, weights: str) -> None:
    """The plan's bytes per tensor group are those of the parameters the engine builds (with
    the MTP layer; fp8: an FP8 checkpoint whose matrices the engine keeps in FP8, as on CUDA),
    fp32 router and indexer weights included: the dtypes are the built ones, not the plan's."""
    import torch

    from dsaserve.config import FP8WeightConfig
    from dsaserve.kernels.registry import get_backend
    from dsaserve.model.dsa import DsaForCausalLM

    model = ModelConfig.from_hf(preset_config(preset))
    if weights == "fp8":
        model = dataclasses.replace(model, fp8_weights=FP8WeightConfig())
    built = DsaForCausalLM.build(model, with_mtp=True, backend=get_backend("reference"),
                                 dtype=torch.bfloat16, device="meta")
    engine: dict[str, int] = {}
    for name, p in built.named_parameters():
        part = _part(name, tuple(p.shape))
        engine[part] = engine.get(part, 0) + p.numel() * p.element_size()
    plan: dict[str, int] = {}
    fmt, block = cm.weight_format(weights), cm.fp8_block(model)
    for t in cm.model_tensors(model):
        plan[t.part] = plan.get(t.part, 0) + t.nbytes(fmt, block)
    assert plan == engine
    assert sum(engine.values()) == cm.weight_bytes(model, weights).total
    fp32 = {_part(n, tuple(p.shape)) for n, p in built.named_parameters()
            if p.dtype == torch.float32 and "scale_inv" not in n}
    assert fp32 == {"vector", "indexer", "moe_shared"}  # router, weights_proj, k_norm, bias


def test_param_count_matches_published_totals() -> None:
    # GLM-5 (indexer on every layer, MTP excluded) is published as 744B parameters.
    raw = preset_config("glm-5.3")
    raw.pop("indexer_types")
    raw.update(index_topk_freq=1, num_nextn_predict_layers=0)
    assert round(cm.weight_bytes(ModelConfig.from_hf(raw)).num_params / 1e9) == 744
    # DeepSeek-V3.2 is published as 685B with the MTP layer and its embedding/head copies.
    ds = ModelConfig.from_hf(preset_config("deepseek-v3.2"))
    copies = 2 * ds.vocab_size * ds.hidden_size
    assert round((cm.weight_bytes(ds).num_params + copies) / 1e9) == 685


def test_matrix_flops_match_published_active_parameters() -> None:
    """A token's pass through the weight matrices is 2 FLOPs per active parameter: DeepSeek-V3
    is published as 37B activated per token, GLM-5 (indexer on every layer) as 40B active;
    without embedding and lm_head (a prompt token reaches neither matrix's product)."""
    ds = ModelConfig.from_hf(preset_config("deepseek-v3.2"))
    assert round(cm.matrix_flops_per_token(ds, ParallelConfig()) / 2e9) == 37
    raw = preset_config("glm-5.3")
    raw.pop("indexer_types")
    raw.update(index_topk_freq=1)
    glm5 = ModelConfig.from_hf(raw)
    assert round(cm.matrix_flops_per_token(glm5, ParallelConfig()) / 2e9) == 40
    # PCP splits a prompt's rows; TP splits the matrices but not the replicated down-projections
    one = cm.prefill_flops(glm5, ParallelConfig()).matrices(1 << 20)
    assert cm.prefill_flops(glm5, ParallelConfig(prefill_context_parallel_size=8)).matrices(
        1 << 20) == pytest.approx(one / 8)
    tp8 = cm.matrix_flops_per_token(glm5, ParallelConfig(tensor_parallel_size=8))
    assert one / (1 << 20) / 8 < tp8 < one / (1 << 20) / 4
    # EP moves whole experts, not the work: TP8 with EP costs what TP8 does, and the simulator's
    # step model prices a compute-bound chunk's routed experts at those FLOPs either way
    from dsaserve.plan.parts import H200
    from dsaserve.plan.steptime import StepTimeModel
    ep = ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True)
    assert cm.matrix_flops_per_token(glm5, ep) == tp8
    num_moe = sum(glm5.is_moe_layer(i) for i in range(glm5.num_hidden_layers))
    routed = (num_moe * 2 * glm5.num_experts_per_tok * 3 * glm5.hidden_size
              * glm5.moe_intermediate_size / 8)  # FLOPs per token per GPU
    for par in (ParallelConfig(tensor_parallel_size=8), ep):
        moe = StepTimeModel(glm5, par, H200).step([(16384, 16384)]).moe
        assert moe == pytest.approx(16384 * routed / (H200.matmul_fp8_tflops.value * 1e12))


def test_weight_bytes_by_dtype_and_layout(glm: ModelConfig) -> None:
    fp8, bf16 = cm.weight_bytes(glm, "fp8"), cm.weight_bytes(glm, "bf16")
    assert fp8.num_params == bf16.num_params
    moe_layers = sum(glm.is_moe_layer(i) for i in range(79))
    indexer_layers = sum(glm.has_indexer(i) for i in range(79))
    # bf16: 2 B per value, except what the engine holds in fp32 (4 B): the router's weight and
    # correction bias, the indexer's weights_proj and k_norm (weight and bias)
    fp32 = (moe_layers * glm.n_routed_experts * (glm.hidden_size + 1)
            + indexer_layers * (glm.index_n_heads * glm.hidden_size + 2 * glm.index_head_dim))
    assert bf16.total == 2 * bf16.num_params + 2 * fp32
    # fp8 experts: 1 B per value + one fp32 scale per 128×128 block (2048×6144 → 16×48 blocks)
    assert fp8.routed_experts == moe_layers * 256 * 3 * (2048 * 6144 + 4 * 16 * 48)
    # weight-only FP8 holds the same bytes as fp8 (it differs in the matmul rate alone)
    assert cm.weight_bytes(glm, "fp8-weight-only") == fp8
    assert cm.weight_format("fp8-weight-only").param_bytes == cm.weight_format("fp8").param_bytes
    with pytest.raises(ConfigError, match="--weights: expected one of .*'fp8-weight-only'"):
        cm.weight_bytes(glm, "int4")
    w = fp8
    assert cm.weight_bytes_per_gpu(w, _layout(pcp=8, dcp=8, ep=True)) == (
        w.replicated + w.tp_sharded + w.routed_experts // 8)
    assert cm.weight_bytes_per_gpu(w, _layout(tp=8)) == (
        w.replicated + -(-w.tp_sharded // 8) + w.routed_experts // 8)
    assert cm.weight_bytes_per_gpu(w, _layout(dp=8, ep=True)) == (
        w.replicated + w.tp_sharded + w.routed_experts // 8)
    assert cm.weight_bytes_per_gpu(w, _layout(pcp=8, dcp=8)) == w.total  # PCP replicates


@pytest.mark.parametrize("weights", cm.WEIGHT_DTYPES)
@pytest.mark.parametrize("layout", [dict(tp=8), dict(tp=8, ep=True), dict(dp=8, ep=True),
                                    dict(pcp=8, dcp=8, ep=True), dict(tp=2)])
def test_matrix_reads_are_the_memory_count_per_gpu(glm: ModelConfig, weights: str,
                                                   layout: dict) -> None:
    """The bytes a step reads of each layer kind's matrices come from weight_bytes' own tensors:
    every layer's matrices, all experts this GPU holds and the lm_head, plus what is not read
    as a matrix (norms and biases; the embedding, gathered by row), is the memory per GPU."""
    par = _layout(**layout)
    held, tp = cm.matrix_bytes(glm, par, weights), par.tensor_parallel_size
    layers = range(glm.num_hidden_layers + glm.num_nextn_predict_layers)  # MTP layer: MoE
    reads = sum(held.attn + (held.indexer if glm.has_indexer(i) else 0)
                + (held.moe_shared + held.experts_here * held.expert if glm.is_moe_layer(i)
                   else held.dense_mlp) for i in layers)
    reads += glm.num_nextn_predict_layers * held.mtp_proj + held.lm_head
    h, moe_layers = glm.hidden_size, sum(glm.is_moe_layer(i) for i in layers)
    vectors = 2 * (len(layers) * (glm.q_lora_rank + glm.kv_lora_rank + 2 * h) + 3 * h + h) \
        + 4 * 2 * glm.index_head_dim * sum(glm.has_indexer(i) for i in layers) \
        + 4 * moe_layers * glm.n_routed_experts  # fp32: the indexer's k_norm, the router's bias
    embedding = 2 * glm.vocab_size * h // tp
    memory = cm.weight_bytes_per_gpu(cm.weight_bytes(glm, weights), par)
    assert reads + vectors + embedding == memory
    # kv_b_proj is read dequantized in every mode: 2 B a value, TP-split by heads
    kv_b = glm.num_attention_heads * (glm.qk_nope_head_dim + glm.v_head_dim) * glm.kv_lora_rank
    if weights != "bf16":
        q_b = glm.num_attention_heads * glm.qk_head_dim * glm.q_lora_rank
        o = h * glm.num_attention_heads * glm.v_head_dim
        fp8 = sum(r * c + 4 * -(-r // 128) * -(-c // 128) for r, c in (
            (glm.q_lora_rank, h), (glm.kv_cache_width, h)))
        fp8_tp = (q_b + 4 * (q_b // 128 // 128) + o + 4 * (o // 128 // 128)) // tp
        assert held.attn == fp8 + fp8_tp + 2 * kv_b // tp


# ---- DCP gather and HiSparse ------------------------------------------------------------------
def test_dcp_gather_bytes(glm: ModelConfig) -> None:
    kv = cm.kv_bytes_per_token(glm, "fp8_ds_mla")
    g = cm.dcp_gather_cost(kv, N_1M, dcp=8, link_gbps=450)
    assert g.mla_layer_bytes == 7 * (N_1M // 8) * 656
    assert g.indexer_layer_bytes == 7 * (N_1M // 8) * 132
    assert g.step_bytes == 79 * g.mla_layer_bytes + 22 * g.indexer_layer_bytes
    assert g.mla_layer_seconds == pytest.approx(g.mla_layer_bytes / 450e9)
    assert cm.dcp_gather_cost(kv, N_1M, dcp=1, link_gbps=450).step_bytes == 0


def test_hisparse_concurrency(glm: ModelConfig) -> None:
    kv = cm.kv_bytes_per_token(glm, "fp8_ds_mla")
    ctx, room = 131_072, 18 * GIB
    h = cm.hisparse_concurrency(kv, ctx, room, host_pool_bytes=48 * GIB, hot_rows=10_240)
    assert h.host_bytes == ctx * 79 * 656
    assert h.gpu_bytes_hisparse == ctx * 22 * 132 + (10_240 + 128) * 79 * 656
    assert (h.by_host, h.by_hbm_full) == (48 * GIB // h.host_bytes, room // (ctx * 54_728))
    assert (h.by_host, h.by_hbm_hisparse, h.by_hbm_full) == (7, 21, 2)
    assert h.hisparse == 7 and h.bound == "host memory"
    big = cm.hisparse_concurrency(kv, ctx, room, host_pool_bytes=512 * GIB, hot_rows=10_240)
    assert big.hisparse == big.by_hbm_hisparse == 21 and big.bound == "HBM"
    # the suggested MLA pages cover what the engine asks of spilling under MTP3: one prefill's
    # window with the 2 lookahead slots (a window of whole pages needs one more), and the tails
    from dsaserve.kv.hisparse.admission import min_mla_pages

    assert h.mla_pages == min_mla_pages(ctx + 2, 64) + 7 * cm.HISPARSE_TAIL_PAGES
    assert h.mla_pages == ctx // 64 + 1 + 7 * 2


# ---- the CLI ----------------------------------------------------------------------------------
PCP8 = ["--model", "glm-5.3", "--gpu", "h200", "--pcp", "8", "--dcp", "8", "--ep"]

# ---- FP8 products as dsaserve's engine runs them ------------------------------------------------
def test_fp8_thresholds_are_the_engines():
    """The plan restates the engine's kernel thresholds (it imports no kernel module): each
    must equal the engine's own constant."""
    pytest.importorskip("triton")
    from dsaserve.kernels.fp8_weights import FP8_BLOCK
    from dsaserve.kernels.triton import fp8_linear, fp8_w8a8
    from dsaserve.model import moe_compute

    assert cm.FP8_WEIGHT_BLOCK == FP8_BLOCK
    assert cm.FP8_WEIGHT_ONLY_MAX_ROWS == fp8_linear.WEIGHT_ONLY_MAX_M
    assert cm.FP8_W8A8_MAX_ROWS == fp8_linear.W8A8_MAX_M
    narrow = fp8_w8a8.TILES[-1]
    assert cm.FP8_W8A8_NARROW_TILE == (narrow.block_m, narrow.block_n)
    assert cm.FP8_CUBLAS_K_MULTIPLE == fp8_w8a8.CUBLAS_ROWS * FP8_BLOCK
    assert cm.FP8_EXPERTS_W8A8_MIN_MEAN_ROWS == moe_compute.W8A8_GROUPED_MIN_MEAN_ROWS
    assert cm.FP8_EXPERTS_W8A8_MAX_MEAN_ROWS == moe_compute.TRITON_GROUPED_MAX_MEAN_ROWS


def test_fp8_dense_path_follows_the_engines_rule():
    """fp8_dense_path against the engine's own predicates over rows and GLM-5.3's and
    DeepSeek-V3.2's product shapes: weight-only up to 64 rows; to 256 W8A8 where
    fp8_w8a8.fills_device, else dequantized; above, W8A8 where cublas_takes, else dequantized."""
    pytest.importorskip("triton")
    import torch

    from dsaserve.kernels.triton import fp8_w8a8

    cuda = torch.device("cuda")  # cublas_takes reads the device type only
    shapes = [(2752, 6144), (2624, 7168), (6144, 2048), (2048, 2048), (512, 6144),
              (6144, 256), (3072, 6144), (6144, 1536), (576, 6144), (4096, 1536)]
    for n, k in shapes:
        for aligned in (True, False):
            for rows in (*range(1, 300), 1024, 4096, 16384):
                path = cm.fp8_dense_path(rows, n, k, aligned)
                if rows <= 64:
                    assert path == "weight-only"
                    continue
                if rows <= 256:
                    w8a8 = fp8_w8a8.fills_device(rows, n, cm.DEVICE_SMS)
                else:
                    w8a8 = fp8_w8a8.cublas_takes(n, k, 0 if aligned else 64, 0, cuda)
                assert path == ("w8a8" if w8a8 else "dequantized"), (rows, n, k, aligned)
    # the edges, by hand: q_b alone at TP8 (2,048 wide) gives 2·2·32 = 128 < 132 programs at
    # 128 rows and 2·3·32 = 192 at 129; a 4K prefill's kv_a-bearing x_proj ends inside a block
    assert cm.fp8_dense_path(128, 2048, 2048, True) == "dequantized"
    assert cm.fp8_dense_path(129, 2048, 2048, True) == "w8a8"
    assert cm.fp8_dense_path(4096, 2752, 6144, True) == "dequantized"
    assert cm.fp8_dense_path(4096, 6144, 2048, True) == "w8a8"
    assert cm.fp8_dense_path(64.5, 6144, 2048, True) == "w8a8"  # a PCP share: 65 whole rows


def test_fp8_experts_path_follows_the_engines_rule():
    """W8A8 for a mean of more than 16 and at most 64 pairs per held expert, as
    moe_compute.w8a8_experts decides from host sizes; the FP8 grouped kernel (bf16 MMAs)
    elsewhere."""
    pytest.importorskip("triton")
    import torch

    from dsaserve.model import moe_compute

    for experts in (1, 32, 256):
        for pairs in range(0, 80 * experts, max(1, experts // 4)):
            w8a8 = moe_compute.w8a8_experts(pairs, experts, torch.bfloat16)
            assert (cm.fp8_experts_path(pairs / experts) == "w8a8") == w8a8, (pairs, experts)
    assert [cm.fp8_experts_path(r) for r in (1, 16, 16.5, 64, 65)] == [
        "weight-only", "weight-only", "w8a8", "w8a8", "weight-only"]


@pytest.mark.parametrize("model_name", ["glm-5.3", "deepseek-v3.2"])
@pytest.mark.parametrize("tp", [1, 8])
def test_fp8_gemms_cover_the_fp8_matrices_once(model_name: str, tp: int):
    """The fused products of a layer hold, part by part, exactly the FP8-held matrices that
    matrix_params counts (an indexer layer's wk and wq_b among them), and GLM-5.3's fuse as
    model/fused.py merges them."""
    model = ModelConfig.from_hf(preset_config(model_name))
    par = _layout(tp=tp)
    fp8_only = cm._matrices_per_gpu(model, par, lambda t: t.values if t.held == "fp8" else 0)
    for indexer in (True, False):
        gemms = cm.fp8_gemms(model, par, indexer)
        for part in ("attn", "indexer", "dense_mlp", "moe_shared", "lm_head", "mtp_proj"):
            total = sum(v for g in gemms for p, v in g.values if p == part)
            want = 0 if part == "indexer" and not indexer else getattr(fp8_only, part)
            assert total == want, (part, indexer)
        for g in gemms:  # the members' values, or those padded to a whole block of rows
            values = sum(v for _, v in g.values)
            assert values == g.n * g.k or (
                g.n % cm.FP8_WEIGHT_BLOCK == 0 and 0 < g.n * g.k - values < 128 * g.k)
    if model_name == "glm-5.3" and tp == 8:
        shapes = [(g.n, g.k, g.aligned) for g in cm.fp8_gemms(model, par, True)]
        # q_a + wk + kv_a: 2,752 rows padded to 2,816 (whole blocks, model/fused.py)
        assert shapes == [(2816, 6144, True), (2048 + 4096, 2048, True),
                          (6144, 2048, True), (2 * 1536, 6144, True), (6144, 1536, True),
                          (2 * 256, 6144, True), (6144, 256, True)]
        plain = [(g.n, g.k) for g in cm.fp8_gemms(model, par, False)][:2]
        assert plain == [(2688, 6144), (2048, 2048)]  # q_a + kv_a: 2,624 padded


def test_weight_modes_rates():
    """fp8 multiplies at the FP8 peak and fp8-weight-only and bf16 at the bf16 peak whatever
    the kernel; fp8-dsaserve at the FP8 peak on W8A8 alone, matrices held unquantized at bf16."""
    rates = {w: [cm.weight_format(w).matmul_tflops(1.0, 2.0, path)
                 for path in ("weight-only", "w8a8", "dequantized", None)]
             for w in cm.WEIGHT_DTYPES}
    assert rates == {"fp8": [2.0] * 4, "fp8-dsaserve": [1.0, 2.0, 1.0, 1.0],
                     "fp8-weight-only": [1.0] * 4, "bf16": [1.0] * 4}
    assert cm.weight_bytes(ModelConfig.from_hf(preset_config("glm-5.3")), "fp8-dsaserve") == (
        cm.weight_bytes(ModelConfig.from_hf(preset_config("glm-5.3")), "fp8"))

TP8 = ["--model", "glm-5.3", "--gpu", "h200", "--tp", "8", "--ep"]


def test_cli_json_reference_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    p = _json(PCP8, capsys)
    assert p["kv"]["total"] == {"fp8_ds_mla": 54_728, "bf16": 96_640}
    assert p["inputs"]["context"] == N_1M and p["inputs"]["num_gpus"] == 8
    assert p["memory"]["request_kv"] == 54_728 * MIB
    assert p["memory"]["request_kv_per_gpu"] == 54_728 * MIB // 8
    assert p["memory"]["kv_room"] == (
        int(141 * GIB * 0.9) - p["memory"]["weights_per_gpu"] - 4 * GIB)
    assert p["memory"]["max_context"] == p["memory"]["kv_room"] // 54_728 * 8
    assert (p["sparse_mla"]["heads_per_gpu"], p["sparse_mla"]["bytes"]) == (64, 1_490_944)
    assert round(p["sparse_mla"]["intensity"]) == 191 and round(p["sparse_mla"]["ridge"]) == 206
    assert p["prefill"]["crossover"] == 255_600
    assert p["dcp"]["mla_layer"]["bytes"] == 7 * 131_072 * 656
    t = _json(TP8, capsys)
    assert (t["sparse_mla"]["heads_per_gpu"], t["sparse_mla"]["bytes"]) == (8, 1_369_088)
    assert round(t["sparse_mla"]["intensity"]) == 26
    assert t["prefill"]["crossover"] == 31_020
    assert t["memory"]["request_kv_per_gpu"] == 54_728 * MIB and t["dcp"]["step"]["bytes"] == 0


def test_cli_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset_config("glm-5.3")))
    for model in (str(path), str(tmp_path)):  # the file or its directory
        p = _json(["--model", model, "--tp", "8"], capsys)
        assert p["kv"]["total"]["fp8_ds_mla"] == 54_728 and p["prefill"]["crossover"] == 31_020
    # DeepSeek-V3.2 keeps an indexer on every layer: 61·656 + 61·132 + 788
    path.write_text(json.dumps(preset_config("deepseek-v3.2")))
    p = _json(["--model", str(path)], capsys)
    assert p["kv"]["total"]["fp8_ds_mla"] == 61 * 788 + 788
    assert p["inputs"]["context"] == 163_840


def test_cli_table_lines_are_documented_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, table, _ = _run(PCP8, capsys)
    assert rc == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for line in table.splitlines()[1:]:
        label = line[2: 2 + cli._LABEL_WIDTH].strip() if line.startswith("  ") else line
        assert label in help_text, f"undocumented output line {label!r}"
    assert "54,728 B" in table and "53.45 GiB (54,728 MiB)" in table and "6.68 GiB" in table


def test_cli_hardware_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    base = _json(PCP8, capsys)
    p = _json([*PCP8, "--hbm-gib", "100", "--link-gbps", "900", "--hbm-tbps", "9.6"], capsys)
    assert p["inputs"]["gpu"]["hbm_bytes"] == 100 * GIB
    usable_drop = int(141 * GIB * 0.9) - int(100 * GIB * 0.9)
    assert p["memory"]["kv_room"] == base["memory"]["kv_room"] - usable_drop
    assert p["dcp"]["step"]["seconds"] == pytest.approx(base["dcp"]["step"]["seconds"] / 2)
    assert p["sparse_mla"]["ridge"] == pytest.approx(base["sparse_mla"]["ridge"] / 2)
    q = _json([*PCP8, "--fp8-tflops", "1000", "--bf16-tflops", "500"], capsys)["prefill"]
    assert q["indexer_at_context"]["flops"] == base["prefill"]["indexer_at_context"]["flops"]
    idx, mla = q["indexer_at_context"], q["mla_at_context"]
    assert idx["seconds"] == pytest.approx(idx["flops"] / 1e15)
    assert mla["seconds"] == pytest.approx(mla["flops"] / 5e14)


def test_cli_pd_decode_pages(capsys: pytest.CaptureFixture[str]) -> None:
    """--pd-decode: a P/D decode engine's "auto" MLA pages hold one prompt of the hot rows
    (10,240 + 2 lookahead) beside the tails, not a --context window; same concurrency."""
    from dsaserve.kv.hisparse.admission import min_mla_pages

    args = ["--model", "glm-5.3", "--gpu", "h200", "--dp", "8", "--ep", "--context", "131072"]
    agg = _json(args, capsys)["hisparse"]
    pd = _json([*args, "--pd-decode"], capsys)
    assert pd["inputs"]["pd_decode"] is True
    h = pd["hisparse"]
    assert h["concurrency"] == agg["concurrency"] == 7
    assert agg["mla_pages"] == min_mla_pages(131_072 + 2, 64) + 7 * cm.HISPARSE_TAIL_PAGES
    assert h["mla_pages"] == min_mla_pages(10_240 + 2, 64) + 7 * cm.HISPARSE_TAIL_PAGES == 175


def test_cli_weight_modes(capsys: pytest.CaptureFixture[str]) -> None:
    """--weights fp8-weight-only: fp8's memory, the prompt's matrices at the BF16 peak (bf16's
    time); fp8 at the FP8 peak; fp8-dsaserve between them."""
    p = {w: _json([*TP8, "--weights", w], capsys) for w in cm.WEIGHT_DTYPES}
    assert p["fp8-weight-only"]["inputs"]["weights"] == "fp8-weight-only"
    assert p["fp8-weight-only"]["memory"] == p["fp8"]["memory"]
    assert p["bf16"]["memory"]["weights_per_gpu"] > 1.9 * p["fp8"]["memory"]["weights_per_gpu"]
    matrices = {w: q["prefill"]["matrices_at_context"] for w, q in p.items()}
    assert matrices["fp8"]["seconds"] == pytest.approx(matrices["fp8"]["flops"] / 1979e12)
    for w in ("fp8-weight-only", "bf16"):
        assert matrices[w] == pytest.approx({"flops": matrices["fp8"]["flops"],
                                             "seconds": matrices["fp8"]["flops"] / 989e12})
    # fp8-dsaserve: the prompt's projections cuBLAS takes at the FP8 peak, the rest at BF16's
    assert matrices["fp8-dsaserve"]["flops"] == matrices["fp8"]["flops"]
    assert (matrices["fp8"]["seconds"] < matrices["fp8-dsaserve"]["seconds"]
            < matrices["bf16"]["seconds"])


def test_cli_weights_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-5.3 FP8 needs 105 GiB per GPU under EP8 without TP: more than an H100 has."""
    p = _json(["--gpu", "h100", "--pcp", "8", "--dcp", "8", "--ep"], capsys)
    assert p["memory"]["kv_room"] < 0
    assert p["memory"]["max_context"] == p["memory"]["requests_per_gpu"] == 0
    assert p["hisparse"]["concurrency"] == p["hisparse"]["by_hbm_full"] == 0
    rc, table, _ = _run(["--gpu", "h100", "--pcp", "8", "--dcp", "8", "--ep"], capsys)
    assert rc == 0 and "the weights do not fit" in table


def test_cli_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flops.png"
    rc, _, err = _run([*TP8, "--plot", str(out)], capsys)
    assert rc == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = _run([*TP8, "--plot", str(tmp_path / "missing" / "x.png")], capsys)
    assert rc == 2 and "--plot" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--pcp", "0"], "--pcp"), (["--gpu", "a100"], "--gpu"), (["--context", "-5"], "--context"),
     (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
     (["--weights", "int4"], "--weights")],
)
def test_cli_bad_flags_exit_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--model", "/nonexistent/config.json"], "--model"), (["--pcp", "8", "--dcp", "3"],
      "--decode-context-parallel-size"),
     (["--tp", "3"], "--tp")],
)
def test_cli_bad_values_return_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == "" and err.startswith("dsaserve plan: error: " + flag)


def test_add_parser_wires_run() -> None:
    parser = argparse.ArgumentParser(prog="dsaserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--tp", "8", "--json"])
    assert args.func is cli.run and args.tp == 8 and args.json


def test_module_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsaserve.plan.cli", *TP8, "--json"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert json.loads(proc.stdout)["prefill"]["crossover"] == 31_020
