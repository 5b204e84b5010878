"""The module-level skip of the GPU suites whose kernels are built for sm_90 (Gluon, wgmma):
called before triton is imported (see test_kernels_gpu.py), so that a machine without CUDA or
with another GPU skips the suite with its reason instead of failing to collect it."""

from __future__ import annotations

import pytest
import torch


def require_sm90(kernels: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{kernels}: built for sm_90", allow_module_level=True)
