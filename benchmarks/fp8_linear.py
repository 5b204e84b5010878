"""FP8-weight GEMMs (kernels/triton/fp8_linear.py, fp8_w8a8.py) against bf16 cuBLAS, GLM-5.3 shapes.

    python benchmarks/fp8_linear.py --out docs/fp8_linear_h200.md
    python benchmarks/fp8_linear.py --m 1,16,64 --only q_a,kv_a --sweep   # every candidate tile

Per projection (N × K from the glm-5.3 preset) and batch rows M, three ways to compute x · Wᵀ:

  fp8        fp8_linear on the e4m3 weight and its 128 × 128 scales (1 byte per weight): the
             weight-only kernel up to WEIGHT_ONLY_MAX_M rows, then W8A8 (the activations
             quantized per row and 128 columns, FP8 tensor cores: Triton's or cuBLAS's
             block-scaled GEMM; its time includes the quantization; checked against
             fp8_weights.w8a8_reference) where fp8_linear.takes_w8a8, else the dequantized
             copy + cuBLAS
  bf16       F.linear on the weight dequantized at load (cuBLAS; 2 bytes per weight)
  deq+bf16   fp8_dequantize into a bf16 scratch, then F.linear (fp8_linear's path above
             WEIGHT_ONLY_MAX_M rows before W8A8: the previous version)

--sweep above WEIGHT_ONLY_MAX_M times the W8A8 tiles (at any M: where fp8_linear does not use
W8A8, the table's fp8 column is the dequantized copy and the sweep shows what W8A8 would take).

with the weight bytes each reads per call over its time (GB/s) against the HBM roofline (the
device-to-device copy, read + write, measured here; --hbm-tbps to give one). Decode and
verify sizes (M ≤ --graph-max-m, default 256: the engine replays them from graphs, and eagerly
their short kernels are launch-bound) run from a CUDA graph that cycles over enough copies of
the weight to overflow L2 (the engine's layers each read their own weights), time per call =
replay / copies; larger M run eagerly through triton.testing.do_bench (L2 flushed before each
run). Every configuration is checked against its reference before it is timed.

Grouped: fp8_grouped at decode (P = 64 · 8 pairs, E = 32 local experts, gate/up w13 and down
w2) against torch._grouped_mm on the bf16 weights (moe_compute's grouped path), for routings
over 256 experts (an EP8 rank: ~1/8 of the pairs local, the rest past the last group) and over
the 32 local ones only. Weight bytes: the experts that received pairs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from dsaserve.bench import gpu_timing
from dsaserve.bench.argtypes import positive_ints
from dsaserve.kernels import fp8_weights as fw
from dsaserve.model.presets import GLM_5_3

DEV = "cuda"
COLD_BYTES = 256 << 20  # weight copies cycled through per graph replay: > 5× an H100's L2
MAX_COPIES = 512
DECODE_PAIRS, LOCAL_EXPERTS, TOP_K = 64 * 8, 32, 8


@dataclass(frozen=True)
class Projection:
    name: str
    n: int  # out features
    k: int  # in features


def projections(cfg: dict) -> list[Projection]:
    """The FP8 weight matrices of a glm_moe_dsa / deepseek_v32 config (one GPU, no TP)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, inter = cfg["q_lora_rank"], cfg["moe_intermediate_size"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return [
        Projection("q_a", q_lora, h),
        Projection("q_b", heads * qk, q_lora),
        Projection("kv_a", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
        Projection("o_proj", h, heads * cfg["v_head_dim"]),
        Projection("idx_wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], q_lora),
        Projection("shared_gate|up", inter, h),  # gate_proj and up_proj: two of these
        Projection("shared_down", h, inter),
        Projection("routed_w13", 2 * inter, h),  # one expert's [gate; up]
        Projection("routed_w2", h, inter),
        Projection("dense_gate|up", cfg["intermediate_size"], h),  # the first dense layers
        Projection("dense_down", h, cfg["intermediate_size"]),
        # the engine's fused groups (model/fused.py): q_a + wk + kv_a, q_b + wq_b, gate + up
        Projection("x_proj", q_lora + cfg["index_head_dim"] + cfg["kv_lora_rank"]
                   + cfg["qk_rope_head_dim"], h),
        Projection("qr_proj", heads * qk + cfg["index_n_heads"] * cfg["index_head_dim"],
                   q_lora),
        Projection("shared_gate_up", 2 * inter, h),
    ]


@dataclass
class Row:
    name: str
    n: int
    k: int
    m: int
    fp8_us: float
    bf16_us: float
    deq_us: float
    fp8_bytes: int  # weight bytes one call reads: e4m3 + scales
    config: str

    def gbs(self, us: float, nbytes: int) -> float:
        return nbytes / us / 1e3


def _weight(n: int, k: int, g: torch.Generator, batch: tuple[int, ...] = ()):
    wq = (torch.randn(*batch, n, k, generator=g, device=DEV) * 64).clamp(-448, 448)
    scale = torch.exp2(torch.rand(*batch, fw.num_blocks(n), fw.num_blocks(k), generator=g,
                                  device=DEV) * 4 - 14)
    return wq.to(torch.float8_e4m3fn), scale


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    big = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=2.0**-10 * big,
                               msg=lambda m: f"{what}: {m}")


def _time(calls: list[Callable[[], object]], graph: bool) -> float:
    """Microseconds per call: from a CUDA graph of every call in turn (each on its own weight
    copy), or eagerly (the first) with L2 flushed before each run."""
    return gpu_timing.graph_us(calls) if graph else gpu_timing.eager_us(calls[0])


def _label(cfg, split: int | None = None) -> str:
    s = f"{cfg.block_m}×{cfg.block_n}×{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    return s + (f" split {split}" if split and split > 1 else "")


def sweep_w8a8_configs(m: int) -> list:
    """W8A8 candidates above WEIGHT_ONLY_MAX_M rows: m and n tiles, warps, stages, bands (tiles
    that spill in the sm_90 build left out: 128 × 128 on 4 warps, 256 columns)."""
    from dsaserve.kernels.triton.fp8_w8a8 import W8a8Config

    out = set()
    for bm in (64, 128):
        for bn in (64, 128):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                if bm * bn > 64 * 128 and warps == 4:
                    continue
                for group in (1, 8):
                    out.add(W8a8Config(bm, bn, warps, stages, group))
    return sorted(out, key=lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages,
                                      c.group_m))


def _w8a8_label(cfg) -> str:
    return (f"W8A8 {cfg.block_m}×{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"g{cfg.group_m}")


def sweep_configs(m: int) -> list:
    """Candidate launch shapes for --sweep at batch rows m: the bucket's block_m with other n / k
    tiles, warps and stages; split K as chosen, off, and forced to 2, 4 and 8 (decode: the 64-row
    bucket's rule chooses none, and its narrow n tiles are the other way to more programs).
    Shapes that do not fit the device fail to compile and are skipped."""
    from dsaserve.kernels.triton.fp8_linear import Fp8LinearConfig, choose_config

    base = choose_config(m, 1, 1)
    out = {base}
    for bn in (16, 32, 64, 128, 256):
        for bk in (64, 128):
            for warps, stages in ((4, 3), (4, 4), (4, 6), (8, 3), (8, 4)):
                out.add(Fp8LinearConfig(base.block_m, bn, bk, warps, stages))
                if m <= 64:
                    for split in (1, 2, 4, 8):
                        out.add(Fp8LinearConfig(base.block_m, bn, bk, warps, stages,
                                                split_k=split))
    return sorted(out, key=lambda c: (c.block_n, c.block_k, c.num_warps, c.num_stages,
                                      c.split_k or 0))


def bench_projection(p: Projection, m: int, args: argparse.Namespace) -> Row:
    from dsaserve.kernels.triton import fp8_linear as fl

    graph = m <= args.graph_max_m
    copies = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / (p.n * p.k)))) if graph else 1
    g = torch.Generator(device=DEV).manual_seed(p.n * 131 + p.k)
    ws = [_weight(p.n, p.k, g) for _ in range(copies)]
    bf = [fw.dequantize(wq, s, torch.bfloat16) for wq, s in ws]
    scratch = torch.empty_like(bf[0])
    x = torch.randn(m, p.k, generator=g, device=DEV).bfloat16()
    want = F.linear(x, bf[0])
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    want_fp8 = want
    if fl.takes_w8a8(x, p.n, p.k):
        want_fp8 = fw.w8a8_reference(x, *ws[0])
        label = ("cuBLAS block-scaled" if fl.fp8_w8a8.cublas_ready(p.n, p.k, 0, 0, x)
                 else _w8a8_label(fl.fp8_w8a8.choose_config(m, p.n, sms)))
    elif m > fl.WEIGHT_ONLY_MAX_M:
        label = "deq + cuBLAS"
    else:
        cfg = fl.choose_config(m, p.n, p.k)
        label = _label(cfg, fl.choose_split_k(m, p.n, p.k, cfg, sms))
    _check(fl.fp8_linear(x, *ws[0]), want_fp8, f"{p.name} M={m}")
    _check(F.linear(x, fl.fp8_dequantize(*ws[0], torch.bfloat16, out=scratch)), want, "deq")
    def deq_linear(wq: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fl.fp8_dequantize(wq, s, torch.bfloat16, out=scratch))

    fp8 = _time([partial(fl.fp8_linear, x, wq, s) for wq, s in ws], graph)
    bf16 = _time([partial(F.linear, x, w) for w in bf], graph)
    deq = _time([partial(deq_linear, wq, s) for wq, s in ws], graph)
    row = Row(p.name, p.n, p.k, m, fp8, bf16, deq, ws[0][0].numel() + ws[0][1].numel() * 4,
              label)
    if args.sweep:
        best = (fp8, row.config)
        if m > fl.WEIGHT_ONLY_MAX_M:
            run = fl.fp8_w8a8.w8a8_linear
            want_fp8 = fw.w8a8_reference(x, *ws[0])
            candidates = [(c, _w8a8_label(c)) for c in sweep_w8a8_configs(m)]
        else:
            run = fl.fp8_linear
            candidates = [(c, _label(c, c.split_k)) for c in sweep_configs(m)]
        for c, name in candidates:
            try:
                _check(run(x, *ws[0], config=c), want_fp8, name)
                us = _time([partial(run, x, wq, s, config=c) for wq, s in ws], graph)
            except Exception as e:  # out of resources: skip the shape
                print(f"    {name}: {type(e).__name__}", flush=True)
                continue
            print(f"    {name}: {us:.1f} us", flush=True)
            best = min(best, (us, name))
        row.config += f" (sweep best: {best[1]}, {best[0]:.1f} us)"
    return row


