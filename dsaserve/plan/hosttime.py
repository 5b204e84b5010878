"""The engine's host time per step: the part of a step's wall time that is not GPU kernels
(Python, launches, metadata, sampling, the gaps between kernels), fitted from measured runs.

The engine is synchronous per step today: `ModelRunner.execute` builds the step's inputs,
launches (or replays) its kernels and waits for the sampled tokens before the scheduler runs
again, so a step lasts its kernels plus the host time they do not hide. Both benchmarks time
`ModelRunner.execute` (the scheduler's own time is not in them, nor in the simulator), and
host time here is wall − GPU kernels (busy) of the same step:

    step kind        measured on                              fitted, per kind
    decode graphed   benchmarks/decode.py, graph rows         fixed + per request · B
    decode eager     benchmarks/decode.py, eager rows           + per block-table entry · B·ctx/64
                     (2 layers; MTP: + its layer; k = 0 and k = 3 drafts: one fit each, other
                     k linear between them)
    prefill          benchmarks/prefill_host.py: one 4K       per step + per layer · L
                     prompt per step at 2, 4 and 6 layers

Projection to the model simulated (L layers, k drafts), the assumptions:
- graphed decode: one replay launches every layer, so the host part does not grow with layers
  but for a launch gap per layer (`Parts.kernel_overhead_us`, assumed) beyond the measured 2;
- eager decode: its excess over the graphed step is per-layer Python and launches, scaled by
  the forwards it runs: L target layers + k one-layer MTP drafts (measured: 2 + k). The
  measured pair of layers is one dense and one MoE layer; GLM-5.3's are mostly MoE, whose
  layers launch more (and sync once for the expert counts), so this is the low side;
- prefill and mixed steps (eager: the graphs cover decode-only steps) are priced from the
  prefill fit at L layers, measured, not extrapolated from 2: 0.270 ms + 0.260 ms per layer,
  20.6 ms at 78 layers, on the H200 machine of the decode rows (PREFILL_RUN; an H100 machine's
  host CPU had measured 2.30 ms + 0.252 ms per layer, 22 ms at 78).

How a prefill or mixed step combines the two. The prefill rows measure the *exposed* host
time of a step whose kernels are long (15 ms of them at 2 layers for 1 ms of host), not all
the host work it does: what the host issues while earlier kernels still run is hidden, and
what the GPU waits for is the work before the first kernel (the batch's inputs, metadata,
uploads), the syncs inside the forward (the MoE's expert counts, one per MoE layer: the per
layer part), and the sampling and result copy after the last kernel. An eager decode step's
kernels are short (~1 ms), so its fit is nearly all of its host work. A prefill or mixed step
of B requests with E block-table entries therefore costs

    exposed = prefill(L)                        the measured step: its fixed work, one 4K
                                                request, and the exposed per-layer part
            + max(eager₀(B, E) − eager₀(1, 64), 0)   the per-request and per-entry parts of
                                                the eager decode fit beyond that one request
    host    = exposed + max(issue − exposed − long, 0)
    issue   = eager_k(B, E) at L layers         the whole host work of the same requests'
                                                eager decode step, drafts included when they
                                                draft (k one-layer MTP forwards)
    long    = the step's kernels − the kernels of its requests as decode rows

so a step with a long chunk pays its exposed part alone (the prefill fit's rows: the drafts,
issued while the MTP layer's pass over the chunk still runs, hide too), and a step of a few new
tokens pays what an eager decode step of its requests pays (a 2-token chunk measured 5.5 ms on
an H100 against that step's 5.5 ms, where the exposed part alone priced 3.3 ms at that day's H100
fits: docs/simulate.md).
The exposed part's eager fits are at the measured 2 layers, not scaled by L: the per-request
and per-entry work (inputs and block tables before the forward, sampling after it) does not
repeat per layer, and the per-layer part of the eager fit is issue work, which the long
kernels hide; the small per-layer term of the prefill fit says so. Not measured: prompts other
than 4K (the calibration's probe measures this process's chunk: benchmarks/
simulate_calibration.py). The earlier long-prefill run (H200, 2 layers, 16K chunks, each prompt
prefilled once, no warm-up) exposed 10–14 ms of host per step on its 128K–1M prompts against
this fit's 0.8 ms at 2 layers; how much of that was first use and how much grows with the
chunk or its depth in the prompt is not known, so a deep 16K chunk may cost more than this.

Fitting: decode, per kind, least squares on relative error of the step's wall time (kernels +
host), coefficients held ≥ 0 (a feature whose coefficient would be negative is dropped);
prefill, least squares on the host time, a and b ≥ 0. `tests/unit/test_hosttime.py` checks
every measured row's residual.

Measured on the machine at hand instead (`HostFits.load`): `benchmarks/decode.py --rows-json
FILE` writes its rows as DecodeRow objects under the run's name (`decode_rows_json`), and
`benchmarks/prefill_host.py --json FILE` its prefill rows; either file replaces the rows above.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsaserve.config import ConfigError

# The graphed rows replay the engine's own decode graphs, MTP drafts included (the table in
# docs/decode_rows_h200.md; its rows in docs/decode_rows_h200.json).
DECODE_RUN = ("H200 run, benchmarks/decode.py (docs/decode_rows_h200.md), 2026-12-06, engine "
              "graphs")
# The same H200 machine's host CPU as DECODE_RUN.
PREFILL_RUN = ("H200 run, benchmarks/prefill_host.py (docs/prefill_host_h200.json, 2026-12-06), "
               "4K prompt at 2, 4, 6 layers, steady state")
MEASURED_LAYERS = 2  # GLM-5.3-shaped: 1 dense + 1 MoE layer (+ the MTP layer with MTP)
MEASURED_DRAFTS = 3  # MTP3 rows
MEASURED_BLOCK = 64  # tokens per block-table entry in both runs
PREFILL_PROMPT = 4096  # tokens of the one prompt of each measured prefill step


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


# GLM-5.3-shaped, 2 layers + MTP, bf16, fp8_ds_mla KV, one H200; median of 20 steps, synchronous
# steps (the async rows of the table are not fitted); docs/decode_rows_h200.json to 0.1 µs (the
# fit on relative error moves by up to 0.8 % with the walls rounded to the µs).
# context  batch  MTP3  graph  step wall (ms)  GPU kernels (ms)
DECODE_H200 = _rows("""
  8192   1  no  no     3.7250  0.7935
  8192   1  yes no    12.0322  2.5718
  8192   1  no  yes    1.5196  0.8092
  8192   1  yes yes    3.8338  2.6050
  8192   2  no  no     4.2036  0.8503
  8192   2  yes no    12.3603  2.7644
  8192   2  no  yes    1.6063  0.8714
  8192   2  yes yes    4.1947  2.8187
  8192   8  no  no     4.8108  0.9511
  8192   8  yes no    13.2439  3.0906
  8192   8  no  yes    1.7249  0.9672
  8192   8  yes yes    4.9739  3.1202
 32768   1  no  no     4.2427  0.8371
 32768   1  yes no    12.4398  2.5992
 32768   1  no  yes    1.6221  0.8498
 32768   1  yes yes    3.9242  2.6521
 32768   2  no  no     4.3805  0.8884
 32768   2  yes no    12.4935  2.7574
 32768   2  no  yes    1.6614  0.9094
 32768   2  yes yes    3.9914  2.7827
 32768   8  no  no     4.3057  0.9586
 32768   8  yes no    12.5954  3.2563
 32768   8  no  yes    1.7573  0.9840
 32768   8  yes yes    4.4331  3.2507
