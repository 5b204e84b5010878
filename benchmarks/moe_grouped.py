"""The routed experts' grouped GEMMs at decode sizes: torch._grouped_mm (CUTLASS) against the
Triton kernel (kernels/triton/fp8_linear.grouped_linear) on bf16 and FP8 experts (issue #28).

    python benchmarks/moe_grouped.py --out docs/moe_grouped_h200.md
    python benchmarks/moe_grouped.py --pairs 2,8 --sweep fp8 # every candidate FP8 tile
    python benchmarks/moe_grouped.py --pairs 512 --sweep w8a8 # the W8A8 tiles at MTP3's b = 64
    python benchmarks/moe_grouped.py --pairs 2,8,128 --sweep split  # K splits of the default tile
    python benchmarks/moe_grouped.py --smoke                 # CPU: tiny shapes, interpreter

The experts of `presets.glm53_shaped` (GLM-5.3's hidden 6144 and moe_intermediate 2048; 8
experts, 2 per token, all held here), random routing, P sorted pairs (default 2, 8, 128, 512:
b = 1, MTP3 at b = 1, b = 64, MTP3 at b = 64). Per projection:

  w13        torch._grouped_mm on bf16 | Triton bf16 | Triton FP8 (e4m3 + 128 × 128 scales)
  w13+act    the same followed by silu(gate) · up, what moe_compute runs: torch._grouped_mm,
             F.silu, the product | Triton bf16 and FP8 with it fused (glu=True)
  w2         torch._grouped_mm on bf16 | Triton bf16 | Triton FP8

and FP8 in W8A8 (kernels/triton/fp8_w8a8.py: the activations quantized per row and 128
columns, FP8 tensor cores; what moe_compute runs at 17–64 rows per expert): its w13 row is the
quantization of xs and the product, its w2 row silu(gate) · up with its quantization (one
kernel) and the product, so w13 + w2 is the whole MoE as w13+act + w2 is for the others.

µs per call from a CUDA graph of --copies calls, each on its own copy of the experts (the
engine's layers each read their own weights; the copies overflow L2), replay / copies, median
of triton.testing.do_bench. Bytes: the weights of the experts that received pairs (what a
call must read; e4m3 + fp32 scales for FP8). GB/s against the device's copy rate (a copy of 2
GiB, read + write bytes per second, measured here). Every configuration is checked against
torch._grouped_mm / the FP8 reference before it is timed.

--smoke runs on a CPU under Triton's interpreter (tiny shapes, fp32 activations: the interpreter
multiplies bf16 as integers; a per-group F.linear loop stands in for torch._grouped_mm), times
each call once with the host clock, and prints the same table: it keeps the script from rotting
(tests/unit/test_moe_grouped_bench.py), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
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

NUM_EXPERTS, TOP_K = 8, 2  # presets.glm53_shaped
DEFAULT_PAIRS = [2, 8, 128, 512]


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    dtype: torch.dtype
    device: str


GPU_SHAPE = Shape(GLM_5_3["hidden_size"], GLM_5_3["moe_intermediate_size"], NUM_EXPERTS,
                  torch.bfloat16, "cuda")
SMOKE_SHAPE = Shape(64, 32, 4, torch.float32, "cpu")


@dataclass
class Row:
    pairs: int
    proj: str  # w13, w13+act, w2
    variant: str  # torch, triton bf16, triton fp8 (+ its tile)
    us: float
    nbytes: int  # weight bytes of the experts that received pairs
    ref_us: float  # torch._grouped_mm's time for the same projection

    def gbs(self) -> float:
        return self.nbytes / self.us / 1e3


@dataclass
class Experts:
    """One copy of the stacked experts, bf16 (the shape's dtype) and FP8."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    q13: tuple[torch.Tensor, torch.Tensor]  # e4m3 [E, 2I, H], scales [E, 2I/128, H/128]
    q2: tuple[torch.Tensor, torch.Tensor]


def _fp8(n: int, k: int, e: int, g: torch.Generator, device: str):
    wq = (torch.randn(e, n, k, generator=g, device=device) * 64).clamp(-448, 448)
    scale = torch.exp2(torch.rand(e, fw.num_blocks(n), fw.num_blocks(k), generator=g,
                                  device=device) * 4 - 14)
    return wq.to(torch.float8_e4m3fn), scale


def make_experts(s: Shape, g: torch.Generator) -> Experts:
    h, i, e = s.hidden, s.inter, s.experts
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=s.device) / h**0.5).to(s.dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=s.device) / i**0.5).to(s.dtype)
    return Experts(w13, w2, _fp8(2 * i, h, e, g, s.device), _fp8(h, i, e, g, s.device))


