"""RoPE tables against HF's implementation; pairing conventions against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from dsaserve.config import ModelConfig
from dsaserve.model.presets import preset_config
from dsaserve.model.rope import apply_rope, rope_inv_freq


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5.3", "tiny-dsv32"])
def test_inv_freq_matches_hf(preset):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = preset_config(preset)
    cfg = ModelConfig.from_hf(raw)
    hf_cls = DeepseekV32Config if raw["model_type"] == "deepseek_v32" else GlmMoeDsaConfig
    hf = hf_cls(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    ours, factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    if cfg.rope.rope_type == "yarn":
        ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    else:
        theta = hf.rope_parameters["rope_theta"]
        ref = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
        ref_factor = 1.0
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_deepseek_yarn_ramp_bounds():
    """MODEL_SPEC §2.2: d=64, θ=1e4, orig=4096 → low=10, high=23 (dims below low keep θ's freq)."""
    cfg = ModelConfig.from_hf(preset_config("deepseek-v3.2"))
    inv, _ = rope_inv_freq(cfg.rope, 64)
    plain = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(inv[:10].double(), plain[:10], rtol=1e-6, atol=0)
    torch.testing.assert_close(inv[23:].double(), plain[23:] / 40, rtol=1e-6, atol=0)


@pytest.mark.parametrize("interleaved", [True, False])
def test_pairing_conventions(interleaved):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8)
    pos = torch.arange(5)
    inv = torch.tensor([1.0, 0.1, 0.01, 0.001])
    ang = pos[:, None].float() * inv
    out = apply_rope(x, ang.cos(), ang.sin(), interleaved)
    for t in range(5):
        for i in range(4):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + 4)
            c, s = math.cos(ang[t, i]), math.sin(ang[t, i])
            torch.testing.assert_close(out[t, :, a], x[t, :, a] * c - x[t, :, b] * s)
            torch.testing.assert_close(out[t, :, b], x[t, :, b] * c + x[t, :, a] * s)
    # Rotations preserve relative-position dot products: q(p)·k(p) is position-independent.
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