""")


@dataclass(frozen=True)
class PrefillHostRow:
    """One row of the prefill host table: one fresh 4K-token prompt prefilled whole per step,
    steady state; per step, the median wall time and the union of its kernels' intervals."""

    layers: int
    wall_ms: float
    busy_ms: float

    @property
    def host_ms(self) -> float:
        return self.wall_ms - self.busy_ms


# GLM-5.3-shaped (1 dense layer, the rest MoE), fp8_ds_mla, triton backend, bf16, eager, one
# H200; after 3 warm-up steps, median of 5 (docs/prefill_host_h200.json, to the µs).
# layers  step wall (ms)  GPU busy (ms)
PREFILL_HOST_H200 = tuple(PrefillHostRow(int(n), float(w), float(b)) for n, w, b in (
    line.split() for line in """
  2  15.731  14.782
  4  29.288  28.297
  6  42.125  40.135
""".strip().splitlines()))


@dataclass(frozen=True)
class PrefillFit:
    """Exposed host seconds of a prefill step of one PREFILL_PROMPT-token prompt at L layers:
    per_step + per_layer · L; plus, where a calibration's probe measured prefill steps of a few
    sizes at a few depths in its own process, what they took beyond that and the priced
    kernels, GPU or host alike (`by_shape`, interpolated: `residual`;
    benchmarks/simulate_calibration.py). The rows' fits have none."""

    per_step: float
    per_layer: float
    source: str
    # (cached tokens before the step, prefill tokens of the step, seconds): a grid, sorted
    by_shape: tuple[tuple[int, int, float], ...] = ()

    def __call__(self, num_layers: int) -> float:
        return self.per_step + self.per_layer * num_layers

    def residual(self, tokens: float, cached: float = 0.0) -> float:
        """`by_shape` at a step of `tokens` prefill tokens over `cached` ones: piecewise linear
        over tokens at each probed depth, then over depth, the nearest end's value beyond the
        probed points (no trend is extrapolated from a few noisy points); 0 without a probe."""
        depths = sorted({d for d, _, _ in self.by_shape})
        if not depths:
            return 0.0
        at = [(d, _interpolate([(n, r) for dd, n, r in self.by_shape if dd == d], tokens))
              for d in depths]
        return _interpolate(at, cached)


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), constant beyond the first and last."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x minimising |a·x − b|, a [rows, n] (full column rank), b [rows] → x [n] float64.

    In Python floats (modified Gram-Schmidt QR, columns scaled to unit norm first): LAPACK's
    lstsq rounds the last bits differently from run to run (its kernels depend on the
    buffers' alignment), and the simulator must give the same numbers every time."""
    rows = a.tolist()
    rhs = b.tolist()
    n = len(rows[0])
    cols = [[r[j] for r in rows] for j in range(n)]
    norms = [math.sqrt(sum(v * v for v in c)) or 1.0 for c in cols]
    q = [[v / norms[j] for v in c] for j, c in enumerate(cols)]
    r = [[0.0] * n for _ in range(n)]
    for j in range(n):
        for i in range(j):
            r[i][j] = sum(x * y for x, y in zip(q[i], q[j], strict=True))
            q[j] = [y - r[i][j] * x for x, y in zip(q[i], q[j], strict=True)]
        r[j][j] = math.sqrt(sum(v * v for v in q[j]))
        q[j] = [v / r[j][j] for v in q[j]]
    qtb = [sum(x * y for x, y in zip(q[j], rhs, strict=True)) for j in range(n)]
    x = [0.0] * n
    for j in reversed(range(n)):
        x[j] = (qtb[j] - sum(r[j][k] * x[k] for k in range(j + 1, n))) / r[j][j]
    return torch.tensor([x[j] / norms[j] for j in range(n)], dtype=torch.float64)


def fit_prefill(rows: Sequence[PrefillHostRow], source: str = PREFILL_RUN) -> PrefillFit:
    """Least squares on host = a + b · layers (absolute ms: the rows' walls differ 3×, but their
    host times are of one size), a and b held ≥ 0."""
    layers = torch.tensor([float(r.layers) for r in rows], dtype=torch.float64)
    host = torch.tensor([r.host_ms for r in rows], dtype=torch.float64) * 1e-3
    a = torch.stack([torch.ones_like(layers), layers], dim=1)  # [rows, 2]
    per_step, per_layer = _least_squares(a, host).tolist()
    if per_layer < 0:  # host time that falls with layers: all of it per step
        per_step, per_layer = float(host.mean()), 0.0
    elif per_step < 0:
        per_step, per_layer = 0.0, float((layers * host).sum() / (layers * layers).sum())
    return PrefillFit(per_step, per_layer, source)


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
        coef = _least_squares(a, host / wall)
        if (coef >= 0).all() or len(keep) == 1:
            break
        del keep[int(coef.argmin())]
    full = [0.0, 0.0, 0.0]
    for i, c in zip(keep, coef.tolist(), strict=True):
        full[i] = max(c, 0.0)
    return HostFit(*full, source=source)


@dataclass(frozen=True)
class HostFits:
    """The fitted host time of the measured model, by step kind and drafts (0 or MEASURED)."""

    graphed: dict[int, HostFit]
    eager: dict[int, HostFit]
    prefill: PrefillFit  # the exposed host of a prefill step of one request, by layers

    @staticmethod
    def fit(decode: Sequence[DecodeRow] = DECODE_H200,
            prefill: Sequence[PrefillHostRow] = PREFILL_HOST_H200,
            decode_source: str = DECODE_RUN, prefill_source: str = PREFILL_RUN) -> HostFits:
        """ValueError naming the kind when the rows cannot fit one: each of graphed and eager at
        0 and MEASURED_DRAFTS drafts needs rows at >= 2 batches and >= 2 contexts (its three
        coefficients), the prefill rows >= 2 layer counts."""
        def kind(graph: bool, drafts: int) -> HostFit:
            rows = [r for r in decode if r.graph == graph and r.drafts == drafts]
            if len({r.batch for r in rows}) < 2 or len({r.context for r in rows}) < 2:
                raise ValueError(
                    f"decode rows ({decode_source}): {'graphed' if graph else 'eager'} steps at "
                    f"{drafts} drafts need rows at >= 2 batches and >= 2 contexts, got "
                    f"{sorted({(r.context, r.batch) for r in rows})}")
            return fit_decode(rows, decode_source)

        if len({r.layers for r in prefill}) < 2:
            raise ValueError(f"prefill rows ({prefill_source}): need >= 2 layer counts, got "
                             f"{sorted({r.layers for r in prefill})}")
        return HostFits(graphed={k: kind(True, k) for k in (0, MEASURED_DRAFTS)},
                        eager={k: kind(False, k) for k in (0, MEASURED_DRAFTS)},
                        prefill=fit_prefill(prefill, prefill_source))

    @staticmethod
    def load(decode_rows: str | Path | None = None,
             prefill_rows: str | Path | None = None) -> HostFits:
        """Fits from a `benchmarks/decode.py --rows-json` file and a `benchmarks/prefill_host.py
        --json` file; None keeps that half's default rows. ConfigError naming the file."""
        decode, decode_source = (DECODE_H200, DECODE_RUN) if decode_rows is None else \
            load_decode_rows(decode_rows)
        prefill, prefill_source = (PREFILL_HOST_H200, PREFILL_RUN) if prefill_rows is None \
            else load_prefill_rows(prefill_rows)
        try:
            return HostFits.fit(decode, prefill, decode_source, prefill_source)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def figures(self) -> dict[str, dict[str, float | str]]:
        """Every fitted coefficient by name (for `simulate --json`)."""
        out: dict[str, dict[str, float | str]] = {}
        for name, fits in (("graphed", self.graphed), ("eager", self.eager)):
            for k, f in fits.items():
                out[f"decode_{name}_mtp{k}"] = {
                    "fixed_ms": f.fixed * 1e3, "per_request_us": f.per_request * 1e6,
                    "per_block_entry_ns": f.per_entry * 1e9, "source": f.source}
        out["prefill"] = {"per_step_ms": self.prefill.per_step * 1e3,
                          "per_layer_ms": self.prefill.per_layer * 1e3,
                          "probe_residual_ms": {f"{n} over {d}": r * 1e3
                                                for d, n, r in self.prefill.by_shape},
                          "source": self.prefill.source}
        return out


H200_HOST = HostFits.fit()


def decode_rows_json(rows: Sequence[DecodeRow], source: str) -> dict[str, Any]:
    """The file `load_decode_rows` reads: the run's name and its rows."""
    return {"source": source, "rows": [dataclasses.asdict(r) for r in rows]}


def _read_json(path: str | Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e})") from None


