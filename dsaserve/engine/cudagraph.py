"""CUDA graphs for decode batches: which sizes are captured, how a batch is padded to one, and
the capture / replay of a step over static buffers.

A decode batch of n tokens (requests × (1 + drafts)) runs the graph captured for the smallest
capture size ≥ n, its inputs padded to that size; larger batches, prefill and mixed steps run
eager. Graphs exist only on CUDA (on the CPU the engine runs eager, as vLLM does) and never
under --enforce-eager.

    default sizes (vLLM's buckets):  1 2 4 8 16 24 … 248 256 272 … (step 16), up to the largest
                                     decode batch, which is always a size itself
    n = 5  → size 8: rows 5..7 are padding (a pad slot: written nowhere, outputs ignored)
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from dsaserve.config import CompilationConfig


def default_capture_sizes(max_num_seqs: int, num_speculative_tokens: int = 0) -> tuple[int, ...]:
    """1, 2, 4, then multiples of 8 below 256, then of 16, up to the largest decode batch
    (max_num_seqs × (1 + drafts) tokens), which ends the list."""
    limit = max_num_seqs * (1 + num_speculative_tokens)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    sizes = [n for n in grid if n < limit]
    return (*sizes, limit)


def capture_sizes(config: CompilationConfig, device: torch.device, max_num_seqs: int,
                  num_speculative_tokens: int = 0) -> tuple[int, ...]:
    """The sizes this engine captures: none off CUDA or under --enforce-eager."""
    if device.type != "cuda" or config.enforce_eager:
        return ()
    if config.cudagraph_capture_sizes is not None:
        return config.cudagraph_capture_sizes
    return default_capture_sizes(max_num_seqs, num_speculative_tokens)


def padded_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size ≥ num_tokens (sizes ascending); None: run eager."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def pad_to(t: torch.Tensor, size: int, value: int | float) -> torch.Tensor:
    """t [n, ...] → [size, ...], rows n.. filled with `value` (n ≤ size)."""
    if t.shape[0] == size:
        return t
    pad = t.new_full((size - t.shape[0], *t.shape[1:]), value)
    return torch.cat((t, pad))


class GraphPool:
    """One CUDA graph per capture size over static input buffers; every graph shares one memory
    pool (captured largest first, as the pool's blocks are then reused by the smaller ones).

    fn(**inputs) → output tensor; `inputs` are device tensors whose first dimension is the
    size. Replay copies the step's (padded) inputs into the static buffers, replays, and
    returns the static output (valid until the next replay: callers copy what they keep)."""

    def __init__(self, fn: Callable[..., torch.Tensor], warmup: int = 2) -> None:
        self.fn = fn
        self.warmup = warmup
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor],
                                     torch.Tensor]] = {}
        self._pool = None

    def capture(self, size: int, inputs: dict[str, torch.Tensor]) -> None:
        if not all(t.is_cuda for t in inputs.values()):
            raise RuntimeError("GraphPool: CUDA graphs need CUDA tensors")
        static = {k: v.clone() for k, v in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits, autotuning
            for _ in range(self.warmup):
                self.fn(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.fn(**static)
        self._pool = graph.pool()
        self.graphs[size] = (graph, static, out)

    def replay(self, size: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        graph, static, out = self.graphs[size]
        for name, t in inputs.items():
            static[name].copy_(t, non_blocking=True)
        graph.replay()
        return out
