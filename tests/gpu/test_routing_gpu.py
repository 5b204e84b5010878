"""The routing kernel (kernels/triton/routing.py) compiled on the GPU against the model's PyTorch
routing (model/dsa.py `route_reference`) on the same CUDA logits, at GLM-5.3's 256 experts / 8
per token and DeepSeek-V3.2's 8 groups of which 4 kept, decode and prefill batch sizes: the same
ids, best first, and the weights within the fp32 sum's order; captured in a CUDA graph and
replayed with other logits.

Run on the device machine: `pytest -m gpu tests/gpu/test_routing_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.config import ModelConfig
from dsaserve.model.dsa import route_reference
from dsaserve.model.presets import preset_config

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine the interpreter tests need to be the
    # first to import it.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from dsaserve.kernels.triton import routing  # noqa: E402


def _route(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig):
    return routing.route(logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                         cfg.norm_topk_prob, cfg.routed_scaling_factor)


@pytest.mark.parametrize("preset", ["glm-5.3", "deepseek-v3.2"])
@pytest.mark.parametrize("n", [1, 64, 4096])
def test_kernel_routes_as_the_model(preset, n):
    cfg = ModelConfig.from_hf(preset_config(preset))
    g = torch.Generator(device="cuda").manual_seed(n)
    logits = torch.randn(n, cfg.n_routed_experts, generator=g, device="cuda") * 3
    bias = torch.randn(cfg.n_routed_experts, generator=g, device="cuda") * 0.1
    ids, weights = _route(logits, bias, cfg)
    want_ids, want_w = route_reference(logits, bias, cfg)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_replays_in_a_cuda_graph():
    cfg = ModelConfig.from_hf(preset_config("deepseek-v3.2"))
    logits = torch.randn(64, cfg.n_routed_experts, device="cuda")
    bias = torch.randn(cfg.n_routed_experts, device="cuda") * 0.1
    _route(logits, bias, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = _route(logits, bias, cfg)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want_ids, want_w = _route(logits, bias, cfg)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
