"""The host time of a prefill step, at several layer counts: does it grow with layers (Python
and launches per layer) or not (per-step work: batch and metadata, sampling, first-use costs)?

    python benchmarks/prefill_host.py --json docs/prefill_host_h200.json   # one GPU
    python benchmarks/prefill_host.py --smoke                              # CPU, tiny (CI)
    python benchmarks/prefill_host.py --lengths 4K --layers 2,4,6 --json prefill_host.json
                                   # the rows plan/hosttime.py fits (HostFits.load: 4K prompts)

A GLM-5.3-shaped checkpoint (benchmarks/long_prefill.py's: real attention and indexer
dimensions, 8 experts; `presets.glm53_shaped`) is built at each of --layers (2, 4, 8); its
`ModelRunner` (triton backend, fp8_ds_mla, bf16, eager) prefills one fresh prompt of each of
--lengths (1K, 4K, 16K tokens) per step, whole, after --warmup steps like it. Per (prompt,
layers) row:

  - wall: the step, synchronised before and after (`ModelRunner.execute`, which waits for its
    sampled token), median of --repeats;
  - GPU busy: the union of the step's kernel intervals (torch.profiler, a second run of
    --profile-steps steps; dsaserve/bench/profile.py), and the kernels it launched;
  - host = wall − busy: the time the GPU waits for the host;
  - the host's own CPU time by top-level operator (the profiler's CPU events, per step) and by
    Python function (cProfile of one step, own time of dsaserve's functions): where it goes.

Then per prompt the fit host = a + b·layers (least squares over the layer counts): a is per
step, b per layer; at 78 layers a + 78·b. Last, the torch ops and Triton launches per layer
of a prefill and an eager decode step (engine/host_ops.py's counter, at the two smallest
layer counts; dsaserve/bench/step_ops.py): multiplied by a dispatch's cost, what b should be.

On a CPU (--smoke: tiny-glm5, the reference backend, float32, prompts of 32 and 64 tokens,
2 and 4 layers) the "kernels" are the profiler's top-level CPU operators, so busy is their
union and host the Python around them. With `--attention-backend triton` on a CPU the op
count takes the GPU path's host code, launches counted, not run (gpu_branches); the timed
rows need the reference backend there.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsaserve.bench import steps
from dsaserve.bench.profile import summarize
from dsaserve.bench.step_ops import StepOps, count_steps
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.engine.runner import ModelRunner
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped

BLOCK = 64
TARGET_LAYERS = 78  # GLM-5.3


@dataclass(frozen=True)
class Row:
    """One prompt length at one layer count; times in ms per step."""

    prompt: int
    layers: int
    wall_ms: float
    busy_ms: float
    kernels: float  # kernels (CPU: top-level operators) per step
    host_ops_ms: dict[str, float]  # top-level CPU operator → ms per step (the top ones)
    python_ms: dict[str, float]  # dsaserve function → own ms in one step (the top ones)

    @property
    def host_ms(self) -> float:
        return max(self.wall_ms - self.busy_ms, 0.0)


def parse_length(text: str) -> int:
    """"4096" or "4K" → tokens (K = 1024)."""
    text = text.strip()
    scale = 1024 if text[-1:] in "kK" else 1
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"--lengths: {text!r} is not a token count (4096, 4K)")
    return int(digits) * scale


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x → (a, b); one point: (y, 0)."""
    if len(set(xs)) < 2:
        return (statistics.fmean(ys), 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Prefills:
    """Fresh prompts for one runner, one step each; each step ends the previous request, so the
    same blocks serve every prompt."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.count = 0
        self.last: tuple[str, ...] = ()

    def step(self, length: int) -> float:
        """Prefill a fresh prompt of `length` tokens → the step's wall seconds."""
        runner = self.runner
        so = steps.prefill(length, runner.config.model.vocab_size, runner.block_size,
                           f"p{self.count}", seed=self.count, finished=self.last)
        self.count += 1
        self.last = (f"{so.new_requests[0].request_id}",)
        device = runner.device.type
        _sync(device)
        t0 = time.perf_counter()
        runner.execute(so)
        _sync(device)
        return time.perf_counter() - t0


def _python_top(prof: cProfile.Profile, top: int) -> dict[str, float]:
    """cProfile's own time of dsaserve's functions, ms, the `top` largest."""
    stats = pstats.Stats(prof).stats  # (file, line, name) → (cc, nc, tottime, cumtime, callers)
    own: dict[str, float] = {}
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        if "/dsaserve/" in path:
            own[f"{path.rsplit('/dsaserve/', 1)[1]}:{line} {name}"] = 1e3 * tottime
    return dict(sorted(own.items(), key=lambda kv: -kv[1])[:top])


def measure(prefills: Prefills, length: int, layers: int, args: argparse.Namespace) -> Row:
    device = prefills.runner.device.type
    for _ in range(args.warmup):
        prefills.step(length)
    wall = statistics.median(prefills.step(length) for _ in range(args.repeats))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = sum(prefills.step(length) for _ in range(args.profile_steps))
    p = summarize(prof.events(), profiled, device == "cuda")
    n = args.profile_steps
    host_ops = {name: 1e3 * s / n for name, s in p.host_ops.most_common(args.top)}
    py = cProfile.Profile()
    py.enable()
    prefills.step(length)
    py.disable()
    return Row(length, layers, 1e3 * wall, 1e3 * p.busy / n, p.kernels / n, host_ops,
               _python_top(py, args.top))


def make_runner_factory(args: argparse.Namespace, root: Path):
    """layers → a ModelRunner of that many decoder layers (built once per layer count)."""
    max_len = max(max(args.lengths), args.ops_context) + BLOCK
    blocks = max(-(-max_len // BLOCK), args.ops_batch * -(-(args.ops_context + 2) // BLOCK)) + 4

    def make(layers: int) -> ModelRunner:
        if args.smoke:
            path = make_model("tiny-glm5", root / f"tiny{layers}", with_mtp=False,
                              overrides={"num_hidden_layers": layers})
        else:
            print(f"building a GLM-5.3-shaped checkpoint ({layers} layers) ...", file=sys.stderr)
            path = make_model("glm-5.3", root / f"glm53-{layers}", with_mtp=False,
                              overrides=glm53_shaped(layers))
        return ModelRunner(EngineConfig(
            model_path=str(path), model=ModelConfig.from_file(path),
            cache=CacheConfig(block_size=BLOCK, kv_cache_dtype=args.kv_cache_dtype,
                              num_gpu_blocks=blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(1, args.ops_batch),
                                      max_num_batched_tokens=max(args.lengths),
                                      max_model_len=max_len),
            attention=AttentionConfig(backend=args.attention_backend,
                                      sparse_mla_force_mqa=True),
            dtype=args.dtype, device=args.device,
            compilation=CompilationConfig(enforce_eager=True)))
    return make


def report(args: argparse.Namespace, rows: list[Row], ops: tuple[StepOps, StepOps] | None
           ) -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    unit = "kernels" if args.device == "cuda" else "CPU operators"
    lines = [f"{'tiny-glm5' if args.smoke else 'GLM-5.3-shaped'}, {args.kv_cache_dtype} KV, "
             f"{args.attention_backend} backend, {args.dtype}, eager, {where}; one prompt per "
             f"step; wall: median of {args.repeats}; busy: union of {unit}' intervals", "",
             f"| prompt | layers | wall (ms) | busy (ms) | host = wall − busy (ms) | host share "
             f"| {unit} / step |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.prompt} | {r.layers} | {r.wall_ms:.2f} | {r.busy_ms:.2f} | "
                     f"{r.host_ms:.2f} | {r.host_ms / r.wall_ms:.0%} | {r.kernels:.0f} |")
    if rows:
        lines += ["", "host = a + b·layers (least squares over the layer counts)", "",
                  "| prompt | a: per step (ms) | b: per layer (ms) | host at 78 layers (ms) | "
                  f"{unit} per layer |", "|---:|---:|---:|---:|---:|"]
    for length in args.lengths:
        mine = [r for r in rows if r.prompt == length]
        if not mine:  # the op count alone (the triton backend on a CPU)
            continue
        a, b = fit_line([r.layers for r in mine], [r.host_ms for r in mine])
        _, k = fit_line([r.layers for r in mine], [r.kernels for r in mine])
        lines.append(f"| {length} | {a:.2f} | {b:.3f} | {a + TARGET_LAYERS * b:.1f} | "
                     f"{k:.1f} |")
    for r in rows:
        if r.layers != max(args.layers):
            continue
        lines += ["", f"{r.prompt}-token prompt, {r.layers} layers: host CPU per step by "
                      "top-level operator (ms) | own time of dsaserve functions in one step "
                      "(ms)", ""]
        ops_rows = list(r.host_ops_ms.items())
        py_rows = list(r.python_ms.items())
        lines += ["| operator | ms | function | ms |", "|---|---:|---|---:|"]
        for i in range(max(len(ops_rows), len(py_rows))):
            o = ops_rows[i] if i < len(ops_rows) else ("", None)
            f = py_rows[i] if i < len(py_rows) else ("", None)
            lines.append(f"| {o[0]} | {'' if o[1] is None else f'{o[1]:.3f}'} | {f[0]} | "
                         f"{'' if f[1] is None else f'{f[1]:.3f}'} |")
    if ops is not None:
        how = ("the GPU path's host code, launches counted, not run"
               if args.device == "cpu" and args.attention_backend == "triton" else "as run")
        lines += ["", f"torch ops and Triton launches per layer ({how}; layers "
                      f"{ops[0].layers[0]} → {ops[0].layers[1]}; prefill of "
                      f"{args.ops_prompt} tokens, eager decode of {args.ops_batch} × "
                      f"{args.ops_context})", "",
                  "| step | ops per layer | launches per layer | ops of the step | "
                  "launches of the step |", "|---|---:|---:|---:|---:|"]
        for s in ops:
            lines.append(f"| {s.kind} | {s.ops_per_layer:g} | {s.launches_per_layer:g} | "
                         f"{s.ops[0]} → {s.ops[1]} | {s.launches[0]} → {s.launches[1]} |")
        lines += ["", "prefill: per layer by site", "", "```", ops[0].report(20), "```"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1K,4K,16K",
                   help="prompt lengths, comma-separated (4096 or 4K), one prompt per step")
    p.add_argument("--layers", default="2,4,8", help="decoder layer counts, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per row")
    p.add_argument("--top", type=int, default=12, help="host operators / functions listed")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--attention-backend", default=None,
                   help="default: triton (--smoke: reference)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--no-ops", dest="ops", action="store_false",
                   help="skip the count of torch ops and launches per layer")
    p.add_argument("--ops-prompt", type=int, default=1024, help="the op count's prefill")
    p.add_argument("--ops-context", type=int, default=1024, help="the op count's decode context")
    p.add_argument("--ops-batch", type=int, default=4, help="the op count's decode batch")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-glm5, reference backend, float32, prompts of 32 and 64 "
                        "tokens, 2 and 4 layers, 2 repeats (what CI runs)")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.attention_backend = args.attention_backend or "reference"
        defaults = {"lengths": "32,64", "layers": "2,4", "repeats": 2, "warmup": 1,
                    "profile_steps": 1, "ops_prompt": 64, "ops_context": 80, "ops_batch": 2}
        for name, value in defaults.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.attention_backend = args.attention_backend or "triton"
    try:
        args.lengths = sorted({parse_length(x) for x in args.lengths.split(",")})
        args.layers = sorted({int(x) for x in args.layers.split(",")})
    except ValueError:
        p.error("--layers: comma-separated integers (2,4,8)")
    if min(args.layers) < 1:
        p.error("--layers: each at least 1")
    if min(args.repeats, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--repeats and --profile-steps: at least 1; --warmup: at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here (--smoke runs on the CPU)")
    if args.device == "cpu" and args.attention_backend != "reference" and not args.smoke:
        p.error("--device cpu: the timed rows need --attention-backend reference (the op "
                "count alone takes the triton backend's host code: --smoke "
                "--attention-backend triton)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.device == "cpu":  # one thread: a shared CPU's contention swamps tiny steps
        torch.set_num_threads(1)
    rows: list[Row] = []
    ops = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            make = make_runner_factory(args, Path(tmp))
            runners: dict[int, ModelRunner] = {}
            stub = args.device == "cpu" and args.attention_backend == "triton"
            for layers in args.layers:
                runners[layers] = make(layers)
                if stub:  # the CPU cannot run the triton backend's kernels: counts only
                    continue
                prefills = Prefills(runners[layers])
                for length in args.lengths:
                    rows.append(measure(prefills, length, layers, args))
                    r = rows[-1]
                    print(f"{length} tokens, {layers} layers: wall {r.wall_ms:.2f} ms, busy "
                          f"{r.busy_ms:.2f} ms", file=sys.stderr)
                if len(runners) > 2:  # the op count needs the two smallest
                    del runners[layers]
            if args.ops and len(args.layers) > 1:
                pair = (args.layers[0], args.layers[1])
                ops = count_steps(runners.__getitem__, pair, args.ops_prompt, args.ops_context,
                                  args.ops_batch, stub)
    finally:
        torch.set_num_threads(threads)
    text = report(args, rows, ops)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({
            # the GPU (or CPU) measured: plan/hosttime.py's load_prefill_rows names it
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [asdict(r) | {"host_ms": r.host_ms} for r in rows],
            "fits": {length: dict(zip(("a_ms", "b_ms_per_layer"), fit_line(
                [r.layers for r in rows if r.prompt == length],
                [r.host_ms for r in rows if r.prompt == length]), strict=True))
                for length in args.lengths if any(r.prompt == length for r in rows)},
            "ops": [{k: v for k, v in asdict(s).items() if k != "growth"}
                    | {"growth_per_layer": {site: n / (s.layers[1] - s.layers[0])
                                            for site, n in s.growth.most_common(40)}}
                    for s in ops] if ops else None,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
