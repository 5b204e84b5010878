"""DP + EP decode steps padded to one size on every replica, so that they can replay CUDA graphs.

Under DP + EP every MoE dispatch is a collective over every replica's ranks (parallel/ep.py). A
captured dispatch cannot exchange row counts and read their maximum on the host, so every rank
must dispatch the same, known number of rows: when every replica's step is decode-only (or
empty), each pads to one capture size, the smallest ≥ the largest replica's decode rows, and an
idle replica runs an all-padding batch of it (engine/decode_graph.py `run_padding`); a step with
a prompt chunk on any replica runs as it is on every replica. vLLM's DP pads to
`num_tokens_across_dp` the same way.

    replica 0: 3 requests × (1 + k=1) = 6 rows  ┐
    replica 1: 1 request  × 2         = 2 rows  ├─ max 6 → size 8 on every replica
    replica 2: idle                   = 0 rows  ┘   (2 of its 8 rows live on replica 1, 0 on 2)

Where the size is chosen: in the DP front (engine/dp.py), which holds every replica's
scheduler output before any is sent, so that it costs nothing per step; an exchange on a CPU
group before the forward (vLLM's) would hold every rank's host at one more rendezvous per step.
The runner checks that its step is one it can pad (a mismatch is a bug and fails the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

from dsaserve.config import EngineConfig
from dsaserve.engine import cudagraph
from dsaserve.kernels.metadata import dense_allowed


def padded_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The sizes a decode step may be padded to: the runner's (runner.py `_decode_graphs`;
    engine/decode_graph.py keeps the multiples of 1 + k); none where its padded path is off
    (--enforce-eager, PCP, DCP)."""
    p = config.parallel
    if p.prefill_context_parallel_size > 1 or p.decode_context_parallel_size > 1:
        return ()
    k = config.num_speculative_tokens
    sizes = cudagraph.decode_sizes(config.compilation, config.scheduler.max_num_seqs, k)
    return tuple(n for n in sizes if n % (1 + k) == 0)


def common_size(config: EngineConfig, steps: Sequence[list[int] | None]) -> int | None:
    """One step of every replica, each given by the context lengths of its decode requests
    (Scheduler.decode_context_lens: [] for no rows, None for a step with other rows) → the size
    every replica pads it to; None: every replica runs it as it is (a prompt chunk somewhere,
    a dense step, no rows anywhere, or more rows than the largest size)."""
    if any(lens is None for lens in steps):
        return None
    m = config.model
    if any(lens and dense_allowed(max(lens), m.index_topk, 1,
                                  config.attention.sparse_mla_force_mqa) for lens in steps):
        return None
    most = max(len(lens) for lens in steps)
    if most == 0:
        return None
    return cudagraph.padded_size(most * (1 + config.num_speculative_tokens),
                                 padded_sizes(config))
