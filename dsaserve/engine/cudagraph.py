"""CUDA graphs for decode batches: which sizes are captured, how a batch is padded to one, and
the capture / replay of a step over static buffers.

A decode batch of n tokens (requests × (1 + drafts)) runs at the smallest capture size ≥ n that
1 + drafts divides, its inputs padded to that size (engine/decode_graph.py lays it out);
larger batches, prefill and mixed steps run as they are. The padded path runs on every device
unless --enforce-eager; graphs are captured and replayed only on CUDA, with an attention
backend that is `capturable` (on the CPU the same padded step runs eager).

    default sizes (vLLM's buckets):  1 2 4 8 16 24 … 248 256 272 … (step 16), up to the largest
                                     decode batch, which is always a size itself
    n = 5  → size 8: rows 5..7 are padding (written nowhere, outputs ignored)
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


def decode_sizes(config: CompilationConfig, max_num_seqs: int,
                 num_speculative_tokens: int = 0) -> tuple[int, ...]:
    """The sizes decode batches are padded to, on any device: none under --enforce-eager."""
    if config.enforce_eager:
        return ()
    if config.cudagraph_capture_sizes is not None:
        return config.cudagraph_capture_sizes
    return default_capture_sizes(max_num_seqs, num_speculative_tokens)


def capture_sizes(config: CompilationConfig, device: torch.device, max_num_seqs: int,
                  num_speculative_tokens: int = 0) -> tuple[int, ...]:
    """The sizes this engine captures: none off CUDA or under --enforce-eager."""
    if device.type != "cuda":
        return ()
    return decode_sizes(config, max_num_seqs, num_speculative_tokens)


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


def capture(fn: Callable[[], torch.Tensor], pool=None, warmup: int = 2
            ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run fn `warmup` times on a side stream (lazy initialisation, autotuning, host-side plans
    cached on the inputs), then capture one call into a graph that allocates from `pool` (None:
    a new pool) → (graph, its static output). Everything fn reads must stay where it is."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


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
        graph, out = capture(lambda: self.fn(**static), self._pool, self.warmup)
        self._pool = graph.pool()
        self.graphs[size] = (graph, static, out)

    def replay(self, size: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        graph, static, out = self.graphs[size]
        for name, t in inputs.items():
            static[name].copy_(t, non_blocking=True)
        graph.replay()
        return out
