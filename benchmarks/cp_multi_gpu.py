"""The prefill engine on N GPUs: PCP N × DCP N × EP N exact and fast (one command, one table).

    python benchmarks/cp_multi_gpu.py --gpus 8                 # the reference deployment's node
    python benchmarks/cp_multi_gpu.py --gpus 4 --contexts 32768,131072
    python benchmarks/cp_multi_gpu.py --device cpu --gpus 2 --smoke   # gloo, tiny model (CI)

On a GLM-5.3-shaped model (real attention and indexer dimensions: 64 heads, 576/512 latent, 32 × 128
indexer, top-2048; few layers and experts so that it fits) it measures, in one run:

  1. exactness — greedy tokens of PCP N × DCP N × EP N equal those of one GPU;
  2. TTFT of one prompt per context length under PCP N × DCP N, PCP N alone, TP N and DP (one GPU
     per prompt), so the speed-up of splitting tokens over splitting heads is measured;
  3. DCP's per-step overhead against PCP alone: a 2K-token prefill chunk over cached contexts;
  4. KV bytes per GPU of a 1M-token request under DCP N, from the allocator's block arithmetic for
     the full 78-layer model (the reference: 6.7 GiB per GPU at N = 8).

Every engine is a real `LLMEngine` (worker processes, NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import cache_bytes_per_block
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped, preset_config

GIB = 2**30


@dataclass(frozen=True)
class Layout:
    name: str
    parallel: ParallelConfig
    gpus: int  # GPUs one prompt occupies


def layouts(n: int) -> list[Layout]:
    return [
        Layout(f"PCP{n}×DCP{n}×EP{n}", ParallelConfig(
            prefill_context_parallel_size=n, decode_context_parallel_size=n,
            enable_expert_parallel=True), n),
        Layout(f"PCP{n}×EP{n}", ParallelConfig(prefill_context_parallel_size=n,
                                               enable_expert_parallel=True), n),
        Layout(f"TP{n}×EP{n}", ParallelConfig(tensor_parallel_size=n,
                                              enable_expert_parallel=True), n),
        Layout("DP (1 GPU per prompt)", ParallelConfig(), 1),
    ]


def build_model(args: argparse.Namespace, root: Path) -> Path:
    if args.smoke:
        return make_model("tiny-glm5", root / "tiny-glm5")
    overrides = glm53_shaped(args.layers, num_experts=max(8, args.gpus))
    print(f"building a GLM-5.3-shaped checkpoint ({args.layers} layers) ...", file=sys.stderr)
    return make_model("glm-5.3", root / "glm53-small", overrides=overrides, with_mtp=False)


def engine_config(args, model_dir: Path, parallel: ParallelConfig, *, max_len: int,
                  chunk: int) -> EngineConfig:
    # Blocks for the few requests a run holds at once, not a share of HBM: engines of several
    # layouts live one after another on the same GPUs.
    blocks = args.num_blocks or 4 * math.ceil(max_len / 64) + 16
    return EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=64, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk,
                                  max_model_len=max_len),
        attention=AttentionConfig(backend=args.backend, sparse_mla_force_mqa=True),
        parallel=parallel, dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
    )


def with_engine(cfg: EngineConfig, work):
    """Run `work(engine)` on a fresh engine, then stop its workers and free its memory before the
    next layout starts on the same GPUs (the engine never outlives this call)."""
    engine = LLMEngine.from_config(cfg)
    try:
        return work(engine)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def human(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def timed_steps(engine: LLMEngine, prompt_ids: list[int], max_tokens: int
                ) -> tuple[list[int], list[float]]:
    """Run one request; returns its tokens and the wall time of every step (synchronised)."""
    engine.add_request(f"r{time.monotonic_ns()}", prompt_ids,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, times = [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        times.append(time.perf_counter() - t0)
    engine.check_integrity()
    return tokens, times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=max(torch.cuda.device_count(), 1))
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="triton" if torch.cuda.is_available() else "reference")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--contexts", default="32768,131072,253952",
                   help="TTFT prompt lengths (comma-separated)")
    p.add_argument("--prefill-chunk", type=int, default=16384,
                   help="max-num-batched-tokens for the TTFT runs")
    p.add_argument("--cached", default="16384,65536,131072,253952",
                   help="cached context lengths for the DCP overhead runs")
    p.add_argument("--dcp-chunk", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per rank (default: fit)")
    p.add_argument("--exact-prompt", type=int, default=4096)
    p.add_argument("--smoke", action="store_true",
                   help="tiny model and short lengths: checks the script end to end on CPU")
    p.add_argument("--out", type=Path, default=None, help="also write the tables (markdown)")
    args = p.parse_args(argv)
    n = args.gpus
    contexts = [int(x) for x in args.contexts.split(",")]
    cached = [int(x) for x in args.cached.split(",")]
    if args.smoke:
        contexts, cached, args.prefill_chunk, args.dcp_chunk = [96, 192], [64, 160], 64, 32
        args.exact_prompt, args.num_blocks = 80, args.num_blocks or 64
    lines: list[str] = [f"# PCP × DCP × EP on {n} × {args.device} ({args.backend} backend, "
                        f"{args.kv_cache_dtype} KV)", ""]

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp))
        vocab = ModelConfig.from_file(model_dir).vocab_size
        max_len = max(contexts + [c + args.dcp_chunk for c in cached] + [args.exact_prompt + 64])
        max_len = 64 * math.ceil((max_len + 1) / 64)  # room for the one generated token
        warm = min(256, max_len // 2)

        # 1. exactness
        emit("## 1. Greedy output against one GPU")
        ids = prompt(vocab, args.exact_prompt, seed=1)
        outs = {}
        for lay in (layouts(n)[0], layouts(n)[3]):
            cfg = engine_config(args, model_dir, lay.parallel, max_len=max_len,
                                chunk=args.prefill_chunk)
            outs[lay.name] = with_engine(cfg, lambda e: timed_steps(e, ids, 16)[0])
        same = len(set(map(tuple, outs.values()))) == 1
        emit(f"prompt {len(ids)} tokens, 16 greedy tokens: "
             f"{'identical' if same else 'DIFFERENT'} ({', '.join(outs)})")
        emit()

        # 2. TTFT per layout and context
        emit("## 2. TTFT of one prompt (s)")
        emit("| layout | GPUs/prompt | " + " | ".join(human(c) for c in contexts) + " |")
        emit("|---|---|" + "---|" * len(contexts))
        ttft: dict[str, list[float]] = {}
        for lay in layouts(n):
            cfg = engine_config(args, model_dir, lay.parallel, max_len=max_len,
                                chunk=args.prefill_chunk)

            def ttft_row(engine: LLMEngine) -> list[float]:
                timed_steps(engine, prompt(vocab, warm, seed=2), 1)  # warm-up
                return [sum(timed_steps(engine, prompt(vocab, c, seed=10 + i), 1)[1])
                        for i, c in enumerate(contexts)]

            row = ttft[lay.name] = with_engine(cfg, ttft_row)
            emit(f"| {lay.name} | {lay.gpus} | " + " | ".join(f"{t:.2f}" for t in row) + " |")
        base = ttft[layouts(n)[2].name]
        best = ttft[layouts(n)[0].name]
        emit("speed-up of PCP×DCP over TP (token split over head split): "
             + ", ".join(f"{human(c)} {b / a:.2f}×" for c, a, b in zip(contexts, best, base,
                                                                         strict=True)))
        emit()

        # 3. DCP overhead: the step time of one chunk over a cached context
        emit(f"## 3. One {args.dcp_chunk}-token prefill chunk over a cached context (ms)")
        emit("| cached | PCP alone | PCP × DCP | DCP overhead |")
        emit("|---|---|---|---|")
        step_ms: dict[str, list[float]] = {}
        for lay in layouts(n)[:2][::-1]:
            cfg = engine_config(args, model_dir, lay.parallel, max_len=max_len,
                                chunk=args.dcp_chunk)

            def chunk_ms(engine: LLMEngine) -> list[float]:
                timed_steps(engine, prompt(vocab, warm, seed=2), 1)
                # the last chunk's step: its context is the cached length c
                return [timed_steps(engine, prompt(vocab, c + args.dcp_chunk, seed=20 + i),
                                    1)[1][-1] * 1e3 for i, c in enumerate(cached)]

            step_ms[lay.name] = with_engine(cfg, chunk_ms)
        pcp, dcp = (step_ms[lay.name] for lay in layouts(n)[:2][::-1])
        for c, a, b in zip(cached, pcp, dcp, strict=True):
            emit(f"| {human(c)} | {a:.1f} | {b:.1f} | {100 * (b / a - 1):+.1f}% |")
        emit()

        # 4. KV bytes per GPU of a 1M-token request, from the allocator's arithmetic
        emit("## 4. KV of one 1,048,576-token request per GPU (full GLM-5.3, fp8_ds_mla)")
        glm = ModelConfig.from_hf(preset_config("glm-5.3"))
        per_block = cache_bytes_per_block(glm, glm.num_hidden_layers + 1, 64, True, torch.bfloat16)
        tokens = 1 << 20
        for d in sorted({1, n}):
            blocks = math.ceil(tokens / (64 * d))  # virtual blocks of 64·d tokens
            emit(f"DCP {d}: {blocks} blocks × {per_block / 2**20:.2f} MiB per rank = "
                 f"{blocks * per_block / GIB:.2f} GiB per GPU")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