@dataclass
class GroupedRow:
    routing: str
    proj: str
    n: int
    k: int
    active: int  # experts that received pairs
    fp8_us: float
    bf16_us: float  # NaN where torch._grouped_mm does not run


def bench_grouped(cfg: dict) -> list[GroupedRow]:
    from dsaserve.kernels.triton import fp8_linear as fl
    from dsaserve.model.moe_compute import sorted_pairs

    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator(device=DEV).manual_seed(0)
    grouped_mm = (hasattr(torch, "_grouped_mm")
                  and torch.cuda.get_device_capability()[0] >= 9)
    rows = []
    for proj, (n, k) in (("w13", (2 * inter, h)), ("w2", (h, inter))):
        wq, scale = _weight(n, k, g, batch=(LOCAL_EXPERTS,))
        wb = fw.dequantize(wq, scale, torch.bfloat16)  # [E, N, K]
        for routing, num_experts in (("EP8 rank (256 experts)", 8 * LOCAL_EXPERTS),
                                     ("all local (32 experts)", LOCAL_EXPERTS)):
            tokens = DECODE_PAIRS // TOP_K
            ids = torch.stack([torch.randperm(num_experts, generator=g, device=DEV)[:TOP_K]
                               for _ in range(tokens)])
            weights = torch.rand(tokens, TOP_K, generator=g, device=DEV)
            token_of, _, ends = sorted_pairs(ids, weights, 0, LOCAL_EXPERTS)
            xs = torch.randn(tokens, k, generator=g, device=DEV).bfloat16()[token_of]
            ref = fw.grouped_reference(xs, wq, scale, ends)
            _check(fl.fp8_grouped(xs, wq, scale, ends), ref, f"grouped {proj}")
            fp8 = _time([partial(fl.fp8_grouped, xs, wq, scale, ends)], graph=True)
            bf16 = math.nan
            if grouped_mm:
                live = int(ends[-1])
                got = torch._grouped_mm(xs, wb.transpose(1, 2), offs=ends)
                _check(got[:live], ref[:live], f"_grouped_mm {proj}")
                bf16 = _time([partial(torch._grouped_mm, xs, wb.transpose(1, 2), offs=ends)],
                             graph=True)
            active = int((torch.diff(ends, prepend=ends.new_zeros(1)) > 0).sum())
            rows.append(GroupedRow(routing, proj, n, k, active, fp8, bf16))
            print(f"  grouped {proj} {routing}: fp8 {fp8:.1f} us, bf16 {bf16:.1f} us, "
                  f"{active} experts", flush=True)
    return rows


