"""Long prefill against its kernel floor: the engine's own API on prompts of 4K … 1M tokens.

    python benchmarks/long_prefill.py --out docs/long_prefill_h200.md       # one H200
    python benchmarks/long_prefill.py --lengths 128K,1M --max-num-batched-tokens 32768
    python benchmarks/long_prefill.py --smoke                   # CPU, tiny model (CI)
    python benchmarks/long_prefill.py --smoke --pcp 2           # the same under PCP2 (gloo)
    python benchmarks/long_prefill.py --lengths 4K,128K --async-scheduling  # chunk k + 1's host
                                                                # work under chunk k's kernels

A GLM-5.3-shaped checkpoint (real attention and indexer dimensions: 64 heads, 576/512 latent,
32 × 128 indexer, top-2048; 2 layers, 8 experts) prefills one prompt per length through
`LLMEngine` with max_tokens=1 (fp8_ds_mla, the triton backend, 16K-token chunks by default).
Per length it prints:

  - wall: the prefill, every chunk's step synchronised, no profiler attached;
  - GPU kernel time by category (torch.profiler's kernel names, dsaserve/bench/profile.py's
    `classify`), from a second,
    profiled run of the same prompt; GPU-busy is the union of the kernels' intervals;
  - host: wall − GPU-busy (time the GPU waits for the host), and the profiled steps' CPU time
    outside synchronisation calls (the host's own work, launches included);
  - peak device memory;
  - with --gaps N: from one more run, profiled with Python stacks, the device's idle time inside
    the steps (lead / mid / tail gaps) by the host function that was running in it, the top N
    (dsaserve/bench/gaps.py): which host code the GPU waits on;
  - the floor: `dsaserve plan`'s prefill FLOPs (plan/costmodel.prefill_flops) at the measured
    rates of the indexer logits and sparse MLA kernels, and wall / floor;
  - the floor with the weight matrices: that floor plus the prompt's pass through the layers'
    matrices (projections, MLPs, experts: `PrefillFlops.matrices`) at the measured dense bf16
    matmul rate (the engine multiplies in bf16: FP8 checkpoints are dequantized at load), and
    wall / it. The attention floor leaves that work out; at 2 layers it is 22.6 TFLOP per 16K
    tokens, as much as the attention of a 128K prompt.

For the longest prompt a per-chunk table follows: each chunk's time against its own floor at
its position. Work that grows with the cached context shows as a ratio rising with position.
With --async-scheduling the steps are not synchronised one by one (that would undo the
overlap): a chunk's row is the engine step that launched it and read the chunk before (the
last row also the step that read it), and the wall is their sum.

On a CPU (the reference backend) the "kernels" are the profiler's CPU operators, classified by
the same rules; under PCP the ranks are worker processes the profiler does not see, so only
wall, floor and the per-chunk table are given.
"""

from __future__ import annotations

import argparse
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsaserve.bench.gaps import GapResult, gaps_table, profiled_gaps
from dsaserve.bench.profile import ORDER, Profile, summarize
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.kernels.registry import register_backend
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped
from dsaserve.plan.costmodel import prefill_flops
from dsaserve.plan.parts import Parts

INDEXER_TFLOPS = 887.0  # indexer logits, measured on an H200 (issue 34, docs/kernels.md)
MLA_TFLOPS = 480.0  # sparse MLA prefill, measured on an H200
MATMUL_TFLOPS = Parts().matmul_bf16_tflops.value  # dense bf16 matmul ceiling, the same H200


def parse_length(text: str) -> int:
    """"4096", "4K", "1M" → tokens (K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"--lengths: {text!r} is not a token count (4096, 128K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]


def human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Result:
    length: int
    wall: float
    chunks: list[tuple[int, int, float]]  # (first position, tokens, seconds)
    token: int  # the greedy token after the prompt (compare before/after a change)
    profile: Profile | None
    peak_bytes: int | None
    floor: float
    floor_matrices: float  # the floor plus the weight matrices' FLOPs at the matmul rate
    gaps: GapResult | None = None  # --gaps: the device's idle time by host function


def matrices_seconds(flops, first: int, end: int, matmul_tflops: float) -> float:
    """Prompt positions [first, end) through the layers' weight matrices at the matmul rate."""
    return (flops.matrices(end) - flops.matrices(first)) / (matmul_tflops * 1e12)


