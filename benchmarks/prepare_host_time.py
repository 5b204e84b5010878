"""Host time of a prefill step's batch and metadata build (`ModelRunner._prepare`) on the CPU,
per chunk position: what docs/long_prefill.md's "host work of a step" table reports.

    python benchmarks/prepare_host_time.py [--chunk 16384] [--at 0,114688,1032192] [--repeats 20]

One thread, the minimum of --repeats calls. The block ids are synthetic (the build never reads
the caches), so a 1M-token context needs no 1M-token pool.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.args import add_engine_args, engine_config_from_args
from dsaserve.engine.runner import ModelRunner, _ReqState
from dsaserve.model.make_model import make_model


def prepare_ms(runner: ModelRunner, chunk: int, at: int, repeats: int) -> float:
    """Milliseconds of one _prepare of a `chunk`-token prefill step starting at position `at`."""
    b = runner.block_size
    n = at + chunk
    runner.requests["r"] = _ReqState(
        token_ids=[5] * (n + 1), block_ids=list(range(-(-n // b))), params=SamplingParams(),
        generator=torch.Generator(), num_computed_tokens=at)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner._prepare(["r"], {"r": chunk}, {})
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--at", default="0,114688,1032192", help="chunk start positions")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model("tiny-glm5", Path(tmp) / "tiny")
        engine_args = add_engine_args(argparse.ArgumentParser()).parse_args(
            ["--block-size", "64", "--num-gpu-blocks-override", "8", "--device", "cpu"])
        runner = ModelRunner(engine_config_from_args(engine_args, str(model_dir)))
        print(f"| chunk start | {args.chunk}-token chunk: host ms (min of {args.repeats}) |")
        print("|---:|---:|")
        for at in (int(x) for x in args.at.split(",")):
            print(f"| {at} | {prepare_ms(runner, args.chunk, at, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
