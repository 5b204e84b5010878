"""Host time of a prefill step's batch and metadata build (`ModelRunner._prepare`) on the CPU,
per chunk position: what docs/long_prefill.md's "host work of a step" table reports; with
--decode, that of a decode step of B requests at each context (docs/decode.md, "The block
table").

    python benchmarks/prepare_host_time.py [--chunk 16384] [--at 0,114688,1032192] [--repeats 20]
    python benchmarks/prepare_host_time.py --decode 1,16,64 --at 8192,131072

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
        token_ids=[5] * (n + 1), params=SamplingParams(), num_computed_tokens=at)
    # its rows of the device block table and sampling parameters: filled once (the first call
    # sends them), as when the request first runs
    runner.block_table.add("r", range(-(-n // b)))
    runner.sampling.add("r", runner.block_table.row_of["r"], SamplingParams())
    return _min_ms(runner, {"r": chunk}, repeats)


def decode_ms(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    """Milliseconds of one _prepare of a decode step of `batch` requests at `context`."""
    runner.requests.clear()
    for i in range(batch):
        rid = f"r{i}"
        runner.requests[rid] = _ReqState(
            token_ids=[5] * (context + 1), params=SamplingParams(), num_computed_tokens=context)
        runner.block_table.remove(rid)
        runner.block_table.add(rid, range(-(-(context + 1) // runner.block_size)))
        runner.sampling.add(rid, runner.block_table.row_of[rid], SamplingParams())
    return _min_ms(runner, {f"r{i}": 1 for i in range(batch)}, repeats)


def _min_ms(runner: ModelRunner, scheduled: dict[str, int], repeats: int) -> float:
    """The minimum over `repeats` calls (the first sends the new rows of the block table)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner._prepare(list(scheduled), scheduled, {})
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--at", default="0,114688,1032192", help="chunk start positions")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--decode", default=None,
                    help="batch sizes: decode steps at the --at contexts instead of chunks")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model("tiny-glm5", Path(tmp) / "tiny")
        engine_args = add_engine_args(argparse.ArgumentParser()).parse_args(
            ["--block-size", "64", "--num-gpu-blocks-override", "8", "--device", "cpu"])
        runner = ModelRunner(engine_config_from_args(engine_args, str(model_dir)))
        positions = [int(x) for x in args.at.split(",")]
        if args.decode is not None:
            print(f"| batch | context | decode step: host ms (min of {args.repeats}) |")
            print("|---:|---:|---:|")
            for batch in (int(x) for x in args.decode.split(",")):
                for at in positions:
                    print(f"| {batch} | {at} | {decode_ms(runner, batch, at, args.repeats):.3f} |")
            return
        print(f"| chunk start | {args.chunk}-token chunk: host ms (min of {args.repeats}) |")
        print("|---:|---:|")
        for at in positions:
            print(f"| {at} | {prepare_ms(runner, args.chunk, at, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