def routing(s: Shape, pairs: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing of pairs / TOP_K tokens over every expert → (token of each sorted
    pair [P], group ends [E] int32)."""
    from dsaserve.model.moe_compute import sorted_pairs

    tokens = max(1, pairs // TOP_K)
    ids = torch.stack([torch.randperm(s.experts, generator=g, device=s.device)[:TOP_K]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g, device=s.device)
    token_of, _, ends = sorted_pairs(ids, weights, 0, s.experts, held_all=True)
    return token_of, ends


def torch_grouped(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm (moe_compute's path before issue #28) on CUDA; on the CPU (--smoke) a
    per-group F.linear loop standing in for it (reads `ends` on the host)."""
    if xs.is_cuda:
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=ends)
    out, start = torch.zeros(xs.shape[0], w.shape[1], dtype=xs.dtype), 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = F.linear(xs[start:end], w[e])
        start = end
    return out


def torch_grouped_act(xs: torch.Tensor, w13: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    gate, up = torch_grouped(xs, w13, ends).chunk(2, dim=-1)
    return F.silu(gate) * up


def _check(got: torch.Tensor, want: torch.Tensor, live: int, what: str, act: bool) -> str:
    """"" if got is within one step of the dtype (bf16: 2^-7) relative of want and 2^-10 of the
    largest |output| (act: the activation after two roundings of each product in either
    order, 2^-5 and 2^-8), over the rows of groups (torch._grouped_mm leaves the rest); else
    the mismatch, printed: a run on the GPU goes on to time the other rows."""
    got, want = got[:live].float(), want[:live].float()
    big = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    rtol, atol = (2.0**-5, 2.0**-8) if act else (2.0**-7, 2.0**-10)
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * big)
    except AssertionError as err:
        print(f"  CHECK FAILED {what}: {str(err).splitlines()[:4]}", flush=True)
        return " (CHECK FAILED)"
    return ""


def time_calls(calls: list[Callable[[], object]], cuda: bool) -> float:
    """µs per call: a CUDA graph of every call in turn (each on its own expert copy), replay /
    len(calls), median of do_bench; on a CPU one eager pass by the host clock (--smoke)."""
    if not cuda:
        t0 = time.perf_counter()
        for call in calls:
            call()
        return 1e6 * (time.perf_counter() - t0) / len(calls)
    return gpu_timing.graph_us(calls, rep_ms=300)


def sweep_configs(block_m: int) -> list:
    """Candidate tiles (--sweep): the default rows per tile (block_m), narrow to wide n tiles,
    k tiles of 64 and 128, warps and pipeline depth."""
    from dsaserve.kernels.triton.fp8_linear import Fp8LinearConfig

    return [Fp8LinearConfig(block_m, bn, bk, warps, stages)
            for bn in (16, 32, 64) for bk in (64, 128)
            for warps, stages in ((2, 4), (4, 3), (4, 5), (4, 6), (8, 4))]


