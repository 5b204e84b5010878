"""The arithmetic a deployment rests on, from `ModelConfig`: pure functions, frozen results.

Conventions (docs/plan.md derives each DESIGN.md §2 number from them):

* KV bytes per token: every MLA layer stores one 576-wide row (`fp8_ds_mla`: 512 e4m3 + 4 fp32 tile
  scales + 64 bf16 RoPE = 656 B; `bf16`: 1152 B); only layers that run an indexer store an index key
  (FP8: 128 e4m3 + 1 fp32 scale = 132 B; bf16: 256 B); each MTP layer stores both.
* Sparse MLA per query token per layer (absorbed form): each of the top-k rows is read once for
  all heads of the GPU, with its 4-byte int32 index; each head reads its 576-wide bf16 query and
  writes its 512-wide bf16 latent output. Per row and head: 2·576 FLOP (q·k) + 2·512 FLOP (p·v).
* Indexer per (query, key) pair on an indexer layer: 2·n_heads·head_dim for the dot products plus
  2·n_heads for weighting each head's ReLU score and summing over heads. Projections are left out
  of both FLOP counts (they are linear in the prompt and the same in every layout).
* Per-GPU prefill work: PCP splits query rows (the indexer and MLA both divide by pcp); TP splits
  MLA heads but every TP rank runs the whole indexer (replicated), so only MLA divides by tp. DCP
  changes where KV lives, not FLOPs.
* Weights: FP8 block-quantized matrices cost 1 B per value plus one fp32 scale per 128×128 block;
  norms, embedding, lm_head, MTP `eh_proj` and kv_b_proj (which the engine dequantizes) stay bf16;
  the router (weight and correction bias) and the indexer's `weights_proj` and `k_norm` are fp32,
  as the engine holds them (model/precision.py, read by both). One list of tensors
  (`model_tensors`) says how each is held; the memory (`weight_bytes`) and a step's weight reads
  (`matrix_bytes`) are both sums over it. TP shards the attention up/out projections, dense and
  shared-expert MLPs, embedding and lm_head; EP shards routed experts over every GPU of the engine
  (without EP they are TP-sharded); PCP and DCP replicate weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from dsaserve.config import ConfigError, ModelConfig, ParallelConfig
from dsaserve.kv.hisparse.admission import (
    MlaPageSizing,
    hisparse_admission,
    hot_region_rows,
    pd_decode_prefill_tokens,
    size_mla_pages,
    write_tail_pages,
)
from dsaserve.model.precision import FP32_PARAMS

KVDType = Literal["fp8_ds_mla", "bf16"]
WeightDType = Literal["fp8", "fp8-dsaserve", "fp8-weight-only", "bf16"]
# The kernel an FP8 product of bf16 activations takes (fp8_dense_path, fp8_experts_path).
Fp8Path = Literal["weight-only", "w8a8", "dequantized"]
KV_DTYPES: tuple[KVDType, ...] = ("fp8_ds_mla", "bf16")

FP8_TILE = 128  # fp8_ds_mla quantizes the latent in tiles of 128 values, one fp32 scale each
TOPK_INDEX_BYTES = 4  # int32 row index read with every selected row
BF16 = 2
FP32 = 4
# Pages of 64 tokens each request keeps resident per MLA layer while it reads the rest from the host
# pool: the write tail of an MTP3 decoder (the engine's rule, kv/hisparse/admission.py).
HISPARSE_TAIL_PAGES = write_tail_pages(3, 64)
# Tokens a decoder reserves past its window for MTP drafts (k − 1 lookahead slots) when the model
# has an MTP layer: MTP3, as the reference deployment runs (the engine's scheduler, num_lookahead).
MTP3_LOOKAHEAD = 2
# HBM kept for activations and temporaries: one layer's 1M-token context gathered in bf16
# (1.1 GiB) plus an 8K-token step's activations (`dsaserve plan` and `simulate`).
DEFAULT_ACTIVATION_RESERVE_GIB = 4.0
PAGE_TOKENS = 64


# ---- parallel layout -----------------------------------------------------------------------------
def num_gpus(par: ParallelConfig) -> int:
    """GPUs of one engine: DP × PCP × TP (DCP is a view over those ranks, never extra ones)."""
    return par.data_parallel_size * par.prefill_context_parallel_size * par.tensor_parallel_size


def expert_shards(par: ParallelConfig) -> int:
    """How many ways routed experts are split: EP spans every GPU of the engine; without EP the
    experts are TP-sharded like the dense MLPs."""
    return num_gpus(par) if par.enable_expert_parallel else par.tensor_parallel_size


def check_layout(model: ModelConfig, par: ParallelConfig) -> None:
    """Reject layouts the cost model cannot express; the message names the offending flag."""
    tp, pcp, dcp = (par.tensor_parallel_size, par.prefill_context_parallel_size,
                    par.decode_context_parallel_size)
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"--tp: {tp} does not divide the model's {model.num_attention_heads} attention heads"
        )
    if (pcp * tp) % dcp:
        raise ConfigError(f"--dcp: {dcp} must divide pcp × tp = {pcp * tp} (DCP adds no ranks)")


# ---- KV bytes per token --------------------------------------------------------------------------
def mla_row_bytes(model: ModelConfig, kv_dtype: KVDType) -> int:
    """Bytes of one cached MLA row (one token, one layer).

    fp8_ds_mla, for kv_lora_rank 512 and qk_rope_head_dim 64:
        [0, 512) e4m3 latent | [512, 528) 4 × fp32 tile scales | [528, 656) 64 × bf16 RoPE key
    """
    if kv_dtype == "bf16":
        return BF16 * model.kv_cache_width
    if kv_dtype != "fp8_ds_mla":
        raise ConfigError(f"--kv-cache-dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")
    if model.kv_lora_rank % FP8_TILE:
        raise ConfigError(
            f"kv_lora_rank: {model.kv_lora_rank} is not a multiple of {FP8_TILE}, "
            "so it has no fp8_ds_mla layout"
        )
    scales = FP32 * (model.kv_lora_rank // FP8_TILE)
    return model.kv_lora_rank + scales + BF16 * model.qk_rope_head_dim


def indexer_key_bytes(model: ModelConfig, kv_dtype: KVDType) -> int:
    """Bytes of one cached indexer key: FP8 values plus one fp32 scale per token, or bf16."""
    if kv_dtype == "bf16":
        return BF16 * model.index_head_dim
    return model.index_head_dim + FP32


@dataclass(frozen=True)
class KVBytesPerToken:
    """KV cache bytes one token costs in every layer that keeps KV, by component."""

    kv_dtype: KVDType
    mla_row: int  # one MLA layer
    indexer_key: int  # one indexer layer
    num_layers: int  # MLA layers of the main model (all of them store rows)
    num_indexer_layers: int  # main-model layers that run their own indexer
    num_mtp_layers: int  # each stores one MLA row and one indexer key

    @property
    def mla(self) -> int:
        return self.num_layers * self.mla_row

    @property
    def indexer(self) -> int:
        return self.num_indexer_layers * self.indexer_key

    @property
    def mtp(self) -> int:
        return self.num_mtp_layers * (self.mla_row + self.indexer_key)

    @property
    def total(self) -> int:
        return self.mla + self.indexer + self.mtp

    @property
    def mla_all_layers(self) -> int:
        """MLA rows of every layer including MTP: what a HiSparse host pool holds per token."""
        return (self.num_layers + self.num_mtp_layers) * self.mla_row

    @property
    def indexer_all_layers(self) -> int:
        """Indexer keys of every layer including MTP: what stays on GPU under HiSparse."""
        return (self.num_indexer_layers + self.num_mtp_layers) * self.indexer_key


def kv_bytes_per_token(model: ModelConfig, kv_dtype: KVDType) -> KVBytesPerToken:
    return KVBytesPerToken(
        kv_dtype=kv_dtype,
        mla_row=mla_row_bytes(model, kv_dtype),
        indexer_key=indexer_key_bytes(model, kv_dtype),
        num_layers=model.num_hidden_layers,
        num_indexer_layers=len(model.full_indexer_layers),
        num_mtp_layers=model.num_nextn_predict_layers,
    )


def request_kv_bytes_per_gpu(kv: KVBytesPerToken, context: int, dcp: int) -> int:
    """KV bytes one request of `context` tokens holds on one GPU: DCP N stores ceil(context/N)
    tokens per rank (each token's owner keeps it); without DCP every rank keeps all of them."""
    return -(-context // dcp) * kv.total


# ---- weights -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    """How an engine holds its weight matrices and the tensor-core rate it multiplies them at.

        mode              held as                         matmul          served so by
        fp8               e4m3 + fp32 128×128 scales       FP8             vLLM, SGLang (W8A8)
        fp8-dsaserve      e4m3 + fp32 128×128 scales       by rows         dsaserve on CUDA
        fp8-weight-only   e4m3 + fp32 128×128 scales       bf16            weight-only kernels
        bf16              bf16                             bf16            FP8 checkpoints
                                                                           dequantized at load;
                                                                           bf16 checkpoints

    Weight-only FP8 reads one byte per weight but keeps activations in bf16, so its products run
    at the bf16 rate: like fp8 where weight reads bound a step (small-batch decode), like bf16
    where FLOPs do (prefill). dsaserve's engine picks the kernel of each product by its rows
    (fp8_dense_path for a projection's step rows, fp8_experts_path for the experts' mean rows
    per expert): weight-only in decode, W8A8 for MTP verification of large batches and for the
    prefill projections cuBLAS takes, bf16 MMAs for the other prefill projections and the
    prefill experts; `fp8-dsaserve` prices each product at its kernel's rate, and matrices held
    unquantized (kv_b_proj, lm_head, eh_proj, the fp32 router) at bf16's."""

    fp8_held: bool  # quantized matrices: 1 B per value + one fp32 scale per block (else 2 B)
    # "fp8": activations quantized too, every product at the FP8 rate; "bf16": every product at
    # the bf16 rate; "by-rows": an FP8 product at its kernel's rate (Fp8Path), the rest at bf16
    matmul: Literal["fp8", "bf16", "by-rows"]

    @property
    def param_bytes(self) -> int:
        """Bytes of one quantizable matrix value, in HBM and in a step's weight reads."""
        return 1 if self.fp8_held else BF16

    def matmul_tflops(self, bf16: float, fp8: float, path: Fp8Path | None = None) -> float:
        """The rate of a product on kernel `path` (None: a matrix held unquantized), from a
        GPU's dense bf16 and FP8 ceilings; the fixed modes ignore the path."""
        if self.matmul == "by-rows":
            return fp8 if path == "w8a8" else bf16
        return fp8 if self.matmul == "fp8" else bf16


WEIGHT_FORMATS: dict[WeightDType, WeightFormat] = {
    "fp8": WeightFormat(fp8_held=True, matmul="fp8"),
    "fp8-dsaserve": WeightFormat(fp8_held=True, matmul="by-rows"),
    "fp8-weight-only": WeightFormat(fp8_held=True, matmul="bf16"),
    "bf16": WeightFormat(fp8_held=False, matmul="bf16"),
}
WEIGHT_DTYPES: tuple[WeightDType, ...] = tuple(WEIGHT_FORMATS)


def weight_format(weight_dtype: str) -> WeightFormat:
    """The format of a weight mode; the error names --weights."""
    if weight_dtype not in WEIGHT_FORMATS:
        raise ConfigError(f"--weights: expected one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    return WEIGHT_FORMATS[weight_dtype]  # type: ignore[index]


# ---- the tensors, as the engine holds them -------------------------------------------------------
Held = Literal["fp8", "bf16", "fp32"]  # "fp8": block-quantized when the mode holds FP8, else bf16
Shard = Literal["replicated", "tp", "experts"]
# The matrix group a step reads a tensor in (a MatrixParams field), or "vector": norms and biases,
# applied element-wise, and "embedding", gathered by token row; neither is priced as a read.
Part = Literal["attn", "indexer", "dense_mlp", "moe_shared", "expert", "mtp_proj", "lm_head",
               "embedding", "vector"]


@dataclass(frozen=True)
class Tensor:
    """`count` alike checkpoint tensors of [rows, cols] values (a vector: cols 1), as the engine
    holds them (docs/fp8_weights.md) and as a layout divides them."""

    part: Part
    rows: int
    cols: int = 1
    held: Held = "bf16"
    shard: Shard = "replicated"
    count: int = 1

    @property
    def values(self) -> int:
        return self.count * self.rows * self.cols

    def nbytes(self, fmt: WeightFormat, block: tuple[int, int]) -> int:
        """Bytes in HBM, which a step reads whole: an FP8 matrix's values at fmt.param_bytes
        plus one fp32 weight_scale_inv per `block` (rows × cols) block."""
        if self.held == "fp8" and fmt.fp8_held:
            bo, bi = block
            scales = FP32 * -(-self.rows // bo) * -(-self.cols // bi)
            return self.count * (fmt.param_bytes * self.rows * self.cols + scales)
        return (FP32 if self.held == "fp32" else BF16) * self.values


def _held(name: str, held: Held = "bf16") -> Held:
    """How the engine holds the decoder-layer parameter `name`: fp32 where model/precision.py
    says so, else `held`."""
    return "fp32" if name in FP32_PARAMS else held


def attention_tensors(model: ModelConfig) -> list[Tensor]:
    """MLA: down-projections and norms replicated, up/out projections split by heads over TP.
    kv_b_proj is held dequantized: attention reads it absorbed, per head (W_UK, W_UV)."""
    m, h, heads = model, model.hidden_size, model.num_attention_heads
    return [
        Tensor("attn", m.q_lora_rank, h, "fp8"),  # q_a_proj
        Tensor("attn", m.kv_cache_width, h, "fp8"),  # kv_a_proj_with_mqa
        Tensor("vector", m.q_lora_rank + m.kv_lora_rank + 2 * h),  # q_a, kv_a, layer norms
        Tensor("attn", heads * m.qk_head_dim, m.q_lora_rank, "fp8", "tp"),  # q_b_proj
        Tensor("attn", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank,
               "bf16", "tp"),  # kv_b_proj
        Tensor("attn", h, heads * m.v_head_dim, "fp8", "tp"),  # o_proj
    ]


def indexer_tensors(model: ModelConfig) -> list[Tensor]:
    """A full-indexer layer's own projections, replicated (every TP rank runs the indexer)."""
    d, nh, h = model.index_head_dim, model.index_n_heads, model.hidden_size
    return [
        Tensor("indexer", nh * d, model.q_lora_rank, "fp8"),  # wq_b
        Tensor("indexer", d, h, "fp8"),  # wk
        Tensor("vector", d, held=_held("self_attn.indexer.k_norm.weight")),
        Tensor("vector", d, held=_held("self_attn.indexer.k_norm.bias")),
        Tensor("indexer", nh, h, held=_held("self_attn.indexer.weights_proj.weight")),
    ]


def dense_mlp_tensors(model: ModelConfig) -> list[Tensor]:
    return [Tensor("dense_mlp", model.intermediate_size, model.hidden_size, "fp8", "tp",
                   count=3)]  # gate, up, down


def routed_expert_tensors(model: ModelConfig) -> list[Tensor]:
    """One routed expert: gate, up, down (EP holds it whole, else TP splits it)."""
    return [Tensor("expert", model.moe_intermediate_size, model.hidden_size, "fp8", "experts",
                   count=3)]


def moe_shared_tensors(model: ModelConfig) -> list[Tensor]:
    """What every token of an MoE layer passes through: the router (weight and
    e_score_correction_bias, fp32) and the shared experts (TP-split like dense MLPs)."""
    e, h = model.n_routed_experts, model.hidden_size
    return [
        Tensor("moe_shared", e, h, held=_held("mlp.gate.weight")),
        Tensor("vector", e, held=_held("mlp.gate.e_score_correction_bias")),
        Tensor("moe_shared", model.moe_intermediate_size, h, "fp8", "tp",
               count=3 * model.n_shared_experts),
    ]


def mtp_tensors(model: ModelConfig) -> list[Tensor]:
    """What an MTP layer adds to a decoder layer: enorm, hnorm, shared_head.norm and eh_proj
    (stored unquantized); it reuses the target's embedding and lm_head."""
    h = model.hidden_size
    return [Tensor("vector", 3 * h), Tensor("mtp_proj", h, 2 * h)]


def head_tensors(model: ModelConfig) -> list[Tensor]:
    """Embedding, lm_head (vocab-split over TP, both as stored) and the final norm."""
    h, v = model.hidden_size, model.vocab_size
    lm_head = [] if model.tie_word_embeddings else [Tensor("lm_head", v, h, shard="tp")]
    return [Tensor("embedding", v, h, shard="tp"), *lm_head, Tensor("vector", h)]


def layer_tensors(model: ModelConfig, layer: int) -> list[Tensor]:
    """Every tensor of decoder layer `layer` (MTP layers are numbered after the main ones)."""
    tensors = attention_tensors(model)
    if model.has_indexer(layer):
        tensors += indexer_tensors(model)
    if model.is_moe_layer(layer):
        e = model.n_routed_experts
        tensors += moe_shared_tensors(model) + [
            replace(t, count=t.count * e) for t in routed_expert_tensors(model)]
    else:
        tensors += dense_mlp_tensors(model)
    if layer >= model.num_hidden_layers:
        tensors += mtp_tensors(model)
    return tensors


def model_tensors(model: ModelConfig) -> list[Tensor]:
    """Every checkpoint tensor: main and MTP layers, embedding, lm_head, final norm."""
    layers = range(model.num_hidden_layers + model.num_nextn_predict_layers)
    return [t for layer in layers for t in layer_tensors(model, layer)] + head_tensors(model)


def fp8_block(model: ModelConfig) -> tuple[int, int]:
    """The FP8 scale block (rows, cols): the checkpoint's, or 128 × 128 when quantized at load."""
    return model.fp8_weights.block_size if model.fp8_weights else (128, 128)


@dataclass(frozen=True)
class WeightBytes:
    """Checkpoint bytes by how a layout divides them."""

    replicated: int  # norms, q_a/kv_a projections, indexer, router, MTP eh_proj: on every GPU
    tp_sharded: int  # q_b/kv_b/o projections, dense and shared-expert MLPs, embedding, lm_head
    routed_experts: int  # divided by EP size (all GPUs of the engine), else by TP
    num_params: int  # values, not counting FP8 scales

    @property
    def total(self) -> int:
        return self.replicated + self.tp_sharded + self.routed_experts


def weight_bytes(model: ModelConfig, weight_dtype: WeightDType = "fp8") -> WeightBytes:
    """Count every checkpoint tensor (`model_tensors`) exactly, as the engine holds it: FP8
    matrices as stored (model/fp8.py), except kv_b_proj, which it dequantizes. Both FP8 modes
    hold the same bytes."""
    fmt, block = weight_format(weight_dtype), fp8_block(model)
    by_shard = dict.fromkeys(("replicated", "tp", "experts"), 0)
    tensors = model_tensors(model)
    for t in tensors:
        by_shard[t.shard] += t.nbytes(fmt, block)
    return WeightBytes(replicated=by_shard["replicated"], tp_sharded=by_shard["tp"],
                       routed_experts=by_shard["experts"],
                       num_params=sum(t.values for t in tensors))


def weight_bytes_per_gpu(w: WeightBytes, par: ParallelConfig) -> int:
    tp = par.tensor_parallel_size
    return w.replicated + -(-w.tp_sharded // tp) + -(-w.routed_experts // expert_shards(par))


@dataclass(frozen=True)
class MemoryBudget:
    """HBM of one GPU: what is left for KV after weights and the activation reserve."""

    hbm_bytes: int
    utilization: float
    weights: int
    activation_reserve: int

    @property
    def usable(self) -> int:
        return int(self.hbm_bytes * self.utilization)

    @property
    def kv_room(self) -> int:
        """Bytes for KV; negative when the weights alone do not fit."""
        return self.usable - self.weights - self.activation_reserve


def max_context_tokens(kv_room: int, kv: KVBytesPerToken, dcp: int) -> int:
    """Longest single request whose KV fits in `kv_room` bytes per GPU (DCP N stores 1/N of it)."""
    if kv_room <= 0:
        return 0
    return kv_room // kv.total * dcp


# ---- sparse MLA per query token ------------------------------------------------------------------
def mla_flops_per_row_head(model: ModelConfig) -> int:
    """2·576 (q·k over latent + RoPE) + 2·512 (p·v over the latent) = 2,176 for the real models."""
    return 2 * model.kv_cache_width + 2 * model.kv_lora_rank


@dataclass(frozen=True)
class SparseMLACost:
    """Per query token, per layer, per GPU: one decode step's sparse attention."""

    topk: int
    heads: int  # heads on this GPU
    row_bytes: int  # cached row + its int32 index
    per_head_bytes: int  # bf16 absorbed query in + bf16 latent output out
    flops_per_row_head: int

    @property
    def kv_bytes(self) -> int:
        return self.topk * self.row_bytes

    @property
    def bytes(self) -> int:
        return self.kv_bytes + self.heads * self.per_head_bytes

    @property
    def flops(self) -> int:
        return self.topk * self.heads * self.flops_per_row_head

    @property
    def intensity(self) -> float:
        """FLOP per HBM byte; compare with GPUSpec.ridge_flop_per_byte."""
        return self.flops / self.bytes


def sparse_mla_cost(model: ModelConfig, kv_dtype: KVDType, heads: int) -> SparseMLACost:
    return SparseMLACost(
        topk=model.index_topk,
        heads=heads,
        row_bytes=mla_row_bytes(model, kv_dtype) + TOPK_INDEX_BYTES,
        per_head_bytes=BF16 * (model.kv_cache_width + model.kv_lora_rank),
        flops_per_row_head=mla_flops_per_row_head(model),
    )


# ---- the weight matrices a token passes through ----------------------------------------------
@dataclass(frozen=True)
class MatrixParams:
    """The matrices one GPU multiplies each row by, per layer kind: their values
    (`matrix_params`) or the bytes a step reads of them (`matrix_bytes`)."""

    attn: int  # attention projections (absorbed W_UK / W_UV included)
    indexer: int  # indexer projections (full-indexer layers only)
    dense_mlp: int
    moe_shared: int  # shared experts + router
    expert: int  # one routed expert, as this GPU holds it
    experts_here: int  # routed experts this GPU holds (a count in both forms)
    lm_head: int
    mtp_proj: int  # an MTP layer's eh_proj


def _matrices_per_gpu(model: ModelConfig, par: ParallelConfig,
                      size: Callable[[Tensor], int]) -> MatrixParams:
    """Sum `size` over each part's tensors (from one layer that has the part), divided as
    weight_bytes_per_gpu divides memory: TP-split tensors by tp; a routed expert is whole under
    EP (this GPU holds 1/ep of them), else split over TP."""
    tp, ep = par.tensor_parallel_size, par.enable_expert_parallel
    shards = {"replicated": 1, "tp": tp, "experts": 1 if ep else tp}
    tensors = (attention_tensors(model) + indexer_tensors(model) + dense_mlp_tensors(model)
               + moe_shared_tensors(model) + routed_expert_tensors(model) + mtp_tensors(model)
               + head_tensors(model))
    by_part: dict[tuple[str, str], int] = {}
    for t in tensors:
        key = (t.part, t.shard)
        by_part[key] = by_part.get(key, 0) + size(t)

    def part(name: str) -> int:
        return sum(-(-n // shards[shard]) for (p, shard), n in by_part.items() if p == name)

    return MatrixParams(
        attn=part("attn"), indexer=part("indexer"), dense_mlp=part("dense_mlp"),
        moe_shared=part("moe_shared"), expert=part("expert"),
        experts_here=-(-model.n_routed_experts // expert_shards(par)) if ep
        else model.n_routed_experts,
        lm_head=part("lm_head"), mtp_proj=part("mtp_proj"),
    )


def matrix_params(model: ModelConfig, par: ParallelConfig) -> MatrixParams:
    """Values of the matrices of one layer of each kind on one GPU of layout `par`."""
    return _matrices_per_gpu(model, par, lambda t: t.values)


def matrix_bytes(model: ModelConfig, par: ParallelConfig,
                 weight_dtype: WeightDType = "fp8") -> MatrixParams:
    """Bytes of the same matrices as the engine holds them (weight_bytes' tensors): what a step
    reads of each, FP8 scales included; kv_b_proj, router, weights_proj, eh_proj and lm_head
    at their own dtype in every mode."""
    fmt, block = weight_format(weight_dtype), fp8_block(model)
    return _matrices_per_gpu(model, par, lambda t: t.nbytes(fmt, block))


def matrix_flops_per_token(model: ModelConfig, par: ParallelConfig) -> int:
    """FLOPs of one token's pass through every main-model layer's matrices on the GPU that
    computes its row (projections, dense MLPs, shared experts and router, its
    num_experts_per_tok routed experts; not the lm_head, which only sampled rows reach). The
    routed experts cost k / tp whole experts per row either way: split over TP, or whole under
    EP, where the TP ranks share their rows and the group's assignments spread over its GPUs."""
    w = matrix_params(model, par)
    num_moe = sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))
    num_dense = model.num_hidden_layers - num_moe
    routed = (model.num_experts_per_tok * 3 * model.hidden_size * model.moe_intermediate_size
              // par.tensor_parallel_size)
    params = (model.num_hidden_layers * w.attn + len(model.full_indexer_layers) * w.indexer
              + num_dense * w.dense_mlp + num_moe * (w.moe_shared + routed))
    return 2 * params


# ---- FP8 products as dsaserve's engine runs them -------------------------------------------------
# The engine's kernel choice for FP8 matrices and bf16 activations, restated here so that the plan
# imports no kernel module (tests/unit/test_plan.py holds each equal to the engine's constant).
FP8_WEIGHT_BLOCK = 128  # kernels/fp8_weights.FP8_BLOCK: the weights' scale block
FP8_WEIGHT_ONLY_MAX_ROWS = 64  # kernels/triton/fp8_linear.WEIGHT_ONLY_MAX_M
FP8_W8A8_MAX_ROWS = 256  # kernels/triton/fp8_linear.W8A8_MAX_M
FP8_W8A8_NARROW_TILE = (64, 64)  # kernels/triton/fp8_w8a8.TILES[-1]: fills_device counts it
FP8_CUBLAS_K_MULTIPLE = 512  # fp8_w8a8.CUBLAS_ROWS × FP8_BLOCK: cuBLAS's block-scaled K
FP8_EXPERTS_W8A8_MIN_MEAN_ROWS = 16  # model/moe_compute.W8A8_GROUPED_MIN_MEAN_ROWS (exclusive)
FP8_EXPERTS_W8A8_MAX_MEAN_ROWS = 64  # model/moe_compute.TRITON_GROUPED_MAX_MEAN_ROWS
# SMs of an H100 or H200 SXM, the GPUs the engine's thresholds were measured on: whether a
# 65–256-row product fills the device depends on it.
DEVICE_SMS = 132


def fp8_dense_path(rows: float, n: int, k: int, aligned: bool,
                   num_sms: int = DEVICE_SMS) -> Fp8Path:
    """The kernel dsaserve's engine multiplies [rows, k] bf16 activations by an [n, k] FP8
    matrix with (kernels/triton/fp8_linear.takes_w8a8); `aligned`: the matrix's shard starts on
    a scale block in both dimensions (a TP cut inside a block leaves an offset).

        rows    1 ... 64      65 ... 256                 257 ...
                weight-only   W8A8 (Triton or cuBLAS)    W8A8 (cuBLAS) where n % 128 = 0,
                              where the narrowest tiles  k % 512 = 0 and aligned; else the
                              give half the SMs a        weight dequantized to bf16 + cuBLAS
                              program; else dequantized

    Rows split over PCP ranks may be fractional here: a GPU multiplies whole rows."""
    m = math.ceil(rows)
    if m <= FP8_WEIGHT_ONLY_MAX_ROWS:
        return "weight-only"
    if m <= FP8_W8A8_MAX_ROWS:
        tile_m, tile_n = FP8_W8A8_NARROW_TILE
        programs = -(-m // tile_m) * -(-n // tile_n)
        return "w8a8" if 2 * programs >= num_sms else "dequantized"
    cublas = aligned and n % FP8_WEIGHT_BLOCK == 0 and k % FP8_CUBLAS_K_MULTIPLE == 0
    return "w8a8" if cublas else "dequantized"


def fp8_experts_path(mean_rows: float) -> Fp8Path:
    """The kernel dsaserve's engine runs FP8 routed experts with, by the mean (token, expert)
    pairs per held expert (model/moe_compute.w8a8_experts): W8A8 grouped from just above 16 up
    to 64 (MTP verification of large batches), else the FP8 grouped kernel, which dequantizes
    each tile and multiplies on bf16 tensor cores (decode; prefill at larger tiles)."""
    if FP8_EXPERTS_W8A8_MIN_MEAN_ROWS < mean_rows <= FP8_EXPERTS_W8A8_MAX_MEAN_ROWS:
        return "w8a8"
    return "weight-only"


@dataclass(frozen=True)
class Fp8Gemm:
    """One product of FP8-held matrices one GPU runs per layer, [rows, k] · [n, k]ᵀ: projections
    that read one input are one product (model/fused.py), so `n` is the group's and `values`
    are its matrices' by the part (a MatrixParams field) each belongs to."""

    n: int
    k: int
    aligned: bool  # every rank's shard starts on a scale block (cuBLAS needs it)
    values: tuple[tuple[Part, int], ...]

    def path(self, rows: float, num_sms: int = DEVICE_SMS) -> Fp8Path:
        return fp8_dense_path(rows, self.n, self.k, self.aligned, num_sms)


def _shard(size: int, ways: int) -> tuple[int, bool]:
    """One rank's extent of a dimension split `ways` ways, and whether every rank's range starts
    on a scale block."""
    per = size // ways
    return per, ways == 1 or per % FP8_WEIGHT_BLOCK == 0


def _fused(members: Sequence[tuple[Part, int, bool]], k: int, k_aligned: bool,
           whole_blocks: bool = False) -> list[Fp8Gemm]:
    """Projections (part, rows n, starts on a block) of one input of width k, as model/fused.py
    merges them: one product when none starts inside a scale block and at most one ends inside
    one (it goes last), else each apart; `whole_blocks`: the merged rows padded with zeros to a
    whole block (its FLOPs, ≤ 127 rows, not counted), as the engine pads q_a + wk + kv_a."""
    partial = sum(n % FP8_WEIGHT_BLOCK != 0 for _, n, _ in members)
    if len(members) > 1 and all(start for _, _, start in members) and partial <= 1:
        rows = sum(n for _, n, _ in members)
        if whole_blocks:
            rows = -(-rows // FP8_WEIGHT_BLOCK) * FP8_WEIGHT_BLOCK
        return [Fp8Gemm(rows, k, k_aligned, tuple((part, n * k) for part, n, _ in members))]
    return [Fp8Gemm(n, k, start and k_aligned, ((part, n * k),)) for part, n, start in members]


def _glu_mlp(part: Part, inter: int, hidden: int, tp: int) -> list[Fp8Gemm]:
    """An MLP split over TP: [gate | up] by rows, then down by columns."""
    i, i_aligned = _shard(inter, tp)
    return (_fused([(part, i, i_aligned), (part, i, i_aligned)], hidden, True)
            + [Fp8Gemm(hidden, i, i_aligned, ((part, hidden * i),))])


def fp8_gemms(model: ModelConfig, par: ParallelConfig, indexer: bool) -> tuple[Fp8Gemm, ...]:
    """The FP8 products of a layer on one GPU as the engine runs them (model/dsa.py's
    fuse_projections), `indexer`: the layer runs its own indexer:

        x_proj    [q_a | wk | kv_a] · x            replicated (wk on indexer layers only)
        qr_proj   [q_b / tp | wq_b] · q latent     (wq_b on indexer layers only)
        o_proj    · (heads / tp) × v_head_dim
        gate_up   [gate | up] / tp · x             the dense MLP's and the shared experts'
        down      · intermediate / tp              (a layer runs one of the two)

    Their values are matrix_params's FP8-held ones (tests/unit/test_plan.py); routed experts
    are priced by fp8_experts_path."""
    m, h, tp = model, model.hidden_size, par.tensor_parallel_size
    q_b, q_b_aligned = _shard(m.num_attention_heads * m.qk_head_dim, tp)
    o_k, o_aligned = _shard(m.num_attention_heads * m.v_head_dim, tp)
    wk = [("indexer", m.index_head_dim, True)] if indexer else []
    wq_b = [("indexer", m.index_n_heads * m.index_head_dim, True)] if indexer else []
    return tuple(
        _fused([("attn", m.q_lora_rank, True), *wk, ("attn", m.kv_cache_width, True)], h, True,
               whole_blocks=True)
        + _fused([("attn", q_b, q_b_aligned), *wq_b], m.q_lora_rank, True, whole_blocks=True)
        + [Fp8Gemm(h, o_k, o_aligned, (("attn", h * o_k),))]
        + _glu_mlp("dense_mlp", m.intermediate_size, h, tp)
        + _glu_mlp("moe_shared", m.moe_intermediate_size * m.n_shared_experts, h, tp))


def matmul_seconds(gemms: Sequence[Fp8Gemm], w: MatrixParams, part: Part, rows: float,
                   rate: Callable[[Fp8Path | None], float]) -> float:
    """Seconds `rows` rows take through `part`'s matrices on one GPU at the tensor-core rate
    alone: each FP8 product at `rate` of the kernel its rows take, the matrices held
    unquantized at rate(None). `rate` in FLOP/s (a WeightFormat's matmul_tflops)."""
    fp8 = 0
    seconds = 0.0
    for g in gemms:
        values = sum(v for p, v in g.values if p == part)
        if values:
            fp8 += values
            seconds += values / rate(g.path(rows))
    return 2 * rows * (seconds + (getattr(w, part) - fp8) / rate(None))


def prefill_matrices_tflops(model: ModelConfig, par: ParallelConfig, weight_dtype: WeightDType,
                            tokens: int, bf16: float, fp8: float) -> float:
    """The rate matrix_flops_per_token's matrices run at in a prefill step of `tokens` prompt
    tokens, from a GPU's dense bf16 and FP8 ceilings: their FLOPs over the time each product
    takes at its kernel's rate (one rate in the fixed weight modes). Each GPU multiplies its
    tokens / pcp rows; the routed experts see tokens · k / E rows each (EP gathers every rank's
    tokens; without it a GPU's own)."""
    fmt = weight_format(weight_dtype)
    if fmt.matmul != "by-rows":
        return fmt.matmul_tflops(bf16, fp8)

    def rate(path: Fp8Path | None) -> float:
        return fmt.matmul_tflops(bf16, fp8, path)

    w = matrix_params(model, par)
    rows = tokens / par.prefill_context_parallel_size
    with_idx, without = (fp8_gemms(model, par, True), fp8_gemms(model, par, False))
    num_moe = sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))
    num_idx = len(model.full_indexer_layers)
    seconds = (num_idx * matmul_seconds(with_idx, w, "attn", rows, rate)
               + (model.num_hidden_layers - num_idx) * matmul_seconds(without, w, "attn", rows,
                                                                       rate)
               + num_idx * matmul_seconds(with_idx, w, "indexer", rows, rate)
               + (model.num_hidden_layers - num_moe) * matmul_seconds(with_idx, w, "dense_mlp",
                                                                       rows, rate)
               + num_moe * matmul_seconds(with_idx, w, "moe_shared", rows, rate))
    k, e = model.num_experts_per_tok, model.n_routed_experts
    expert_tokens = tokens if par.enable_expert_parallel else rows
    routed = rows * k * 3 * model.hidden_size * model.moe_intermediate_size / (
        par.tensor_parallel_size)
    seconds += num_moe * 2 * routed / rate(fp8_experts_path(expert_tokens * k / e))
    return matrix_flops_per_token(model, par) * rows / seconds


# ---- prefill FLOPs: indexer against sparse MLA ---------------------------------------------------
def indexer_flops_per_pair(model: ModelConfig) -> int:
    """One (query, key) score on one indexer layer: per head a dot product (2·head_dim) plus the
    weight multiply and the sum over heads of the ReLU'd score (2)."""
    return 2 * model.index_n_heads * (model.index_head_dim + 1)


@dataclass(frozen=True)
class PrefillFlops:
    """Per-GPU prefill FLOPs of one prompt, main-model layers: attention scoring (indexer,
    sparse MLA) and, apart, the weight matrices (`matrices`), which grow with the prompt only.

    Query at position p (0-based) sees p + 1 keys (causal, itself included):
        indexer(L) = a · Σ_{p<L} (p + 1)            = a · L(L+1)/2
        mla(L)     = b · Σ_{p<L} min(p + 1, K)      = b · (K·L − K(K−1)/2)   for L ≥ K
    with a = pair FLOPs · indexer layers / pcp and b = 2,176 · heads/tp · layers / pcp.
    """

    indexer_per_key: float  # a: FLOPs per (query, key) pair per GPU, all indexer layers
    mla_per_row: float  # b: FLOPs per (query, selected row) per GPU, all layers
    topk: int  # K
    matrices_per_token: float  # FLOPs of the weight matrices per prompt token per GPU

    def matrices(self, length: int) -> float:
        return self.matrices_per_token * length

    def indexer(self, length: int) -> float:
        return self.indexer_per_key * length * (length + 1) / 2

    def mla(self, length: int) -> float:
        k = self.topk
        rows = length * (length + 1) // 2 if length <= k else k * length - k * (k - 1) // 2
        return self.mla_per_row * rows

    @property
    def asymptotic_crossover(self) -> float:
        """Where a·L²/2 = b·K·L: the crossover if every query read K rows (2·K·b/a)."""
        return 2 * self.topk * self.mla_per_row / self.indexer_per_key

    @property
    def crossover(self) -> int:
        """Smallest prompt length whose cumulative indexer FLOPs reach the sparse-MLA FLOPs.

        Below K both grow as L(L+1)/2 (ratio a/b); above K solve a·L(L+1)/2 = b·(K·L − K(K−1)/2),
        i.e. a·L² + (a − 2bK)·L + bK(K−1) = 0, larger root, then step to the exact integer.
        """
        a, b, k = self.indexer_per_key, self.mla_per_row, self.topk
        if a >= b:
            return 1
        c1 = a - 2 * b * k
        disc = c1 * c1 - 4 * a * b * k * (k - 1)
        length = max(k, math.floor((-c1 + math.sqrt(max(disc, 0.0))) / (2 * a)) - 1)
        while self.indexer(length) < self.mla(length):
            length += 1
        while length > 1 and self.indexer(length - 1) >= self.mla(length - 1):
            length -= 1
        return length


def prefill_flops(model: ModelConfig, par: ParallelConfig) -> PrefillFlops:
    pcp, tp = par.prefill_context_parallel_size, par.tensor_parallel_size
    heads_per_gpu = model.num_attention_heads // tp
    return PrefillFlops(
        # the indexer is replicated across TP: every TP rank scores all its query rows
        indexer_per_key=indexer_flops_per_pair(model) * len(model.full_indexer_layers) / pcp,
        mla_per_row=mla_flops_per_row_head(model) * heads_per_gpu * model.num_hidden_layers / pcp,
        topk=model.index_topk,
        matrices_per_token=matrix_flops_per_token(model, par) / pcp,
    )


# ---- DCP all-gather during prefill ---------------------------------------------------------------
@dataclass(frozen=True)
class DCPGatherCost:
    """Per prefill step: each layer all-gathers the DCP shards of the cached context into a full
    temporary copy (rows as stored in the cache). Each GPU receives the N−1 shards it does not own:

        rank:     0      1     ...   N-1
        shard:  [S_0]  [S_1]   ...  [S_N-1]     S = ceil(context / N) rows each
        rank r receives (N − 1)·S rows per layer

    Time is the received bytes at the GPU's per-direction link bandwidth (a ring or switch
    all-gather moves each byte into a rank once)."""

    dcp: int
    context: int
    mla_layer_bytes: int  # received per GPU per MLA layer
    indexer_layer_bytes: int  # received per GPU per indexer layer
    num_mla_layers: int  # every layer with KV, MTP included
    num_indexer_layers: int
    link_bytes_per_s: float

    @property
    def step_bytes(self) -> int:
        return (self.num_mla_layers * self.mla_layer_bytes
                + self.num_indexer_layers * self.indexer_layer_bytes)

    @property
    def mla_layer_seconds(self) -> float:
        return self.mla_layer_bytes / self.link_bytes_per_s

    @property
    def indexer_layer_seconds(self) -> float:
        return self.indexer_layer_bytes / self.link_bytes_per_s

    @property
    def step_seconds(self) -> float:
        return self.step_bytes / self.link_bytes_per_s


def dcp_gather_cost(
    kv: KVBytesPerToken, context: int, dcp: int, link_gbps: float
) -> DCPGatherCost:
    received_rows = (dcp - 1) * -(-context // dcp)
    return DCPGatherCost(
        dcp=dcp,
        context=context,
        mla_layer_bytes=received_rows * kv.mla_row,
        indexer_layer_bytes=received_rows * kv.indexer_key,
        num_mla_layers=kv.num_layers + kv.num_mtp_layers,
        num_indexer_layers=kv.num_indexer_layers + kv.num_mtp_layers,
        link_bytes_per_s=link_gbps * 1e9,
    )


# ---- HiSparse decode concurrency -----------------------------------------------------------------
@dataclass(frozen=True)
class HiSparseConcurrency:
    """Requests of `context` tokens one decode replica (DCP 1) can hold.

    All-HBM: each request keeps its whole KV on GPU. HiSparse: the MLA rows of every layer live in
    the pinned host pool (admission reserves the whole request there); the GPU keeps all indexer
    keys, a hot buffer of `hot_rows` rows per MLA layer and the write-tail pages."""

    context: int
    kv_room: int  # GPU bytes for KV
    host_pool_bytes: int
    hot_rows: int
    gpu_bytes_full: int  # per request, everything on GPU
    host_bytes: int  # per request, MLA rows of every layer in the host pool
    gpu_bytes_hisparse: int  # per request under HiSparse

    @property
    def by_hbm_full(self) -> int:
        return max(self.kv_room, 0) // self.gpu_bytes_full

    block_size: int = PAGE_TOKENS  # the host pool's block (admission reserves whole blocks)
    lookahead: int = 0  # MTP lookahead tokens a prefill's pages cover past the window
    num_speculative_tokens: int = 0  # MTP drafts per step (their rows are in the write tail)
    mla_bytes_per_token: int = 0  # MLA rows of every layer (the MTP layer's included)
    index_bytes_per_token: int = 0  # indexer keys of every indexer layer
    pd_decode: bool = False  # a P/D decode engine: its pages hold short local prompts only

    @property
    def by_host(self) -> int:
        """What the engine's scheduler admits: the same function (kv/hisparse/admission.py)."""
        per_token = self.host_bytes // self.context
        return hisparse_admission(self.host_pool_bytes, per_token, self.context,
                                  self.block_size).max_requests

    @property
    def by_hbm_hisparse(self) -> int:
        return max(self.kv_room, 0) // self.gpu_bytes_hisparse

    @property
    def hisparse(self) -> int:
        return min(self.by_host, self.by_hbm_hisparse)

    @property
    def bound(self) -> str:
        return "host memory" if self.by_host <= self.by_hbm_hisparse else "HBM"

    @property
    def mla_sizing(self) -> MlaPageSizing | None:
        """What `hisparse_config.device_mla_pages: "auto"` chooses for this KV room and host
        pool: the engine's own function (kv/hisparse/admission.py); None when not one request
        fits."""
        b = self.block_size
        if self.by_host < 1:
            return None
        try:
            return size_mla_pages(
                max_requests=self.by_host, window_tokens=self.context + self.lookahead,
                block_size=b, tail_pages=write_tail_pages(self.num_speculative_tokens, b),
                mla_page_bytes=b * self.mla_bytes_per_token,
                index_page_bytes=b * self.index_bytes_per_token,
                hot_bytes_per_request=hot_region_rows(self.hot_rows, b) * self.mla_bytes_per_token,
                kv_bytes=max(self.kv_room, 0),
                prefill_tokens=(pd_decode_prefill_tokens(self.hot_rows, self.lookahead)
                                if self.pd_decode else None))
        except ConfigError:
            return None

    @property
    def mla_pages(self) -> int:
        """`hisparse_config.device_mla_pages` "auto" would choose (0: no spilling, or nothing
        fits)."""
        sizing = self.mla_sizing
        return 0 if sizing is None else sizing.num_mla_pages


def hisparse_concurrency(
    kv: KVBytesPerToken, context: int, kv_room: int, host_pool_bytes: int, hot_rows: int,
    block_size: int = PAGE_TOKENS, pd_decode: bool = False,
) -> HiSparseConcurrency:
    mla_layers = kv.num_layers + kv.num_mtp_layers
    gpu_rows_per_layer = min(context, hot_rows + HISPARSE_TAIL_PAGES * PAGE_TOKENS)
    return HiSparseConcurrency(
        context=context,
        kv_room=kv_room,
        host_pool_bytes=host_pool_bytes,
        hot_rows=hot_rows,
        gpu_bytes_full=context * kv.total,
        host_bytes=context * kv.mla_all_layers,
        gpu_bytes_hisparse=context * kv.indexer_all_layers
        + gpu_rows_per_layer * mla_layers * kv.mla_row,
        block_size=block_size,
        lookahead=MTP3_LOOKAHEAD if kv.num_mtp_layers else 0,
        num_speculative_tokens=MTP3_LOOKAHEAD + 1 if kv.num_mtp_layers else 0,
        mla_bytes_per_token=kv.mla_all_layers,
        index_bytes_per_token=kv.indexer_all_layers,
        pd_decode=pd_decode,
    )
