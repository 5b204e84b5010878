"""The engine end to end on one GPU with each attention backend: same greedy output, step times.

    python benchmarks/generate_backends.py                 # GLM-5.3-shaped, 2 layers, fp8_ds_mla
    python benchmarks/generate_backends.py --prompt-len 8192 --layers 4 --out docs/e2e.md

A GLM-5.3-shaped checkpoint (real attention and indexer dimensions: 64 heads, 576/512 latent,
32 × 128 indexer, top-2048; few layers and experts) generates greedily from a prompt longer than
the top-k, so the indexer's selection matters, once per backend. The table gives the prefill time,
the mean decode step and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import ModelRunner
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped


def run(model_dir: Path, backend: str, args: argparse.Namespace, ids: list[int]
        ) -> tuple[list[int], float, list[float]]:
    """(greedy tokens, prefill seconds, each decode step's seconds)."""
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=64, kv_cache_dtype=args.kv_cache_dtype, num_gpu_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=args.prompt_len,
                                  max_model_len=args.prompt_len + args.max_tokens + 64),
        attention=AttentionConfig(backend=backend, sparse_mla_force_mqa=True),
        dtype=args.dtype, device="cuda",
    )
    engine = LLMEngine.from_config(cfg)
    # Warm-up at the same shapes (compiles every kernel variant), with other tokens so that the
    # measured request finds nothing in the prefix cache.
    engine.generate([[(t * 7 + 1) % engine.config.model.vocab_size for t in ids]],
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("r", ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                ignore_eos=True))
    tokens, times = [], []
    prof = None
    # --profile: the prefill step (by GPU time, also by input shape) and four decode steps (by
    # host time).
    windows = {0: (1, "the prefill step", "self_device_time_total"),
               4: (8, "4 decode steps", "cpu_time_total")}
    while engine.has_unfinished_requests():
        if args.profile and len(times) in windows:
            end, what, order = windows[len(times)]
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA],
                                          record_shapes=end == 1)
            prof.__enter__()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if prof is not None and len(times) == end:
            prof.__exit__(None, None, None)
            print(f"--- {backend}: {what}", file=sys.stderr)
            print(prof.key_averages().table(sort_by=order, row_limit=18), file=sys.stderr)
            if end == 1:  # the prefill's ops also by input shape: which tensors the glue moves
                print(prof.key_averages(group_by_input_shape=True).table(
                    sort_by=order, row_limit=24, max_name_column_width=28,
                    max_shapes_column_width=80), file=sys.stderr)
            prof = None
    engine.check_integrity()
    return tokens, times[0], times[1:]


def prompt_logits(model_dir: Path, ids: list[int], backend: str, kv: str, dtype: str
                  ) -> torch.Tensor:
    """Logits [T, V] of every prompt position, one prefill step on a fresh runner."""
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=64, kv_cache_dtype=kv, num_gpu_blocks=len(ids) // 64 + 16),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=len(ids),
                                  max_model_len=len(ids) + 64),
        attention=AttentionConfig(backend=backend, sparse_mla_force_mqa=True),
        dtype=dtype, device="cuda",
    )
    runner = ModelRunner(cfg)
    blocks = tuple(range(len(ids) // 64 + 1))
    so = SchedulerOutput((NewRequestData("r", tuple(ids), SamplingParams(), blocks, 0),), (),
                         {"r": len(ids)}, ())
    out = runner.execute_all_logits(so)["r"].float().cpu()
    del runner
    torch.cuda.empty_cache()
    return out


def compare_logits(model_dir: Path, ids: list[int], out: Path | None) -> int:
    """How far each bf16 path is from fp32: a random model's greedy tokens part under any bf16
    noise, so equal distances (not equal tokens) show that the kernels are right."""
    ref = prompt_logits(model_dir, ids, "reference", "auto", "float32")
    lines = [f"prompt logits ({len(ids)} tokens) against the reference backend in fp32", "",
             "| backend | KV | max relative error | argmax agreement |", "|---|---|---:|---:|"]
    for backend in ("reference", "triton"):
        for kv in ("auto", "fp8_ds_mla"):
            got = prompt_logits(model_dir, ids, backend, kv, "bfloat16")
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            lines.append(f"| {backend} | {kv} | {err:.2f} | {100 * agree:.1f}% |")
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="model dtype (the Triton sparse-MLA kernel takes bf16 queries only)")
    p.add_argument("--compare-logits", action="store_true",
                   help="instead: the prompt's logits of every bf16 path (backend × KV format) "
                        "against the reference backend in fp32")
    p.add_argument("--model", type=Path, default=None, help="an existing checkpoint directory")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", action="store_true",
                   help="profile the prefill step and 4 decode steps per backend")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(
            "glm-5.3", Path(tmp) / "glm53", with_mtp=False, overrides=glm53_shaped(args.layers))
        vocab = ModelConfig.from_file(model_dir).vocab_size
        ids = torch.randint(4, vocab, (args.prompt_len,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        if args.compare_logits:
            return compare_logits(model_dir, ids, args.out)
        results = {b: run(model_dir, b, args, ids) for b in ("reference", "triton")}
    ref = results["reference"][0]
    lines = [
        f"GLM-5.3-shaped, {args.layers} layers, prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} greedy tokens, {args.dtype}, {args.kv_cache_dtype} KV, "
        f"{torch.cuda.get_device_name()}",
        "",
        "| backend | prefill (ms) | decode step, mean / median / slowest (ms) "
        "| tokens equal to reference |",
        "|---|---:|---:|---|",
    ]
    for b, (toks, prefill, steps) in results.items():
        agree = sum(x == y for x, y in zip(toks, ref, strict=True))
        ms = sorted(1e3 * t for t in steps) or [math.nan]
        lines.append(f"| {b} | {prefill * 1e3:.1f} | {sum(ms) / len(ms):.2f} / "
                     f"{ms[len(ms) // 2]:.2f} / {ms[-1]:.2f} | {agree}/{len(ref)} |")
        print(f"{b}: decode steps (ms) " + " ".join(f"{1e3 * t:.1f}" for t in steps),
              file=sys.stderr)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if results["triton"][0] == ref else 1


if __name__ == "__main__":
    sys.exit(main())
