"""The host code of a GPU prefill step, timed on a CPU: where a step's own host work goes when no
GPU is at hand (the GPU numbers come from prefill_host.py and long_prefill.py --gaps).

    python benchmarks/prefill_host_cpu.py --tokens 4096 --layers 2 --repeats 7

A tiny-glm5 checkpoint with GLM-5.3's attention widths where the host plans depend on them
(512 + 64 latent, top-2048, every layer a full indexer layer) and tiny matrices, fp8_ds_mla,
the triton backend: its steps take the GPU path's branches on CPU tensors
(engine/host_ops.gpu_branches), every Triton launch stubbed (not run; its small integer outputs
zeroed), and the indexer's top-k replaced by zeros (on a GPU one kernel; torch.topk over
[4096, 4096] on a CPU would swamp the rest). Each step prefills a fresh prompt whole. Printed:
the step's wall (median; mostly the CPU running the tiny matrices, so noisy), cProfile's
cumulative time of the step's host functions per step (median over --repeats steps), and
with --ops the torch ops and Triton launches of one step, per layer and by site.

What it cannot show: the pinned upload (kernels/staging.py returns CPU parts as they are), the
CUDA-only kernels' launchers (Gluon, the CUDA extension) and every launch's own cost.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from dsaserve.bench import host_cpu, steps
from dsaserve.bench.host_cpu import tiny_glm53
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.engine.host_ops import OpCounter, gpu_branches
from dsaserve.engine.runner import ModelRunner

BLOCK = 64
FUNCS = ("_prepare", "_metadata", "_flat_ids", "upload", "_step_plan", "_workspace_plan",
         "cos_sin", "_limits", "run_slots", "apply", "pending", "_sample", "_tiles",
         "workspace_pages")


def make_runner(root: Path, tokens: int, layers: int) -> ModelRunner:
    path = tiny_glm53(root, layers, 2 * tokens + BLOCK)
    return ModelRunner(EngineConfig(
        model_path=str(path), model=ModelConfig.from_file(path),
        cache=CacheConfig(block_size=BLOCK, kv_cache_dtype="fp8_ds_mla",
                          num_gpu_blocks=-(-(tokens + BLOCK) // BLOCK) + 8,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=tokens,
                                  max_model_len=tokens + BLOCK),
        attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
        dtype="float32", device="cpu", compilation=CompilationConfig(enforce_eager=True)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ops", action="store_true", help="also count one step's ops and launches")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a shared CPU's contention swamps small steps
    with tempfile.TemporaryDirectory() as tmp, gpu_branches(), host_cpu.stubbed():
        runner = make_runner(Path(tmp), args.tokens, args.layers)
        vocab = runner.config.model.vocab_size
        last: tuple[str, ...] = ()

        def step(tag: str, seed: int, profile: cProfile.Profile | None = None) -> float:
            nonlocal last
            so = steps.prefill(args.tokens, vocab, BLOCK, tag, seed=seed, finished=last)
            last = (so.new_requests[0].request_id,)
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            runner.execute(so)
            if profile is not None:
                profile.disable()
            return time.perf_counter() - t0

        for i in range(2):
            step(f"w{i}", i)
        walls, cum = [], defaultdict(list)
        for i in range(args.repeats):
            prof = cProfile.Profile()
            walls.append(step(f"t{i}", 10 + i, prof))
            for key, (_, ct) in host_cpu.function_times(prof, dsaserve_only=True).items():
                if key.rsplit(" ", 1)[1] in FUNCS:
                    cum[key].append(ct)
        print(f"{args.tokens} tokens, {args.layers} layers: step wall (cProfiled) median "
              f"{1e3 * statistics.median(walls):.1f} ms")
        print("cumulative ms per step (median), GPU-path host functions:")
        print("\n".join(host_cpu.median_lines(cum)))
        if args.ops:
            so = steps.prefill(args.tokens, vocab, BLOCK, "ops", seed=99, finished=last)
            with OpCounter(runner.model.model.layers, stub_launches=True) as ops:
                runner.execute(so)
            print(f"torch ops, launches: {ops.total()}; per layer (-1: the step's own): "
                  f"{ops.per_layer()}")
            print(ops.report(top=40, names=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
