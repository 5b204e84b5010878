"""P/D through the engine on one device: a prefill engine and a decode engine (NixlConnector),
the time from the prefill's end to the first decoded token, and the KV transfer's share of it.

    python benchmarks/pd_e2e.py                        # H200: GLM-5.3-shaped, fp8_ds_mla, NIXL
    python benchmarks/pd_e2e.py --out docs/pd_h200.md
    python benchmarks/pd_e2e.py --smoke                # CPU, tiny sizes (the script runs)

Both engines live in this process (one agent each; on a GPU their caches are registered as
VRAM, so a READ is GPU → GPU). Per prompt length: the prefill engine prefills and holds the
blocks; then, timed, the decode engine checks the params over the side channel, allocates,
READs every prompt row it lacks (posted in the runner's step with the `KVRecv`, polled in
the following ones until they land) and decodes its first token. Columns: that time to the
first decoded token; the READs alone (until the request leaves `receiving`) and their GB/s over the
bytes moved (a GLM-5.3-shaped model with few layers: the bytes are those layers'); the same
request's whole-model KV (54,728 B per token) at that rate; and the cost model's transfer time for
the 16-GPU deployment (a decode rank's 400 Gb/s InfiniBand link, 50 GB/s), next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.disagg import offline
from dsaserve.engine.engine import LLMEngine
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

    p, d = LLMEngine.from_config(role("kv_producer")), LLMEngine.from_config(role("kv_consumer"))
    assert isinstance(p, LLMEngine) and isinstance(d, LLMEngine)
    g = torch.Generator().manual_seed(0)
    rows = [f"P/D on one {device.type} ({model.num_hidden_layers} layers + MTP, "
            f"{args.kv_cache_dtype}, {args.transport}, block {args.block_size})", "",
            "| prompt | first decoded token after the prefill (ms) | READ step (ms) | KV moved "
            "(MiB) | GB/s | whole-model KV at that rate (ms) | 16 GPUs, IB 50 GB/s (ms) |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        for n in [min(args.tokens), *args.tokens]:  # the first is a warm-up, not reported
            prompt = torch.randint(4, model.vocab_size, (n,), generator=g).tolist()
            rid = f"p{n}-{time.monotonic_ns()}"
            params = offline.prefill(p, rid, prompt)
            before = sum(d.executor.call("kv_bytes_received"))
            _sync(device)
            t0 = time.perf_counter()
            d.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                      ignore_eos=True), kv_transfer_params=params)
            read_s = first_s = None
            while d.has_unfinished_requests():
                outs = d.step()
                _sync(device)
                if read_s is None and rid not in d.scheduler.receiving:
                    # check + the READs (posted in one step, polled until they land)
                    read_s = time.perf_counter() - t0
                if any(o.new_token_ids for o in outs) and first_s is None:
                    first_s = time.perf_counter() - t0
            while p.has_unfinished_requests():
                p.step()
            moved = sum(d.executor.call("kv_bytes_received")) - before
            assert read_s is not None and first_s is not None
            gbps = moved / read_s / 1e9
            whole = n * FULL_RECORD
            rows.append(f"| {n:,} | {first_s * 1e3:.1f} | {read_s * 1e3:.1f} | "
                        f"{moved / 2**20:.1f} | {gbps:.2f} | {whole / (gbps * 1e9) * 1e3:,.0f} | "
                        f"{whole / (IB_GBPS * 1e9) * 1e3:.1f} |")
            for e in (p, d):
                e.check_integrity()
        del rows[4]  # the warm-up row
    finally:
        p.shutdown()
        d.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the script runs")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16384, help="--max-num-batched-tokens")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    ap.add_argument("--transport", default="nixl", choices=("nixl", "shm", "auto"))
    ap.add_argument("--backend", default="triton", choices=("reference", "triton"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.block_size, args.chunk = [48, 96], 16, 64
        args.backend, args.dtype, args.transport = "reference", "auto", "shm"
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
