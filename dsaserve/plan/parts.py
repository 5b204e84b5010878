"""Measured parts of a step on one GPU: what the simulator's step-time model is built from.

Every figure names the run it came from. "H200 run" figures are dsaserve's own kernels timed on one
H200 (docs/kernels.md, ../ANCHORS side-by-side runs; `benchmarks/kernels.py`, CUDA graphs,
fp8_ds_mla pages of 64, 64 heads, top-2048); "datasheet" figures are the vendor's; "assumed"
figures are estimates that no run of ours has measured yet, listed so a calibration run can
replace them (docs/simulate.md names each one).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """One figure and where it came from."""

    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Curve:
    """A piecewise-linear function measured at a few points: linear from the last two points
    beyond the last one, proportional to x (through 0) below the first."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    unit: str
    source: str

    def __post_init__(self) -> None:
        if len(self.xs) < 2 or len(self.xs) != len(self.ys) or list(self.xs) != sorted(self.xs):
            raise ValueError(f"Curve: need >= 2 increasing points, got {self.xs} / {self.ys}")

    def __call__(self, x: float) -> float:
        if x <= self.xs[0]:
            return self.ys[0] * x / self.xs[0] if x > 0 else 0.0
        i = min(bisect.bisect_left(self.xs, x), len(self.xs) - 1)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_KERNELS = "H200 run, benchmarks/kernels.py (docs/kernels.md, 2026-12)"
_SIDE = "H200 run beside FlashMLA (ANCHORS, 2026-12-04)"


@dataclass(frozen=True)
class Parts:
    """One GPU's measured rates. Defaults: the H200 (docs/kernels.md, ANCHORS)."""

    name: str = "H200"
    hbm_bytes: int = 141 << 30  # datasheet
    # Sparse MLA decode, fp8_ds_mla, 64 heads, top-2048: µs per step by query rows (b · s_q).
    # 32 rows: b 32; 128: b 128 s_q 1; 512: b 128 s_q 4 (CUDA graph).
    mla_decode_us: Curve = Curve((32, 128, 512), (41.1, 120.0, 466.6), "us", _KERNELS)
    # Sparse MLA prefill, bf16 rows, uniform index draw over the context (the agentic case: a
    # turn's queries attend all over a long history), T = 4,096 / 16,384.
    mla_prefill_tflops: Measured = Measured(453.0, "TFLOP/s", _SIDE + ", uniform draw")
    # Indexer prefill logits + top-k, 32 heads (GLM-5.3's index_n_heads), T 4,096 × 128K keys.
    indexer_prefill_tflops: Measured = Measured(886.6, "TFLOP/s", _SIDE)
    # Indexer decode logits + top-k, b 64 × 64K keys, bytes of FP8 keys read per second.
    indexer_decode_tbps: Measured = Measured(3.28, "TB/s", _SIDE)
    # Ceilings of the same run: a dense bf16 / fp8 matmul and a device copy.
    matmul_bf16_tflops: Measured = Measured(693.0, "TFLOP/s", _SIDE + ", ceilings")
    matmul_fp8_tflops: Measured = Measured(1286.0, "TFLOP/s", _SIDE + ", ceilings")
    hbm_tbps: Measured = Measured(4.25, "TB/s", _SIDE + ", ceilings (copy)")
    # Links, per direction.
    nvlink_gbps: Measured = Measured(450.0, "GB/s", "datasheet (NVLink 4)")
    host_gbps: Measured = Measured(55.0, "GB/s", "H200 run, pinned host <-> GPU copies "
                                                 "(ECOSYSTEM)")
    # P/D KV transfers: one 400 Gb/s InfiniBand NIC per GPU (the HGX H200 reference design).
    network_gbps: Measured = Measured(50.0, "GB/s", "datasheet (400 Gb/s per GPU, HGX)")
    network_latency_us: Measured = Measured(
        500.0, "us", "assumed (one P/D read: side-channel check, RDMA READ set-up, the read "
                     "notification; not measured across hosts yet)")
    # Fixed costs no run of ours has isolated yet.
    collective_latency_us: Measured = Measured(15.0, "us", "assumed (one NCCL collective on "
                                                           "8 NVLink GPUs)")
    # The kernels of a layer the figures above do not price, per layer and step whatever the
    # batch: norms, rotary, the indexer's top-k and slot maps, the MoE's routing, sort and
    # combine, copies, and the latency floors of attention and the indexer at small batches.
    # The slope of a decode step's kernel time over its layers, less what the parts above
    # price for those layers at the H100's bandwidth: ~190-200 µs per layer at b = 1 and at
    # b = 64, 8K (2 against 16 layers); on the H200 the 2-layer steps leave 0.48-0.60 ms per
    # step beyond the parts, the same order. By category (decode.py --kernel-profile, 16
    # layers, an H100): the small kernels themselves are 58 µs per layer at b = 1 and 64 at
    # b = 64; the rest is GEMMs below the bandwidth the parts price them at. The H100's
    # figure, until the H200 measures it.
    layer_kernels_us: Measured = Measured(
        200.0, "us", "H100 runs, benchmarks/decode.py at 2 and 16 layers (2026-12-06, "
                     "docs/decode.md): kernels beyond the parts above, per layer")
    # A graph replay's launch gap per layer, charged for the layers beyond the 2 of the measured
    # decode steps (plan/hosttime.py: everything else outside the kernels is fitted there).
    kernel_overhead_us: Measured = Measured(
        5.0, "us", "assumed (per layer: launch gaps of a graph-replayed decode step)")

    def figures(self) -> dict[str, Measured | Curve]:
        """Every figure by name (for `simulate --json` and docs/simulate.md)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, (Measured, Curve))}


H200 = Parts()
