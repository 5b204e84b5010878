"""Host time of the scheduler's decode step and of the block pool's bulk allocation, on the CPU
(no model: the runner's output is stubbed with one token per sampling request): what
docs/decode.md ("The scheduler's host time") and docs/disagg.md (the posting step) report.

    python benchmarks/scheduler_host_time.py                      # b = 64 decode, sync + async
    python benchmarks/scheduler_host_time.py --batch 1,64,256 --context 8192 --steps 2000
    python benchmarks/scheduler_host_time.py --allocate 2048      # + BlockPool.allocate(2,048)

Decode: `--batch` requests of `--context` prompt tokens (block 64, prefix caching on) are
prefilled, then each timed step is `schedule()` + `update_from_output()` of its stubbed output
(async: `update_from_output` of the step before, as the engine calls it); a request's last
block fills every 64 steps, so its allocation and prefix-cache registration are in the
sample. Allocate: `allocate(n)` from a pool whose free queue holds 2n cached blocks (each
taken block evicts a hash), n blocks freed and re-cached between calls (untimed). One
thread; median and minimum per row, in ms. To compare two trees, run this file with each on
PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dsaserve.config import CacheConfig, SchedulerConfig
from dsaserve.core import ModelRunnerOutput, Request, SamplingParams, SchedulerOutput
from dsaserve.engine.async_scheduler import AsyncScheduler
from dsaserve.engine.scheduler import Scheduler
from dsaserve.kv.block_pool import BlockPool

BLOCK = 64


def _stub_output(sched: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    """One token (never a stop) for each request whose step reaches its last known token."""
    sampled = {}
    for request_id, n in so.num_scheduled_tokens.items():
        req = sched.requests[request_id]
        known = req.num_tokens - req.num_output_placeholders
        if isinstance(sched, AsyncScheduler) or req.num_computed_tokens + n >= known:
            sampled[request_id] = [7]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def decode_step_ms(batch: int, context: int, steps: int, async_: bool) -> list[float]:
    """Milliseconds of each of `steps` decode steps' schedule + update at `batch` requests."""
    cls = AsyncScheduler if async_ else Scheduler
    max_tokens = steps + 4 * BLOCK  # none ends while timed (prefill, warm-up, async lag)
    max_len = context + max_tokens + BLOCK
    sched = cls(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 8192),
                                max_model_len=max_len, async_scheduling=async_),
                CacheConfig(block_size=BLOCK), batch * -(-max_len // BLOCK) + 1)
    for i in range(batch):  # distinct prompts: no prefix shared
        sched.add_request(Request(f"r{i}", [i] * context,
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    pending: list[SchedulerOutput] = []

    def step() -> None:
        so = sched.schedule()
        pending.append(so)
        if not async_ or len(pending) == 2:
            done = pending.pop(0)
            sched.update_from_output(done, _stub_output(sched, done))

    while any(r.num_computed_tokens < context for r in sched.requests.values()):
        step()  # the prefill chunks (untimed)
    for _ in range(BLOCK):
        step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    assert len(sched.running) == batch, "a request ended or was preempted while timed"
    return times


def allocate_ms(n: int, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` BlockPool.allocate(n), every block taken evicting a
    cached one."""
    pool = BlockPool(2 * n, enable_caching=True)
    next_hash = 0
    held = pool.allocate(2 * n)
    times = []
    for _ in range(repeats):
        for block_id in held:
            next_hash += 1
            pool.cache_block(block_id, next_hash.to_bytes(32, "big"))
        pool.free(held)
        t0 = time.perf_counter()
        taken = pool.allocate(n)
        times.append((time.perf_counter() - t0) * 1e3)
        assert pool.num_cached_blocks == n, "every block taken evicted a cached one"
        held = taken + pool.allocate(n)  # untimed: the pool full again, to be re-cached
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="64", help="decode batch sizes (comma-separated)")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=1000, help="timed decode steps per row")
    ap.add_argument("--allocate", type=int, default=0,
                    help="also time BlockPool.allocate of this many blocks, all evicting")
    ap.add_argument("--repeats", type=int, default=200, help="timed allocations")
    args = ap.parse_args(argv)
    print("| scheduler | batch | context | schedule + update ms (median / min) |")
    print("|---|---:|---:|---:|")
    for batch in (int(x) for x in args.batch.split(",")):
        for async_ in (False, True):
            t = decode_step_ms(batch, args.context, args.steps, async_)
            print(f"| {'async' if async_ else 'sync'} | {batch} | {args.context} | "
                  f"{statistics.median(t):.3f} / {min(t):.3f} |")
    if args.allocate:
        t = allocate_ms(args.allocate, args.repeats)
        print(f"\nBlockPool.allocate({args.allocate}), all evicting: "
              f"{statistics.median(t):.3f} / {min(t):.3f} ms (median / min)")


if __name__ == "__main__":
    main()
