"""The engine's host time per step: the part of a step's wall time that is not GPU kernels
(Python, launches, metadata, sampling, the gaps between kernels), fitted from measured runs.

The engine is synchronous per step today: `ModelRunner.execute` builds the step's inputs,
launches (or replays) its kernels and waits for the sampled tokens before the scheduler runs
again, so a step lasts its kernels plus the host time they do not hide. Both benchmarks time
`ModelRunner.execute` (the scheduler's own time is not in them, nor in the simulator), and
host time here is wall − GPU kernels of the same step:

    step kind        measured on (2 layers; MTP: + its layer) fitted, per kind, at 2 layers
    decode graphed   benchmarks/decode.py, graph rows        fixed + per request · B
    decode eager     benchmarks/decode.py, eager rows          + per block-table entry · B·ctx/64
    (k = 0 and k = 3 MTP drafts: one fit each; other k linear between them)
    prefill / mixed  benchmarks/long_prefill.py (16K chunks) the eager decode host of its
                                                             requests + one fitted extra per step

Projection to the model simulated (L layers, k drafts), the assumptions:
- graphed decode: one replay launches every layer, so the host part does not grow with layers
  but for a launch gap per layer (`Parts.kernel_overhead_us`, assumed) beyond the measured 2;
- eager decode: its excess over the graphed step is per-layer Python and launches, scaled by
  the forwards it runs: L target layers + k one-layer MTP drafts (measured: 2 + k). The
  measured pair of layers is one dense and one MoE layer; GLM-5.3's are mostly MoE, whose
  layers launch more (and sync once for the expert counts), so this is the low side;
- prefill and mixed steps are eager (the graphs cover decode-only steps): their extra scales
  with L / 2 the same way.

Fitting: per kind, least squares on relative error of the step's wall time (kernels + host),
coefficients held ≥ 0 (a feature whose coefficient would be negative is dropped).
`tests/unit/test_hosttime.py` checks every measured row's residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The graphed rows replay the engine's own decode graphs, MTP drafts included (the table in
# docs/decode_h200.md).
DECODE_RUN = "H200 run, benchmarks/decode.py (docs/decode_h200.md), 2026-12-05, engine graphs"
PREFILL_RUN = "H200 run, benchmarks/long_prefill.py (docs/long_prefill_h200.md, 2026-12-05)"
MEASURED_LAYERS = 2  # GLM-5.3-shaped: 1 dense + 1 MoE layer (+ the MTP layer with MTP)
MEASURED_DRAFTS = 3  # MTP3 rows
MEASURED_BLOCK = 64  # tokens per block-table entry in both runs
PREFILL_CHUNK = 16384  # tokens per prefill step of the long-prefill run


@dataclass(frozen=True)
class DecodeRow:
    """One row of the decode table: per step, median wall time and the sum of its kernels."""

    context: int
    batch: int
    drafts: int  # MTP drafts per step (0 or 3)
    graph: bool  # the target forward (and the drafts) replayed from CUDA graphs
    wall_ms: float
    kernels_ms: float


def _rows(text: str) -> tuple[DecodeRow, ...]:
    out = []
    for line in text.strip().splitlines():
        ctx, b, mtp, graph, wall, kernels = line.split()
        out.append(DecodeRow(int(ctx), int(b), MEASURED_DRAFTS if mtp == "yes" else 0,
                             graph == "yes", float(wall), float(kernels)))
    return tuple(out)


# GLM-5.3-shaped, 2 layers + MTP, bf16, fp8_ds_mla KV, one H200; median of 20 steps.
# context  batch  MTP3  graph  step wall (ms)  GPU kernels (ms)
DECODE_H200 = _rows("""
  8192   1  no  no    8.87  0.801
  8192   1  yes no   19.36  2.700
  8192   1  no  yes   1.76  0.830
  8192   1  yes yes   4.63  2.725
  8192  64  no  no    7.88  1.161
  8192  64  yes no   32.77  5.099
  8192  64  no  yes   2.72  1.186
  8192  64  yes yes  13.95  5.137
131072   1  no  no    6.72  0.932
131072   1  yes no   21.79  3.001
131072   1  no  yes   1.96  0.961
131072   1  yes yes   5.16  3.019
131072  64  no  no   11.59  1.848
131072  64  yes no   59.89  8.133
131072  64  no  yes   5.97  1.868
131072  64  yes yes  24.07  8.040
""")


@dataclass(frozen=True)
class PrefillRow:
    """One prompt of the long-prefill table: prefilled alone in chunks, no MTP layer."""

    prompt: int
    wall_s: float
    gpu_busy_s: float  # the union of the kernels' intervals

    @property
    def steps(self) -> int:
        return -(-self.prompt // PREFILL_CHUNK)


# GLM-5.3-shaped, 2 layers, fp8_ds_mla, triton backend, 16K-token chunks, one H200.
PREFILL_H200 = (PrefillRow(4096, 0.033, 0.016), PrefillRow(32768, 0.164, 0.131),
                PrefillRow(131072, 0.742, 0.661), PrefillRow(524288, 5.147, 4.773),
                PrefillRow(1048575, 16.269, 15.397))


@dataclass(frozen=True)
class HostFit:
    """Host seconds of one step of the measured model: fixed + per_request · B + per_entry · E,
    E the block-table entries of the step's requests (Σ ⌈ctx / 64⌉)."""

    fixed: float
    per_request: float
    per_entry: float
    source: str

    def __call__(self, num_requests: float, entries: float) -> float:
        return self.fixed + self.per_request * num_requests + self.per_entry * entries


