"""The host KV tier on one GPU: copy bandwidth, TTFT of a host-tier hit, decode under loads.

    python benchmarks/offload.py                       # H200: GLM-5.3-shaped, fp8_ds_mla
    python benchmarks/offload.py --out docs/offload_h200.md
    python benchmarks/offload.py --smoke               # CPU, tiny sizes (CI runs this)

Three tables:
1. Bandwidth: the copier alone on caches with GLM-5.3's whole per-token record (78 MLA layers +
   the MTP layer at 656 B, 21 + 1 indexer layers at 132 B: 54,728 B per token), blocks scattered
   over the GPU pool as they are in service; stores (GPU → pinned host) and loads (host → GPU)
   of 32K and 128K tokens against the link's 55 GB/s (target: loads of ≥ 32K tokens ≥ 40 GB/s).
2. TTFT through the engine (GLM-5.3-shaped model: real attention and indexer shapes, few layers,
   Triton backend): a turn of 64 new tokens after a 32K / 128K prefix that is (a) recomputed,
   (b) a GPU prefix hit, (c) evicted from the GPU and loaded from the host tier. Target: (c) ≤
   1.2 × (b) + the transfer at 40 GB/s of the full model's record; (a) / (c) ≥ 5 at 128K.
3. Decode step time of running requests while loads and stores of the full record stream on the
   copy streams (target ≤ 1.05 × without: the copies overlap).
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    OffloadConfig,
    SchedulerConfig,
)
from dsaserve.core import KVTransfer, SamplingParams, SchedulerOutput
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.copier import COPY_PIECE_BYTES, KVCopier
from dsaserve.kv.host_pool import HostKVPool
from dsaserve.model.dsa import LayerCache
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped

LINK_GBPS = 55.0  # pinned host ↔ H200, contiguous, each way (ECOSYSTEM.md)
GLM53_MLA_LAYERS = 79  # 78 decoder layers + the MTP layer
GLM53_INDEX_LAYERS = 22  # 21 decoder layers + the MTP layer's (788 = 656 + 132 B)
MLA_ROW, INDEX_ROW = 656, 132  # bytes per token (fp8_ds_mla, indexer FP8 key + scale)
FULL_RECORD = GLM53_MLA_LAYERS * MLA_ROW + GLM53_INDEX_LAYERS * INDEX_ROW  # 54,728 B / token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_compute(device: torch.device) -> None:
    """Wait for the compute stream only (copies on the copy streams keep going)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ------------------------------------------------------------------------------------------------
def _piece_bytes(args: argparse.Namespace) -> int | None:
    return None if args.copy_piece_mib == 0 else int(args.copy_piece_mib * 2**20)


# 1. bandwidth of the copier alone
# ------------------------------------------------------------------------------------------------
def record_caches(num_blocks: int, block: int, device: torch.device, mla_layers: int,
                  index_layers: int) -> list[LayerCache]:
    """Caches with the byte layout of GLM-5.3's fp8_ds_mla record (contents irrelevant)."""
    return [LayerCache(
        kv=torch.empty(num_blocks, block, MLA_ROW, dtype=torch.uint8, device=device),
        index=(torch.empty(num_blocks, block * INDEX_ROW, dtype=torch.uint8, device=device)
               if i < index_layers else None))
        for i in range(mla_layers)]


class _Jobs:
    """Issues copy jobs with the ids the copier expects."""

    def __init__(self, copier: KVCopier) -> None:
        self.copier = copier
        self.next = {"load": 0, "store": 0}

    def start(self, kind: str, gpu: list[int], host: list[int]) -> None:
        job = KVTransfer(self.next[kind], tuple(gpu), tuple(host))
        self.next[kind] += 1
        so = SchedulerOutput((), (), {}, (), **{f"kv_{kind}s": (job,)})
        self.copier.start(so)


