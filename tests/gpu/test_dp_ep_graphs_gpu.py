"""On a machine with two CUDA devices: DP2 + EP decode steps padded to one size on both
replicas replay CUDA graphs (engine/dp_padding.py, engine/decode_graph.py), NCCL dispatches
captured inside them. Run on the device machine with
`pytest -m gpu tests/gpu/test_dp_ep_graphs_gpu.py` (skipped with fewer than two devices).

* the greedy tokens of --enforce-eager DP2 + EP, with graphs on, without and with MTP3, sync
  and async; the trained tiny model of tests/gpu/test_cudagraph_gpu.py, its five requests
  joining at three steps: padded steps with both replicas busy at different batch sizes and
  with one idle (an all-padding batch replayed);
* every padded step replayed on both replicas, the same number on each, and none of their
  dispatches exchanging row counts (the steps run as they are exchange them)."""

from __future__ import annotations

import pytest
import torch
from staggered import run_staggered, trained_config

from dsaserve.config import (
    CompilationConfig,
    ParallelConfig,
)
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine
from dsaserve.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _generate(compilation: CompilationConfig, k: int, async_scheduling: bool
              ) -> tuple[dict[str, list[int]], list[tuple[int, ...]]]:
    """DP2 + EP of the trained tiny model (triton backend, fp8_ds_mla KV) → (greedy tokens per
    request, each replica's `dp_ep_counts` at the end)."""
    cfg = trained_config(compilation, k, async_scheduling, parallel=ParallelConfig(
        data_parallel_size=2, enable_expert_parallel=True))
    engine = LLMEngine.from_config(cfg)
    assert isinstance(engine, DataParallelEngine)
    try:
        outputs = run_staggered(engine, Tokenizer.from_pretrained(cfg.model_path))
        counts = [r.executor.call("dp_ep_counts")[0] for r in engine.replicas]
    finally:
        engine.shutdown()
    return outputs, counts


@pytest.mark.parametrize(("k", "async_scheduling"), [(0, False), (3, False), (3, True)],
                         ids=["plain", "mtp3", "mtp3-async"])
def test_dp_ep_graphs_give_eager_tokens(k, async_scheduling):
    eager_out, eager = _generate(CompilationConfig(enforce_eager=True), k, async_scheduling)
    assert all(c[0] == 0 for c in eager)  # --enforce-eager: nothing padded
    graph_out, counts = _generate(CompilationConfig(), k, async_scheduling)
    print(f"k={k} async={async_scheduling}: (padded, all-padding, count exchanges, replays) "
          f"per replica {counts}")
    (steps0, padding0, _, replays0), (steps1, padding1, _, replays1) = counts
    assert steps0 == steps1 > 0  # lock-step: every padded step on both replicas
    assert replays0 == steps0 and replays1 == steps1  # every one replayed
    assert padding0 + padding1 > 0  # an idle replica's all-padding batch replayed too
    assert graph_out == eager_out