def report(rows: list[Row], grouped: list[GroupedRow], roof: float, where: str) -> str:
    from dsaserve.kernels.triton.fp8_linear import W8A8_MAX_M, WEIGHT_ONLY_MAX_M

    lines = [
        f"FP8-weight GEMMs (weight-only up to {WEIGHT_ONLY_MAX_M} rows, W8A8 up to {W8A8_MAX_M}, "
        "then the dequantized copy + cuBLAS), GLM-5.3 "
        f"shapes, bf16 activations, {where}; HBM roofline "
        f"{roof:.2f} TB/s (device copy, read + write). Times in µs per call; decode sizes "
        "from CUDA graphs over weight copies that overflow L2, the rest eager (L2 flushed). "
        "GB/s: weight bytes read per call / time (fp8: e4m3 + scales; bf16: 2 bytes per "
        "weight); TFLOP/s: 2·M·N·K / fp8 time.", "",
        "| projection | N × K | M | fp8 | bf16 cuBLAS | deq + bf16 | bf16 / fp8 | fp8 GB/s "
        "| % roofline | bf16 GB/s | fp8 TFLOP/s | fp8 tiles |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        fp8_gbs = r.gbs(r.fp8_us, r.fp8_bytes)
        bf16_gbs = r.gbs(r.bf16_us, 2 * r.n * r.k)
        tflops = 2 * r.m * r.n * r.k / r.fp8_us / 1e6
        lines.append(
            f"| {r.name} | {r.n} × {r.k} | {r.m} | {r.fp8_us:.1f} | {r.bf16_us:.1f} | "
            f"{r.deq_us:.1f} | {r.bf16_us / r.fp8_us:.2f}× | {fp8_gbs:.0f} | "
            f"{fp8_gbs / (roof * 1e3):.0%} | {bf16_gbs:.0f} | {tflops:.1f} | {r.config} |")
    if grouped:
        lines += ["", f"Grouped experts at decode: P = {DECODE_PAIRS} pairs "
                  f"({DECODE_PAIRS // TOP_K} tokens × top-{TOP_K}), E = {LOCAL_EXPERTS} local "
                  "experts, CUDA graphs; GB/s over the weights of the experts that received "
                  "pairs.", "",
                  "| routing | proj | N × K | experts hit | fp8 | bf16 _grouped_mm | bf16 / fp8 "
                  "| fp8 GB/s | % roofline |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in grouped:
            nbytes = r.active * (r.n * r.k + 4 * fw.num_blocks(r.n) * fw.num_blocks(r.k))
            gbs = nbytes / r.fp8_us / 1e3
            lines.append(f"| {r.routing} | {r.proj} | {r.n} × {r.k} | {r.active} | "
                         f"{r.fp8_us:.1f} | {r.bf16_us:.1f} | {r.bf16_us / r.fp8_us:.2f}× | "
                         f"{gbs:.0f} | {gbs / (roof * 1e3):.0%} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [p.name for p in projections(GLM_5_3)]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=positive_ints, default=[1, 16, 64, 256, 4096, 16384],
                   help="batch rows, comma-separated (default %(default)s)")
    p.add_argument("--only", default=None,
                   help=f"projections, comma-separated, of: {','.join(names)}")
    p.add_argument("--no-grouped", dest="grouped", action="store_false",
                   help="skip the grouped (MoE) rows")
    p.add_argument("--sweep", action="store_true",
                   help="also time every candidate fp8 tile shape (the best one is noted)")
    p.add_argument("--graph-max-m", type=int, default=256,
                   help="M up to this run from CUDA graphs (default %(default)s)")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="the HBM roofline in TB/s (default: the device copy, measured)")
    p.add_argument("--out", type=Path, default=None, help="also write the tables (markdown)")
    args = p.parse_args(argv)
    args.only = names if args.only is None else args.only.split(",")
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        p.error(f"--only: unknown projection(s) {unknown}; known: {names}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: the kernels are Triton GPU kernels (their CPU tests are "
                "tests/unit/test_fp8_linear_interp.py)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}")
    print(where, flush=True)
    roof = args.hbm_tbps or gpu_timing.copy_rate_tbps(DEV)
    print(f"HBM roofline {roof:.2f} TB/s", flush=True)
    rows = []
    for proj in projections(GLM_5_3):
        if proj.name not in args.only:
            continue
        for m in args.m:
            row = bench_projection(proj, m, args)
            rows.append(row)
            print(f"  {proj.name:<15} M={m:<6} fp8 {row.fp8_us:9.1f} us  bf16 "
                  f"{row.bf16_us:9.1f} us  deq+bf16 {row.deq_us:9.1f} us  {row.config}",
                  flush=True)
            torch.cuda.empty_cache()
    grouped = bench_grouped(GLM_5_3) if args.grouped else []
    text = report(rows, grouped, roof, where)
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