def bandwidth(args: argparse.Namespace, device: torch.device) -> list[str]:
    block = args.block_size
    num_blocks = max(args.bw_tokens) // block
    gpu_pool = num_blocks + num_blocks // 4  # the job's blocks scattered over a larger pool
    caches = record_caches(gpu_pool, block, device, args.bw_mla_layers, args.bw_index_layers)
    pool = HostKVPool(caches, num_blocks, pin=device.type == "cuda", flag="--kv-offloading-size")
    jobs = _Jobs(KVCopier(pool, device, _piece_bytes(args)))
    rows = [f"copier alone: {args.bw_mla_layers} MLA + {args.bw_index_layers} indexer cache "
            f"layers, {pool.block_bytes // block:,} B per token, blocks of {block} tokens, "
            f"pinned: {pool.pinned}", "",
            "| tokens | GiB | store D2H (GB/s) | load H2D (GB/s) | load / link |",
            "|---:|---:|---:|---:|---:|"]
    rng = random.Random(0)
    for tokens in args.bw_tokens:
        n = tokens // block
        gpu = rng.sample(range(gpu_pool), n)
        host = list(range(n))
        result = {}
        for kind in ("store", "load"):
            times = []
            for _ in range(args.repeats + 1):  # the first is a warm-up
                _sync(device)
                t0 = time.perf_counter()
                jobs.start(kind, gpu, host)
                jobs.copier.drain()
                times.append(time.perf_counter() - t0)
            result[kind] = n * pool.block_bytes / min(times[1:]) / 1e9
        rows.append(f"| {tokens:,} | {n * pool.block_bytes / 2**30:.2f} | {result['store']:.2f} "
                    f"| {result['load']:.2f} | {result['load'] / LINK_GBPS:.1%} |")
    return rows


# ------------------------------------------------------------------------------------------------
# 2. TTFT through the engine
# ------------------------------------------------------------------------------------------------
def _ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    device = engine.runner.device
    _sync(device)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                   ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                _sync(device)
                first = time.perf_counter() - t0
    assert first is not None
    return first


def ttft(args: argparse.Namespace, model_dir: Path, device: torch.device) -> list[str]:
    model = ModelConfig.from_file(model_dir)
    vocab = model.vocab_size
    rows = [f"TTFT of 64 new tokens after the prefix ({model.num_hidden_layers} layers, "
            f"{args.kv_cache_dtype}, {args.backend} backend, chunks of {args.chunk} tokens)", "",
            "| prefix | recompute, +191 tokens (ms) | GPU hit (ms) | host hit (ms) | "
            "host-hit KV (MiB) | recompute / host | host / (1.2 GPU + full record at 40 GB/s) |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    for prefix_len in args.prefixes:
        max_len = prefix_len + 192
        blocks = -(-max_len // args.block_size)  # one request's worth: a filler evicts the rest
        cfg = EngineConfig(
            model_path=str(model_dir), model=model,
            cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                              num_gpu_blocks=blocks),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=args.chunk,
                                      max_model_len=max_len),
            attention=AttentionConfig(backend=args.backend, sparse_mla_force_mqa=True),
            offload=OffloadConfig(cpu_bytes_to_use=int(args.host_gib * 2**30)),
            dtype=args.dtype, device=str(device),
        )
        engine = LLMEngine.from_config(cfg)
        _ttft(engine, "warm-up", rand(min(prefix_len, args.chunk) + 64))
        prefix = rand(prefix_len)
        q1, q2, q3 = rand(64), rand(64), rand(64)
        _ttft(engine, "turn-1", prefix + q1)  # now on the GPU and (write-through) on the host
        gpu_hit = _ttft(engine, "turn-2", prefix + q1 + q2)
        # The filler takes every GPU block (evicting the prefix); its TTFT is the recompute's.
        recompute = _ttft(engine, "filler", rand(max_len - 1))
        before = engine.stats()
        host_hit = _ttft(engine, "turn-3", prefix + q1 + q3)
        after = engine.stats()
        loaded = after.offload_bytes_loaded - before.offload_bytes_loaded
        assert after.offload_hits - before.offload_hits >= prefix_len - args.block_size, \
            "the prefix did not come from the host tier"
        engine.check_integrity()
        transfer = (prefix_len + 64) * FULL_RECORD / 40e9
        rows.append(f"| {prefix_len:,} | {recompute * 1e3:.1f} | {gpu_hit * 1e3:.1f} | "
                    f"{host_hit * 1e3:.1f} | {loaded / 2**20:.0f} | {recompute / host_hit:.1f} | "
                    f"{host_hit / (1.2 * gpu_hit + transfer):.2f} |")
        engine.shutdown()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# 3. decode steps while copies stream