def sweep_w8a8_configs() -> list:
    """W8A8 candidate tiles (--sweep w8a8): rows and columns per tile, warps and pipeline
    depth around fp8_w8a8.GROUPED_TILES (k tiles are one 128-column scale group)."""
    from dsaserve.kernels.triton.fp8_w8a8 import W8a8Config

    return [W8a8Config(bm, bn, warps, stages)
            for bm in (32, 64) for bn in (64, 128, 256)
            for warps, stages in ((4, 3), (4, 4), (4, 5), (8, 3), (8, 4))]


def sweep_splits(cfg) -> list:
    """The default tile with its K range split 1 to 12 ways (--sweep split;
    fp8_linear.choose_grouped_split picks one for decode-sized groups)."""
    return [dataclasses.replace(cfg, split_k=k) for k in (1, 2, 3, 4, 5, 6, 8, 12)]


def _label(cfg, split: int | None = None) -> str:
    """A tile's label; `split`: its K splits when the config leaves them to the kernel."""
    block_k = getattr(cfg, "block_k", 128)  # W8A8: one scale group
    split = getattr(cfg, "split_k", None) or split
    return (f"{cfg.block_m}×{cfg.block_n}×{block_k} w{cfg.num_warps} s{cfg.num_stages}"
            + (f" k{split}" if split and split > 1 else ""))


def _timed(calls: list[Callable[[], object]], cuda: bool, what: str) -> float:
    """time_calls, or nan (printed) when the launch fails: a tile whose pipeline does not fit
    the SM's shared memory must not end the table."""
    try:
        return time_calls(calls, cuda)
    except Exception as err:  # triton's OutOfResources, a CUDA launch error
        print(f"  {what}: {type(err).__name__}: {str(err)[:120]}", flush=True)
        return math.nan


