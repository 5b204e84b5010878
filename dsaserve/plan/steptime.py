"""How long one engine step takes on one GPU, from the measured parts (plan/parts.py).

A step is what the scheduler emits: per request, `n` new tokens whose context after the step is
`ctx` tokens. The model prices one GPU of the engine (all GPUs of a replica do the same work in
lock-step) layer by layer:

    gemm      dense projections, dense MLPs, shared experts, router, lm_head, MTP eh_proj:
              max(FLOPs at the matmul rate of the weight mode (costmodel.WeightFormat: FP8 for
              W8A8, the default; bf16 for weight-only FP8 and bf16 weights; for fp8-dsaserve,
              the engine on CUDA, each FP8 product at the rate of the kernel the step's rows
              take, costmodel.fp8_dense_path), bytes at the HBM rate) — decode reads every
              matrix once a step, at
              the bytes the engine holds it in (costmodel.matrix_bytes, weight_bytes' tensors:
              FP8 matrices 1 B a value plus their block scales; kv_b_proj, router,
              weights_proj, eh_proj and lm_head as stored; everything 2 B in bf16)
    moe       routed experts: the same max(), over the experts this GPU holds that the step's
              tokens touch (EP: the whole engine's tokens are dispatched to it); fp8-dsaserve
              multiplies at the rate of the kernel their mean rows per expert take
              (costmodel.fp8_experts_path)
    indexer   prefill rows: causal (query, key) pairs at the measured prefill rate; decode rows:
              the FP8 keys read at the measured decode rate (DCP: this rank's 1/N of them)
    mla       decode rows: the measured 64-head decode curve, scaled by the keys and heads of this
              GPU; prefill rows: FLOPs at the measured prefill rate
    small     the kernels the parts above do not price (norms, rotary, top-k, routing,
              copies, small-batch latency floors): a measured time per layer run, whatever the
              batch (Parts.layer_kernels_us)
    comm      TP all-reduces, EP dispatch/combine, PCP gathers of new rows and cached contexts,
              DCP merges: bytes over NVLink plus one latency per collective
    cpu       the engine's host time not hidden by the kernels (plan/hosttime.py: fitted from the
              measured decode and prefill steps, by step kind; graphed decode steps barely grow
              with layers, eager and prefill steps do). The engine is synchronous per step:
              the step is the kernels + cpu; with async scheduling (host work overlapping the
              previous step's kernels) it is max(kernels, cpu)
    host      hybrid HiSparse: the hot-buffer misses of decode rows whose context outgrows the
              buffer, 656-byte rows over the host link (not overlapped with compute, as built)

Rows: under PCP a prefill chunk's rows are split over the group, decode rows are replicated
(DESIGN §5). A row is a decode row when its request computes at most 1 + k tokens (k MTP drafts
verified); with MTP, the MTP layer then runs over every row of the step, and each request that
samples runs it k − 1 more times on one row (spec/mtp.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dsaserve.config import ModelConfig, ParallelConfig
from dsaserve.plan import costmodel as cm
from dsaserve.plan.hosttime import H200_HOST, HostFits, HostTimeModel
from dsaserve.plan.parts import Parts

BF16 = 2
MLA_OUT_BYTES = 2 * 512 + 4  # one head's bf16 latent output and its fp32 LSE (DCP merge)


GPU_PARTS = ("gemm", "moe", "indexer", "mla", "small", "comm", "host")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one GPU, by part: the GPU's (GPU_PARTS; `host` is the host link's
    HiSparse reads, which the GPU waits for) and the engine's host time (`cpu`)."""

    gemm: float = 0.0
    moe: float = 0.0
    indexer: float = 0.0
    mla: float = 0.0
    small: float = 0.0
    comm: float = 0.0
    host: float = 0.0
    cpu: float = 0.0
    cpu_overlaps: bool = False  # async scheduling: the host work runs under the kernels

    @property
    def gpu(self) -> float:
        return sum(getattr(self, name) for name in GPU_PARTS)

    @property
    def total(self) -> float:
        return max(self.gpu, self.cpu) if self.cpu_overlaps else self.gpu + self.cpu

    @property
    def bound(self) -> str:
        """The largest part: what limits this step."""
        return max((*GPU_PARTS, "cpu"), key=lambda name: getattr(self, name))

    def __add__(self, other: StepTime) -> StepTime:
        return replace(self, **{name: getattr(self, name) + getattr(other, name)
                                for name in (*GPU_PARTS, "cpu")})


@dataclass(frozen=True)
class HiSparseReads:
    """Hybrid HiSparse decode as the simulator models it: a request whose context exceeds
    `hot_rows` reads its selected rows through its hot buffer, and of each layer's top-k the
    rows the previous step did not select (1 − `overlap`) miss and come from the host pool."""

    hot_rows: int
    overlap: float