# ------------------------------------------------------------------------------------------------
def decode_under_copies(args: argparse.Namespace, model_dir: Path,
                        device: torch.device) -> list[str]:
    model = ModelConfig.from_file(model_dir)
    cfg = EngineConfig(
        model_path=str(model_dir), model=model,
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=args.decode_reqs * (-(-args.decode_ctx // args.block_size)
                                                             + 4) + 8),
        scheduler=SchedulerConfig(max_num_seqs=args.decode_reqs, max_num_batched_tokens=args.chunk,
                                  max_model_len=args.decode_ctx + 2 * args.decode_steps + 64),
        attention=AttentionConfig(backend=args.backend, sparse_mla_force_mqa=True),
        dtype=args.dtype, device=str(device),
    )
    engine = LLMEngine.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=2 * args.decode_steps + 8, temperature=0.0,
                            ignore_eos=True)
    for i in range(args.decode_reqs):
        engine.add_request(f"d{i}", torch.randint(4, model.vocab_size, (args.decode_ctx,),
                                                  generator=g).tolist(), params)
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefills
    # A second copier streams the full GLM-5.3 record (loads and stores) on its own streams.
    block = args.block_size
    n = args.copy_tokens // block
    caches = record_caches(n, block, device, args.bw_mla_layers, args.bw_index_layers)
    pool = HostKVPool(caches, n, pin=device.type == "cuda", flag="--kv-offloading-size")
    jobs = _Jobs(KVCopier(pool, device, _piece_bytes(args)))
    ids = list(range(n))

    def steps(with_copies: bool, count: int) -> tuple[list[float], int]:
        times, copied = [], 0
        for _ in range(count):
            if with_copies:
                loads, stores = jobs.copier.poll()
                if loads == jobs.next["load"]:
                    jobs.start("load", ids, ids)
                    copied += n * pool.block_bytes
                if stores == jobs.next["store"]:
                    jobs.start("store", ids, ids)
                    copied += n * pool.block_bytes
            _sync_compute(device)
            t0 = time.perf_counter()
            engine.step()  # sampling reads the tokens back: the step's end is synchronous
            times.append(time.perf_counter() - t0)
        if with_copies:
            jobs.copier.drain()
        return times, copied

    # Rounds alternate without / with copies, so that the context's growth and any drift of the
    # clocks fall on both sides alike; the median step of each side is compared.
    rounds = 4
    plain: list[float] = []
    loaded: list[float] = []
    copied = 0
    for _ in range(rounds):
        plain += steps(False, max(1, args.decode_steps // rounds))[0]
        times, moved = steps(True, max(1, args.decode_steps // rounds))
        loaded += times
        copied += moved
    base, with_copies = statistics.median(plain), statistics.median(loaded)
    engine.shutdown()
    return [f"decode steps of {args.decode_reqs} requests at {args.decode_ctx:,} tokens of "
            f"context while the copier streams {args.copy_tokens:,}-token loads and stores of "
            f"the full record", "",
            "| median step, no copies (ms) | with copies (ms) | ratio | GiB copied meanwhile |",
            "|---:|---:|---:|---:|",
            f"| {base * 1e3:.2f} | {with_copies * 1e3:.2f} | {with_copies / base:.3f} | "
            f"{copied / 2**30:.1f} |"]


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the script runs")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the engine's model")
    p.add_argument("--prefixes", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--bw-tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--bw-mla-layers", type=int, default=GLM53_MLA_LAYERS)
    p.add_argument("--bw-index-layers", type=int, default=GLM53_INDEX_LAYERS)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=16384, help="--max-num-batched-tokens")
    p.add_argument("--host-gib", type=float, default=16.0)
    p.add_argument("--decode-reqs", type=int, default=8)
    p.add_argument("--decode-ctx", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--copy-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-piece-mib", type=float, default=COPY_PIECE_BYTES / 2**20,
                   help="the most one host<->GPU copy moves, MiB (0: a whole run of blocks); "
                        "to compare the decode step's slowdown under copies")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--backend", default="triton", choices=("reference", "triton"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tables", default="bandwidth,ttft,decode",
                   help="which tables, comma-separated (bandwidth, ttft, decode)")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = p.parse_args(argv)
    wanted = set(args.tables.split(","))
    if not wanted or wanted - {"bandwidth", "ttft", "decode"}:
        p.error(f"--tables: expected some of bandwidth,ttft,decode, got {args.tables!r}")
    if args.smoke:
        args.prefixes, args.bw_tokens, args.copy_tokens = [64], [256], 256
        args.bw_mla_layers, args.bw_index_layers, args.block_size = 3, 2, 16
        args.chunk, args.host_gib, args.repeats = 64, 0.05, 1
        args.decode_reqs, args.decode_ctx, args.decode_steps = 2, 32, 3
        args.backend, args.dtype = "reference", "auto"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir = make_model("tiny-glm5", Path(tmp) / "tiny")
        else:
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", with_mtp=True,
                                   overrides=glm53_shaped(args.layers, mtp=True))
        tables = [make() for name, make in (
            ("bandwidth", lambda: bandwidth(args, device)),
            ("ttft", lambda: ttft(args, model_dir, device)),
            ("decode", lambda: decode_under_copies(args, model_dir, device))) if name in wanted]
    text = "\n\n".join("\n".join(t) for t in tables) + "\n"
    header = f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}\n"
    print(header + "\n" + text)
    if args.out:
        args.out.write_text(header + "\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
