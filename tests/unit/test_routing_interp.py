"""The routing kernel (kernels/triton/routing.py) run by Triton's CPU interpreter against the
model's PyTorch routing (model/dsa.py `Router` with the kernels off): GLM-5.3's 256 experts and
8 per token without groups, DeepSeek-V3.2's 8 groups of which 4 kept, the tiny presets' shapes,
an expert count that is not a power of two, norm_topk_prob off; the same ids in the same order
(best first) and weights equal up to the fp32 sum's order. tests/gpu covers the compiled kernel
through the engines.

Like tests/unit/test_fp8_linear_interp.py, triton is imported in a fixture with
TRITON_INTERPRET=1, never at collection.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from triton_interp import interpreted

from dsaserve.config import ModelConfig
from dsaserve.model.dsa import Router
from dsaserve.model.presets import preset_config


@pytest.fixture(scope="module")
def rt():
    yield from interpreted("dsaserve.kernels.triton.routing")


def _router(preset: str, **changes) -> Router:
    cfg = dataclasses.replace(ModelConfig.from_hf(preset_config(preset)), hidden_size=64,
                              **changes)
    router = Router(cfg)
    g = torch.Generator().manual_seed(7)
    router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    router.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    return router


@pytest.mark.parametrize("preset,changes", [
    ("glm-5.3", {}),  # 256 experts, 8 per token, no groups
    ("deepseek-v3.2", {}),  # 8 groups, 4 kept
    ("tiny-glm5", {}), ("tiny-dsv32", {}),
    ("deepseek-v3.2", {"n_routed_experts": 96, "n_group": 4, "topk_group": 2}),  # not 2^n
    ("glm-5.3", {"norm_topk_prob": False, "num_experts_per_tok": 3}),
])
def test_kernel_routes_as_the_model(rt, preset, changes):
    router = _router(preset, **changes)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    got_ids, got_w = router(x)  # TRITON_INTERPRET=1: the kernel
    os.environ["TRITON_INTERPRET"] = "0"  # the PyTorch routing
    try:
        want_ids, want_w = router(x)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def test_bad_shapes_are_refused(rt):
    logits, bias = torch.zeros(2, 10), torch.zeros(10)
    with pytest.raises(ValueError, match="groups"):
        rt.route(logits, bias, 2, 3, 1, True, 1.0)  # 10 experts in 3 groups
    with pytest.raises(ValueError, match="k = 11"):
        rt.route(logits, bias, 11, 1, 1, True, 1.0)
    ids, w = rt.route(logits[:0], bias, 2, 1, 1, True, 1.0)
    assert ids.shape == (0, 2) and w.shape == (0, 2)
