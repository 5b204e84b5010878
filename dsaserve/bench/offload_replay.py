"""Agentic replay in process: the workload `bench/traces.py` writes, driven straight into an engine
with and without the host KV tier, on a GPU pool smaller than the sessions' working set.

    python -m dsaserve.bench.offload_replay [--sessions 8 --turns 4 --gpu-blocks 48 ...]

Closed loop: `--concurrency` lanes, each running its sessions' turns back to back (think time
0, so the other lanes' turns are what evicts a session's prefix from the GPU). A turn's prompt is
the chat-templated history, as the server would tokenize it. TTFT is the wall time from a turn's
arrival to its first token. Prints one row per configuration (docs/offload.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    OffloadConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.args import resolve_model
from dsaserve.engine.engine import LLMEngine
from dsaserve.tokenizer import Tokenizer

from . import traces


@dataclass(frozen=True)
class ReplayResult:
    label: str
    num_requests: int
    prompt_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    mean_ttft_s: float
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return (self.gpu_hit_tokens + self.host_hit_tokens) / max(self.prompt_tokens, 1)

    @property
    def mean_prefill_tokens(self) -> float:
        """Prompt tokens computed per turn: what TTFT pays for, free of timing noise."""
        hits = self.gpu_hit_tokens + self.host_hit_tokens
        return (self.prompt_tokens - hits) / max(self.num_requests, 1)


def session_prompts(workload: traces.Workload, tokenizer: Tokenizer) -> list[list[list[int]]]:
    """Token ids of every turn of every session."""
    return [[tokenizer.encode(tokenizer.apply_chat_template(s.prompt(k)))
             for k in range(len(s.turns))] for s in workload.sessions]


def replay(engine: LLMEngine, prompts: list[list[list[int]]], output_tokens: Sequence[int],
           concurrency: int, label: str) -> ReplayResult:
    """Run every session's turns in order over `concurrency` lanes; engine stats give the hits."""
    lanes = [list(range(i, len(prompts), concurrency)) for i in range(concurrency)]
    cursor = [(0, 0)] * concurrency  # per lane: (index into its sessions, turn)
    arrival: dict[str, float] = {}  # request id → arrival time, until its first token
    lane_of: dict[str, int] = {}
    ttft: list[float] = []
    prompt_tokens = 0
    before = engine.stats()
    start = time.perf_counter()

    def submit(lane: int) -> None:
        nonlocal prompt_tokens
        i, turn = cursor[lane]
        if i >= len(lanes[lane]):
            return
        session = lanes[lane][i]
        rid = f"{label}-s{session}-t{turn}"
        params = SamplingParams(max_tokens=output_tokens[session], temperature=0.0,
                                ignore_eos=True)
        engine.add_request(rid, prompts[session][turn], params)
        prompt_tokens += len(prompts[session][turn])
        arrival[rid] = time.perf_counter()
        lane_of[rid] = lane

    def advance(lane: int) -> None:
        i, turn = cursor[lane]
        session = lanes[lane][i]
        cursor[lane] = (i, turn + 1) if turn + 1 < len(prompts[session]) else (i + 1, 0)
        submit(lane)

    for lane in range(concurrency):
        submit(lane)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id in arrival:
                ttft.append(now - arrival.pop(out.request_id))
            if out.finished:
                advance(lane_of.pop(out.request_id))
    wall = time.perf_counter() - start
    engine.check_integrity()
    after = engine.stats()
    return ReplayResult(
        label=label, num_requests=len(ttft), prompt_tokens=prompt_tokens,
        gpu_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
        host_hit_tokens=after.offload_hits - before.offload_hits,
        mean_ttft_s=sum(ttft) / max(len(ttft), 1), wall_s=wall,
    )


def format_table(results: Sequence[ReplayResult]) -> str:
    lines = ["| host tier | requests | prompt tokens | GPU hits | host hits | prefix hit rate | "
             "prefilled tokens / turn | mean TTFT (ms) | wall (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r.label} | {r.num_requests} | {r.prompt_tokens} | {r.gpu_hit_tokens} | "
            f"{r.host_hit_tokens} | {r.hit_rate:.1%} | {r.mean_prefill_tokens:.0f} | "
            f"{r.mean_ttft_s * 1e3:.1f} | "
            f"{r.wall_s:.1f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsaserve.bench.offload_replay",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-glm5")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=64,
                   help="GPU KV blocks: keep it below the sessions' working set")
    p.add_argument("--host-gib", type=float, default=0.25)
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    b = args.block_size
    spec = traces.WorkloadSpec(num_sessions=args.sessions, num_turns=args.turns, block_size=b,
                               system_tokens=8 * b, tool_tokens=4 * b, task_tokens=4 * b,
                               tool_result_tokens=(2 * b, 6 * b), output_tokens=(4, 8),
                               think_time_s=(0.0, 0.0), seed=args.seed)
    workload = traces.generate(spec, tokenizer, args.model)
    prompts = session_prompts(workload, tokenizer)
    outputs = [s.turns[0].output_tokens for s in workload.sessions]
    longest = max(len(p) for turns in prompts for p in turns) + max(outputs)
    max_model_len = -(-longest // b) * b
    config = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=b, num_gpu_blocks=args.gpu_blocks,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=512,
                                  max_model_len=max_model_len),
        attention=AttentionConfig(sparse_mla_force_mqa=True), device="cpu",
    )
    working_set = sum(len(p[-1]) for p in prompts)
    print(f"{args.sessions} sessions x {args.turns} turns, concurrency {args.concurrency}; "
          f"working set {working_set} tokens vs GPU pool {args.gpu_blocks * b} tokens",
          file=sys.stderr)
    results = []
    for label, gib in (("off", None), (f"{args.host_gib:g} GiB", args.host_gib)):
        cfg = config if gib is None else dataclasses.replace(
            config, offload=OffloadConfig(cpu_bytes_to_use=int(gib * 2**30)))
        engine = LLMEngine.from_config(cfg)
        results.append(replay(engine, prompts, outputs, args.concurrency, label))
        engine.shutdown()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
