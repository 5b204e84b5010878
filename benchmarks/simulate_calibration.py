"""How well `dsaserve simulate` predicts the real engine: the same sessions, once with every step
run by the real model runner on the wall clock, once with every step priced by the step-time
model (plan/steptime.py); per request, predicted against measured TTFT and inter-token latency.

    python benchmarks/simulate_calibration.py                    # H200: GLM-5.3-shaped, 2 layers
    python benchmarks/simulate_calibration.py --contexts 8192,32768 --concurrency 2,8
    python benchmarks/simulate_calibration.py --enforce-eager    # decode eager, as the flag
    python benchmarks/simulate_calibration.py --mtp 3            # MTP3, synthetic acceptance 2.99
    python benchmarks/simulate_calibration.py --weights fp8      # an FP8 checkpoint, kept in FP8
    python benchmarks/simulate_calibration.py --hisparse         # HiSparse, GPU pages spilled
    python benchmarks/simulate_calibration.py --smoke            # CPU, tiny model (CI)
    python benchmarks/simulate_calibration.py --parts parts.json --decode-rows decode.json \
        --prefill-rows prefill_host.json                         # this machine's own parts

Both runs share the simulator's event loop (arrivals, think times, routing, the scheduler), so
what differs is only how long each step takes. The measured run also prices each of its own
steps, which separates the step model's error from the different interleavings the two clocks
lead to. The model is built from the H200's measured parts and host fits unless the run is
given this machine's own (Vidur's way: profile the hardware the calibration runs on): --parts
from `benchmarks/kernels.py --parts`, --decode-rows from `benchmarks/decode.py --rows-json`,
--prefill-rows from `benchmarks/prefill_host.py --json` (docs/simulate.md: the commands). A
run on another GPU with the H200's figures compares that GPU with an H200, not the model with
the engine.
The simulated deployment is given the settings the real runner runs with (`deployment_spec`):
its KV dtype, its weights (`--weights fp8`: the runner keeps the FP8 matrices on CUDA and
multiplies them with bf16 activations, `weights=fp8-dsaserve`; a bf16 checkpoint, or FP8
dequantized at load as on the CPU, `weights=bf16`), whether its decode steps replay CUDA graphs,
its MTP drafts.

`--hisparse` runs the runner as a HiSparse decode engine (docs/hisparse.md): a host pool of the
sessions' windows (`--host-pool-gib`), hot buffers of the engine's default rows
(`--device-buffer-size`) and GPU MLA pages for one prefill's window beside each decoder's write
tail (`--device-mla-pages`), so long decoders' older pages spill and every decode beyond the
hot buffer fetches its misses, from the host pool where spilled. Both passes' schedulers hand
out the MLA pages as the engine's (`MlaSpilling`); the model is given the same pool, hot rows,
window and admitted requests, and an overlap of consecutive steps' selections (`--overlap`):
an assumed one, printed beside the one the runner's miss counters give, or `--overlap
measured`, that one: the model then prices the pass at the misses the runner had (the overlap
is the model's input, as the contexts are; what is calibrated is the price of a miss). The
probe (above) still prices its own steps at the assumed default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    HiSparseConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import ModelRunnerOutput, SchedulerOutput
from dsaserve.engine.runner import ModelRunner, cache_page_bytes, resolve_dtype
from dsaserve.kv.hisparse.admission import mla_pages_for, write_tail_pages
from dsaserve.model.dsa import keeps_fp8
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped
from dsaserve.plan.deployment import DEFAULT_OVERLAP, parse_deployment
from dsaserve.plan.hosttime import (
    MEASURED_DRAFTS,
    DecodeRow,
    HostFits,
    PrefillFit,
    fit_decode,
)
from dsaserve.plan.parts import H200, Parts
from dsaserve.plan.simengine import MlaSpilling
from dsaserve.plan.simtrace import TraceSession, TraceTurn
from dsaserve.plan.simulate import SimResult, Simulator
from dsaserve.plan.steptime import GPU_PARTS


def sessions(num: int, turns: int, context: int, out: int, block: int = 64) -> list[TraceSession]:
    """`num` sessions whose first prompt is ~context/2 tokens, growing to ~context by the last
    turn (each turn appends whole blocks)."""
    first = max(block, context // 2 // block * block)
    grow = max(block, (context - first) // max(turns - 1, 1) // block * block)
    result = []
    for s in range(num):
        ids: list[int] = list(range(first // block))
        ts = []
        for k in range(turns):
            if k:
                ids = ids + list(range(len(ids), len(ids) + grow // block))
            ts.append(TraceTurn(input_tokens=len(ids) * block, output_tokens=out + s,
                                hash_ids=tuple(ids), think_time_s=0.05 if k else 0.0))
        result.append(TraceSession(id=f"cal{s}", block_size=block, scope="local",
                                   turns=tuple(ts)))
    return result


ACCEPTANCE = 2.99  # MTP's synthetic mean acceptance length (benchmarks/decode.py's)
PROBE_BATCHES = (1, 2, 8)  # the probe's batch sizes (the calibration's concurrencies and 1)
# decode steps per probe row once its batch decodes together: 16 gave rows whose noise (3–5 %
# between neighbouring rows of one process) the fit's per-entry term chased (docs/simulate.md)
PROBE_STEPS = 32
MEASURED = "measured"  # --overlap: the runner's misses of the measured pass


def probe_sessions(batch: int, context: int, out: int, block: int = 64) -> list[TraceSession]:
    """The probe's workload: `batch` one-turn requests of `context` tokens (each its own
    blocks: no prefix shared), decoding `out` tokens side by side."""
    n = context // block
    return [TraceSession(id=f"probe{batch}-{context}-{s}", block_size=block, scope="local",
                         turns=(TraceTurn(input_tokens=n * block, output_tokens=out,
                                          hash_ids=tuple(range(s * n, (s + 1) * n)),
                                          think_time_s=0.0),))
            for s in range(batch)]


def probe_fits(model: ModelConfig, spec, parts: Parts, fits: HostFits, runner: ModelRunner,
               context: int, num_blocks: int, batches: tuple[int, ...] = PROBE_BATCHES,
               steps: int = PROBE_STEPS, spilling: MlaSpilling | None = None) -> HostFits:
    """The host fit of the runner's decode steps measured in this process, on a workload apart
    from the calibration's (Vidur's way, taken to the process: the same machine's decode rows
    vary 10-25 % from process to process, docs/simulate.md). Steady decode batches of
    `batches` at half and the whole `context` run on the real runner (about `steps` decode
    steps each once the whole batch decodes); each full batch's decode steps give a row whose
    kernels are the model's GPU time for it, so the fit is what the model's GPU parts leave of
    the measured step. Replaces the fit of the runner's own kind (graphed or eager, its
    drafts) and measures the prefill fit's residual (`probe_prefill`); the other kinds keep
    `fits`. `spilling`: the
    runner's HiSparse MLA pages, handed out by the simulator's scheduler."""
    drafts = runner.config.num_speculative_tokens
    graph = runner.decode_graphs is not None and runner.decode_graphs.capture
    if drafts not in (0, MEASURED_DRAFTS):  # the host model fits only these two (hosttime.py)
        print(f"probe: skipped at {drafts} drafts (fits at 0 and {MEASURED_DRAFTS})",
              file=sys.stderr)
        return fits
    rows = []
    chunk = runner.config.scheduler.max_num_batched_tokens
    for ctx in (context // 2, context):
        for b in batches:
            # each request decodes while the later ones prefill (b · ⌈ctx / chunk⌉ steps at
            # most), then `steps` more with the whole batch decoding
            out = (steps + b * -(-ctx // chunk)) * (1 + drafts)
            work = probe_sessions(b, ctx, out)
            for _ in range(2):  # the first untimed, as the calibration's own passes
                first_use = FirstUse(runner)
                sim = Simulator(model, spec, parts, work, b, num_blocks=num_blocks,
                                measure=first_use.measure, host_fits=fits, spilling=spilling)
                sim.run()
            decode = [(m, max(times, key=lambda t: t.total).gpu)
                      for (m, _), kind, (replicas, times), paid in zip(
                          sim.step_times, sim.step_kinds, sim.step_batches, first_use.steps,
                          strict=True)
                      if kind == "decode" and len(replicas[0]) == b and not paid]
            if decode:
                rows.append(DecodeRow(ctx, b, drafts, graph,
                                      1e3 * statistics.median(m for m, _ in decode),
                                      1e3 * statistics.median(g for _, g in decode)))
    fit = fit_decode(rows, f"this process's probe ({len(rows)} rows)")
    print(f"probe: {'graphed' if graph else 'eager'} decode at {drafts} drafts, host = "
          f"{1e3 * fit.fixed:.3f} ms + {1e3 * fit.per_request:.4f} ms per request + "
          f"{1e6 * fit.per_entry:.3f} µs per block-table entry; rows (context, batch, wall, "
          f"model GPU ms): " + ", ".join(f"({r.context}, {r.batch}, {r.wall_ms:.2f}, "
                                        f"{r.kernels_ms:.2f})" for r in rows),
          file=sys.stderr)
    kind = "graphed" if graph else "eager"
    return dataclasses.replace(fits, **{kind: {**getattr(fits, kind), drafts: fit}},
                               prefill=probe_prefill(model, spec, parts, fits, runner, context,
                                                     num_blocks, spilling))


def probe_sizes(chunk: int, context: int) -> list[int]:
    """The probe's prefill sizes: powers of two from 1,024 (or the context) up to a whole
    chunk, each no longer than the context, and the chunk or context itself."""
    top = min(chunk, context)
    sizes = {top}
    n = 1024
    while n < top:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def probe_turns(depth: int, tokens: int, block: int = 64) -> list[TraceSession]:
    """One session whose last turn prefills `tokens` new tokens over `depth` cached ones (a
    first turn of `depth` tokens before it; none at depth 0)."""
    lengths = ([depth] if depth else []) + [depth + tokens]
    return [TraceSession(id=f"probe-{depth}-{tokens}", block_size=block, scope="local",
                         turns=tuple(TraceTurn(input_tokens=n // block * block, output_tokens=1,
                                               hash_ids=tuple(range(n // block)),
                                               think_time_s=0.0) for n in lengths))]


def probe_prefill(model: ModelConfig, spec, parts: Parts, fits: HostFits, runner: ModelRunner,
                  context: int, num_blocks: int, spilling: MlaSpilling | None = None
                  ) -> PrefillFit:
    """The prefill fit moved to this process: prefill steps of `probe_sizes` tokens (up to a
    whole chunk, the scheduler's --max-num-batched-tokens), fresh and over half the context
    cached (a turn appended to an earlier one, as the sessions do), each once untimed, then
    three times timed. The median of measured − priced at each (depth, size) becomes the fit's
    residual there (PrefillFit.by_shape, interpolated between them, as Vidur interpolates its
    profiled shapes); the per-step and per-layer parts are kept (one process measures one
    layer count)."""
    block = runner.config.cache.block_size
    medians = {}
    for depth in (0, context // 2 // block * block):
        for tokens in probe_sizes(runner.config.scheduler.max_num_batched_tokens,
                                  context - depth):
            residuals = []
            for timed in (False, True, True, True):
                first_use = FirstUse(runner)
                sim = Simulator(model, spec, parts, probe_turns(depth, tokens, block), 1,
                                num_blocks=num_blocks, measure=first_use.measure,
                                host_fits=fits, spilling=spilling)
                sim.run()
                residuals += [m - p for (m, p), kind, (batches, _), paid in zip(
                    sim.step_times, sim.step_kinds, sim.step_batches, first_use.steps,
                    strict=True)
                    if timed and kind == "prefill" and not paid
                    and all(c > depth for _, c in batches[0])]  # the last turn's
            if residuals:
                medians[depth, tokens] = statistics.median(residuals)
    if not medians:
        return fits.prefill
    fit = dataclasses.replace(
        fits.prefill,
        by_shape=tuple((d, n, fits.prefill.residual(n, d) + r)
                       for (d, n), r in sorted(medians.items())),
        source=f"this process's probe ({len(medians)} prefill shapes) on "
               f"{fits.prefill.source}")
    print("probe: prefill measured − priced " + ", ".join(
        f"{1e3 * r:+.2f} ms at {n:,} over {d:,}" for (d, n), r in sorted(medians.items())),
        file=sys.stderr)
    return fit


def deployment_spec(runner: ModelRunner, overlap: float = DEFAULT_OVERLAP) -> str:
    """The one-GPU deployment the simulator is given: the real runner's own settings (HiSparse:
    `hisparse_words`, at the assumed `overlap`)."""
    cfg = runner.config
    # The model as built: FP8 layers only where the runner keeps the checkpoint's FP8 (CUDA);
    # either way the activations are bf16 (or fp32); kept FP8 products take the engine's
    # kernels by their rows (weight-only, W8A8, or dequantized), which fp8-dsaserve prices
    weights = "fp8-dsaserve" if keeps_fp8(runner.model.cfg) else "bf16"
    words = ["tp1", "kv=" + ("fp8_ds_mla" if cfg.cache.kv_cache_dtype == "fp8_ds_mla" else
                             "bf16"), f"weights={weights}"]
    graphs = runner.decode_graphs
    if graphs is None or not graphs.capture:  # eager decode: --enforce-eager, or the CPU
        words.append("enforce-eager")
    if cfg.speculative is not None:
        words.append(f"mtp={cfg.speculative.num_speculative_tokens} acceptance={ACCEPTANCE}")
    if cfg.hisparse is not None:
        words += hisparse_words(runner, overlap)
    return " ".join(words)


# ---- HiSparse (--hisparse) ----------------------------------------------------------------------
def hisparse_window(args: argparse.Namespace, context: int, block: int = 64) -> int:
    """--max-model-len of a HiSparse calibration: the context and room for what the sessions
    and the probe decode (whole blocks). Each request reserves this window in the host pool,
    and the GPU MLA pages hold one such prefill; a larger window would hold the sessions'
    pages whole and nothing would spill."""
    decoded = args.output_tokens + args.sessions + 16 * (1 + args.mtp) + args.mtp
    return context + -(-decoded // block) * block


def with_hisparse(cfg: EngineConfig, args: argparse.Namespace, context: int,
                  most: int) -> EngineConfig:
    """`cfg` as a HiSparse decode engine for requests of up to `context` tokens, `most` of them
    at once: the window of `hisparse_window`; a host pool of max(sessions, most) windows (every
    cache layer's MLA rows) unless --host-pool-gib; the engine's hot buffer unless
    --device-buffer-size; GPU MLA pages for one prefill's window beside `most` write tails
    (`mla_pages_for`, what `dsaserve plan` suggests) unless --device-mla-pages, so the older
    pages of every decoder spill once two or more run."""
    model, block = cfg.model, cfg.cache.block_size
    window = hisparse_window(args, context, block)
    reserved = window + max(args.mtp - 1, 0)  # what admission reserves: the MTP lookahead too
    if args.host_pool_gib is not None:
        pool = int(args.host_pool_gib * 2**30)
    else:
        layers = model.num_hidden_layers + model.num_nextn_predict_layers  # the MTP layer's too
        mla_page, _ = cache_page_bytes(model, layers, block, cfg.cache.fp8,
                                       resolve_dtype(cfg.dtype, model))
        pool = max(args.sessions, most) * -(-reserved // block) * mla_page
    pages = args.device_mla_pages or mla_pages_for(most, reserved, block,
                                                   write_tail_pages(args.mtp, block))
    attention = dataclasses.replace(cfg.attention, hisparse_device_buffer_size=args.buffer_size,
                                    hisparse_device_mla_pages=min(pages, cfg.cache.num_gpu_blocks),
                                    hisparse_config_given=True)
    return dataclasses.replace(cfg, attention=attention,
                               scheduler=dataclasses.replace(cfg.scheduler, max_model_len=window),
                               hisparse=HiSparseConfig(host_pool_bytes=pool))


def hisparse_words(runner: ModelRunner, overlap: float) -> list[str]:
    """The deployment words of the runner's HiSparse: its pool (the exact bytes: a float's repr
    of GiB round-trips), hot rows, window, and the requests its pool admits (the engine caps
    --max-num-seqs with them), with the overlap of consecutive steps' selections the model
    assumes."""
    cfg = runner.config
    assert cfg.hisparse is not None
    seqs = min(cfg.scheduler.max_num_seqs, runner.hisparse_spec())
    return ["hisparse", f"host={cfg.hisparse.host_pool_bytes / 2**30!r}GiB",
            f"hot-rows={cfg.hisparse_buffer_rows}", f"overlap={overlap}",
            f"max-model-len={cfg.scheduler.max_model_len}", f"max-num-seqs={seqs}"]


def spilling_of(runner: ModelRunner) -> MlaSpilling | None:
    """What the simulator's schedulers need to drive the runner's spilling (None: it does not
    spill)."""
    pages = runner.hisparse_mla_pages() if runner.config.hisparse is not None else 0
    if not pages:
        return None
    host = runner.hisparse_host_spec()
    assert host is not None
    return MlaSpilling(pages, runner.config.hisparse_buffer_rows, host)


def drop_last_pass(runner: ModelRunner) -> None:
    """A HiSparse runner starts a pass (a fresh scheduler) holding nothing of the last one: the
    requests its last step finished (no later step of that pass told the runner, as the
    engine's next step would), their host windows, the host blocks kept for cached spilled
    blocks and the MLA page map are given back, so the pool admits what the new scheduler
    does. Untimed, outside every pass."""
    rt = runner.hisparse
    if rt is None:
        return
    pages = runner.mla_page_of
    mapped = () if pages is None else tuple((int(b), -1) for b in
                                            np.flatnonzero(pages.host >= 0))
    runner.execute(SchedulerOutput(new_requests=(), cached_requests=(), num_scheduled_tokens={},
                                   finished_request_ids=tuple(runner.requests),
                                   mla_pages=mapped, host_drop=tuple(rt.kept)))
    assert not rt.entries and not rt.kept, "HiSparse: the last pass's windows were not freed"


def hisparse_counters(runner: ModelRunner) -> tuple[int, int]:
    """(rows missed, of those read from the host pool) so far, every layer (the runtime's
    device counters: read between passes, never inside a timed step)."""
    missed, from_host, _, _ = runner.hisparse_counters()
    return missed, from_host


@dataclasses.dataclass(frozen=True)
class Misses:
    """The measured pass's HiSparse misses: rows its decode rows selected through hot buffers
    by the model's rule, rows the runner missed, of those read from the host pool."""

    selected: int
    missed: int
    from_host: int

    @property
    def overlap(self) -> float | None:
        """The overlap at which the model's misses equal the runner's (None: nothing selected
        through a hot buffer)."""
        return 1 - self.missed / self.selected if self.selected else None


def hisparse_misses(sim: Simulator, runner: ModelRunner, before: tuple[int, int]) -> Misses:
    """The misses of the pass `sim` ran (the runtime's device counters since `before`): the
    rows selected by the model's rule (plan/steptime.py: a decode row beyond the buffer selects
    min(context, top-k) rows per MLA layer, the MTP layer's when it drafts), so the overlap at
    which the model's misses would equal the runner's (cold buffers at a request's first decode
    steps included)."""
    model, cfg = runner.model_cfg, runner.config
    topk, hot, rows = model.index_topk, cfg.hisparse_buffer_rows, 1 + cfg.num_speculative_tokens
    layers = model.num_hidden_layers + (model.num_nextn_predict_layers if rows > 1 else 0)
    selected = layers * sum(min(ctx, topk) for batches, _ in sim.step_batches
                            for n, ctx in batches[0] if n <= rows and ctx > hot)
    missed, from_host = (a - b for a, b in zip(hisparse_counters(runner), before, strict=True))
    return Misses(selected, missed, from_host)


def misses_line(context: int, c: int, misses: Misses, sim: Simulator, runner: ModelRunner,
                priced: float) -> str:
    """One line on the measured pass's misses beside the overlap the model priced it at; how
    many were read from the host pool (the model: all; the runtime reads every miss there but
    the rows its step wrote, kv/hisparse/fetch.py) and how many MLA blocks spilled."""
    mla = sim.replicas[0].scheduler.mla
    spilled = f"{mla.num_spills:,} MLA blocks spilled" if mla is not None else "no spilling"
    if misses.overlap is None:
        return (f"context {context:,}, c = {c}, HiSparse: no decode row beyond the hot buffer "
                f"({runner.config.hisparse_buffer_rows} rows); {misses.missed:,} rows missed; "
                f"{spilled}")
    return (f"context {context:,}, c = {c}, HiSparse: {misses.missed:,} of "
            f"{misses.selected:,} rows selected through hot buffers missed: measured overlap "
            f"{misses.overlap:.3f}, priced at {priced:.3f}; "
            f"{misses.from_host / max(misses.missed, 1):.1%} of the misses read from the host "
            f"pool (the model: all; the rest were written this step); {spilled}")


class FirstUse:
    """What each measured step paid for the first time: Triton kernels compiled for a new
    specialisation (Triton's post-compile hook) and the runner's decode CUDA graphs captured
    inside it. A deployment pays these once, a calibration step that carries one is not the
    step the model prices; `steps` holds, per measured step, what it compiled or captured."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        drop_last_pass(runner)
        self.steps: list[list[str]] = []
        self._compiled: list[str] = []
        try:
            import triton.knobs
        except ImportError:  # the CPU's reference backend compiles nothing
            return
        triton.knobs.runtime.jit_post_compile_hook = self._on_compile

    def _on_compile(self, *, fn, compile: dict, **_) -> None:  # noqa: A002 (Triton's keyword)
        # what was new about this call: the arguments' types, their attributes (divisibility
        # by 16) and the integers specialised as constants (values of 1)
        consts = {k: v for k, v in compile["constants"].items() if not isinstance(v, str)}
        self._compiled.append(f"{fn.name} {compile['signature']} attrs {compile['configs'][0]} "
                              f"constants {consts}"[:900])

    def _graphs(self) -> int:
        graphs = self.runner.decode_graphs
        return 0 if graphs is None else graphs.num_graphs

    def measure(self, _: int, so: SchedulerOutput) -> tuple[float, ModelRunnerOutput]:
        """The simulator's MeasureStep: one step on the real runner, synchronised, timed."""
        runner = self.runner
        before, self._compiled = self._graphs(), []
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        out = runner.execute(so)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        seconds = time.perf_counter() - t0
        captured = self._graphs() - before
        self.steps.append(self._compiled + ([f"{captured} CUDA graph(s) captured"]
                                            if captured else []))
        return seconds, out

    def summary(self) -> str:
        """One line: how many measured steps compiled or captured, and what."""
        paid = [s for s in self.steps if s]
        if not paid:
            return "no step compiled a kernel or captured a graph"
        names = sorted({n for s in paid for n in s})
        return f"{len(paid)} of {len(self.steps)} steps compiled or captured: {'; '.join(names)}"


def errors(measured: SimResult, modelled: SimResult) -> dict[str, float]:
    """Median absolute relative error per request of TTFT and ITL (requests in both runs)."""
    pred = {r.request_id: r for r in modelled.records}
    ttft, itl = [], []
    for r in measured.records:
        p = pred.get(r.request_id)
        if p is None or r.finish is None or p.finish is None:
            continue
        ttft.append(abs(p.ttft - r.ttft) / r.ttft)
        if r.itl and p.itl:
            itl.append(abs(p.itl - r.itl) / r.itl)
    return {"ttft": statistics.median(ttft) if ttft else float("nan"),
            "itl": statistics.median(itl) if itl else float("nan")}


KINDS = ("decode", "mixed", "prefill")


def by_kind(context: int, c: int, sim: Simulator) -> list[str]:
    """Rows of the per-kind table: the measured steps of each kind (decode rows only, prefill
    rows only, both), their median measured and predicted times, the predicted total over the
    measured (the bias: > 1 over-priced) and the median absolute error."""
    lines = []
    for kind in KINDS:
        pairs = [t for t, k in zip(sim.step_times, sim.step_kinds, strict=True) if k == kind]
        if not pairs:
            continue
        m = statistics.median(x for x, _ in pairs)
        p = statistics.median(y for _, y in pairs)
        bias = sum(y for _, y in pairs) / sum(x for x, _ in pairs)
        err = statistics.median(abs(y - x) / x for x, y in pairs)
        lines.append(f"| {context:,} | {c} | {kind} | {len(pairs)} | {1e3 * m:.2f} | "
                     f"{1e3 * p:.2f} | {bias:.3f} | {err:.1%} |")
    return lines


def step_records(context: int, c: int, sim: Simulator, first_use: FirstUse) -> list[dict]:
    """--steps-json: every measured step with its kind, measured and predicted ms, its batch
    ((new tokens, context after the step) per request, the first replica's), the model's
    parts for it in ms (what a refit of the step model needs) and what it compiled or
    captured."""
    out = []
    for (m, p), kind, (batches, times), paid in zip(sim.step_times, sim.step_kinds,
                                                    sim.step_batches, first_use.steps,
                                                    strict=True):
        t = max(times, key=lambda x: x.total)
        out.append({"context": context, "c": c, "kind": kind, "measured_ms": 1e3 * m,
                    "predicted_ms": 1e3 * p, "batch": batches[0],
                    "parts_ms": {**{k: 1e3 * getattr(t, k) for k in GPU_PARTS},
                                 "cpu": 1e3 * t.cpu},
                    "first_use": paid})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--concurrency", default="2,8")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="the engine's flag: decode steps run eager, not from CUDA graphs")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help=f"MTP drafts per step, accepted at synthetic length {ACCEPTANCE}")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8"),
                    help="the built checkpoint's matrices: bf16, or FP8 with 128x128 block "
                         "scales as the released checkpoints (kept in FP8 on CUDA; default: "
                         "%(default)s)")
    ap.add_argument("--hisparse", action="store_true",
                    help="run the runner as a HiSparse decode engine with spilling GPU MLA pages "
                         "and simulate it with the same pool, hot rows and window")
    ap.add_argument("--host-pool-gib", type=float, default=None,
                    help="--hisparse: the HiSparse host pool (kv_connector_extra_config."
                         "host_pool_gib; default: the sessions' windows)")
    ap.add_argument("--device-buffer-size", dest="buffer_size", type=int, default=None,
                    help="--hisparse: hot-buffer rows per request (hisparse_config."
                         "device_buffer_size; default: the engine's, (query rows + 1) × top-k)")
    ap.add_argument("--device-mla-pages", type=int, default=None,
                    help="--hisparse: GPU MLA pages (hisparse_config.device_mla_pages; default: "
                         "one prefill's window beside each decoder's write tail)")
    ap.add_argument("--overlap", type=overlap_arg, default=DEFAULT_OVERLAP,
                    help="--hisparse: the share of a step's selected rows the previous step "
                         "selected, as the model prices it: a number in (0, 1], or 'measured' "
                         "(the runner's misses of the pass; default: %(default)s)")
    ap.add_argument("--steps-json", type=Path, default=None, metavar="FILE",
                    help="also write every measured step (kind, measured and predicted ms, "
                         "its batch, the model's parts) to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, tiny contexts")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="price decode steps with the files' host fits alone, not refitted "
                         "from this process's probe (probe_fits; the last two columns are "
                         "those fits' errors either way)")
    ap.add_argument("--parts", default=None, metavar="FILE",
                    help="this GPU's kernel rates (benchmarks/kernels.py --parts); default: the "
                         "H200's")
    ap.add_argument("--decode-rows", default=None, metavar="FILE",
                    help="this machine's decode rows (benchmarks/decode.py --rows-json) for the "
                         "host time fits; default: the H200's")
    ap.add_argument("--prefill-rows", default=None, metavar="FILE",
                    help="this machine's prefill host rows (benchmarks/prefill_host.py --json); "
                         "default: the H200 run's")
    args = ap.parse_args(argv)
    given = [flag for flag, value in (("--host-pool-gib", args.host_pool_gib),
                                      ("--device-buffer-size", args.buffer_size),
                                      ("--device-mla-pages", args.device_mla_pages),
                                      ("--overlap", args.overlap != DEFAULT_OVERLAP or None))
             if value is not None]
    if given and not args.hisparse:
        ap.error(f"{given[0]}: needs --hisparse")
    return args


