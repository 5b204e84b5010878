"""The CUDA top-k's entry point on a machine without CUDA: a clear error, never a crash, and
callers (the indexer) keep the Triton kernel. Its GPU tests: tests/gpu/test_topk_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels.cuda import topk as cuda_topk


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_unavailable_without_cuda() -> None:
    assert not cuda_topk.available()
    assert cuda_topk.unavailable_reason() == "no CUDA device"
    logits = torch.zeros(2, 100)
    with pytest.raises(RuntimeError, match="unavailable: no CUDA device"):
        cuda_topk.topk_rows(logits, None, torch.tensor([100, 50]), 10)


def test_sources_exist() -> None:
    """The sources the build compiles sit beside topk.py (pyproject.toml ships them as package
    data, so they are compiled where the package is installed)."""
    assert all(p.is_file() for p in cuda_topk._SOURCES)
