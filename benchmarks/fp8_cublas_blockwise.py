"""W8A8 through cuBLAS's block-scaled FP8 GEMM (PyTorch's scaled_mm with 1 × 128 activation
and 128 × 128 weight scales, the DeepSeek-V3 recipe) against our Triton W8A8 kernel
(kernels/triton/fp8_w8a8.py), GLM-5.3 projections, on a GPU:

    python benchmarks/fp8_cublas_blockwise.py [--m 128,256,1024,4096] [--out FILE]

Both start from the same act_quant (the activations quantized per row and 128 columns), so
their products should agree with fp8_weights.w8a8_reference to fp32 rounding; each is checked
before it is timed. Times from a CUDA graph cycling over enough weight copies to overflow L2
(benchmarks/fp8_linear.py's method): `triton` is w8a8_linear forced onto the Triton kernel
(act_quant included), `cublas` act_quant with group-major scales + fp8_w8a8.block_scaled_mm
(PyTorch's scaled_mm; w8a8_linear's choice where cublas_takes the shape). Where PyTorch or
cuBLAS refuses the scaling on a GPU, the row says why.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from dsaserve.bench import gpu_timing
from dsaserve.bench.argtypes import positive_ints
from dsaserve.kernels import fp8_weights as fw
from dsaserve.model.presets import GLM_5_3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_linear import COLD_BYTES, MAX_COPIES, _check, _weight, projections  # noqa: E402

DEV = "cuda"


def bench(p, m: int, dtype: torch.dtype) -> dict:
    from dsaserve.kernels.triton import fp8_w8a8

    copies = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / (p.n * p.k))))
    g = torch.Generator(device=DEV).manual_seed(p.n * 7 + p.k)
    ws = [_weight(p.n, p.k, g) for _ in range(copies)]
    x = torch.randn(m, p.k, generator=g, device=DEV).to(dtype)
    want = fw.w8a8_reference(x, *ws[0])
    row = {"name": p.name, "n": p.n, "k": p.k, "m": m}
    tiles = fp8_w8a8.choose_config(m, p.n, fp8_w8a8.device_sms(x.device))  # forces Triton

    def triton_w8a8(wq, s):
        return fp8_w8a8.w8a8_linear(x, wq, s, config=tiles)

    def cublas_w8a8(wq, s):
        return fp8_w8a8.block_scaled_mm(*fp8_w8a8.act_quant(x, outer_scales=True), wq, s, dtype)

    _check(triton_w8a8(*ws[0]), want, f"triton {p.name} M={m}")
    row["triton"] = gpu_timing.graph_us([lambda wq=wq, s=s: triton_w8a8(wq, s) for wq, s in ws])
    row["cublas"], row["why"] = float("nan"), "scaled_mm"
    try:
        _check(cublas_w8a8(*ws[0]), want, f"cublas {p.name}")
    except Exception as e:  # refused here: that is the answer too
        row["why"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}".replace("|", "/")
    else:
        row["cublas"] = gpu_timing.graph_us(
            [lambda wq=wq, s=s: cublas_w8a8(wq, s) for wq, s in ws])
    row["tflops"] = 2 * m * p.n * p.k / min(row["triton"], row["cublas"]
                                            if row["cublas"] == row["cublas"] else 1e30) / 1e6
    return row


def report(rows: list[dict], where: str) -> str:
    lines = [f"W8A8 products, µs per call from CUDA graphs, {where}", "",
             "| projection | N × K | M | Triton W8A8 | cuBLAS block-scaled | Triton / cuBLAS "
             "| best TFLOP/s | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = r["triton"] / r["cublas"] if r["cublas"] == r["cublas"] else float("nan")
        lines.append(f"| {r['name']} | {r['n']} × {r['k']} | {r['m']} | {r['triton']:.1f} | "
                     f"{r['cublas']:.1f} | {ratio:.2f} | {r['tflops']:.0f} | "
                     f"{r.get('why', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=positive_ints, default=(128, 256, 1024, 4096))
    p.add_argument("--only", default="q_a,q_b,o_proj,idx_wq_b,shared_gate|up,shared_down,"
                   "x_proj,qr_proj,shared_gate_up")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    wanted = set(args.only.split(","))
    rows = []
    for proj in projections(GLM_5_3):
        if proj.name not in wanted:
            continue
        for m in args.m:
            rows.append(bench(proj, m, torch.bfloat16))
            print(rows[-1], flush=True)
    text = report(rows, torch.cuda.get_device_name())
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
