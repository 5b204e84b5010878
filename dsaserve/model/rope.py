"""Rotary position embeddings: the default table, DeepSeek's YaRN, and both pairing conventions.

MODEL_SPEC.md §2.2. The same table serves MLA and the indexer; only the pairing differs:

    interleaved (GPT-J):  pairs (x[2i], x[2i+1]) by angle i: MLA (both families), GLM indexer
    NeoX (half-split):    pairs (x[i], x[i+d/2]) by angle i:  DeepSeek-V3.2 indexer

Interleaved outputs stay interleaved (the layout vLLM / FlashMLA caches store); HF returns them
de-interleaved, a fixed permutation of q and k that leaves every dot product unchanged.
"""

from __future__ import annotations

import math

import torch

from dsaserve.config import RopeConfig
from dsaserve.kernels.registry import use_kernels


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin multiplier (1.0 unless YaRN sets it)."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = 1.0 / base  # [dim/2]
    if rope.rope_type != "yarn":
        return inv_freq.float(), 1.0

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation
    if rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
            rope.factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(rope.factor)
    return inv_freq.float(), float(attention_factor)


class RotaryTable:
    """cos/sin for arbitrary positions, computed on demand in fp32 (no length cap)."""

    def __init__(self, rope: RopeConfig, dim: int, device: torch.device | str = "cpu") -> None:
        inv_freq, self.attention_factor = rope_inv_freq(rope, dim)
        self.inv_freq = inv_freq.to(device)  # [dim/2]
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] → cos, sin [N, dim/2] fp32."""
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        if self.attention_factor == 1.0:  # (default RoPE: two launches fewer per step)
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first R = 2·cos.shape[-1] columns of x [N, ..., dim] by cos/sin [N, R/2] in
    fp32 and copy the rest (R < dim: the indexer, whose RoPE part comes first); keeps x's
    dtype and layout. With `out` (x's shape and dtype, e.g. a view into a wider tensor) the
    result is written there and returned."""
    if use_kernels(x):  # the same arithmetic in one pass (kernels/triton/rotary.py)
        from dsaserve.kernels.triton import rotary

        return rotary.rotate(x, cos, sin, interleaved, out)
    if out is not None:
        return out.copy_(apply_rope(x, cos, sin, interleaved))
    rope = 2 * cos.shape[-1]
    if rope < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rope], cos, sin, interleaved), x[..., rope:]), dim=-1)
    shape = x.shape
    xf = x.float()
    extra = (1,) * (x.dim() - 2)
    c = cos.view(cos.shape[0], *extra, cos.shape[1])
    s = sin.view(sin.shape[0], *extra, sin.shape[1])
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