def floor_seconds(flops, first: int, end: int, indexer_tflops: float, mla_tflops: float
                  ) -> float:
    """Kernel floor of prompt positions [first, end): cumulative FLOPs at the measured rates."""
    return ((flops.indexer(end) - flops.indexer(first)) / (indexer_tflops * 1e12)
            + (flops.mla(end) - flops.mla(first)) / (mla_tflops * 1e12))


def split_backend(split: str) -> str:
    """Register the triton backend with the indexer's logits split fixed → its name."""
    from dsaserve.kernels.triton.backend import TritonBackend
    from dsaserve.kernels.triton.indexer import IndexerConfig

    name = f"triton-{split}"
    register_backend(name, lambda: TritonBackend(
        indexer_config=IndexerConfig(logits_split=split)))
    return name


def model_max_len(model_dir: Path) -> int:
    return ModelConfig.from_file(model_dir).max_position_embeddings


def fit_lengths(lengths: list[int], max_len: int) -> list[int]:
    """Prompt lengths that leave their one output token within max_len positions."""
    return sorted({min(n, max_len - 1) for n in lengths})


def engine_config(args: argparse.Namespace, model_dir: Path) -> EngineConfig:
    # A prompt leaves room for its one output token within max_model_len, and max_model_len
    # stays within the model's positions: a "1M" prompt is 1M − 1 tokens (fit_lengths).
    max_len = min(max(args.lengths) + 64, model_max_len(model_dir))
    dcp_tokens = args.block_size  # a scheduler block: B tokens (no DCP here)
    blocks = -(-max_len // dcp_tokens) + 8
    return EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=max_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  async_scheduling=args.async_scheduling),
        attention=AttentionConfig(backend=args.attention_backend, sparse_mla_force_mqa=True),
        parallel=ParallelConfig(prefill_context_parallel_size=args.pcp),
        compilation=CompilationConfig.from_json(args.compilation_config, args.enforce_eager),
        dtype=args.dtype, device=args.device,
    )


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def _sync(device: str) -> None:
    """Wait for this process's GPU work ("cpu": nothing to wait for; under PCP a step returns
    once every worker's is done)."""
    if device == "cuda":
        torch.cuda.synchronize()


