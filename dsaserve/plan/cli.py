"""`dsaserve plan`: the cost model and capacity planner as a table (or JSON, or a PNG).

Every output line is declared once in `LINES` (key, label, meaning); the table, the JSON keys and
the `--help` text are all built from it, so `--help` documents exactly the lines that are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from typing import Any

from dsaserve.config import ConfigError, ModelConfig, ParallelConfig, default_hot_rows
from dsaserve.model.presets import REAL_PRESETS, TINY_PRESETS, preset_config
from dsaserve.plan import costmodel as cm
from dsaserve.plan.hardware import GIB, GPU_PRESETS, MIB, GPUSpec, gpu_spec

# (section key, section title, ((line key, label, meaning), ...)), in print order.
LINES: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("kv", "KV cache bytes per token (fp8_ds_mla | bf16)", (
        ("mla_row", "MLA row, one layer",
         "latent + RoPE key of one token in one layer: 512 e4m3 + 4 fp32 scales + 64 bf16 = 656 B "
         "(bf16: 576 x 2 B)"),
        ("mla", "MLA rows, all layers", "every main-model layer stores a row"),
        ("indexer_key", "indexer key, one layer",
         "128 e4m3 + 1 fp32 scale = 132 B (bf16: 128 x 2 B)"),
        ("indexer", "indexer keys, indexer layers",
         "only layers that run their own indexer store keys (IndexShare layers reuse top-k)"),
        ("mtp", "MTP layers", "each MTP layer stores one MLA row and one indexer key"),
        ("total", "total per token", "sum of the three lines above"),
    )),
    ("memory", "Memory per GPU", (
        ("weights_total", "weights, whole model",
         "every checkpoint tensor counted from the config (MTP included): FP8 matrices 1 B + "
         "fp32 block scales, norms/embedding/lm_head bf16, router/indexer weights_proj/k_norm "
         "fp32"),
        ("weights_per_gpu", "weights per GPU",
         "replicated + TP-sharded / tp + routed experts / EP size (all GPUs with --ep, else tp)"),
        ("hbm_usable", "HBM x utilisation", "HBM capacity times --gpu-memory-utilization"),
        ("activation_reserve", "activation reserve", "--activation-reserve-gib"),
        ("kv_room", "KV room", "HBM x utilisation - weights per GPU - activation reserve"),
        ("request_kv", "one request, whole KV", "--context tokens x total bytes per token"),
        ("request_kv_per_gpu", "one request, per GPU",
         "ceil(context / dcp) tokens x total bytes per token (DCP shards KV; TP/PCP replicate)"),
        ("requests_per_gpu", "requests that fit", "KV room // one request per GPU"),
        ("max_context", "longest context that fits",
         "KV room // total bytes per token x dcp, for this layout"),
        ("host_load", "reload one request from host",
         "one request per GPU at the host link bandwidth (CPU offload tier)"),
    )),
    ("sparse_mla", "Sparse MLA per query token per layer (absorbed, top-k)", (
        ("heads_per_gpu", "heads per GPU", "attention heads / tp"),
        ("kv_read", "selected rows read",
         "top-k x (row + 4 B int32 index), read once for all heads of the GPU"),
        ("query_output", "queries and outputs",
         "per head: 576-wide bf16 query read + 512-wide bf16 latent output written"),
        ("bytes", "HBM bytes", "selected rows + queries and outputs"),
        ("flops", "FLOPs", "top-k x heads x (2 x 576 for q.k + 2 x 512 for p.v)"),
        ("intensity", "arithmetic intensity", "FLOPs / HBM bytes"),
        ("ridge", "GPU ridge point", "dense BF16 FLOP/s / HBM bytes/s: above it compute-bound"),
    )),
    ("prefill", "Prefill FLOPs per GPU, cumulative over one prompt", (
        ("indexer_per_pair", "indexer, per (query, key)",
         "2 x heads x (head_dim + 1) per indexer layer, all indexer layers, / pcp (TP replicates)"),
        ("mla_per_row", "sparse MLA, per (query, row)",
         "2 x (576 + 512) = 2,176 x heads per GPU (heads / tp) x layers / pcp"),
        ("indexer_at_context", "indexer, prompt of --context",
         "a x L(L+1)/2 with a the per-(query, key) line, L = --context: query p scores p+1 keys; "
         "and its time at the dense FP8 peak (the indexer scores in FP8)"),
        ("mla_at_context", "sparse MLA, prompt of --context",
         "b x (K x L - K(K-1)/2) with b the per-(query, row) line, K = top-k: query p reads "
         "min(p+1, K) rows; and its time at the dense BF16 peak"),
        ("matrices_at_context", "matrices, prompt of --context",
         "L x 2 x the parameters one token passes (projections, MLPs, shared and top-k routed "
         "experts; no lm_head) / pcp; and its time at the --weights matmul peak (FP8 for fp8; "
         "BF16 for fp8-weight-only and bf16, whose activations are bf16; for fp8-dsaserve "
         "each product at the peak of the kernel the engine runs it with, in one step of the "
         "whole prompt)"),
        ("crossover", "crossover prompt length",
         "shortest prompt whose indexer FLOPs reach its sparse-MLA FLOPs (exact sums)"),
        ("crossover_asymptotic", "crossover, asymptotic",
         "2 x top-k x b / a: the same if every query read top-k rows (DESIGN.md's figure)"),
    )),
    ("dcp", "DCP all-gather per prefill step (cached context = --context)", (
        ("mla_layer", "per MLA layer",
         "(dcp - 1) x ceil(context / dcp) rows received per GPU, and its time on the link"),
        ("indexer_layer", "per indexer layer", "same for the indexer keys"),
        ("step", "per step, all layers", "every MLA and indexer layer, MTP included"),
    )),
    ("hisparse", "Decode concurrency per replica at --context (DCP 1)", (
        ("host_pool", "host pool", "--host-pool-gib, per decode replica"),
        ("host_per_request", "host bytes per request", "MLA rows of every layer (MTP included)"),
        ("gpu_per_request", "GPU bytes per request",
         "all indexer keys + (hot rows + 2 tail pages of 64) per MLA layer"),
        ("by_hbm_full", "all KV in HBM", "KV room // (context x total bytes per token)"),
        ("by_host", "HiSparse, bounded by host", "host blocks // blocks per request (whole "
                                                 "64-token blocks, as the engine admits)"),
        ("by_hbm", "HiSparse, bounded by HBM", "KV room // GPU bytes per request"),
        ("concurrency", "HiSparse concurrency", "the smaller of the two bounds"),
        ("mla_pages", "GPU MLA pages (spilling)",
         "what hisparse_config.device_mla_pages \"auto\" chooses: a write tail (2 pages) per "
         "request + one --context prefill (--pd-decode: one prompt of the hot rows); 0: no "
         "spilling"),
    )),
)
_LABELS = {(s, k): label for s, _, lines in LINES for k, label, _ in lines}
_LABEL_WIDTH = 34


@dataclasses.dataclass(frozen=True)
class Line:
    key: str
    text: str  # what the table shows after the label
    value: Any  # what the JSON holds (numbers in base units: bytes, FLOPs, tokens, seconds)


@dataclasses.dataclass(frozen=True)
class Plan:
    header: str
    sections: dict[str, list[Line]]  # section key → its lines, in LINES order
    inputs: dict[str, Any]  # the resolved inputs, echoed in the JSON
    prefill: cm.PrefillFlops  # for --plot


# ---- formatting ---------------------------------------------------------------------------------
def _b(n: float) -> str:
    """Bytes: exact below 10 kB, then decimal MB, then GiB with the MiB count."""
    if abs(n) < 10_000:
        return f"{n:,.0f} B"
    if abs(n) < GIB:
        return f"{n:,.0f} B ({n / 1e6:,.2f} MB)"
    return f"{n / GIB:,.2f} GiB ({n / MIB:,.0f} MiB)"


def _si(x: float, unit: str) -> str:
    prefixes = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
    for scale, prefix in prefixes:
        if abs(x) >= scale:
            return f"{x / scale:,.3g} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


# ---- the plan -----------------------------------------------------------------------------------
def load_model(spec: str) -> tuple[str, ModelConfig]:
    """A preset name or a path to a config.json (or its directory); errors name `--model`."""
    presets = {**REAL_PRESETS, **TINY_PRESETS}
    try:
        if spec in presets:
            return spec, ModelConfig.from_hf(preset_config(spec))
        return spec, ModelConfig.from_file(spec)
    except ConfigError as e:
        raise ConfigError(f"--model {spec}: {e}") from None


def build_plan(args: argparse.Namespace) -> Plan:
    """Compute every section from parsed flags; ConfigError names the offending flag."""
    name, model = load_model(args.model)
    gpu = gpu_spec(args.gpu).replace(
        hbm_bytes=None if args.hbm_gib is None else int(args.hbm_gib * GIB),
        hbm_tbps=args.hbm_tbps, bf16_tflops=args.bf16_tflops, fp8_tflops=args.fp8_tflops,
        link_gbps=args.link_gbps, host_gbps=args.host_gbps,
    )
    par = ParallelConfig(
        tensor_parallel_size=args.tp, prefill_context_parallel_size=args.pcp,
        decode_context_parallel_size=args.dcp, data_parallel_size=args.dp,
        enable_expert_parallel=args.ep,
    )
    cm.check_layout(model, par)
    context = args.context or model.max_position_embeddings
    hot_rows = args.hot_rows or default_hot_rows(args.spec_tokens, model.index_topk)
    kv_dtype: cm.KVDType = args.kv_cache_dtype
    dcp, tp = par.decode_context_parallel_size, par.tensor_parallel_size

    sections: dict[str, list[Line]] = {}
    sections["kv"] = _kv_lines(model)
    kv = cm.kv_bytes_per_token(model, kv_dtype)
    weights = cm.weight_bytes(model, args.weights)
    budget = cm.MemoryBudget(
        hbm_bytes=gpu.hbm_bytes, utilization=args.gpu_memory_utilization,
        weights=cm.weight_bytes_per_gpu(weights, par),
        activation_reserve=int(args.activation_reserve_gib * GIB),
    )
    sections["memory"] = _memory_lines(model, par, gpu, kv, weights, budget, context)
    sections["sparse_mla"] = _sparse_mla_lines(model, kv_dtype, tp, gpu)
    prefill = cm.prefill_flops(model, par)
    matmul_tflops = cm.prefill_matrices_tflops(model, par, args.weights, context,
                                               gpu.bf16_tflops, gpu.fp8_tflops)
    sections["prefill"] = _prefill_lines(model, par, gpu, prefill, context, matmul_tflops)
    sections["dcp"] = _dcp_lines(cm.dcp_gather_cost(kv, context, dcp, gpu.link_gbps))
    host_pool = int(args.host_pool_gib * GIB)
    hs = cm.hisparse_concurrency(kv, context, budget.kv_room, host_pool, hot_rows,
                                 pd_decode=args.pd_decode)
    sections["hisparse"] = _hisparse_lines(hs)

    ep = f", EP{cm.num_gpus(par)}" if par.enable_expert_parallel else ""
    header = (
        f"dsaserve plan: {name} ({model.model_type}) on {cm.num_gpus(par)} x {gpu.name}, "
        f"TP{tp} x PCP{par.prefill_context_parallel_size} x DCP{dcp} x "
        f"DP{par.data_parallel_size}{ep}; context {context:,} tokens; KV {kv_dtype}, "
        f"weights {args.weights}"
    )
    inputs = {
        "model": name, "model_type": model.model_type,
        "gpu": dataclasses.asdict(gpu) | {"key": args.gpu},
        "tp": tp, "pcp": par.prefill_context_parallel_size, "dcp": dcp,
        "dp": par.data_parallel_size, "ep": par.enable_expert_parallel,
        "num_gpus": cm.num_gpus(par), "context": context, "kv_cache_dtype": kv_dtype,
        "weights": args.weights, "gpu_memory_utilization": args.gpu_memory_utilization,
        "activation_reserve_gib": args.activation_reserve_gib,
        "host_pool_gib": args.host_pool_gib, "hot_rows": hot_rows,
        "pd_decode": args.pd_decode,
    }
    return Plan(header, sections, inputs, prefill)


def _kv_lines(model: ModelConfig) -> list[Line]:
    fp8, bf16 = (cm.kv_bytes_per_token(model, d) for d in cm.KV_DTYPES)

    def both(attr: str, note: str) -> Line:
        a, b = getattr(fp8, attr), getattr(bf16, attr)
        return Line(attr, f"{a:>9,} B | {b:>9,} B   {note}", {"fp8_ds_mla": a, "bf16": b})

    n, ni, nm = fp8.num_layers, fp8.num_indexer_layers, fp8.num_mtp_layers
    return [
        both("mla_row", ""),
        both("mla", f"{n} x {fp8.mla_row}"),
        both("indexer_key", ""),
        both("indexer", f"{ni} of {n} layers x {fp8.indexer_key}"),
        both("mtp", f"{nm} x ({fp8.mla_row} + {fp8.indexer_key})"),
        both("total", ""),
    ]


def _memory_lines(
    model: ModelConfig, par: ParallelConfig, gpu: GPUSpec, kv: cm.KVBytesPerToken,
    w: cm.WeightBytes, budget: cm.MemoryBudget, context: int,
) -> list[Line]:
    dcp, tp = par.decode_context_parallel_size, par.tensor_parallel_size
    request = context * kv.total
    per_gpu = cm.request_kv_bytes_per_gpu(kv, context, dcp)
    room = budget.kv_room
    max_ctx = cm.max_context_tokens(room, kv, dcp)
    fits = "" if max_ctx <= model.max_position_embeddings else (
        f" (model max {model.max_position_embeddings:,})")
    room_text = _b(room) if room > 0 else f"{_b(room)}: the weights do not fit"
    return [
        Line("weights_total", f"{_b(w.total)}, {w.num_params / 1e9:,.1f} B params", w.total),
        Line("weights_per_gpu", f"{_b(budget.weights)}   {w.replicated / GIB:.2f} replicated + "
             f"{w.tp_sharded / GIB:.2f} / {tp} + {w.routed_experts / GIB:.2f} / "
             f"{cm.expert_shards(par)} GiB", budget.weights),
        Line("hbm_usable", f"{_b(budget.usable)} ({gpu.hbm_bytes / GIB:,.1f} GiB x "
             f"{budget.utilization:g})", budget.usable),
        Line("activation_reserve", _b(budget.activation_reserve), budget.activation_reserve),
        Line("kv_room", room_text, room),
        Line("request_kv", _b(request), request),
        Line("request_kv_per_gpu", f"{_b(per_gpu)} (DCP {dcp})", per_gpu),
        Line("requests_per_gpu", f"{max(room, 0) // per_gpu:,}", max(room, 0) // per_gpu),
        Line("max_context", f"{max_ctx:,} tokens{fits}", max_ctx),
        Line("host_load", f"{_ms(per_gpu / (gpu.host_gbps * 1e9))} at {gpu.host_gbps:g} GB/s",
             per_gpu / (gpu.host_gbps * 1e9)),
    ]


def _sparse_mla_lines(
    model: ModelConfig, kv_dtype: cm.KVDType, tp: int, gpu: GPUSpec
) -> list[Line]:
    c = cm.sparse_mla_cost(model, kv_dtype, model.num_attention_heads // tp)
    ridge = gpu.ridge_flop_per_byte
    bound = "memory-bound" if c.intensity < ridge else "compute-bound"
    return [
        Line("heads_per_gpu", f"{c.heads}", c.heads),
        Line("kv_read", f"{_b(c.kv_bytes)}   {c.topk:,} x {c.row_bytes} B", c.kv_bytes),
        Line("query_output", f"{_b(c.heads * c.per_head_bytes)}   {c.heads} x "
             f"{c.per_head_bytes:,} B", c.heads * c.per_head_bytes),
        Line("bytes", _b(c.bytes), c.bytes),
        Line("flops", f"{_si(c.flops, 'FLOP')}   {c.topk:,} x {c.heads} x {c.flops_per_row_head:,}",
             c.flops),
        Line("intensity", f"{c.intensity:,.1f} FLOP/B ({bound})", c.intensity),
        Line("ridge", f"{ridge:,.1f} FLOP/B   {gpu.bf16_tflops:g} TFLOP/s / {gpu.hbm_tbps:g} TB/s",
             ridge),
    ]


def _flops_line(key: str, flops: float, tflops: float) -> Line:
    seconds = flops / (tflops * 1e12)
    return Line(key, f"{_si(flops, 'FLOP')}, {seconds:,.2f} s at {tflops:g} TFLOP/s",
                {"flops": flops, "seconds": seconds})


def _prefill_lines(
    model: ModelConfig, par: ParallelConfig, gpu: GPUSpec, f: cm.PrefillFlops, context: int,
    matmul_tflops: float,
) -> list[Line]:
    """`matmul_tflops`: the weight matrices' rate (the --weights mode's, for a prompt of
    `context` tokens: costmodel.prefill_matrices_tflops)."""
    pcp, tp = par.prefill_context_parallel_size, par.tensor_parallel_size
    n_idx = len(model.full_indexer_layers)
    pair, row = cm.indexer_flops_per_pair(model), cm.mla_flops_per_row_head(model)
    heads = model.num_attention_heads // tp
    return [
        Line("indexer_per_pair", f"{_si(f.indexer_per_key, 'FLOP')}   {pair:,} x {n_idx} layers "
             f"/ pcp {pcp}", f.indexer_per_key),
        Line("mla_per_row", f"{_si(f.mla_per_row, 'FLOP')}   {row:,} x {heads} heads x "
             f"{model.num_hidden_layers} layers / pcp {pcp}", f.mla_per_row),
        _flops_line("indexer_at_context", f.indexer(context), gpu.fp8_tflops),
        _flops_line("mla_at_context", f.mla(context), gpu.bf16_tflops),
        _flops_line("matrices_at_context", f.matrices(context), matmul_tflops),
        Line("crossover", f"{f.crossover:,} tokens", f.crossover),
        Line("crossover_asymptotic", f"{f.asymptotic_crossover:,.0f} tokens",
             f.asymptotic_crossover),
    ]


def _dcp_lines(g: cm.DCPGatherCost) -> list[Line]:
    note = "" if g.dcp > 1 else "   (DCP 1: nothing to gather)"
    return [
        Line("mla_layer", f"{_b(g.mla_layer_bytes)}, {_ms(g.mla_layer_seconds)}{note}",
             {"bytes": g.mla_layer_bytes, "seconds": g.mla_layer_seconds}),
        Line("indexer_layer", f"{_b(g.indexer_layer_bytes)}, {_ms(g.indexer_layer_seconds)}",
             {"bytes": g.indexer_layer_bytes, "seconds": g.indexer_layer_seconds}),
        Line("step", f"{_b(g.step_bytes)}, {_ms(g.step_seconds)}   {g.num_mla_layers} MLA + "
             f"{g.num_indexer_layers} indexer layers at {g.link_bytes_per_s / 1e9:g} GB/s",
             {"bytes": g.step_bytes, "seconds": g.step_seconds}),
    ]


def _mla_pages_text(h: cm.HiSparseConcurrency) -> str:
    if h.mla_sizing is None:
        return "0 (not one request of --context fits)"
    if not h.mla_pages:
        return "0 (no spilling: one MLA page per block holds as many requests)"
    return f"{h.mla_pages:,} pages of {h.block_size}"


def _hisparse_lines(h: cm.HiSparseConcurrency) -> list[Line]:
    return [
        Line("host_pool", _b(h.host_pool_bytes), h.host_pool_bytes),
        Line("host_per_request", _b(h.host_bytes), h.host_bytes),
        Line("gpu_per_request", f"{_b(h.gpu_bytes_hisparse)}   hot rows {h.hot_rows:,}",
             h.gpu_bytes_hisparse),
        Line("by_hbm_full", f"{h.by_hbm_full:,} requests", h.by_hbm_full),
        Line("by_host", f"{h.by_host:,} requests", h.by_host),
        Line("by_hbm", f"{h.by_hbm_hisparse:,} requests", h.by_hbm_hisparse),
        Line("concurrency", f"{h.hisparse:,} requests (bounded by {h.bound})", h.hisparse),
        Line("mla_pages", _mla_pages_text(h), h.mla_pages),
    ]


def render_table(header: str, sections: dict[str, list[Line]]) -> str:
    out = [header]
    for key, title, _ in LINES:
        out += ["", title]
        out += [f"  {_LABELS[key, ln.key]:<{_LABEL_WIDTH}} {ln.text}".rstrip()
                for ln in sections[key]]
    return "\n".join(out) + "\n"


def render_json(sections: dict[str, list[Line]], inputs: dict[str, Any]) -> str:
    doc: dict[str, Any] = {"inputs": inputs}
    doc.update({s: {ln.key: ln.value for ln in lines} for s, lines in sections.items()})
    return json.dumps(doc, indent=2) + "\n"


# ---- argparse -----------------------------------------------------------------------------------
def _number(text: str, cast: type[int] | type[float], low: float, strict: bool) -> Any:
    """Parse `text` with `cast` and require it > low (strict) or >= low; argparse names the flag."""
    try:
        v = cast(text)
    except ValueError:
        kind = "an integer" if cast is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if (v <= low) if strict else (v < low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
    return v


def _positive_int(text: str) -> int:
    return _number(text, int, 1, strict=False)


def _non_negative_int(text: str) -> int:
    return _number(text, int, 0, strict=False)


def _positive_float(text: str) -> float:
    return _number(text, float, 0, strict=True)


def _non_negative_float(text: str) -> float:
    return _number(text, float, 0, strict=False)


def _fraction(text: str) -> float:
    v = _positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def _epilog() -> str:
    out = ["output lines (the JSON of --json uses the keys in brackets):"]
    for key, title, lines in LINES:
        out.append(f"  {title} [{key}]")
        for k, label, meaning in lines:
            out.append(f"    {label} [{k}]")
            out += textwrap.wrap(meaning, 96, initial_indent=" " * 8, subsequent_indent=" " * 8)
    out.append("docs/plan.md derives each number and the FLOP conventions.")
    return "\n".join(out)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="glm-5.3",
                   help="a preset (glm-5.3, deepseek-v3.2, tiny-glm5, tiny-dsv32) or the path of a "
                        "config.json or its directory (default: %(default)s)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPU_PRESETS),
                   help="hardware preset (datasheet figures; default: %(default)s)")
    g = p.add_argument_group("layout (engine flag names also accepted)")
    layout = (
        ("--tp", "--tensor-parallel-size", "tensor parallel: splits heads and dense weights"),
        ("--pcp", "--prefill-context-parallel-size", "prefill context parallel: splits query rows"),
        ("--dcp", "--decode-context-parallel-size",
         "decode context parallel: shards KV over PCP (or TP) ranks; must divide pcp x tp"),
        ("--dp", "--data-parallel-size", "data parallel replicas"),
    )
    for short, long, text in layout:
        g.add_argument(short, long, type=_positive_int, metavar="N", default=1, help=text)
    g.add_argument("--ep", "--enable-expert-parallel", action="store_true",
                   help="shard routed experts over all dp x pcp x tp GPUs")
    m = p.add_argument_group("workload and memory")
    m.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="tokens of one request (default: the model's max_position_embeddings)")
    m.add_argument("--kv-cache-dtype", choices=cm.KV_DTYPES, default="fp8_ds_mla",
                   help="KV format of the memory, roofline, DCP and HiSparse lines (default: "
                        "%(default)s; bf16 is the engine's 'auto' for bf16 checkpoints)")
    m.add_argument("--weights", choices=cm.WEIGHT_DTYPES, default="fp8",
                   help="weight format: fp8 (128x128 block scales, activations in FP8 too, as "
                        "vLLM and SGLang), fp8-dsaserve (the same bytes, each product at the rate "
                        "of the kernel dsaserve's engine on CUDA picks by its rows), "
                        "fp8-weight-only (the same bytes, matrices at the BF16 rate) or bf16 "
                        "(default: %(default)s)")
    m.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                   help="fraction of HBM the engine may use (default: %(default)s)")
    m.add_argument("--activation-reserve-gib", type=_non_negative_float,
                   default=cm.DEFAULT_ACTIVATION_RESERVE_GIB,
                   metavar="GIB",
                   help="HBM kept for activations and temporaries (default %(default)s GiB: "
                        "one layer's 1M-token context gathered in bf16, 1.1 GiB, plus an "
                        "8K-token step's activations)")
    m.add_argument("--host-pool-gib", type=_positive_float, default=48.0, metavar="GIB",
                   help="HiSparse pinned host pool per decode replica (default %(default)s)")
    m.add_argument("--spec-tokens", type=_non_negative_int, default=3, metavar="K",
                   help="MTP draft tokens; sets the default hot rows (default %(default)s)")
    m.add_argument("--hot-rows", type=_positive_int, default=None, metavar="ROWS",
                   help="HiSparse hot-buffer rows per request and layer (default: "
                        "(spec tokens + 2) x top-k)")
    m.add_argument("--pd-decode", action="store_true",
                   help="size HiSparse's GPU MLA pages for a P/D decode engine (kv_role "
                        "kv_consumer): long prompts arrive spilled, so the pages hold one "
                        "local prompt of the hot rows instead of one of --context")
    h = p.add_argument_group("hardware overrides (replace the preset's datasheet figure)")
    overrides = (
        ("--hbm-gib", "GIB", "HBM capacity, GiB"),
        ("--hbm-tbps", "TBPS", "HBM bandwidth, TB/s"),
        ("--bf16-tflops", "TFLOPS", "dense BF16 TFLOP/s"),
        ("--fp8-tflops", "TFLOPS", "dense FP8 TFLOP/s"),
        ("--link-gbps", "GBPS", "NVLink GB/s per direction"),
        ("--host-gbps", "GBPS", "GPU-host link GB/s per direction"),
    )
    for flag, metavar, text in overrides:
        h.add_argument(flag, type=_positive_float, metavar=metavar, help=text)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of the table")
    o.add_argument("--plot", metavar="FILE", help="write a PNG of the prefill FLOP curves")
    p.set_defaults(func=run)


_DESCRIPTION = ("The arithmetic of a deployment, from the model's config and the GPU's datasheet: "
                "KV bytes, memory, sparse-MLA roofline, indexer vs MLA prefill FLOPs, DCP gather "
                "traffic and HiSparse concurrency.")


def add_parser(subparsers: Any) -> None:
    """Add `plan` to an argparse subparsers object; the parsed args carry `func=run`."""
    p = subparsers.add_parser(
        "plan", help="cost model and capacity planner", description=_DESCRIPTION,
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsaserve plan", description=_DESCRIPTION, epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the plan (and write --plot); 0 on success, 2 with a message naming the flag."""
    try:
        plan = build_plan(args)
        if args.plot:
            from dsaserve.plan.plot import plot_prefill_flops  # matplotlib only when asked

            i = plan.inputs
            title = f"{i['model']}: prefill FLOPs per GPU, TP{i['tp']} x PCP{i['pcp']}"
            try:
                plot_prefill_flops(plan.prefill, args.plot, title, max_length=i["context"])
            except OSError as e:
                raise ConfigError(f"--plot {args.plot}: {e.strerror or e}") from None
    except ConfigError as e:
        print(f"dsaserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(render_json(plan.sections, plan.inputs))
    else:
        sys.stdout.write(render_table(plan.header, plan.sections))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
