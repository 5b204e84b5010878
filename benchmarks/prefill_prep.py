"""The host work of a prefill step around its forward, on the CPU: what `ModelRunner.execute`
does from the SchedulerOutput to the forward (the diff applied, the flattened batch, the
attention metadata, the uploads) and from the forward's end to its return (sampling, the
result copy), and the per-step plans the triton backend derives in the first indexer layer.

    python benchmarks/prefill_prep.py                   # 4K, 16K, 8 × 512 tokens per step
    python benchmarks/prefill_prep.py --profile         # and cProfile's top functions per case
    python benchmarks/prefill_prep.py --smoke           # tiny prompts, 2 repeats (CI)

tiny-glm5 (2 layers, its positions widened to the longest prompt), fp8_ds_mla KV, float32,
the reference backend, one thread. Each step prefills fresh requests whole (--cases:
tokens × requests per step) after ending the previous step's, so the same blocks serve again.
The model itself does not run: the runner's `_forward` is replaced by one that records when
it starts and ends and returns a zero hidden state of the step's shape, one element expanded
(no host memory touched, as a GPU's forward touches none; nothing timed here reads the KV
caches it would have written). Per case, the minimum and median over --repeats:

  - before: `execute`'s call to the forward's start (`_apply_diff`, `_prepare`);
  - after: the forward's end to `execute`'s return (`_sample`, the read-back);
  - plans: the triton backend's per-step plans from the step's metadata, the indexer's
    (`indexer._step_plan`, at GLM-5.3's 32 indexer heads) and sparse MLA's workspace plan
    (`_workspace_plan`, top-2048): host work of the first indexer layer, before its kernels.

These are CPU times of the host code, not the GPU's exposed host time: on a GPU the uploads
go through pinned memory and the plans' copies to the device, and part of the work hides
under kernels already queued (benchmarks/long_prefill.py measures that on the GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsaserve.bench import steps
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.engine.runner import ModelRunner
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.triton import indexer, sparse_mla
from dsaserve.kernels.triton.backend import _workspace_plan
from dsaserve.model.make_model import make_model

BLOCK = 64
INDEX_HEADS, INDEX_DIM, TOPK = 32, 128, 2048  # GLM-5.3's indexer


@dataclass(frozen=True)
class Case:
    tokens: int  # per request
    requests: int  # per step

    @property
    def label(self) -> str:
        return f"{self.requests} × {self.tokens}" if self.requests > 1 else f"{self.tokens}"


@dataclass(frozen=True)
class Row:
    """One case; ms per step: (min, median)."""

    case: Case
    before: tuple[float, float]
    after: tuple[float, float]
    plans: tuple[float, float]


class PhaseClock:
    """Times one runner's steps around its forward, which it replaces: the forward's start and
    end are recorded, the model is not run (a zero hidden state of the step's shape)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.meta: AttentionMetadata | None = None
        self.forward_at = (0.0, 0.0)
        hidden = runner.model_cfg.hidden_size

        zero = torch.zeros((), dtype=runner.dtype)

        def forward(batch, size):  # the runner's _forward(batch, padded size)
            start = time.perf_counter()
            self.meta = batch.meta
            # [N, hidden] of one element: no memory touched, as a GPU's forward touches none
            # of the host's
            out = zero.expand(batch.query_start_loc[-1], hidden)
            self.forward_at = (start, time.perf_counter())
            return out

        runner._forward = forward  # the instance's, in front of the class's
        self.count = 0
        self.last: tuple[str, ...] = ()

    def step(self, case: Case, prof: cProfile.Profile | None = None
             ) -> tuple[float, float, float]:
        """One prefill step of fresh requests → (before, after, plans) in seconds; `prof`
        profiles the runner's work and the plans (not the requests' making)."""
        runner = self.runner
        so = steps.prefill(case.tokens, runner.model_cfg.vocab_size, runner.block_size,
                           f"p{self.count}", seed=self.count, batch=case.requests,
                           finished=self.last)
        self.count += 1
        self.last = tuple(so.num_scheduled_tokens)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        runner.execute(so)
        t1 = time.perf_counter()
        before, after = self.forward_at[0] - t0, t1 - self.forward_at[1]
        plans = plans_time(self.meta, runner, prof)
        if prof is not None:
            prof.disable()
        return before, after, plans


def plans_time(meta: AttentionMetadata, runner: ModelRunner,
               prof: cProfile.Profile | None = None) -> float:
    """Seconds to derive the triton backend's per-step plans from `meta` (as the first indexer
    layer does; they are kept on the metadata for the other layers)."""
    if prof is not None:
        prof.disable()
    # the plan reads only q's shape, dtype and device: a view of one element
    q = torch.empty((), dtype=torch.bfloat16).expand(meta.num_tokens, INDEX_HEADS, INDEX_DIM)
    index_cache = next(c.index for c in runner.caches if c.index is not None)
    meta.derived.clear()
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    indexer._step_plan(meta, q, index_cache, indexer.IndexerConfig())
    _workspace_plan(meta, TOPK, sparse_mla.SparseMlaConfig())
    return time.perf_counter() - t0


def make_runner(cases: list[Case], root: Path) -> ModelRunner:
    longest = max(c.tokens for c in cases) + BLOCK
    per_request = steps.blocks_per_request(longest, BLOCK)
    requests = max(c.requests for c in cases)
    path = make_model("tiny-glm5", root / "tiny", with_mtp=False, overrides={
        "num_hidden_layers": 2, "max_position_embeddings": max(longest, 4096)})
    return ModelRunner(EngineConfig(
        model_path=str(path), model=ModelConfig.from_file(path),
        cache=CacheConfig(block_size=BLOCK, kv_cache_dtype="fp8_ds_mla",
                          num_gpu_blocks=per_request * requests + 4, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=requests,
                                  max_num_batched_tokens=max(c.tokens * c.requests
                                                             for c in cases),
                                  max_model_len=longest),
        attention=AttentionConfig(backend="reference", sparse_mla_force_mqa=True),
        dtype="float32", device="cpu", compilation=CompilationConfig(enforce_eager=True)))


def measure(clock: PhaseClock, case: Case, warmup: int, repeats: int) -> Row:
    for _ in range(warmup):
        clock.step(case)
    runs = list(zip(*(clock.step(case) for _ in range(repeats)), strict=True))

    def ms(xs: tuple[float, ...]) -> tuple[float, float]:
        return 1e3 * min(xs), 1e3 * statistics.median(xs)

    return Row(case, *(ms(xs) for xs in runs))


def profile(clock: PhaseClock, case: Case, top: int) -> str:
    """cProfile of one step's runner work and plans: the `top` functions by own time."""
    prof = cProfile.Profile()
    clock.step(case, prof)
    stats = pstats.Stats(prof).stats  # (file, line, name) → (cc, calls, own, cumulative, ...)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = ["| own ms | calls | function |", "|---:|---:|---|"]
    for (path, line, name), (_, calls, own, _, _) in ranked:
        where = path.rsplit("/dsaserve/", 1)[-1] if "/dsaserve/" in path else Path(path).name
        lines.append(f"| {1e3 * own:.3f} | {calls} | {where}:{line} {name} |")
    return "\n".join(lines)


def report(rows: list[Row], repeats: int) -> str:
    lines = [f"host CPU ms per step (min / median of {repeats}; tiny-glm5, fp8_ds_mla, one "
             "thread; the model not run)", "",
             "| tokens per step | before the forward | after the forward | first-layer plans |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.case.label} | " + " | ".join(
            f"{lo:.3f} / {med:.3f}" for lo, med in (r.before, r.after, r.plans)) + " |")
    return "\n".join(lines)


def parse_case(text: str) -> Case:
    """"4096", "16K" or "512x8" (tokens × requests) → a Case."""
    tokens, _, requests = text.strip().lower().partition("x")
    scale = 1024 if tokens.endswith("k") else 1
    tokens = tokens.removesuffix("k")
    if not tokens.isdigit() or not (requests or "1").isdigit():
        raise argparse.ArgumentTypeError(f"--cases: {text!r} is not TOKENS or TOKENSxREQUESTS")
    case = Case(int(tokens) * scale, int(requests or 1))
    if min(case.tokens, case.requests) < 1:
        raise argparse.ArgumentTypeError(f"--cases: {text!r} is empty")
    return case


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="4K,16K,512x8",
                   help="prompts per step, comma-separated: TOKENS or TOKENSxREQUESTS")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per case first")
    p.add_argument("--profile", action="store_true", help="cProfile one step per case")
    p.add_argument("--top", type=int, default=15, help="functions listed by --profile")
    p.add_argument("--smoke", action="store_true",
                   help="prompts of 64 and 4 × 32 tokens, 2 repeats (what CI runs)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in {"cases": "64,32x4", "repeats": 2, "warmup": 1}.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    try:
        args.cases = [parse_case(x) for x in args.cases.split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats: at least 1; --warmup: at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CPU's contention swamps sub-ms phases
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            clock = PhaseClock(make_runner(args.cases, Path(tmp)))
            for case in args.cases:
                rows.append(measure(clock, case, args.warmup, args.repeats))
                if args.profile:
                    print(f"\n{case.label} tokens per step, one step (cProfile, own time):\n"
                          f"{profile(clock, case, args.top)}\n", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
    text = report(rows, args.repeats)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
