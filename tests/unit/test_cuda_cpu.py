"""The CUDA kernels' Python side on a machine without CUDA: the top-k's entry point gives a clear
error, never a crash, and callers (the indexer) keep the Triton kernels; the launch-shape maths
of the top-k and of the indexer logits. GPU tests: tests/gpu/test_topk_cuda.py and
tests/gpu/test_indexer_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import formats
from dsaserve.kernels.cuda import build as cuda_build
from dsaserve.kernels.cuda import indexer_logits as cuda_logits
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


def test_threads_per_row() -> None:
    """1024 threads while rows fit one per multiprocessor, else two 512-thread blocks per SM."""
    assert cuda_topk.threads_per_row(64, 132) == 1024
    assert cuda_topk.threads_per_row(132, 132) == 1024
    assert cuda_topk.threads_per_row(133, 132) == 512
    assert cuda_topk.threads_per_row(4096, 132) == 512


def test_pages_per_block() -> None:
    """The most pages per block that still gives eight blocks per multiprocessor: a long prefill
    takes 256, a batch of few MTP rows fewer, never under 16."""
    assert cuda_logits.pages_per_block(342, 2048, 132) == 256  # T = 4096 × 128K keys
    assert cuda_logits.pages_per_block(64, 1024, 132) == 32  # 64 requests × 4 tokens, 64K keys
    assert cuda_logits.pages_per_block(132, 8 * 128, 132) == 128
    assert cuda_logits.pages_per_block(25, 63, 132) == 16
    assert cuda_logits.pages_per_block(1, 1, 132) == 16


def test_block_shapes() -> None:
    """Every preferred shape is built, and a block's rows are its consumers' rows."""
    for shapes in cuda_logits.PREFERRED.values():
        assert set(shapes) <= set(cuda_logits.SHAPES)
    assert [cuda_logits.block_rows(s) for s in cuda_logits.SHAPES] == [256] * 4 + [384] * 2 + [512]
    assert cuda_logits.Shape(3, 1, 128) == (3, 1, 128, False)  # a 3-tuple config's shape


def test_abs_inputs() -> None:
    """The linear shapes' tolerance inputs: |q|, |w|, and each page's e4m3 key bytes with the
    sign bit cleared, its fp32 scales (positive) and the caller's cache untouched."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 32, 128, generator=g).bfloat16()
    w = torch.randn(3, 32, generator=g)
    keys = torch.randn(2 * 64, 128, generator=g) * 3
    cache = torch.zeros(formats.index_cache_shape(2, 64, True, 128), dtype=torch.uint8)
    formats.write_index_cache(cache, torch.arange(2 * 64), keys.bfloat16())
    q_abs, w_abs, cache_abs = cuda_logits.abs_inputs(q, w, cache)
    assert torch.equal(q_abs, q.abs()) and torch.equal(w_abs, w.abs())
    k8, k_scale = formats.read_index_cache(cache, torch.arange(2 * 64))
    k8_abs, k_scale_abs = formats.read_index_cache(cache_abs, torch.arange(2 * 64))
    assert torch.equal(k8_abs.float(), k8.float().abs()) and torch.equal(k_scale_abs, k_scale)
    assert bool((k8.float() < 0).any())  # the original keeps its signs
