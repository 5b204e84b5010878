"""DP + EP decode steps padded to one size on every replica (engine/dp_padding.py): the size
chosen from every replica's step; the scheduler's view of a decode-only step (the runner's);
the EP dispatch given every rank's row count exchanges none, and padding rows change no real
row's output. Multi-process runs: tests/parallel/test_dp_ep.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import ModelRunnerOutput, Request, SamplingParams, SchedulerOutput
from dsaserve.engine import dp_padding
from dsaserve.engine.scheduler import Scheduler
from dsaserve.model.dsa import MoE
from dsaserve.model.presets import preset_config
from dsaserve.parallel import ep


def _config(*, force_mqa: bool = True, k: int = 0, **parallel) -> EngineConfig:
    """DP2 + EP of the tiny model (index_topk 16), 16 sequences: sizes 1 2 4 8 16."""
    model = ModelConfig.from_hf(preset_config("tiny-glm5"))
    return EngineConfig(
        model_path="unused", model=model,
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=256),
        attention=AttentionConfig(sparse_mla_force_mqa=force_mqa),
        parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, **parallel),
        speculative=SpecConfig(num_speculative_tokens=k) if k else None)


def test_common_size_from_every_replica() -> None:
    config = _config()
    assert config.model.index_topk == 16
    size = lambda *steps: dp_padding.common_size(config, steps)  # noqa: E731
    assert size([20, 30, 40], [25, 50]) == 4  # the larger replica's 3 rows
    assert size([20], []) == 1  # an idle replica pads too
    assert size([20] * 9, [40]) == 16
    assert size([], []) is None  # no rows anywhere: nothing to pad
    assert size(None, [20]) is None  # a prompt chunk on one replica: all run as they are
    # beyond the largest size (more than max_num_seqs never comes; a config's sizes may stop)
    small = dataclasses.replace(config, compilation=CompilationConfig(
        cudagraph_capture_sizes=(1, 2, 4)))
    assert dp_padding.common_size(small, ([20] * 5, [])) is None
    # a dense step (every context ≤ index_topk, MQA not forced) runs as it is, everywhere
    dense = _config(force_mqa=False)
    assert dp_padding.common_size(dense, ([10], [40])) is None
    assert dp_padding.common_size(dense, ([17], [40])) == 1
    # MTP3: 4 rows a request, sizes the multiples of 4
    mtp = _config(k=3)
    assert dp_padding.common_size(mtp, ([20, 30], [25])) == 8
    assert dp_padding.common_size(mtp, ([20, 30, 40], [])) == 16
    # no padded path: --enforce-eager, DCP
    eager = dataclasses.replace(config, compilation=CompilationConfig(enforce_eager=True))
    assert dp_padding.common_size(eager, ([20], [20])) is None
    assert dp_padding.padded_sizes(_config(tensor_parallel_size=2,
                                           decode_context_parallel_size=2)) == ()


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(4, 4 + prompt_len)),
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def test_scheduler_decode_context_lens() -> None:
    """A step whose every request computes its last known token: the contexts after it; a
    prompt chunk, even of one row that samples nothing, is not decode-only."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=128), CacheConfig(block_size=4), 64)
    sched.add_request(_request("a", 5))
    sched.add_request(_request("b", 9))
    so = sched.schedule()
    assert sched.decode_context_lens(so) is None  # prefills
    sched.update_from_output(so, ModelRunnerOutput({"a": [1], "b": [2]}))
    so = sched.schedule()
    assert sched.decode_context_lens(so) == [6, 10]
    # a 1-token prompt samples at its first step; a 1-row chunk of a longer prompt does not
    tight = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2,
                                      max_model_len=128), CacheConfig(block_size=4), 64)
    tight.add_request(_request("c", 1))
    so = tight.schedule()
    assert tight.decode_context_lens(so) == [1]
    tight.add_request(_request("d", 9))
    tight.update_from_output(so, ModelRunnerOutput({"c": [1]}))
    so = tight.schedule()
    assert so.num_scheduled_tokens == {"c": 1, "d": 1}
    assert tight.decode_context_lens(so) is None
    assert sched.decode_context_lens(SchedulerOutput((), (), {}, ())) == []  # no rows


class _TwoRanks:
    """An EP group of two ranks seen from rank 0, the other's rows given; records what it
    gathers. Its experts hold every expert, so rank 0's slice of the sum is its own output."""

    size, rank_in_group = 2, 0

    def __init__(self, peer: torch.Tensor) -> None:
        self.peer = peer  # [m, hidden] rank 1's rows
        self.gathered: list[tuple[int, ...]] = []

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.gathered.append(tuple(x.shape))
        if x.dtype == torch.int64:  # the row counts
            return torch.stack((x, torch.tensor([self.peer.shape[0]])))
        peer = x.new_zeros(x.shape)
        peer[: self.peer.shape[0]] = self.peer
        return torch.stack((x, peer))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x[: x.shape[0] // 2]


@pytest.fixture(scope="module")
def moe() -> MoE:
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(preset_config("tiny-glm5"))
    layer = MoE(cfg)
    for p in layer.parameters():
        p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.1)
    return layer


@torch.inference_mode()
def test_dispatch_with_rows_known_exchanges_no_counts(moe: MoE) -> None:
    """Rows per rank given: one all-gather (the rows), none of counts; the output of each real
    row is the experts' on that row alone, whatever rows (padding, zeros, the peer's) share
    the dispatch."""
    hidden = moe.gate.weight.shape[1]
    x = torch.randn(3, hidden)
    alone = moe.experts(x, *moe.gate(x))  # [3, hidden] fp32
    padding = x[-1:].expand(5, hidden)  # a padded step's rows: copies of a live row
    padded = torch.cat((x, padding))  # [8, hidden]
    group = _TwoRanks(torch.randn(8, hidden))
    out = ep.dispatch_combine(padded, moe.gate, moe.experts, group, rows_per_rank=8)
    assert group.gathered == [(8, hidden)]
    torch.testing.assert_close(out[:3], alone, rtol=1e-5, atol=1e-5)
    # fewer rows than the count: zeros pad the dispatch, dropped
    group = _TwoRanks(torch.randn(8, hidden))
    out = ep.dispatch_combine(x, moe.gate, moe.experts, group, rows_per_rank=8)
    assert group.gathered == [(8, hidden)] and out.shape == (3, hidden)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    # not given: the counts are exchanged first (and read on the host)
    group = _TwoRanks(torch.randn(6, hidden))
    out = ep.dispatch_combine(x, moe.gate, moe.experts, group)
    assert group.gathered == [(1,), (6, hidden)]
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