def _row(cls: type, entry: Any, where: str) -> Any:
    """One row object of `cls` from a JSON object holding (at least) its fields, each of the
    field's type (ints and floats finite and >= 0, bools)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object, got {entry!r}")
    values = {}
    for f in dataclasses.fields(cls):
        v = entry.get(f.name)
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = {"bool": isinstance(v, bool), "int": number and isinstance(v, int) and v >= 0,
              "float": number and v >= 0}[f.type]
        if not ok:
            raise ConfigError(f"{where}: {f.name}: expected {f.type}, got {v!r}")
        values[f.name] = float(v) if f.type == "float" else v
    return cls(**values)


def load_decode_rows(path: str | Path) -> tuple[tuple[DecodeRow, ...], str]:
    """The rows and source of a `decode_rows_json` file."""
    where = f"decode rows {path}"
    data = _read_json(path, "decode rows")
    if not isinstance(data, dict) or not isinstance(data.get("source"), str) \
            or not isinstance(data.get("rows"), list):
        raise ConfigError(f"{where}: expected an object with 'source' and a 'rows' list")
    rows = tuple(_row(DecodeRow, r, f"{where}: rows[{i}]") for i, r in enumerate(data["rows"]))
    bad = [r.drafts for r in rows if r.drafts not in (0, MEASURED_DRAFTS)]
    if bad:
        raise ConfigError(f"{where}: drafts {bad[0]}: the fits take 0 or {MEASURED_DRAFTS}")
    return rows, data["source"]


def load_prefill_rows(path: str | Path) -> tuple[tuple[PrefillHostRow, ...], str]:
    """The PREFILL_PROMPT-token rows of a `benchmarks/prefill_host.py --json` file, and a source
    naming its GPU (its 'gpu' key) and the file."""
    where = f"prefill rows {path}"
    data = _read_json(path, "prefill rows")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ConfigError(f"{where}: expected benchmarks/prefill_host.py --json output (a "
                          f"'rows' list)")
    rows = []
    for i, entry in enumerate(data["rows"]):
        if isinstance(entry, dict) and entry.get("prompt") == PREFILL_PROMPT:
            rows.append(_row(PrefillHostRow, entry, f"{where}: rows[{i}]"))
    if not rows:
        raise ConfigError(f"{where}: no rows of a {PREFILL_PROMPT}-token prompt (the fit's; run "
                          f"prefill_host.py with its default --lengths)")
    gpu = data.get("gpu") or "a GPU the file does not name"
    return tuple(rows), f"{gpu}, benchmarks/prefill_host.py --json ({Path(path).name})"


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
        self.prefill = fits.prefill(num_layers)
        # The eager decode host of the measured prefill step's one request (subtracted below).
        self.prefill_request = fits.eager[0](1, _entries(PREFILL_PROMPT))

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

    def prefill_step(self, b: int, entries: int, drafting: bool, long_kernels: float,
                     tokens: float, cached: float) -> float:
        """A prefill or mixed step of `b` requests, `entries` block-table entries, whose kernels
        exceed those of the same requests as decode rows by `long_kernels` seconds (module
        docstring): the exposed part (the measured prefill host at this model's layers, plus
        the eager decode fit's per-request and per-entry parts beyond the measured step's one
        4K request, those fits unprojected), plus whatever of the eager decode step's host
        work (drafts included when its requests draft) neither that part nor the longer
        kernels cover."""
        eager = self.fits.eager
        exposed = (self.prefill + self.fits.prefill.residual(tokens, cached)
                   + max(eager[0](b, entries) - self.prefill_request, 0.0))
        issue = (self._at_drafts(lambda k: self._eager(k, b, entries)) if drafting
                 else self._eager(0, b, entries))
        return exposed + max(issue - exposed - long_kernels, 0.0)

    def step(self, contexts: Sequence[int], prefill: bool, drafting: bool,
             long_kernels: float = 0.0, tokens: float = 0.0, cached: float = 0.0) -> float:
        """`contexts`: each scheduled request's context after the step; `prefill`: some
        request computes more than a decode row (the step runs eager); `drafting`: the step's
        sampling requests then run their MTP drafts; `long_kernels`: a prefill step's kernel
        seconds beyond those of its requests as decode rows (`prefill_step`); `tokens`: its
        prefill rows on this GPU and `cached` the tokens before them (their mean, weighted by
        rows): where the fit's probe residual is read (`PrefillFit.residual`)."""
        if not contexts:
            return 0.0
        b = len(contexts)
        entries = sum(-(-c // self.block_tokens) for c in contexts)
        if prefill:
            return self.prefill_step(b, entries, drafting, long_kernels, tokens, cached)
        if self.graphs:
            return self._at_drafts(lambda k: self.fits.graphed[k](b, entries)) + self.gap
        return self._at_drafts(lambda k: self._eager(k, b, entries))
