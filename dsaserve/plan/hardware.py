"""GPU presets for the cost model: datasheet figures, dense (no structured sparsity).

Rates are decimal, as datasheets mean them: TFLOP/s = 1e12 FLOP/s, TB/s = 1e12 B/s, GB/s = 1e9
B/s; link bandwidths are per direction. Memory capacities are binary, as datasheets mean them too:
"141 GB" of HBM3e is 141 GiB, of which `nvidia-smi` shows a little less (H200: 143,771 MiB =
140.4 GiB). A deployment whose numbers differ (a clock cap, a different board, the memory
`nvidia-smi` reports) overrides any field with `GPUSpec.replace`, which the `dsaserve plan` flags
call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsaserve.config import ConfigError

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator as the roofline sees it.

    `bf16_tflops` is the rate sparse MLA runs at (FlashMLA upconverts FP8 rows and computes in
    BF16), so the ridge point `ridge_flop_per_byte` is taken against it.
    """

    name: str
    bf16_tflops: float  # dense BF16 tensor-core rate, TFLOP/s
    fp8_tflops: float  # dense FP8 tensor-core rate, TFLOP/s
    hbm_tbps: float  # HBM bandwidth, TB/s
    hbm_bytes: int  # HBM capacity, bytes (datasheet GB read as GiB)
    link_gbps: float  # GPU-GPU link (NVLink) bandwidth per direction, GB/s
    host_gbps: float  # GPU-host link bandwidth per direction, GB/s

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "fp8_tflops", "hbm_tbps", "hbm_bytes", "link_gbps", "host_gbps"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"GPUSpec.{f}: must be > 0, got {getattr(self, f)!r}")

    @property
    def ridge_flop_per_byte(self) -> float:
        """BF16 FLOPs per HBM byte at which a kernel stops being memory-bound."""
        return self.bf16_tflops * 1e12 / (self.hbm_tbps * 1e12)

    def replace(self, **overrides: float | int | None) -> GPUSpec:
        """A copy with the non-None `overrides` applied (re-validated)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


GPU_PRESETS: dict[str, GPUSpec] = {
    # NVIDIA H100 SXM5 80GB datasheet: 989 TF BF16 / 1979 TF FP8 dense, 3.35 TB/s HBM3, 80 GB;
    # NVLink 4 at 900 GB/s total = 450 GB/s per direction; PCIe 5 x16 host link, ~55 GB/s achieved.
    "h100": GPUSpec("H100 SXM", 989.0, 1979.0, 3.35, 80 * GIB, 450.0, 55.0),
    # NVIDIA H200 SXM datasheet: same compute and links as H100 SXM, 4.8 TB/s HBM3e, 141 GB.
    "h200": GPUSpec("H200 SXM", 989.0, 1979.0, 4.8, 141 * GIB, 450.0, 55.0),
    # NVIDIA B200 (HGX) datasheet: 2250 TF BF16 / 4500 TF FP8 dense, 8 TB/s HBM3e, 180 GB;
    # NVLink 5 at 1.8 TB/s total = 900 GB/s per direction; host link taken as PCIe 5 like above.
    "b200": GPUSpec("B200", 2250.0, 4500.0, 8.0, 180 * GIB, 900.0, 55.0),
}


def gpu_spec(name: str) -> GPUSpec:
    """The preset called `name` (case-insensitive); ConfigError naming `--gpu` if unknown."""
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"--gpu: unknown GPU {name!r}; known: {sorted(GPU_PRESETS)}") from None
