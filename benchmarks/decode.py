"""The decode step on one GPU: wall time against the sum of its kernels, eager against a CUDA
graph, and tokens/s per user with MTP3 (synthetic acceptance 2.99) against no MTP.

    python benchmarks/decode.py --out docs/decode_h200.md      # GLM-5.3-shaped, 2 layers + MTP
    python benchmarks/decode.py --smoke                        # tiny model on the CPU (CI)
    python benchmarks/decode.py --rows-json decode.json        # + the rows for plan/hosttime.py

Each row is a batch of B requests at a context of C tokens, decoding in steady state: the runner
is given the requests with C tokens already computed (the KV pages hold zeros; the step's cost
does not depend on their values) and the same decode step is run again and again. Per row:

* step wall time (host clock around `ModelRunner.execute`, the host copy of the results
  included) and the sum of the GPU kernels of one step (torch.profiler, device time): their
  ratio is how host-bound the step is (1.0 = the GPU never waits for the host);
* "graph": the same with the runner's own decode path (engine/decode_graph.py): the target's
  forward, and with MTP3 its drafts' chain, replayed from the CUDA graphs the runner captured
  for this batch size at start-up (sampling and rejection stay eager); the other rows run
  --enforce-eager;
* "async": --async-scheduling (graphs on, without and with MTP3): step k + 1 is launched
  before step k's results are read, its input tokens gathered on the device from step k's
  samples (MTP3: its last token and drafts, its rows moved back by the drafts step k
  rejected); the wall time is the interval between steps in that pipeline (the host's work
  for one step overlaps the device's for the previous one);
* tokens/s/user: tokens emitted per step (measured: 1 without MTP; 1 + accepted drafts with
  MTP3 at synthetic acceptance 2.99) over the step's wall time.

Beside its own table, the script prints the same columns from the engine's step log of the
same timed steps (--step-log, engine/step_log.py; read by dsaserve/bench/steplog.py): the
runner's own stats and its forward's GPU time from CUDA events, one log per context (kept
under --step-log DIR). Its GPU column is the target forward alone, not the step's kernels.

--host-profile N prints, per row, the N Python functions with the most own time over as many
more steps (cProfile, not in the timed ones: it slows the host several-fold): where a
host-bound step's time goes. --kernel-profile N prints, per row, the profiled step's kernels by
category (bench/profile.py's rules: time and launches per step) and its N kernels with the most
device time: where a kernel-bound step's time goes (MTP3 against plain, the small kernels of a
layer). --fastest-only keeps the graph + async rows.

--rows-json FILE writes the rows the host time model fits (plan/hosttime.py, `HostFits.load`):
those without --async-scheduling that measured both times, as DecodeRow objects (wall: the
step wall time; kernels: the sum of its GPU kernels), under a source naming this GPU, the date
and the command. The fits need graph and eager rows with and without MTP3 at >= 2 batches and
>= 2 contexts each (the defaults) of the model they project from (2 layers).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import math
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from dsaserve.bench import gaps as bench_gaps
from dsaserve.bench import profile as bench_profile
from dsaserve.bench import steplog
from dsaserve.bench import steps as bench_steps
from dsaserve.bench.argtypes import positive_ints
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import ModelRunnerOutput, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.step_log import StepLog
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped
from dsaserve.plan.hosttime import MEASURED_DRAFTS, MEASURED_LAYERS, DecodeRow, decode_rows_json

BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Row:
    context: int
    batch: int
    mtp: bool
    graph: bool
    async_: bool  # --async-scheduling
    wall_ms: float  # median step wall time
    kernels_ms: float  # GPU kernels of one step (device time; NaN on the CPU)
    tokens_per_step: float  # emitted per request per step
    note: str = ""

    @property
    def tokens_per_s_user(self) -> float:
        return self.tokens_per_step / (self.wall_ms / 1e3)


def _config(model_dir: Path, context: int, batch: int, mtp: bool, graph: bool, device: str,
            dtype: str, kv: str, async_: bool = False, draft_lm_head: str = "auto",
            draft_vocab: int = 0) -> EngineConfig:
    k = 3 if mtp else 0
    per_request = -(-(context + 2 * k + 2) // BLOCK)
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=BLOCK, kv_cache_dtype=kv,
                          num_gpu_blocks=per_request * batch + 1, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * (1 + k),
                                  max_model_len=per_request * BLOCK, async_scheduling=async_),
        attention=AttentionConfig(backend="triton" if device == "cuda" else "reference",
                                  sparse_mla_force_mqa=True),
        dtype=dtype, device=device, compilation=CompilationConfig(enforce_eager=not graph),
    )
    if mtp:
        spec = SpecConfig.from_json(bench_steps.MTP3_SYNTHETIC)
        cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(
            spec, draft_lm_head=draft_lm_head,
            draft_vocab=tuple(range(draft_vocab)) if draft_vocab else None))
    return cfg


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pipelined(runner: ModelRunner, so: SchedulerOutput, steps: int, device: str,
               log: StepLog | None = None) -> tuple[list[float], list[ModelRunnerOutput]]:
    """--async-scheduling's loop: launch step k + 1, then read step k; the interval between
    reads is a step's wall time. `log`: each step read gets its line."""
    pending = runner.submit(so)
    times, outs = [], []
    _sync(device)
    t0 = time.perf_counter()
    if log is not None:
        log.restart_clock()
    for _ in range(steps):
        launched = runner.submit(so)
        outs.append(pending.result())
        if log is not None:
            log.record(so, outs[-1])
        pending = launched
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    last = pending.result()
    if log is not None:  # launched after the last step read: the GPU times it brought
        log.take_gpu_times(last.gpu_times)
    return times, outs


