"""Kernel timings on the GPU for the kernel benchmarks: a list of calls replayed from one CUDA
graph (each call on its own copy of the weights, so that none is served from L2), and the
device's copy rate that GB/s figures are set against. Triton is imported when timing: the
benchmarks' CPU smokes never reach here."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _warm(calls: list[Callable[[], object]]) -> None:
    """Every call once on a side stream: compile and allocate outside any capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def graph_us(calls: list[Callable[[], object]], rep_ms: int = 200) -> float:
    """µs per call: one CUDA graph of every call in turn, its replay's median (do_bench) over
    len(calls)."""
    import triton.testing

    _warm(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = float(triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms,
                                       return_mode="median"))
    return 1e3 * ms / len(calls)


def eager_us(call: Callable[[], object]) -> float:
    """µs per call, launched eagerly with L2 flushed before each run (do_bench's median)."""
    import triton.testing

    _warm([call])
    return 1e3 * float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))


def copy_rate_tbps(device: str | torch.device = "cuda") -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (TB/s)."""
    import triton.testing

    src = torch.empty(1 << 30, device=device, dtype=torch.bfloat16).uniform_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median"))
    return 2 * src.numel() * 2 / ms / 1e9
