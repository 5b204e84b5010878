"""HiSparse's zero-copy fetch and mirror on the GPU: rows read in place from the mapped pinned
host pool equal the reference fetch's, and rows written in place into it equal index_copy_'s,
for fp8_ds_mla and bf16 rows; neither synchronises."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kv.hisparse.fetch import fetch_rows, fetch_rows_reference, mirror_rows
from dsaserve.kv.host_pool import pin_host_memory

pytestmark = pytest.mark.gpu


class _Owner:
    pass


@pytest.mark.parametrize("row_shape,dtype", [((656,), torch.uint8), ((576,), torch.bfloat16)])
def test_zero_copy_fetch_matches_the_reference(g, row_shape, dtype) -> None:
    owner = _Owner()
    cpu = torch.Generator().manual_seed(0)  # the host rows' (g draws on the GPU)
    if dtype == torch.uint8:
        host = torch.randint(0, 256, (4096, *row_shape), dtype=dtype, generator=cpu)
        gpu = torch.randint(0, 256, (2048, *row_shape), dtype=dtype, device="cuda", generator=g)
    else:
        host = torch.randn(4096, *row_shape, generator=cpu).to(dtype)
        gpu = torch.randn(2048, *row_shape, device="cuda", generator=g).to(dtype)
    pin_host_memory(owner, host.view(torch.uint8).view(-1), "--test")
    n = 20000
    dst_idx = torch.randperm(8192, device="cuda", generator=g)[: n // 4].repeat(4)
    dst_idx[n // 4:] = -1  # three quarters masked, as in the residency step's output
    host_idx = torch.randint(0, 4096, (n,), device="cuda", generator=g)
    gpu_idx = torch.randint(0, 2048, (n,), device="cuda", generator=g)
    from_host = torch.rand(n, device="cuda", generator=g) < 0.7
    want = torch.zeros(8192, *row_shape, dtype=dtype, device="cuda")
    got = want.clone()
    fetch_rows_reference(want, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fetch_rows(got, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    del owner


@pytest.mark.parametrize("row_shape,dtype", [((656,), torch.uint8), ((576,), torch.bfloat16)])
def test_zero_copy_mirror_matches_index_copy(g, row_shape, dtype) -> None:
    owner = _Owner()
    pools = [torch.zeros(4096, *row_shape, dtype=dtype) for _ in range(2)]
    for pool in pools:
        pin_host_memory(owner, pool.view(torch.uint8).view(-1), "--test")
    row_bytes = row_shape[-1] * dtype.itemsize  # random bytes, viewed as the rows' dtype
    gpus = [torch.randint(0, 256, (2048, *row_shape[:-1], row_bytes), dtype=torch.uint8,
                          device="cuda", generator=g).view(dtype) for _ in range(2)]
    n = 3000
    host_idx = torch.randperm(4096, device="cuda", generator=g)[:n]  # distinct destinations
    gpu_idx = torch.randint(0, 2048, (n,), device="cuda", generator=g)
    want = [p.clone() for p in pools]
    for w, gpu in zip(want, gpus, strict=True):
        w.index_copy_(0, host_idx.cpu(), gpu.index_select(0, gpu_idx).cpu())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mirror_rows(list(zip(pools, gpus, strict=True)), host_idx, gpu_idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for got, w in zip(pools, want, strict=True):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
    del owner