def measure(model_dir: Path, context: int, batch: int, mtp: bool, graph: bool,
            args: argparse.Namespace, async_: bool = False, step_log: Path | None = None
            ) -> Row:
    """One row; `step_log`: the timed steps' lines appended there (engine/step_log.py)."""
    k = 3 if mtp else 0
    cfg = _config(model_dir, context, batch, mtp, graph, args.device, args.dtype,
                  args.kv_cache_dtype, async_, args.draft_lm_head, args.draft_vocab)
    log = None
    if step_log is not None:  # the runner times its steps (CUDA events), the log writes them
        cfg = dataclasses.replace(cfg, step_log=str(step_log))
        log = StepLog(str(step_log), async_scheduling=async_)
    runner = ModelRunner(cfg)
    first, again = bench_steps.decode(context, batch, cfg.model.vocab_size, BLOCK, k)
    note = ""
    try:
        runner.execute(first)
        if async_:  # every step continues from the previous one's outputs (device gathers):
            for st in runner.requests.values():  # its token is not known on the host
                del st.token_ids[st.num_computed_tokens :]
        for _ in range(args.warmup):  # the graphs were captured when the runner was built
            runner.execute(again)
        times, outs = [], []
        if async_:
            times, outs = _pipelined(runner, again, args.steps, args.device, log)
        if log is not None and not async_:
            _sync(args.device)
            log.restart_clock()
        for _ in range(0 if async_ else args.steps):
            _sync(args.device)
            t0 = time.perf_counter()
            outs.append(runner.execute(again))
            _sync(args.device)
            times.append(time.perf_counter() - t0)
            if log is not None:
                log.record(again, outs[-1])
        if log is not None:  # the timed steps' GPU times not back yet: waited for here
            log.close(runner.drain_step_times())
            log = None
        if args.host_profile:  # its own steps: the profiler slows the Python it watches
            profile = cProfile.Profile()
            profile.enable()
            if async_:
                _pipelined(runner, again, args.steps, args.device)
            for _ in range(0 if async_ else args.steps):
                runner.execute(again)
                _sync(args.device)
            profile.disable()
            print(f"host profile: context {context}, batch {batch}, MTP3 {mtp}, graph {graph}, "
                  f"async {async_}, {args.steps} steps", file=sys.stderr)
            pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(
                args.host_profile)
        if args.gaps:  # its own steps: the stack tracer slows the Python it watches
            print(f"exposed host time: context {context}, batch {batch}, MTP3 {mtp}, graph "
                  f"{graph}, async {async_}, {args.steps} steps", file=sys.stderr)
            print(bench_gaps.gaps_table(step_gaps(runner, again, args, async_), args.gaps),
                  file=sys.stderr)
        emitted = [sum(map(len, out.sampled_token_ids.values())) / batch for out in outs]
        kernels = math.nan
        if args.device == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU,
                          torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                if async_:
                    _pipelined(runner, again, 4, args.device)
                else:
                    for _ in range(4):
                        runner.execute(again)
                _sync(args.device)
            # the kernels themselves (device events), not the host ops that launched them; the
            # pipeline launches one step more than it reads (its first)
            profiled = 5 if async_ else 4
            kernels = sum(e.self_device_time_total for e in prof.events()
                          if e.device_type == DeviceType.CUDA) / profiled / 1e3
            if args.kernel_profile:
                print(f"kernels: context {context}, batch {batch}, MTP3 {mtp}, graph {graph}, "
                      f"async {async_} (µs per step)", file=sys.stderr)
                print(kernel_table(prof, profiled, args.kernel_profile), file=sys.stderr)
        times.sort()
        wall = 1e3 * times[len(times) // 2]
        per_step = sum(emitted) / len(emitted)
        graphs = runner.decode_graphs
        if graph and (graphs is None or not graphs.num_replays):
            note = "no graph replayed"
        elif graph and mtp and not graphs.num_draft_replays:
            note = "no draft graph replayed"
    except (RuntimeError, torch.OutOfMemoryError) as e:  # report the row, keep the table
        wall, kernels, per_step, note = math.nan, math.nan, math.nan, f"failed: {e}"[:120]
    if log is not None:  # the row failed before its log was closed
        log.close()
    del runner
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return Row(context, batch, mtp, graph, async_, wall, kernels, per_step, note)


def step_gaps(runner: ModelRunner, so: SchedulerOutput, args: argparse.Namespace,
              async_: bool) -> bench_gaps.GapResult:
    """--gaps: --steps more steps profiled with Python stacks → the device's idle time inside
    them by the host function running then. The windows: each `ModelRunner.execute` to the
    end of the synchronisation after it, or, pipelined, the first launch to the last read."""
    def run() -> None:
        if async_:
            _pipelined(runner, so, args.steps, args.device)
        for _ in range(0 if async_ else args.steps):
            runner.execute(so)
            _sync(args.device)

    return bench_gaps.profiled_gaps(
        run, args.device == "cuda", step=r"dsaserve/engine/runner\.py\(\d+\): (execute|submit)$",
        contiguous=async_)


def kernel_table(prof: torch.profiler.profile, steps: int, top: int) -> str:
    """The step's kernels by category (bench/profile.py's rules; µs and launches per step),
    then the `top` kernel names with the most device time, per step (µs) and as a share of the
    step's kernels: where an MTP step's time goes against a plain one's, and how much is the
    small kernels between the GEMMs and attention."""
    by_name: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_device_time_total / steps
            count[e.name] = count.get(e.name, 0) + 1
    total = sum(by_name.values()) or 1.0
    cats: dict[str, list[float]] = {}
    for name, us in by_name.items():
        cat = cats.setdefault(bench_profile.classify(name), [0.0, 0.0])
        cat[0] += us
        cat[1] += count[name] / steps
    lines = [f"  {cat:<18} {cats[cat][0]:9.1f} µs {100 * cats[cat][0] / total:5.1f} %  "
             f"{cats[cat][1]:6.1f} launches" for cat in bench_profile.ORDER if cat in cats]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    lines += [f"  {us:9.1f} µs {100 * us / total:5.1f} %  {name[:110]}" for name, us in ranked]
    return "\n".join(lines)


def table(rows: list[Row], title: str) -> list[str]:
    lines = [title, "",
             "| context | batch | MTP3 | graph | async | step wall (ms) | GPU kernels (ms) | "
             "wall / kernels | tokens / step / user | tokens/s/user | MTP3 speed-up |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    # MTP3's speed-up: against the row without MTP that runs the same way (async or not)
    plain = {(r.context, r.batch, r.graph, r.async_): r for r in rows if not r.mtp}
    for r in rows:
        ratio = r.wall_ms / r.kernels_ms if r.kernels_ms > 0 else math.nan
        base = plain.get((r.context, r.batch, r.graph, r.async_))
        speed = (f"{r.tokens_per_s_user / base.tokens_per_s_user:.2f}×"
                 if r.mtp and base is not None else "")
        lines.append(
            f"| {r.context} | {r.batch} | {'yes' if r.mtp else 'no'} | "
            f"{'yes' if r.graph else 'no'} | {'yes' if r.async_ else 'no'} | "
            f"{r.wall_ms:.2f} | {r.kernels_ms:.3f} | "
            f"{ratio:.2f} | {r.tokens_per_step:.2f} | {r.tokens_per_s_user:.1f} | {speed} |"
            + (f" {r.note}" if r.note else ""))
    return lines


def host_rows(rows: list[Row]) -> list[DecodeRow]:
    """The rows the host time fits take: not --async-scheduling (its wall hides the host),
    both times measured (not on the CPU, not failed)."""
    return [DecodeRow(r.context, r.batch, MEASURED_DRAFTS if r.mtp else 0, r.graph, r.wall_ms,
                      r.kernels_ms)
            for r in rows if not r.async_ and not r.note
            and math.isfinite(r.wall_ms) and math.isfinite(r.kernels_ms)]


def write_rows_json(path: Path, rows: list[Row], source: str) -> None:
    kept = host_rows(rows)
    path.write_text(json.dumps(decode_rows_json(kept, source), indent=1) + "\n")
    print(f"--rows-json {path}: {len(kept)} of {len(rows)} rows (not async, both times "
          f"measured)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--contexts", type=positive_ints, default=[8192, 131072])
    p.add_argument("--batches", type=positive_ints, default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", type=Path, default=None, help="an existing checkpoint (with MTP)")
    p.add_argument("--weights", default="bf16", choices=("bf16", "fp8"),
                   help="the built checkpoint's matrices: bf16, or FP8 with 128x128 block scales "
                        "as the released checkpoints (kept in FP8 by the engine)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the built model's vocabulary (default: presets.glm53_shaped's 8,192; "
                        "GLM-5.3's own is 154,880: its lm_head is read once per MTP draft)")
    p.add_argument("--draft-lm-head", default="auto", choices=("auto", "fp8", "model"),
                   help="the head MTP drafts read (--speculative-config's draft_lm_head; auto: "
                        "an FP8 copy with --weights fp8)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="MTP drafts over the first N token ids only (--speculative-config's "
                        "draft_vocab; the acceptance stays the synthetic 2.99; 0: every token)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, contexts 40, batches 1 and 2, 2 steps (any device)")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown)")
    p.add_argument("--step-log", type=Path, default=None, metavar="DIR",
                   help="keep the engine's step logs there (steps-CONTEXT.jsonl; default: a "
                        "temporary directory)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="print each row's N Python functions with the most own time (cProfile)")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                   help="print each row's kernels by category (time and launches) and its N "
                        "GPU kernels with the most device time")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="print each row's device idle time inside its steps by the host "
                        "function running then, the top N (more steps, profiled with Python "
                        "stacks; dsaserve/bench/gaps.py)")
    p.add_argument("--fastest-only", action="store_true",
                   help="only the rows with graphs and --async-scheduling (with and without MTP3)")
    p.add_argument("--rows-json", type=Path, default=None, metavar="FILE",
                   help="also write the rows the host time fits take (plan/hosttime.py)")
    args = p.parse_args(argv)
    if args.rows_json and not args.smoke and (args.layers != MEASURED_LAYERS or args.model):
        p.error(f"--rows-json: the host time fits project from {MEASURED_LAYERS} layers of the "
                f"built GLM-5.3-shaped model (no --model, --layers {MEASURED_LAYERS})")
    if args.smoke:
        args.contexts, args.batches, args.steps, args.warmup = [40], [1, 2], 2, 1
        if args.device == "cpu":
            args.dtype, args.kv_cache_dtype = "float32", "auto"
    graphs = [False, True] if args.device == "cuda" else [False]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.step_log or Path(tmp) / "steps"
        log_dir.mkdir(parents=True, exist_ok=True)
        if args.model is not None:
            model_dir, shape = args.model, str(args.model.name)
        elif args.smoke:
            model_dir, shape = make_model("tiny-glm5", Path(tmp) / "tiny",
                                          fp8=args.weights == "fp8"), "tiny-glm5"
        else:
            overrides = glm53_shaped(args.layers, mtp=True)
            if args.vocab_size is not None:
                overrides["vocab_size"] = args.vocab_size
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", fp8=args.weights == "fp8",
                                   overrides=overrides)
            shape = (f"GLM-5.3-shaped, {args.layers} layers + MTP, {args.weights} weights, "
                     f"vocabulary {overrides['vocab_size']:,}, drafts' head "
                     f"{args.draft_lm_head}"
                     + (f" over {args.draft_vocab:,} tokens" if args.draft_vocab else ""))
        rows, log_tables = [], []
        for context in args.contexts:
            log = log_dir / f"steps-{context}.jsonl"
            log.unlink(missing_ok=True)
            for batch in args.batches:
                for graph in graphs:
                    for mtp, async_ in ((False, False), (True, False), (False, True),
                                        (True, True)):
                        if async_ and graph != graphs[-1]:
                            continue  # async rows: with graphs where they run
                        if args.fastest_only and (graph, async_) != (graphs[-1], True):
                            continue
                        row = measure(model_dir, context, batch, mtp, graph, args, async_,
                                      log)
                        print(row, file=sys.stderr)
                        rows.append(row)
            log_tables += ["", *steplog.table(
                steplog.summarise(steplog.read(log)),
                f"The engine's step log of the same steps ({log.name}), context {context}")]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = table(rows, f"{shape}, {args.dtype}, {args.kv_cache_dtype} KV, {device}; median of "
                        f"{args.steps} steps") + log_tables
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if args.rows_json:
        when = time.strftime("%Y-%m-%d", time.gmtime())
        command = " ".join(["python", "benchmarks/decode.py",
                            *(sys.argv[1:] if argv is None else argv)])
        write_rows_json(args.rows_json, rows, f"{device} run, benchmarks/decode.py, {when} "
                                              f"({shape}): {command}")
    return 0 if all(not r.note for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