def bench_pairs(s: Shape, copies: list[Experts], pairs: int, g: torch.Generator,
                sweep: tuple[str, ...]) -> list[Row]:
    from dsaserve.kernels.triton import fp8_linear as fl

    token_of, ends = routing(s, pairs, g)
    x = torch.randn(int(token_of.max()) + 1, s.hidden, generator=g, device=s.device).to(s.dtype)
    xs = x[token_of]  # [P, H]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    active, live = int((counts > 0).sum()), int(ends[-1])
    h, i = s.hidden, s.inter
    act = torch_grouped_act(xs, copies[0].w13, ends).contiguous()  # [P, I] w2's input
    e0 = copies[0]
    fp8_bytes = {"w13": active * (2 * i * h + 4 * fw.num_blocks(2 * i) * fw.num_blocks(h)),
                 "w2": active * (h * i + 4 * fw.num_blocks(h) * fw.num_blocks(i))}
    bf16_bytes = {"w13": active * 2 * i * h * 2, "w2": active * h * i * 2}
    # (projection, torch call, Triton bf16 call, Triton FP8 call), each a function of a copy
    cases = [
        ("w13", lambda c: partial(torch_grouped, xs, c.w13, ends),
         lambda c, **kw: partial(fl.grouped_linear, xs, c.w13, ends, **kw),
         lambda c, **kw: partial(fl.fp8_grouped, xs, *c.q13, ends, **kw)),
        ("w13+act", lambda c: partial(torch_grouped_act, xs, c.w13, ends),
         lambda c, **kw: partial(fl.grouped_linear, xs, c.w13, ends, glu=True, **kw),
         lambda c, **kw: partial(fl.fp8_grouped, xs, *c.q13, ends, glu=True, **kw)),
        ("w2", lambda c: partial(torch_grouped, act, c.w2, ends),
         lambda c, **kw: partial(fl.grouped_linear, act, c.w2, ends, **kw),
         lambda c, **kw: partial(fl.fp8_grouped, act, *c.q2, ends, **kw)),
    ]
    h13 = torch_grouped(xs, e0.w13, ends)  # [P, 2I] w2's input before the activation (W8A8)
    w8a8_cases = {
        "w13": (lambda c, **kw: partial(_w8a8_product, xs, c.q13, ends, False, **kw),
                lambda: fw.grouped_reference(xs, *e0.q13, ends, fw.w8a8_reference)),
        "w2": (lambda c, **kw: partial(_w8a8_product, h13, c.q2, ends, True, **kw),
               lambda: fw.grouped_reference(_act(h13).contiguous(), *e0.q2, ends,
                                            fw.w8a8_reference)),
    }
    fp8_refs = {"w13": lambda: fw.grouped_reference(xs, *e0.q13, ends),
                "w13+act": lambda: _act(fw.grouped_reference(xs, *e0.q13, ends)),
                "w2": lambda: fw.grouped_reference(act, *e0.q2, ends)}
    cuda = s.device == "cuda"
    rows = []
    for proj, torch_call, bf16_call, fp8_call in cases:
        key = "w2" if proj == "w2" else "w13"
        is_act = proj == "w13+act"
        n = 2 * i if key == "w13" else h
        ref = time_calls([torch_call(c) for c in copies], cuda)
        rows.append(Row(pairs, proj, "torch._grouped_mm", ref, bf16_bytes[key], ref))
        kinds = {"bf16": (bf16_call, torch_call(e0)(), bf16_bytes[key], 2),
                 "fp8": (fp8_call, fp8_refs[proj](), fp8_bytes[key], 1)}
        if proj in w8a8_cases:
            w8a8_call, w8a8_ref = w8a8_cases[proj]
            kinds["w8a8"] = (w8a8_call, w8a8_ref(), fp8_bytes[key], 1)
        line = f"  P={pairs:<4} {proj:<8} torch {ref:8.1f} us"
        for kind, (call, want, nbytes, weight_bytes) in kinds.items():
            out_n, depth = i if is_act else n, h if key == "w13" else i
            cfg = (fl.fp8_w8a8.GROUPED_TILES if kind == "w8a8" else fl.choose_grouped_config(
                pairs, out_n, depth, s.experts, weight_bytes=weight_bytes))
            split = None if kind == "w8a8" else fl.choose_grouped_split(
                pairs, out_n, depth, s.experts, cfg, fl.fp8_w8a8.device_sms(x.device))
            what = f"P={pairs} {proj} triton {kind} {_label(cfg, split)}"
            us = math.nan
            try:
                ok = _check(call(e0)(), want, live, what, is_act)
            except Exception as err:  # out of resources at launch: a row that says so
                print(f"  {what}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                ok = f" ({type(err).__name__})"
            else:
                us = _timed([call(c) for c in copies], cuda, what)
            rows.append(Row(pairs, proj, f"triton {kind} {_label(cfg, split)}{ok}", us, nbytes,
                            ref))
            line += f"  triton {kind} {us:8.1f} us"
            candidates = []
            if kind in sweep:
                candidates += (sweep_w8a8_configs() if kind == "w8a8"
                               else sweep_configs(cfg.block_m))
            if kind != "w8a8" and "split" in sweep:
                candidates += sweep_splits(cfg)
            if not candidates:
                continue
            best = (us, _label(cfg, split))
            # a smoke run (CPU) tries two, to keep the sweep's code path alive
            for c in candidates[:None if cuda else 2]:
                try:
                    if _check(call(e0, config=c)(), want, live, _label(c), is_act):
                        continue
                except Exception as err:  # out of resources: skip the shape
                    print(f"    {kind} {_label(c)}: {type(err).__name__}", flush=True)
                    continue
                t = _timed([call(cp, config=c) for cp in copies], cuda, _label(c))
                print(f"    {kind} {_label(c)}: {t:.1f} us", flush=True)
                if not math.isnan(t) and not t >= best[0]:
                    best = (t, _label(c))
            rows.append(Row(pairs, proj, f"triton {kind} sweep best {best[1]}", best[0],
                            nbytes, ref))
        print(line + f"  ({active} experts)", flush=True)
    return rows


def _w8a8_product(x: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor], ends: torch.Tensor,
                  glu: bool, config=None) -> torch.Tensor:
    """moe_compute's W8A8 step: x (or silu(gate) · up of x with glu) quantized, then the
    grouped product with the FP8 experts q (config: its tiles, default GROUPED_TILES)."""
    from dsaserve.kernels.triton import fp8_w8a8

    return fp8_w8a8.w8a8_grouped(*fp8_w8a8.act_quant(x, glu=glu), *q, ends, x.dtype, config)