def _entries(context: int, block: int = MEASURED_BLOCK) -> int:
    return -(-context // block)


def fit_decode(rows: Sequence[DecodeRow], source: str = DECODE_RUN) -> HostFit:
    """Least squares on the relative error of wall = kernels + host, coefficients ≥ 0."""
    features = torch.tensor([[1.0, r.batch, r.batch * _entries(r.context)] for r in rows],
                            dtype=torch.float64)
    wall = torch.tensor([r.wall_ms for r in rows], dtype=torch.float64) * 1e-3
    host = wall - torch.tensor([r.kernels_ms for r in rows], dtype=torch.float64) * 1e-3
    keep = [0, 1, 2]
    while True:
        a = features[:, keep] / wall[:, None]
        coef = torch.linalg.lstsq(a, (host / wall)[:, None]).solution[:, 0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        del keep[int(coef.argmin())]
    full = [0.0, 0.0, 0.0]
    for i, c in zip(keep, coef.tolist(), strict=True):
        full[i] = max(c, 0.0)
    return HostFit(*full, source=source)


def fit_prefill_extra(eager: HostFit, rows: Sequence[PrefillRow]) -> float:
    """Host seconds a prefill step spends beyond the eager decode step of its one request:
    (Σ measured host − Σ eager decode host of each chunk at its context) / Σ steps."""
    host = sum(r.wall_s - r.gpu_busy_s for r in rows)
    decode = sum(eager(1, _entries(min((i + 1) * PREFILL_CHUNK, r.prompt)))
                 for r in rows for i in range(r.steps))
    return max(host - decode, 0.0) / sum(r.steps for r in rows)


@dataclass(frozen=True)
class HostFits:
    """The fitted host time of the measured model, by step kind and drafts (0 or MEASURED)."""

    graphed: dict[int, HostFit]
    eager: dict[int, HostFit]
    prefill_extra: float  # seconds per prefill or mixed step, at MEASURED_LAYERS

    @staticmethod
    def fit(decode: Sequence[DecodeRow] = DECODE_H200,
            prefill: Sequence[PrefillRow] = PREFILL_H200) -> HostFits:
        def kind(graph: bool, drafts: int) -> HostFit:
            return fit_decode([r for r in decode if r.graph == graph and r.drafts == drafts])

        eager = {k: kind(False, k) for k in (0, MEASURED_DRAFTS)}
        return HostFits(graphed={k: kind(True, k) for k in (0, MEASURED_DRAFTS)}, eager=eager,
                        prefill_extra=fit_prefill_extra(eager[0], prefill))

    def figures(self) -> dict[str, dict[str, float | str]]:
        """Every fitted coefficient by name (for `simulate --json`)."""
        out: dict[str, dict[str, float | str]] = {}
        for name, fits in (("graphed", self.graphed), ("eager", self.eager)):
            for k, f in fits.items():
                out[f"decode_{name}_mtp{k}"] = {
                    "fixed_ms": f.fixed * 1e3, "per_request_us": f.per_request * 1e6,
                    "per_block_entry_ns": f.per_entry * 1e9, "source": f.source}
        out["prefill_extra"] = {"per_step_ms": self.prefill_extra * 1e3, "source": PREFILL_RUN}
        return out


H200_HOST = HostFits.fit()


class HostTimeModel:
    """Host seconds of one step of the simulated model (`num_layers` decoder layers, `num_drafts`
    MTP drafts), projected from the measured model's fits (module docstring)."""

    def __init__(self, num_layers: int, num_drafts: int, graphs: bool, block_tokens: int,
                 layer_gap: float, fits: HostFits = H200_HOST) -> None:
        """`graphs`: decode-only steps replay CUDA graphs (the engine's default on CUDA);
        `block_tokens`: tokens per block-table entry on a rank; `layer_gap`: seconds per layer
        of a graph replay beyond the measured layers."""
        self.graphs, self.block_tokens, self.fits = graphs, block_tokens, fits
        self.num_layers, self.num_drafts = num_layers, num_drafts
        self.gap = max(num_layers - MEASURED_LAYERS, 0) * layer_gap
        self.prefill_extra = fits.prefill_extra * num_layers / MEASURED_LAYERS

    def _eager(self, k: int, b: int, entries: int) -> float:
        """The measured eager step at k ∈ {0, 3} drafts: the graphed step's host work plus its
        excess (per-layer Python and launches) scaled to this model's forwards."""
        graphed, eager = self.fits.graphed[k](b, entries), self.fits.eager[k](b, entries)
        scale = (self.num_layers + k) / (MEASURED_LAYERS + k)
        return graphed + max(eager - graphed, 0.0) * scale

    def _at_drafts(self, at_k: Callable[[int], float]) -> float:
        """k drafts: linear between the measured k = 0 and k = 3."""
        f = self.num_drafts / MEASURED_DRAFTS
        return (1 - f) * at_k(0) + f * at_k(MEASURED_DRAFTS)

    def step(self, contexts: Sequence[int], prefill: bool, drafting: bool) -> float:
        """`contexts`: each scheduled request's context after the step; `prefill`: some
        request computes more than a decode row (the step runs eager); `drafting`: the step's
        sampling requests then run their MTP drafts."""
        if not contexts:
            return 0.0
        b = len(contexts)
        entries = sum(-(-c // self.block_tokens) for c in contexts)
        if not prefill and self.graphs:
            return self._at_drafts(lambda k: self.fits.graphed[k](b, entries)) + self.gap
        if prefill and not drafting:  # a prefill or mixed step whose requests do not draft
            decode = self._eager(0, b, entries)
        else:
            decode = self._at_drafts(lambda k: self._eager(k, b, entries))
        return decode + (self.prefill_extra if prefill else 0.0)
