"""The host code of a whole decode step (the engine's), timed on a CPU: where a host-bound step's
time goes when no GPU is at hand (the GPU numbers come from decode.py, docs/decode.md).

    python benchmarks/decode_host_cpu.py                          # b = 1, 16, 64; 8K context
    python benchmarks/decode_host_cpu.py --batch 64 --mtp on --steps 300 --top 25 --ops

The counterpart of prefill_host_cpu.py (bench/host_cpu.py: the same tiny-glm5 checkpoint with
GLM-5.3's attention widths and tiny matrices, fp8_ds_mla, the triton backend taking the GPU
path's branches on CPU tensors with every Triton launch stubbed). Each row is an `LLMEngine`
(scheduler, in-process runner, outputs) with b running requests decoding at a context of
--context tokens, plain or MTP3 with synthetic acceptance 2.99 (bench/steps.py's
MTP3_SYNTHETIC, as benchmarks/decode.py), sync or --async-scheduling; a timed step is one
`LLMEngine.step()`: schedule →
the runner's whole step (its diff, metadata, the padded decode path's buffers, sampling, MTP's
rejection and draft inputs) → update_from_output → the RequestOutputs (async: step k + 1
launched, step k's results read). As on a GPU with CUDA graphs (the issue's setting), decode
steps take the padded path (engine/decode_graph.py, one capture size b × (1 + k)), whose
target forward and MTP draft chain are "replayed": run once, as a capture is, then their
first output returned (`replays_stubbed`); --eager runs them, every step, as
--enforce-eager does (each op of the forward dispatched: what graphs save).

The context is real KV, prefilled cheaply: the requests share a prompt of --context − 64
tokens (prefix caching on), prefilled once by the first request, and each adds 64 tokens of
its own; every request then holds --context tokens in its own block table row, as a decode
step sees them (its pages' values do not matter to the host).

Printed per row: the step's host time (median over --steps timed steps, after --warmup; no
profiler on), as wall time and as the thread's CPU time (the same on an idle machine; on a
shared one the CPU time leaves out the time the thread waited for a core), then over
--profile-steps more steps under cProfile (several-fold slower, so its times are shares, not
the step's), the --top functions by cumulative and by own time per step (median); --ops: one
step's torch ops and Triton launches (engine/host_ops.OpCounter).

What the CPU cannot show: a launch's own host cost (each torch op here runs inline on tiny
tensors, one CPU thread: a few µs, the order of a CUDA launch's host cost, so the op counts of
--ops are what to carry over), a graph replay's (~10 µs on a GPU), the pinned upload
(kernels/staging.py returns CPU parts as they are), the CUDA-only kernels (Gluon, the CUDA
extension), the device → host copy of the samples and its wait, and the GPU's overlap with the
host under --async-scheduling (here the "device" work runs inside the launch). The shared
prefix makes every request's blocks below its last 64 tokens the same pages (the host work
per block table row is the same). A shared CPU moves rows by tens of % (a job on the
sibling hardware thread slows this one without preempting it, so the CPU column moves too):
compare two trees by running this file with each on PYTHONPATH, alternately, several times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dsaserve.bench import host_cpu
from dsaserve.bench.argtypes import positive_ints
from dsaserve.bench.steps import MTP3_SYNTHETIC
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.decode_graph import DecodeGraphs
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.host_ops import OpCounter, gpu_branches
from dsaserve.engine.runner import ModelRunner

BLOCK = 64


@contextlib.contextmanager
def replays_stubbed() -> Iterator[None]:
    """The padded decode path's forward and MTP draft chain (engine/decode_graph.py) run once
    per size, as a capture does, and afterwards return that first output, as a replay
    refills a graph's static output: what is timed is the host code a GPU step with CUDA
    graphs runs around its replays."""
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def run(self, graphs, size: int, what: str, fn: Callable[[], torch.Tensor]
            ) -> tuple[torch.Tensor, bool]:
        if (what, size) not in kept:
            kept[(what, size)] = fn()
        return kept[(what, size)], True

    saved = DecodeGraphs._run
    DecodeGraphs._run = run
    try:
        yield
    finally:
        DecodeGraphs._run = saved


@dataclasses.dataclass(frozen=True)
class Row:
    batch: int
    mtp: bool
    async_: bool
    host_ms: float  # median step wall time, unprofiled
    cpu_ms: float  # median of the steps' thread CPU time (no time waiting for a core)
    # function → per profiled step (own ms, cumulative ms), median over the profiled steps
    own_ms: dict[str, float]
    cum_ms: dict[str, float]
    ops: tuple[int, int] | None  # one step's (torch ops, Triton launches) with --ops


def make_engine(model_dir: Path, batch: int, context: int, num_steps: int, mtp: bool,
                async_: bool, eager: bool) -> LLMEngine:
    """An engine on the CPU whose KV holds `batch` requests of `context` tokens that decode
    `num_steps` more steps (each emitting up to 1 + 3 tokens with MTP3); not `eager`: its
    decode steps take the padded path at the one size b × (1 + k)."""
    k = 3 if mtp else 0
    max_len = -(-(context + (num_steps + 4) * (1 + k) + 2 * k + 2) // BLOCK) * BLOCK
    # the shared prefix once, then each request's own blocks
    num_blocks = context // BLOCK + batch * (max_len - context + 2 * BLOCK) // BLOCK + 8
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=BLOCK, kv_cache_dtype="fp8_ds_mla",
                          num_gpu_blocks=num_blocks, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=batch,
                                  max_num_batched_tokens=max(context, batch * (1 + k)),
                                  max_model_len=max_len, async_scheduling=async_),
        attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
        dtype="float32", device="cpu", compilation=CompilationConfig(
            cudagraph_capture_sizes=(batch * (1 + k),), enforce_eager=eager))
    if mtp:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig.from_json(MTP3_SYNTHETIC))
    return LLMEngine(cfg, ModelRunner(cfg), tokenizer=None)


def start_decoding(engine: LLMEngine, batch: int, context: int, max_tokens: int) -> None:
    """`batch` requests of `context` prompt tokens, all decoding on return: the first prefills
    the shared context − 64 tokens, the others hit them in the prefix cache."""
    vocab = engine.config.model.vocab_size
    shared = [(7 * t) % vocab for t in range(context - BLOCK)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        own = [(i * BLOCK + t) % vocab for t in range(BLOCK)]
        engine.add_request(f"r{i}", shared + own, params)
        if i == 0:  # its full blocks cached before the others look them up
            while not any(out.new_token_ids for out in engine.step()):
                pass
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    assert len(engine.scheduler.running) == batch, "every request decodes"


def run_row(model_dir: Path, batch: int, context: int, mtp: bool, async_: bool,
            args: argparse.Namespace) -> Row:
    num_steps = args.warmup + args.steps + args.profile_steps + 1
    engine = make_engine(model_dir, batch, context, num_steps, mtp, async_, args.eager)
    try:
        start_decoding(engine, batch, context, max_tokens=(num_steps + 4) * 4)
        for _ in range(args.warmup):
            engine.step()
        gc.collect()  # the rows before this one's garbage is not this row's
        walls, cpus = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
        profiled = []  # per step: function → (own s, cumulative s)
        for _ in range(args.profile_steps):
            prof = cProfile.Profile()
            prof.enable()
            engine.step()
            prof.disable()
            profiled.append(host_cpu.function_times(prof, with_line=True))
        keys = set().union(*profiled)
        # a function some steps skip counts 0 in those: its median is per step
        own_ms = {k: 1e3 * statistics.median(s.get(k, (0.0, 0.0))[0] for s in profiled)
                  for k in keys}
        cum_ms = {k: 1e3 * statistics.median(s.get(k, (0.0, 0.0))[1] for s in profiled)
                  for k in keys}
        ops = None
        if args.ops:
            with OpCounter(engine.runner.model.model.layers, stub_launches=True) as counter:
                engine.step()
            ops = counter.total()
            print(f"b = {batch}, {'MTP3' if mtp else 'plain'}, "
                  f"{'async' if async_ else 'sync'}: one step's busiest sites")
            print(counter.report(top=args.top, names=True))
        assert len(engine.scheduler.running) == batch, "no request ended while timed"
        return Row(batch, mtp, async_, 1e3 * statistics.median(walls),
                   1e3 * statistics.median(cpus), own_ms, cum_ms, ops)
    finally:
        engine.shutdown()


def print_row(row: Row, context: int, top: int) -> None:
    print(f"\n## b = {row.batch}, {'MTP3' if row.mtp else 'plain'}, "
          f"{'async' if row.async_ else 'sync'}, context {context}: host "
          f"{row.host_ms:.3f} ms per step (median; thread CPU {row.cpu_ms:.3f} ms)"
          + ("" if row.ops is None else f"; torch ops, launches: {row.ops}"))
    print("cProfile, cumulative ms per step (median):")
    print("\n".join(host_cpu.median_lines({k: [v] for k, v in row.cum_ms.items()}, top, 1)))
    print("cProfile, own ms per step (median):")
    print("\n".join(host_cpu.median_lines({k: [v] for k, v in row.own_ms.items()}, top, 1)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_ints, default=(1, 16, 64),
                   help="running requests per row (comma-separated)")
    p.add_argument("--context", type=int, default=8192,
                   help="tokens of KV per request (a multiple of 64, at least 128)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mtp", choices=("off", "on", "both"), default="both")
    p.add_argument("--scheduling", choices=("sync", "async", "both"), default="both")
    p.add_argument("--steps", type=int, default=200, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=20, help="cProfiled steps per row")
    p.add_argument("--top", type=int, default=15, help="functions (and --ops sites) printed")
    p.add_argument("--ops", action="store_true", help="also count one step's ops and launches")
    p.add_argument("--eager", action="store_true",
                   help="run the forward and the drafts eager (--enforce-eager), not as replays")
    args = p.parse_args(argv)
    if args.context % BLOCK or args.context < 2 * BLOCK:
        p.error("--context: a multiple of 64, at least 128")
    if min(args.steps, args.profile_steps) < 1:
        p.error("--steps and --profile-steps: at least 1")
    torch.set_num_threads(1)  # a shared CPU's contention swamps small steps
    mtps = {"off": (False,), "on": (True,), "both": (False, True)}[args.mtp]
    asyncs = {"sync": (False,), "async": (True,), "both": (False, True)}[args.scheduling]
    rows = []
    with (tempfile.TemporaryDirectory() as tmp, gpu_branches(), host_cpu.stubbed(),
          contextlib.nullcontext() if args.eager else replays_stubbed()):
        model_dir = host_cpu.tiny_glm53(Path(tmp), args.layers, 4 * args.context + 8 * BLOCK,
                                        with_mtp=True)
        for batch in args.batch:
            for mtp in mtps:
                for async_ in asyncs:
                    row = run_row(model_dir, batch, args.context, mtp, async_, args)
                    print_row(row, args.context, args.top)
                    rows.append(row)
    print(f"\n| b | MTP | scheduling | host ms per step: wall | thread CPU |  (medians of "
          f"{args.steps} steps)")
    print("|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r.batch} | {'MTP3' if r.mtp else '-'} | {'async' if r.async_ else 'sync'} "
              f"| {r.host_ms:.3f} | {r.cpu_ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
