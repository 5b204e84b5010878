"""Host operations per decoder layer: the counter (engine/host_ops.py) sees ops, layers and
Triton launches, and one prefill step and one eager decode step of the triton backend's GPU
path (its host code on the CPU, launches counted, not run) stay within a budget of torch ops
and launches per layer: each is a few µs of an eager step's host time, times 78 layers.

A budget that fails names the sites that grew. Cutting ops: lower the budget with it."""

from __future__ import annotations

import pytest
import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.engine.host_ops import OUTSIDE, OpCounter, gpu_branches

# Per layer, tiny-glm5 (layers 2 and 3 of 4: one full-indexer and one shared MoE layer), fp8_ds_mla,
# the triton backend. Before the cuts (docs/long_prefill.md, "Host time of a step"): prefill
# 132 ops and 13.5 launches, decode 123 and 12.5; after them 90 and 88. The top-k's sort into
# key order (kernels/triton/indexer.py `_in_key_order`: a step that rounds the same from run to
# run) adds five per full-indexer layer, none in the shared one (torch.topk's order, by score,
# had added twelve). The grouped MoE's combine in one kernel (kernels/triton/moe_combine.py:
# no fp32 copies, no atomics) turned 2 ops per layer into one launch, the router's routing
# in one kernel (kernels/triton/routing.py) 6 more, the pairs' layout by expert
# (kernels/triton/moe_pairs.py) 8 more, the shared experts' output added in the combine 3 more,
# and the top-k's key order in one kernel (row_topk.in_key_order) 1.5 more: prefill 92.5 → 72
# ops and 13 → 16.5 launches, decode 90.5 → 70 and 12 → 15.5.
BUDGET = {"prefill": (72, 16.5), "decode": (70, 15.5)}


def test_counter_sees_ops_layers_and_sites():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    with OpCounter(layers) as ops:
        y = x * 2  # outside: one op
        for layer in layers:
            y = layer(y)
    per_layer = ops.per_layer()
    assert per_layer[OUTSIDE] == (1, 0)
    assert per_layer[0] == per_layer[1] and per_layer[0][0] >= 1
    assert ops.total() == (sum(n for n, _ in per_layer.values()), 0)
    # sites are the innermost dsaserve frame; this test file is outside the package
    assert set(ops.sites()) == {"(outside dsaserve)"}
    assert "mul.Tensor" in ops.report(names=True)


def test_stubbed_launches_are_counted_not_run(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dsaserve.kernels.triton import norm

    x, w = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), torch.ones(8)
    with gpu_branches(), OpCounter(stub_launches=True) as ops:
        out = norm.rms_norm(x, w, 1e-5)  # torch.empty, then the (stubbed) launch
    assert ops.total()[1] == 1
    assert any("_rms_norm_kernel" in site for site in ops.sites(names=True))
    assert out.shape == x.shape


@pytest.fixture(scope="module")
def step_ops(tmp_path_factory):
    pytest.importorskip("triton")
    from dsaserve.bench.step_ops import count_steps
    from dsaserve.engine.runner import ModelRunner
    from dsaserve.model.make_model import make_model

    root = tmp_path_factory.mktemp("host_ops")

    def runner(num_layers: int) -> ModelRunner:
        path = make_model("tiny-glm5", root / f"l{num_layers}", with_mtp=False,
                          overrides={"num_hidden_layers": num_layers})
        return ModelRunner(EngineConfig(
            model_path=str(path), model=ModelConfig.from_file(path),
            cache=CacheConfig(block_size=64, kv_cache_dtype="fp8_ds_mla", num_gpu_blocks=16,
                              enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256,
                                      max_model_len=512),
            attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
            dtype="float32", device="cpu", compilation=CompilationConfig(enforce_eager=True)))

    prefill, decode = count_steps(runner, (2, 4), prompt_len=256, context=300, batch=2,
                                  stub=True)
    return {"prefill": prefill, "decode": decode}


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_ops_per_layer_within_budget(step_ops, kind):
    counted = step_ops[kind]
    ops, launches = BUDGET[kind]
    message = (f"{kind}: {counted.ops_per_layer:g} torch ops and {counted.launches_per_layer:g} "
               f"Triton launches per layer, budget {ops} and {launches:g}; per layer by "
               f"site:\n{counted.report()}")
    assert counted.ops_per_layer <= ops and counted.launches_per_layer <= launches, message
    # the counts are real: every layer dispatches its projections and launches its kernels
    assert counted.ops_per_layer > 40 and counted.launches_per_layer >= 8, message