def prefill(engine: LLMEngine, ids: list[int], device: str
            ) -> tuple[int, list[tuple[int, int, float]]]:
    """One request with max_tokens=1 → (its token, (first position, tokens, seconds) per
    chunk).

    Every step is synchronised before and after, so a step's time is its own chunk's. Under
    --async-scheduling only the first and the last are (the point is that step k + 1's host
    work runs while step k's kernels do): a step's time is from one return to the next, and
    the call that launches chunk k reads chunk k − 1's results, waiting for its kernels, so
    that time is chunk k − 1's (the first call's, which only launches, is chunk 0's too; the
    call that reads the last chunk's token is the last chunk's)."""
    engine.add_request(f"p{time.monotonic_ns()}", ids,
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    chunk, token, calls = engine.config.scheduler.max_num_batched_tokens, -1, []
    pipelined = engine.async_scheduling
    _sync(device)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if not pipelined:
            _sync(device)
            t0 = time.perf_counter()
        outs = engine.step()
        if not pipelined or not engine.has_unfinished_requests():
            _sync(device)
        now = time.perf_counter()
        calls.append(now - t0)
        t0 = now
        for out in outs:
            token = out.new_token_ids[-1] if out.new_token_ids else token
    engine.check_integrity()
    starts = range(0, len(ids), chunk)
    seconds, shift = [0.0] * len(starts), 1 if pipelined else 0
    for k, s in enumerate(calls):  # a call past the last chunk's reads its token
        seconds[min(max(k - shift, 0), len(starts) - 1)] += s
    return token, [(first, min(chunk, len(ids) - first), t)
                   for first, t in zip(starts, seconds, strict=True)]


def measure(engine: LLMEngine, args: argparse.Namespace, length: int, flops) -> Result:
    vocab = engine.config.model.vocab_size
    ids = prompt(vocab, length, seed=length)
    # The GPU is this process's only without PCP (under PCP each worker holds its own).
    on_device = args.device == "cuda" and args.pcp == 1
    if on_device:
        torch.cuda.reset_peak_memory_stats()
    token, steps = prefill(engine, ids, args.device if on_device else "cpu")
    peak = torch.cuda.max_memory_allocated() if on_device else None
    profile = None
    if args.profile and args.pcp == 1:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            again, prof_steps = prefill(engine, ids, args.device)
        if again != token:
            print(f"warning: {human(length)}: profiled run gave token {again}, not {token}",
                  file=sys.stderr)
        profile = summarize(prof.events(), sum(s for _, _, s in prof_steps), on_device)
    gaps = profile_gaps(engine, ids, args, on_device) if args.gaps and args.pcp == 1 else None
    wall = sum(s for _, _, s in steps)
    floor = floor_seconds(flops, 0, length, args.indexer_tflops, args.mla_tflops)
    matrices = matrices_seconds(flops, 0, length, args.matmul_tflops)
    return Result(length, wall, steps, token, profile, peak, floor, floor + matrices, gaps)


def profile_gaps(engine: LLMEngine, ids: list[int], args: argparse.Namespace, on_device: bool
                 ) -> GapResult:
    """--gaps: one more run of the prompt, profiled with Python stacks → the device's idle gaps
    inside its engine steps by the host function running in them (pipelined steps are timed
    back to back: one span)."""
    return profiled_gaps(lambda: prefill(engine, ids, args.device), on_device,
                         contiguous=engine.async_scheduling)


def report(args: argparse.Namespace, results: list[Result], flops) -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"{args.preset}, {args.layers} layers, {args.kv_cache_dtype} KV, {args.attention_backend} "
        f"backend, {human(args.max_num_batched_tokens)}-token chunks, PCP {args.pcp}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, {where}; "
        f"floor = indexer logits at {args.indexer_tflops:g} TFLOP/s + sparse MLA at "
        f"{args.mla_tflops:g} TFLOP/s (plan/costmodel.prefill_flops); + matrices: the weight "
        f"matrices at {args.matmul_tflops:g} TFLOP/s besides", "",
        "| prompt | wall (s) | floor (s) | wall / floor | floor + matrices (s) | wall / it "
        "| GPU busy (s) | host: wall − busy (s) | host share | host CPU (s) | peak memory (GiB) "
        "| token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p = r.profile
        # four decimals: a 4K step is ~17 ms, its host part ~2 ms (the ≤ 10 % target)
        busy = f"{p.busy:.4f}" if p else "—"
        gap = f"{max(r.wall - p.busy, 0.0):.4f}" if p else "—"
        share = f"{100 * max(r.wall - p.busy, 0.0) / r.wall:.1f} %" if p else "—"
        cpu = f"{p.host_cpu:.4f}" if p else "—"
        peak = f"{r.peak_bytes / 2**30:.2f}" if r.peak_bytes is not None else "—"
        lines.append(f"| {human(r.length)} | {r.wall:.4f} | {r.floor:.4f} | "
                     f"{r.wall / r.floor:.2f}× | {r.floor_matrices:.4f} | "
                     f"{r.wall / r.floor_matrices:.2f}× | {busy} | {gap} | {share} | {cpu} | "
                     f"{peak} | {r.token} |")
    if any(r.profile for r in results):
        unit = "kernel" if args.device == "cuda" else "CPU operator"
        lines += ["", f"{unit} time by category (ms)", "",
                  "| prompt | " + " | ".join(ORDER) + " |",
                  "|---|" + "---:|" * len(ORDER)]
        for r in results:
            if r.profile:
                # ms to the hundredth: a 4K step's categories are a few ms each
                cells = " | ".join(f"{1e3 * r.profile.by_category[c]:.2f}" for c in ORDER)
                lines.append(f"| {human(r.length)} | {cells} |")
    for r in results:
        if r.gaps:
            lines += ["", f"exposed host time of the {human(r.length)} prompt, by the host "
                      "function the device waited on (a run of its own, profiled with Python "
                      "stacks: the tracer slows the host)", "", gaps_table(r.gaps, args.gaps)]
    longest = max(results, key=lambda r: r.length)
    lines += ["", f"per chunk of the {human(longest.length)} prompt", "",
              "| chunk | first position | tokens | time (ms) | floor (ms) | time / floor "
              "| floor + matrices (ms) | time / it |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (first, n, s) in enumerate(longest.chunks):
        f = floor_seconds(flops, first, first + n, args.indexer_tflops, args.mla_tflops)
        fm = f + matrices_seconds(flops, first, first + n, args.matmul_tflops)
        lines.append(f"| {i} | {first} | {n} | {1e3 * s:.1f} | {1e3 * f:.2f} | {s / f:.2f}× "
                     f"| {1e3 * fm:.2f} | {s / fm:.2f}× |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4K,32K,128K,512K,1M",
                   help="prompt lengths, comma-separated (4096, 128K, 1M)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="the scheduler's token budget per step: the prefill chunk")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--prefill-context-parallel-size", "--pcp", dest="pcp", type=int, default=1)
    p.add_argument("--compilation-config", default=None,
                   help="the engine's --compilation-config JSON (vLLM's flag)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine's --async-scheduling: chunk k + 1 scheduled and launched "
                        "while chunk k runs")
    p.add_argument("--indexer-tflops", type=float, default=INDEXER_TFLOPS)
    p.add_argument("--mla-tflops", type=float, default=MLA_TFLOPS)
    p.add_argument("--matmul-tflops", type=float, default=MATMUL_TFLOPS,
                   help="the dense matmul rate the weight matrices are priced at")
    p.add_argument("--logits-split", choices=("rows", "keys"), default=None,
                   help="the triton backend's indexer with IndexerConfig(logits_split=...): "
                        "'keys' is the key-window merge before row passes (one GPU only; "
                        "default: the backend as the engine builds it)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profiled run (kernel categories, GPU busy, host CPU)")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="one more profiled run per prompt, with Python stacks: the device's "
                        "idle gaps inside the steps attributed to the host functions running "
                        "then, the top N (dsaserve/bench/gaps.py; 0: off)")
    p.add_argument("--model", type=Path, default=None, help="an existing checkpoint directory")
    p.add_argument("--weights", default="bf16", choices=("bf16", "fp8"),
                   help="the built checkpoint's matrices: bf16, or FP8 with 128x128 block scales "
                        "as the released checkpoints (kept in FP8 by the engine)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-glm5, reference backend, float32, prompts of 256 and 1024 "
                        "tokens in 256-token chunks (what CI runs)")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = p.parse_args(argv)
    args.preset = "GLM-5.3-shaped"
    if args.smoke:
        args.device, args.attention_backend, args.dtype = "cpu", "reference", "float32"
        args.kv_cache_dtype, args.preset, args.block_size = "fp8_ds_mla", "tiny-glm5", 16
        if args.lengths == p.get_default("lengths"):
            args.lengths = "256,1024"
        if args.max_num_batched_tokens == p.get_default("max_num_batched_tokens"):
            args.max_num_batched_tokens = 256
    args.lengths = sorted(parse_length(x) for x in args.lengths.split(","))
    if args.logits_split is not None and (args.attention_backend != "triton" or args.pcp > 1):
        p.error("--logits-split: the triton backend in this process only (no --pcp)")
    if args.max_num_batched_tokens < 1:
        p.error("--max-num-batched-tokens: must be >= 1")
    if args.pcp < 1:
        p.error("--prefill-context-parallel-size: must be >= 1")
    if args.gaps < 0 or (args.gaps and args.pcp > 1):
        p.error("--gaps: a count >= 0, in this process only (no --pcp)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here (--smoke runs on the CPU)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model_dir = args.model
        elif args.smoke:
            model_dir = make_model("tiny-glm5", Path(tmp) / "tiny", fp8=args.weights == "fp8")
        else:
            print(f"building a GLM-5.3-shaped checkpoint ({args.layers} layers, {args.weights} "
                  "weights) ...", file=sys.stderr)
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", with_mtp=False,
                                   fp8=args.weights == "fp8", overrides=glm53_shaped(args.layers))
        if args.logits_split is not None:
            args.attention_backend = split_backend(args.logits_split)
        args.lengths = fit_lengths(args.lengths, model_max_len(model_dir))
        cfg = engine_config(args, model_dir)
        flops = prefill_flops(cfg.model, cfg.parallel)
        threads = torch.get_num_threads()
        if args.device == "cpu":  # one thread: a shared CPU's contention swamps tiny steps
            torch.set_num_threads(1)
        engine = LLMEngine.from_config(cfg)
        try:
            # Warm-up: two chunks and a bit (the first chunk's and later chunks' kernels), and
            # the shortest prompt (a chunk of its own size: its kernels compiled and tuned
            # here, not in its row: 68 against 18 ms at 4K on an H100)
            warm = min(max(args.lengths), 2 * args.max_num_batched_tokens + 1)
            for n in sorted({warm, min(args.lengths)}):
                prefill(engine, prompt(cfg.model.vocab_size, n, seed=1),
                        args.device if args.pcp == 1 else "cpu")
            results = []
            for n in args.lengths:
                results.append(measure(engine, args, n, flops))
                r = results[-1]
                print(f"{human(n)}: {r.wall:.3f} s (floor {r.floor:.3f} s)", file=sys.stderr)
        finally:
            engine.shutdown()
            torch.set_num_threads(threads)
    text = report(args, results, flops)
    if args.device == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        text += f"\n\npeak RSS of this process: {rss:.2f} GiB"
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