def overlap_arg(text: str) -> float | str:
    """--overlap: 'measured', or a share in (0, 1]."""
    if text == MEASURED:
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be 'measured' or lie in (0, 1], got {text!r}")
    return value


def load_parts(args: argparse.Namespace) -> tuple[Parts, HostFits]:
    """The parts and host fits the model prices steps with; says on stderr which came from the
    files."""
    parts = H200 if args.parts is None else Parts.load(args.parts)
    fits = HostFits.load(args.decode_rows, args.prefill_rows)
    if args.parts is not None:
        kept = parts.kept(H200)
        print(f"parts from {args.parts} ({parts.name}): "
              f"{', '.join(k for k in parts.figures() if k not in kept)}; the H200's: "
              f"{', '.join(kept) or 'none'}", file=sys.stderr)
    for flag, path, what in (("--decode-rows", args.decode_rows, "decode host fits"),
                             ("--prefill-rows", args.prefill_rows, "prefill host fit")):
        print(f"{what}: {'from ' + path if path else 'the defaults (no ' + flag + ')'}",
              file=sys.stderr)
    return parts, fits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        parts, fits = load_parts(args)
    except ConfigError as e:
        print(f"simulate_calibration: error: {e}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    contexts = [int(c) for c in args.contexts.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.smoke:
        contexts, concurrency, args.sessions, args.turns, args.output_tokens = [256], [2], 2, 2, 4
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        fp8 = args.weights == "fp8"
        if args.smoke:
            make_model("tiny-glm5", model_dir, fp8=fp8)
        else:
            make_model("glm-5.3", model_dir, fp8=fp8,
                       overrides=glm53_shaped(args.layers, mtp=args.mtp > 0))
        model = ModelConfig.from_file(model_dir)
        print("| context | c | requests | TTFT error (median) | ITL error (median) | "
              "step error (median) | steps | TTFT error, files' fits | ITL error, files' fits |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        kinds: list[str] = []
        records: list[dict] = []
        probe_batches, probe_steps = ((1, 2), 3) if args.smoke else (PROBE_BATCHES, PROBE_STEPS)
        for context in contexts:
            max_len = 2 * context + 1024
            blocks = args.sessions * (max_len // 64 + 1)
            cfg = EngineConfig(
                model_path=str(model_dir), model=model,
                cache=CacheConfig(block_size=64, num_gpu_blocks=blocks,
                                  kv_cache_dtype="auto" if args.smoke else "fp8_ds_mla"),
                scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192,
                                          max_model_len=min(blocks * 64,
                                                            model.max_position_embeddings)),
                attention=AttentionConfig(backend="triton" if device == "cuda" else "reference",
                                          sparse_mla_force_mqa=True),
                device=device, compilation=CompilationConfig(enforce_eager=args.enforce_eager),
                speculative=SpecConfig(
                    num_speculative_tokens=args.mtp, rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=SpecConfig.acceptance_length_to_rates(
                        ACCEPTANCE, args.mtp)) if args.mtp else None)
            if args.hisparse:
                cfg = with_hisparse(cfg, args, context, max(*concurrency, *probe_batches))
            runner = ModelRunner(cfg)
            assumed = DEFAULT_OVERLAP if args.overlap == MEASURED else args.overlap
            spec = parse_deployment(deployment_spec(runner, assumed))
            spilling = spilling_of(runner)
            print(f"context {context:,}: simulated as --deployment '{spec.spec}'",
                  file=sys.stderr)
            work = sessions(args.sessions, args.turns, context, args.output_tokens)
            own = probe_fits(model, spec, parts, fits, runner, context, blocks,
                             probe_batches, probe_steps, spilling) if args.probe else fits
            for c in concurrency:
                # an untimed pass first: it compiles the eager (prefill and mixed) steps' new
                # kernel specialisations, which the timed pass would otherwise count as step
                # time (a deployment pays them once; the decode graphs are captured when the
                # runner is built); FirstUse lists what the timed pass still compiles
                Simulator(model, spec, parts, work, c, num_blocks=blocks,
                          measure=FirstUse(runner).measure, host_fits=own,
                          spilling=spilling).run()
                first_use = FirstUse(runner)
                measured_sim = Simulator(model, spec, parts, work, c, num_blocks=blocks,
                                         measure=first_use.measure, host_fits=own,
                                         spilling=spilling)
                counted = hisparse_counters(runner) if args.hisparse else (0, 0)
                measured = measured_sim.run()
                print(f"context {context:,}, c = {c}, timed pass: {first_use.summary()}",
                      file=sys.stderr)
                priced = spec
                if args.hisparse:
                    misses = hisparse_misses(measured_sim, runner, counted)
                    if args.overlap == MEASURED and misses.overlap is not None:
                        # the model's misses at the runner's count (an overlap of 0 or below
                        # is more misses than rows: the model's floor is every row)
                        priced = dataclasses.replace(spec, overlap=max(misses.overlap, 0.0))
                    print(misses_line(context, c, misses, measured_sim, runner,
                                      priced.overlap), file=sys.stderr)
                e = errors(measured, Simulator(model, priced, parts, work, c,
                                               num_blocks=blocks, host_fits=own,
                                               spilling=spilling).run())
                files = errors(measured, Simulator(model, priced, parts, work, c,
                                                   num_blocks=blocks, host_fits=fits,
                                                   spilling=spilling).run())
                step = statistics.median(abs(p - m) / m for m, p in measured_sim.step_times)
                print(f"| {context:,} | {c} | {len(measured.records)} | {e['ttft']:.1%} | "
                      f"{e['itl']:.1%} | {step:.1%} | {len(measured_sim.step_times)} | "
                      f"{files['ttft']:.1%} | {files['itl']:.1%} |")
                sys.stdout.flush()
                kinds += by_kind(context, c, measured_sim)
                records += step_records(context, c, measured_sim, first_use)
            del runner
        print("\nThe measured run's steps by kind, each also priced by the model:\n")
        print("| context | c | kind | steps | measured (ms, median) | predicted (ms, median) | "
              "predicted / measured (total) | error (median) |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|")
        print("\n".join(kinds))
    if args.steps_json is not None:
        args.steps_json.write_text(json.dumps(records, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
