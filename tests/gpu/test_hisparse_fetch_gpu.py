"""HiSparse's zero-copy fetch on the GPU: rows read in place from the mapped pinned host pool
equal the reference fetch's, for fp8_ds_mla and bf16 rows; and the fetch does not synchronise."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kv.hisparse.fetch import fetch_rows, fetch_rows_reference
from dsaserve.kv.host_pool import pin_host_memory

pytestmark = pytest.mark.gpu


class _Owner:
    pass


@pytest.mark.parametrize("row_shape,dtype", [((656,), torch.uint8), ((576,), torch.bfloat16)])
def test_zero_copy_fetch_matches_the_reference(g, row_shape, dtype) -> None:
    owner = _Owner()
    if dtype == torch.uint8:
        host = torch.randint(0, 256, (4096, *row_shape), dtype=dtype)
        gpu = torch.randint(0, 256, (2048, *row_shape), dtype=dtype, device="cuda")
    else:
        host = torch.randn(4096, *row_shape).to(dtype)
        gpu = torch.randn(2048, *row_shape, device="cuda").to(dtype)
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