def _act(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def report(rows: list[Row], copy_tbps: float, where: str, s: Shape) -> str:
    lines = [
        f"Routed experts' grouped GEMMs, {s.experts} experts × (w13 {2 * s.inter} × "
        f"{s.hidden}, w2 {s.hidden} × {s.inter}), top {TOP_K}, random routing, {where}. "
        f"Device copy rate {copy_tbps:.2f} TB/s (read + write). µs per call from CUDA graphs "
        "over expert copies that overflow L2; bytes: weights of the experts that received "
        "pairs; w13+act: the first projection and silu(gate) · up.", "",
        "| pairs | proj | kernel | µs | MB read | GB/s | of copy rate | torch ÷ this |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.pairs} | {r.proj} | {r.variant} | {r.us:.1f} | "
                     f"{r.nbytes / 1e6:.1f} | {r.gbs():.0f} | "
                     f"{r.gbs() / (copy_tbps * 1e3):.0%} | {r.ref_us / r.us:.2f}× |")
    return "\n".join(lines)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    if not kinds or set(kinds) - {"bf16", "fp8", "w8a8", "split"}:
        raise argparse.ArgumentTypeError(f"kernels to sweep: bf16, fp8, w8a8, split (the K "
                                         f"splits of the bf16 and FP8 default tiles; "
                                         f"comma-separated), got {text!r}")
    return kinds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=positive_ints, default=DEFAULT_PAIRS,
                   help="sorted (token, expert) pairs per call, comma-separated "
                        "(default %(default)s)")
    p.add_argument("--copies", type=int, default=4,
                   help="expert copies cycled through per graph replay (default %(default)s: "
                        "2.4 GB of bf16 experts, ~50× an H200's L2)")
    p.add_argument("--sweep", type=_kinds, default=(), metavar="KINDS",
                   help="also time every candidate tile of these kernels, comma-separated "
                        "(bf16, fp8, w8a8; split: the default tiles' K splits; the best one "
                        "gets a row)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under Triton's interpreter, no real timing "
                        "(with --sweep: two tiles)")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown)")
    args = p.parse_args(argv)
    if args.copies < 1:
        p.error("--copies: at least 1")
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke: the CPU check of this script)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # before triton's first import: the kernels interpreted (a test may have done it),
        # with the test suite's fix to Triton 3.6's interpreter (run-time loop bounds)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from triton_interp import patch_interpreter_index

        patch_interpreter_index()
    s = SMOKE_SHAPE if args.smoke else GPU_SHAPE
    on_cuda = s.device == "cuda"
    import triton

    where = (f"{torch.cuda.get_device_name() if on_cuda else 'CPU (interpreter, smoke)'}, "
             f"torch {torch.__version__}, triton {triton.__version__}")
    print(where, flush=True)
    copy_tbps = gpu_timing.copy_rate_tbps() if on_cuda else math.nan
    print(f"device copy rate {copy_tbps:.2f} TB/s", flush=True)
    g = torch.Generator(device=s.device).manual_seed(0)
    copies = [make_experts(s, g) for _ in range(1 if args.smoke else args.copies)]
    pairs = args.pairs
    if args.smoke:  # the interpreter is slow: decode sizes only
        pairs = [p for p in pairs if p <= 8] or [2]
    rows = []
    for p in pairs:
        rows += bench_pairs(s, copies, p, g, args.sweep)
    text = report(rows, copy_tbps, where, s)
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