@dataclass(frozen=True)
class _Layers:
    """How many layers of each kind a forward runs."""

    all: int
    moe: int
    dense: int
    indexer: int  # layers that run their own indexer (IndexShare layers reuse its top-k)


class StepTimeModel:
    """Prices steps of one engine replica (`par`: its tp, pcp, dcp, ep; dp = replicas that run
    in lock-step with it when their experts are shared over EP)."""

    def __init__(self, model: ModelConfig, par: ParallelConfig, parts: Parts,
                 kv_dtype: cm.KVDType = "fp8_ds_mla", num_drafts: int = 0,
                 hisparse: HiSparseReads | None = None, *, graphs: bool = True,
                 async_scheduling: bool = False, block_size: int = 64,
                 host_fits: HostFits = H200_HOST, weight_dtype: cm.WeightDType = "fp8",
                 draft_vocab: int = 0) -> None:
        """`hisparse`: decode rows read through hot buffers (None: from GPU pages). `graphs`:
        decode-only steps replay CUDA graphs (the engine's default; False: --enforce-eager);
        `async_scheduling`: the engine's host work overlaps the kernels (the engine's
        --async-scheduling: docs/decode.md). `weight_dtype`: the weight mode
        (costmodel.WEIGHT_FORMATS), which sets the matrices' matmul rate and the bytes a step
        reads of them. `draft_vocab`: the tokens the drafts' head keeps (SpecConfig's
        draft_vocab; 0: every token)."""
        cm.check_layout(model, par)
        self.hisparse = hisparse
        self.model, self.par, self.parts = model, par, parts
        self.num_drafts = num_drafts  # MTP drafts per step (0: no speculative decoding)
        self.draft_vocab = draft_vocab
        self.decode_rows = 1 + num_drafts  # a request's rows in a decode (verify) step
        self.kv = cm.kv_bytes_per_token(model, kv_dtype)
        self.tp, self.pcp, self.dcp = (par.tensor_parallel_size,
                                       par.prefill_context_parallel_size,
                                       par.decode_context_parallel_size)
        self.heads = model.num_attention_heads // self.tp
        self.ep = cm.expert_shards(par)  # ways the routed experts are split
        self.num_moe = sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))
        self.num_dense = model.num_hidden_layers - self.num_moe
        self.num_indexer = len(model.full_indexer_layers)
        self.w = cm.matrix_params(model, par)  # values: FLOPs
        self.w_bytes = cm.matrix_bytes(model, par, weight_dtype)  # held bytes: reads
        self.weights = cm.weight_format(weight_dtype)
        # the FP8 products of a layer with its own indexer (True) and of one without
        self._fp8_gemms = {idx: cm.fp8_gemms(model, par, idx) for idx in (True, False)}
        # Measured decode cost of one query row at 64 heads over top-k keys, and the roofline's
        # bound for it, so that other head counts scale by their own bound (memory or compute).
        self._mla_row_roof64 = self._mla_row_roofline(64)
        self.async_scheduling = async_scheduling
        self.cpu = HostTimeModel(model.num_hidden_layers, num_drafts, graphs,
                                 block_size * self.dcp, parts.kernel_overhead_us.value * 1e-6,
                                 host_fits)

    # ---- set-up ---------------------------------------------------------------------------------
    def _mla_row_roofline(self, heads: int) -> float:
        """Seconds one decode row takes at the roofline of this GPU's measured ceilings."""
        cost = cm.sparse_mla_cost(self.model, self.kv.kv_dtype, heads)
        return max(cost.bytes / (self.parts.hbm_tbps.value * 1e12),
                   cost.flops / (self.parts.matmul_bf16_tflops.value * 1e12))

    def _matmul(self, path: cm.Fp8Path | None) -> float:
        """FLOP/s of a product on kernel `path` (None: a matrix held unquantized)."""
        return self.weights.matmul_tflops(self.parts.matmul_bf16_tflops.value,
                                          self.parts.matmul_fp8_tflops.value, path) * 1e12

    # ---- pricing --------------------------------------------------------------------------------
    def step(self, batch: Sequence[tuple[int, int]], engine_tokens: int | None = None,
             num_sampled: int | None = None, drafting: Sequence[int] = ()) -> StepTime:
        """One step of this replica: `batch` = (new tokens, context after the step) per request.

        `engine_tokens`: tokens of every replica that shares this one's experts over EP in the
        same step (lock-step DP); defaults to this replica's. `num_sampled`: rows that reach the
        lm_head (default: one per request). `drafting`: the context of each request whose MTP
        layer then drafts `num_drafts` tokens (`_kernels`). A prefill or mixed step runs eager:
        its host work beyond the exposed part hides under the kernels that a step of the same
        requests as decode rows would not have (plan/hosttime.py)."""
        if not batch:
            return StepTime()
        t = self._kernels(batch, engine_tokens, num_sampled, drafting)
        prefill = any(n > self.decode_rows for n, _ in batch)
        long_kernels = 0.0
        if prefill:  # what the same requests' kernels take as decode rows: the rest hides issue
            short = self._kernels([(min(n, self.decode_rows), c) for n, c in batch], None,
                                  None, drafting)
            long_kernels = max(t.gpu - short.gpu, 0.0)
        chunks = [(n, c - n) for n, c in batch if n > self.decode_rows]
        tokens = sum(n for n, _ in chunks)
        cached = sum(n * d for n, d in chunks) / tokens if tokens else 0.0
        cpu = self.cpu.step([c for _, c in batch], prefill, bool(drafting) and self.num_drafts > 0,
                            long_kernels, tokens / self.pcp, cached)
        t = t + StepTime(host=self._hot_misses(batch), cpu=cpu)
        return replace(t, cpu_overlaps=self.async_scheduling)

    def _kernels(self, batch: Sequence[tuple[int, int]], engine_tokens: int | None,
                 num_sampled: int | None, drafting: Sequence[int]) -> StepTime:
        """The step's GPU kernels: the target forward and its lm_head, then with MTP the MTP
        layer over every row of the step (its step 0, which fills its cache: prefill chunks
        included) and, for each drafting request, k − 1 more one-row MTP forwards and k lm_heads
        (spec/mtp.py; `_draft_lm_head`)."""
        m = self.model
        sampled = len(batch) if num_sampled is None else num_sampled
        main = _Layers(m.num_hidden_layers, self.num_moe, self.num_dense, self.num_indexer)
        t = self._forward(batch, engine_tokens, main) + StepTime(gemm=self._gemm("lm_head",
                                                                                 sampled))
        forwards = m.num_hidden_layers
        if self.num_drafts:
            mtp = _Layers(1, 1, 0, 1)
            rows = sum(n if n <= self.decode_rows else n / self.pcp for n, _ in batch)
            # eh_proj on [embedding | hidden] of every row, then the layer
            t = t + self._forward(batch, engine_tokens, mtp) + StepTime(
                gemm=self._gemm("mtp_proj", rows))
            forwards += 1
            if drafting:
                d = len(drafting)
                ep_rows = None if engine_tokens is None else engine_tokens * d // len(batch)
                one = self._forward([(1, c) for c in drafting], ep_rows, mtp) + StepTime(
                    gemm=self._gemm("mtp_proj", d))
                for _ in range(self.num_drafts - 1):
                    t = t + one
                t = t + StepTime(gemm=self.num_drafts * self._draft_lm_head(d))
                forwards += self.num_drafts - 1
        return t + StepTime(small=forwards * self.parts.layer_kernels_us.value * 1e-6)

    def _draft_lm_head(self, rows: float) -> float:
        """One draft's argmax over `rows` rows: lm_head as held, or in fp8-dsaserve its FP8
        copy (SpecConfig.draft_lm_head, the engine's default with FP8 weights kept): one byte a
        value and an fp32 scale per 128 × 128 block, at the rate of the kernel its rows take.
        With a draft vocabulary, its rows only: under TP an equal part per rank
        (parallel/vocab.py's balanced_rows)."""
        h = self.model.hidden_size
        held = self.w.lm_head // h  # this GPU's rows of lm_head
        keep = -(-self.draft_vocab // self.tp) if self.draft_vocab else held
        if self.weights.matmul != "by-rows":
            return keep / held * self._gemm("lm_head", rows)
        copy = cm.Tensor("lm_head", keep, h, held="fp8")
        nbytes = copy.nbytes(self.weights, cm.fp8_block(self.model))
        path = cm.fp8_dense_path(rows, copy.rows, h, aligned=True)
        return max(2 * rows * keep * h / self._matmul(path),
                   nbytes / (self.parts.hbm_tbps.value * 1e12))

    def _hot_misses(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds of host-link reads for the step's hot-buffer misses: per hot decode request
        and MLA layer (the MTP layer's included), (1 − overlap) × top-k rows of 656 B. A
        verify step's 1 + k rows select nearly the same rows, so they count once."""
        hs = self.hisparse
        if hs is None:
            return 0.0
        topk = self.model.index_topk
        hot = sum(min(c, topk) for n, c in batch if n <= self.decode_rows and c > hs.hot_rows)
        rows = hot * (1 - hs.overlap) * (self.kv.num_layers + self.kv.num_mtp_layers)
        return rows * self.kv.mla_row / (self.parts.host_gbps.value * 1e9)

    def _gemm(self, part: cm.Part, n_rows: float, indexer_layer: bool = True) -> float:
        """The matrices of `part` (a MatrixParams field) times `n_rows` rows: compute or
        weight reads. `indexer_layer`: the layer runs its own indexer, whose projections are
        fused with attention's (costmodel.fp8_gemms)."""
        gemms = self._fp8_gemms[indexer_layer]
        return max(cm.matmul_seconds(gemms, self.w, part, n_rows, self._matmul),
                   getattr(self.w_bytes, part) / (self.parts.hbm_tbps.value * 1e12))

    def _forward(self, batch: Sequence[tuple[int, int]], engine_tokens: int | None,
                 layers: _Layers) -> StepTime:
        """`layers` decoder layers over `batch` on this GPU (no lm_head, no fixed costs)."""
        p, m = self.parts, self.model
        hbm = p.hbm_tbps.value * 1e12
        decode = [(n, c) for n, c in batch if n <= self.decode_rows]
        prefill = [(n, c) for n, c in batch if n > self.decode_rows]
        rows = sum(n for n, _ in decode) + sum(n for n, _ in prefill) / self.pcp  # this GPU
        tokens = sum(n for n, _ in batch)
        gemm = self._gemm

        # 1. dense matrices
        w = self.w
        g = (layers.indexer * (gemm("attn", rows) + gemm("indexer", rows))
             + (layers.all - layers.indexer) * gemm("attn", rows, indexer_layer=False))
        g += layers.dense * gemm("dense_mlp", rows) + layers.moe * gemm("moe_shared", rows)

        # 2. routed experts: the tokens dispatched here, the distinct experts they touch
        engine = tokens if engine_tokens is None else engine_tokens
        k, e = m.num_experts_per_tok, m.n_routed_experts
        if self.par.enable_expert_parallel:
            assignments = engine * k / self.ep
            touched = w.experts_here * (1 - (1 - 1 / e) ** (engine * k))
        else:
            assignments = rows * k
            touched = e * (1 - (1 - 1 / e) ** (rows * k))
        # the kernel follows the mean pairs per held expert (EP: assignments over 1/ep of them)
        rate = self._matmul(cm.fp8_experts_path(assignments / w.experts_here))
        moe = layers.moe * max(2 * assignments * w.expert / rate,
                               touched * self.w_bytes.expert / hbm)

        # 3. indexer (replicated over TP: every TP rank scores every key)
        pairs = sum(n * (c - (n - 1) / 2) for n, c in prefill) / self.pcp
        keys = sum(c for _, c in decode) / self.dcp
        idx = layers.indexer * (
            pairs * cm.indexer_flops_per_pair(m) / (p.indexer_prefill_tflops.value * 1e12)
            + keys * self.kv.indexer_key / (p.indexer_decode_tbps.value * 1e12))

        # 4. sparse MLA: decode rows on the measured curve, prefill rows at the measured rate
        topk = m.index_topk
        scale = self._mla_row_roofline(self.heads) / self._mla_row_roof64
        dec_rows = sum(n * min(c, topk) / topk for n, c in decode) / self.dcp * scale
        mla_dec = p.mla_decode_us(dec_rows) * 1e-6
        flops = sum(n * min(c, topk) for n, c in prefill) / self.pcp * self.heads * \
            cm.mla_flops_per_row_head(m)
        mla = layers.all * (mla_dec + flops / (p.mla_prefill_tflops.value * 1e12))

        # 5. collectives, per layer
        link, lat = p.nvlink_gbps.value * 1e9, p.collective_latency_us.value * 1e-6
        comm = 0.0
        per_layer_bytes = 0.0
        collectives = 0
        if self.tp > 1:  # attention output and MoE output all-reduced
            per_layer_bytes += 2 * 2 * rows * m.hidden_size * BF16 * (self.tp - 1) / self.tp
            collectives += 2
        if self.par.enable_expert_parallel and self.ep > 1:  # dispatch + combine
            per_layer_bytes += 2 * assignments * m.hidden_size * BF16 * (self.ep - 1) / self.ep
            collectives += 2
        if self.pcp > 1 and prefill:  # new rows gathered; cached contexts gathered (DCP shards)
            new = sum(n for n, _ in prefill)
            per_layer_bytes += new * (self.kv.mla_row + self.kv.indexer_key) * (
                self.pcp - 1) / self.pcp
            if self.dcp > 1:
                cached = sum(c - n for n, c in prefill)
                per_layer_bytes += cached * self.kv.mla_row * (self.dcp - 1) / self.dcp
            collectives += 2
        if self.dcp > 1 and decode:  # partial (o, lse) merged; local top-k gathered
            per_layer_bytes += (sum(n for n, _ in decode) * self.heads * MLA_OUT_BYTES
                                * (self.dcp - 1) / self.dcp)
            collectives += 2
        comm = layers.all * (per_layer_bytes / link + collectives * lat)
        return StepTime(gemm=g, moe=moe, indexer=idx, mla=mla, comm=comm)
