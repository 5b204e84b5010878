"""P/D through the engine on one device: a prefill engine and a decode engine (NixlConnector) in
two processes, the time from the prefill's end to the first decoded token, and the KV transfer's
share of it.

    python benchmarks/pd_e2e.py                        # H200: GLM-5.3-shaped, fp8_ds_mla, NIXL
    python benchmarks/pd_e2e.py --out docs/pd_h200.md
    python benchmarks/pd_e2e.py --smoke                # CPU, tiny sizes, shm (the script runs)
    python benchmarks/pd_e2e.py --smoke --transport nixl
    python benchmarks/pd_e2e.py --profile              # + the decode engine's host profile

The prefill engine runs in a spawned process (`disagg/prefill_process.py`: built from the same
config, stepping while it holds blocks, as a prefill server does), the decode engine in this one,
as deployed: each has its own agent, and a READ goes between processes (on a GPU both caches
are VRAM, so it is GPU → GPU). Per prompt length: the prefill process prefills and holds the
blocks; then, timed here, the decode engine checks the params over the side channel, allocates,
READs every prompt row it lacks (posted in the runner's step with the `KVRecv`, polled in
the following ones until they land) and decodes its first token. Columns: that time to the
first decoded token; the READs alone (until the request leaves `receiving`), split into the
decode rank's host time posting them and the time they were in flight until a poll found them
landed (with the number of polls; the rest is the side channel's check and the steps around),
and their GB/s over the bytes moved (a GLM-5.3-shaped model with few layers: the bytes are
those layers'); the same request's whole-model KV (54,728 B per token) at that rate; and the
cost model's transfer time for the 16-GPU deployment (a decode rank's 400 Gb/s InfiniBand
link, 50 GB/s), next to it.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsaserve.bench.profile import cprofile_top
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.disagg.prefill_process import PrefillProcess
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import cpu_threads_per_worker
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped

FULL_RECORD = 54_728  # GLM-5.3's KV bytes per token, every layer (DESIGN §2)
IB_GBPS = 50.0  # a decode rank's 400 Gb/s link


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, model_dir: Path, device: torch.device) -> list[str]:
    model = ModelConfig.from_file(model_dir)
    max_len = max(args.tokens) + 64
    base = EngineConfig(
        model_path=str(model_dir), model=model,
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=2 * (-(-max_len // args.block_size)) + 4),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=args.chunk,
                                  max_model_len=max_len),
        attention=AttentionConfig(backend=args.backend, sparse_mla_force_mqa=True),
        dtype=args.dtype, device=str(device))

    def role(r: str) -> EngineConfig:
        return dataclasses.replace(base, disagg=DisaggConfig(kv_role=r, backend=args.transport,
                                                             side_channel_port=0))

    threads = torch.get_num_threads()
    # the cores are shared with the prefill process, which takes as many: oversubscribed,
    # torch's spin-waiting threads made the first token ~20x slower on a CPU, and the READs'
    # posting 50x slower on a GPU's host (367 of 417 ms)
    torch.set_num_threads(cpu_threads_per_worker(2))
    try:
        with PrefillProcess(role("kv_producer")) as p:
            d = LLMEngine.from_config(role("kv_consumer"))
            assert isinstance(d, LLMEngine)
            try:
                rows = [f"P/D on one {device.type}, the engines in two processes "
                        f"({model.num_hidden_layers} layers + MTP, {args.kv_cache_dtype}, "
                        f"{args.transport}, block {args.block_size})", "",
                        "| prompt | first decoded token after the prefill (ms) | READ step (ms) | "
                        "of it: posting (ms) | of it: in flight (ms) | polls | "
                        "KV moved (MiB) | GB/s | whole-model KV at that rate (ms) | 16 GPUs, "
                        "IB 50 GB/s (ms) |",
                        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
                g = torch.Generator().manual_seed(0)
                for i, n in enumerate([min(args.tokens), *args.tokens]):
                    # the first: a warm-up, not reported
                    prompt = torch.randint(4, model.vocab_size, (n,), generator=g).tolist()
                    profiler = cProfile.Profile() if args.profile and i == len(args.tokens) \
                        else None
                    rows.append(_measure(p, d, prompt, device, profiler))
                    if profiler is not None:
                        rows += ["", f"The decode engine's host time at {n:,} tokens "
                                     "(cProfile):", "```", cprofile_top(profiler), "```"]
                del rows[4]  # the warm-up row
            finally:
                d.shutdown()
    finally:
        torch.set_num_threads(threads)
    return rows


def _measure(p: PrefillProcess, d: LLMEngine, prompt: list[int], device: torch.device,
             profiler: cProfile.Profile | None = None) -> str:
    """One prompt prefilled there, then timed here until the first decoded token (under
    `profiler` if given): its row."""
    n = len(prompt)
    rid = f"p{n}-{time.monotonic_ns()}"
    params = p.prefill(rid, prompt)
    before = sum(d.executor.call("kv_bytes_received"))
    times_before = d.executor.call("kv_read_times")
    _sync(device)
    t0 = time.perf_counter()
    d.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                  kv_transfer_params=params)
    read_s = first_s = None
    while d.has_unfinished_requests():
        if profiler is not None:
            profiler.enable()
        outs = d.step()
        if profiler is not None:
            profiler.disable()
        _sync(device)
        if read_s is None and rid not in d.scheduler.receiving:
            # check + the READs (posted in one step, polled until they land)
            read_s = time.perf_counter() - t0
        if any(o.new_token_ids for o in outs) and first_s is None:
            first_s = time.perf_counter() - t0
    p.drain(tick=d.step)  # the producer freed the blocks read; its invariants
    d.check_integrity()
    moved = sum(d.executor.call("kv_bytes_received")) - before
    # the slowest rank's posting and flight (one rank here); the rest of the READ step is the
    # side channel's check and the steps around the READs
    spans = [(a.post_s - b.post_s, a.in_flight_s - b.in_flight_s, a.polls - b.polls)
             for a, b in zip(d.executor.call("kv_read_times"), times_before, strict=True)]
    post_s, flight_s, polls = max(spans, key=lambda t: t[0] + t[1])
    assert read_s is not None and first_s is not None
    gbps = moved / read_s / 1e9
    whole = n * FULL_RECORD
    return (f"| {n:,} | {first_s * 1e3:.1f} | {read_s * 1e3:.1f} | {post_s * 1e3:.1f} | "
            f"{flight_s * 1e3:.1f} | {polls} | {moved / 2**20:.1f} | "
            f"{gbps:.2f} | {whole / (gbps * 1e9) * 1e3:,.0f} | "
            f"{whole / (IB_GBPS * 1e9) * 1e3:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the script runs")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16384, help="--max-num-batched-tokens")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    ap.add_argument("--transport", default=None, choices=("nixl", "shm", "auto"),
                    help="the KV transport (default: nixl; shm with --smoke)")
    ap.add_argument("--backend", default="triton", choices=("reference", "triton"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--profile", action="store_true",
                    help="profile the decode engine's steps of the last prompt (cProfile)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.block_size, args.chunk = [48, 96], 16, 64
        args.backend, args.dtype = "reference", "auto"
        args.transport = args.transport or "shm"
    args.transport = args.transport or "nixl"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir = make_model("tiny-glm5", Path(tmp) / "tiny")
        else:
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", with_mtp=True,
                                   overrides=glm53_shaped(args.layers, mtp=True))
        rows = run(args, model_dir, device)
    header = f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}\n"
    text = header + "\n" + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
