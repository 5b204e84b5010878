"""Measured parts of a step on one GPU: what the simulator's step-time model is built from.

Every figure names the run it came from. "H200 run" figures are dsaserve's own kernels timed on one
H200 (`benchmarks/kernels.py --parts`, CUDA graphs, fp8_ds_mla pages of 64, top-2048: the run of
2026-12-06, docs/parts_h200.json); "datasheet" figures are the vendor's; "assumed"
figures are estimates that no run of ours has measured yet, listed so a calibration run can
replace them (docs/simulate.md names each one).

`Parts.load(FILE)` takes the figures a run of `benchmarks/kernels.py --parts FILE` measured on
the machine at hand (a calibration profiles the GPU it runs on) and keeps the defaults for the
others. The file (`parts_json` writes it):

    {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-07", "command": "...",
     "hbm_bytes": 85045526528,                                  (optional)
     "figures": {"mla_decode_us": {"xs": [32, 128, 512], "ys": [...], "unit": "us",
                                   "source": "..."},
                 "hbm_tbps": {"value": 3.1, "unit": "TB/s", "source": "..."}, ...}}
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.config import ConfigError


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


# The H200 machine's run of 2026-12-06 (docs/parts_h200.json, which `Parts.load` reads; its
# figures here rounded to 4-5 digits, its sources as written): `python benchmarks/kernels.py
# --only ceilings,prefill,decode,indexer --heads 32 --indices uniform --parts FILE`.
_RUN = "NVIDIA H200 run, benchmarks/kernels.py, 2026-12-06; "


@dataclass(frozen=True)
class Parts:
    """One GPU's measured rates. Defaults: the H200 (docs/parts_h200.json; the links: datasheets,
    ECOSYSTEM)."""

    name: str = "H200"
    # What torch reports on that run's H200 (139.8 GiB; the datasheet's 141 GB).
    hbm_bytes: int = 150_109_880_320
    # Sparse MLA decode, fp8_ds_mla, 64 heads, top-2048: µs per step by query rows (b · s_q).
    # 32 rows: b 32; 128: b 128 s_q 1; 512: b 128 s_q 4 (CUDA graph).
    mla_decode_us: Curve = Curve(
        (32, 128, 512), (40.52, 121.65, 473.13), "us",
        _RUN + "decode gluon 32-row, prefetch L2 copies b=32 s_q=1, CUDA graph / decode gluon "
        "32-row, prefetch L2 copies b=128 s_q=1, CUDA graph / decode gluon 32-row, prefetch L2 "
        "copies b=128 s_q=4, CUDA graph")
    # Sparse MLA prefill, bf16 rows, uniform index draw over the context (the agentic case: a
    # turn's queries attend all over a long history), T = 4,096 / 16,384.
    mla_prefill_tflops: Measured = Measured(
        448.6, "TFLOP/s", _RUN + "mean of: prefill gluon ping-pong T=4096 uniform indices / "
        "prefill gluon ping-pong T=16384 uniform indices")
    # Indexer prefill logits + top-k, 32 heads (GLM-5.3's index_n_heads), T 4,096 × 128K keys.
    indexer_prefill_tflops: Measured = Measured(
        788.3, "TFLOP/s", _RUN + "indexer prefill logits+topk H=32, cuda top-k")
    # Indexer decode logits + top-k, b 64 × 64K keys, bytes of FP8 keys read per second.
    indexer_decode_tbps: Measured = Measured(
        2.681, "TB/s", _RUN + "indexer decode logits+topk b=64 s_q=1, cuda top-k, CUDA graph")
    # Ceilings of the same run: a dense bf16 / fp8 matmul and a device copy.
    matmul_bf16_tflops: Measured = Measured(700.2, "TFLOP/s", _RUN + "matmul bf16 8192^3")
    matmul_fp8_tflops: Measured = Measured(1267.2, "TFLOP/s", _RUN + "matmul fp8 8192^3")
    hbm_tbps: Measured = Measured(4.248, "TB/s", _RUN + "copy d2d (read + write)")
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

    def kept(self, base: Parts) -> list[str]:
        """The figures of `base` this one still has (a loaded file did not replace them)."""
        theirs = base.figures()
        return [k for k, v in self.figures().items() if v == theirs[k]]

    @staticmethod
    def load(path: str | Path, base: Parts | None = None) -> Parts:
        """`base` (default: the H200's) with the figures of a `parts_json` file in place of its
        own; ConfigError naming the file and the field for anything it cannot take."""
        base = base or H200
        where = f"parts file {path}"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: cannot read a parts file ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("figures"), dict):
            raise ConfigError(f"{where}: expected a JSON object with a 'figures' object")
        unknown = set(data) - {"gpu", "date", "command", "hbm_bytes", "figures"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        known = base.figures()
        changes: dict[str, Any] = {}
        for name, entry in data["figures"].items():
            if name not in known:
                raise ConfigError(f"{where}: figures.{name}: not a figure of Parts (known: "
                                  f"{', '.join(known)})")
            changes[name] = _figure(entry, known[name], f"{where}: figures.{name}")
        if "gpu" in data:
            if not isinstance(data["gpu"], str) or not data["gpu"]:
                raise ConfigError(f"{where}: gpu: expected a name, got {data['gpu']!r}")
            changes["name"] = data["gpu"]
        if "hbm_bytes" in data:
            hbm = data["hbm_bytes"]
            if not isinstance(hbm, int) or isinstance(hbm, bool) or hbm <= 0:
                raise ConfigError(f"{where}: hbm_bytes: expected a positive integer, got {hbm!r}")
            changes["hbm_bytes"] = hbm
        return dataclasses.replace(base, **changes)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _figure(entry: Any, default: Measured | Curve, where: str) -> Measured | Curve:
    """One figure of a parts file, of the kind and unit of the default it replaces."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object, got {entry!r}")
    keys = {"xs", "ys", "unit", "source"} if isinstance(default, Curve) else \
        {"value", "unit", "source"}
    if set(entry) != keys:
        raise ConfigError(f"{where}: expected the keys {sorted(keys)}, got {sorted(entry)}")
    if entry["unit"] != default.unit:
        raise ConfigError(f"{where}: unit {entry['unit']!r}, expected {default.unit!r}")
    if not isinstance(entry["source"], str) or not entry["source"]:
        raise ConfigError(f"{where}: source: expected the run it came from")
    if isinstance(default, Measured):
        if not _number(entry["value"]):
            raise ConfigError(f"{where}: value: expected a positive number, got "
                              f"{entry['value']!r}")
        return Measured(float(entry["value"]), entry["unit"], entry["source"])
    xs, ys = entry["xs"], entry["ys"]
    if not (isinstance(xs, list) and isinstance(ys, list) and all(map(_number, xs + ys))):
        raise ConfigError(f"{where}: xs, ys: expected lists of positive numbers")
    try:
        return Curve(tuple(map(float, xs)), tuple(map(float, ys)), entry["unit"], entry["source"])
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def parts_json(figures: dict[str, Measured | Curve], gpu: str, date: str, command: str,
               hbm_bytes: int | None = None) -> dict[str, Any]:
    """The file `Parts.load` reads: `figures` by Parts field name (benchmarks/kernels.py
    --parts writes what its sections measured)."""
    out: dict[str, Any] = {"gpu": gpu, "date": date, "command": command}
    if hbm_bytes is not None:
        out["hbm_bytes"] = hbm_bytes
    out["figures"] = {}
    for name, fig in figures.items():
        entry = dataclasses.asdict(fig)
        if isinstance(fig, Curve):
            entry["xs"], entry["ys"] = list(fig.xs), list(fig.ys)
        out["figures"][name] = entry
    return out


H200 = Parts()
