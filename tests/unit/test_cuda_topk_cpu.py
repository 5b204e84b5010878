"""The CUDA top-k's entry point on a machine without CUDA: a clear error, never a crash, and
callers (the indexer) keep the Triton kernel. Its GPU tests: tests/gpu/test_topk_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels.cuda import build as cuda_build
from dsaserve.kernels.cuda import topk as cuda_topk


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_unavailable_without_cuda() -> None:
    assert not cuda_topk.available()
    assert cuda_topk.unavailable_reason() == "no CUDA device"
    logits = torch.zeros(2, 100)
    with pytest.raises(RuntimeError, match="unavailable: no CUDA device"):
        cuda_topk.topk_rows(logits, None, torch.tensor([100, 50]), 10)


def test_sources_exist() -> None:
    """The sources the build compiles sit beside build.py (pyproject.toml ships them as package
    data, so they are compiled where the package is installed): the top-k and the logits."""
    assert {p.name for p in cuda_build.SOURCES} == {"topk_rows.cu", "indexer_logits.cu"}


def test_arch_flag() -> None:
    """Hopper builds for sm_90a (wgmma); other parts for their plain target."""
    assert cuda_build.arch_flag(9, 0) == "-gencode=arch=compute_90a,code=sm_90a"
    assert cuda_build.arch_flag(8, 0) == "-gencode=arch=compute_80,code=sm_80"


def test_blocks_per_row() -> None:
    """Clusters only where one block per row would leave multiprocessors idle: 64 decode rows
    on 132 take 2 blocks each, 16 rows 8; never for 512-thread blocks or before Hopper."""
    assert cuda_topk.blocks_per_row(64, 132, 1024, 9) == 2
    assert cuda_topk.blocks_per_row(33, 132, 1024, 9) == 4
    assert cuda_topk.blocks_per_row(16, 132, 1024, 9) == 8
    assert cuda_topk.blocks_per_row(1, 132, 1024, 9) == 8
    assert cuda_topk.blocks_per_row(67, 132, 1024, 9) == 1
    assert cuda_topk.blocks_per_row(200, 132, 1024, 9) == 1
    assert cuda_topk.blocks_per_row(16, 132, 512, 9) == 1
    assert cuda_topk.blocks_per_row(16, 108, 1024, 8) == 1
