"""HiSparse's zero-copy fetch and mirror on the GPU: rows read in place from the mapped pinned
host pool equal the reference fetch's, and rows written in place into it equal index_copy_'s,
for fp8_ds_mla and bf16 rows; neither synchronises. The fused fetch (operands derived in the
kernel from the residency step's outputs and the tables, counters in it) equals
`fetch_misses_reference` at serving sizes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kv.hisparse.fetch import (
    fetch_misses,
    fetch_misses_reference,
    fetch_rows_reference,
    mirror_rows,
)
from dsaserve.kv.host_pool import pin_host_memory

pytestmark = pytest.mark.gpu


class _Owner:
    pass


@pytest.mark.parametrize("row_shape,dtype", [((656,), torch.uint8), ((576,), torch.bfloat16)])
def test_zero_copy_fetch_matches_the_reference(g, row_shape, dtype) -> None:
    """The row copy under the fused fetch and the mirror (kernels/triton/row_gather.py)."""
    from dsaserve.kernels.triton.row_gather import row_gather  # triton only where CUDA is
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
        row_gather(got, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
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


def _misses(g: torch.Generator, regions: int, width: int, size: int, context: int,
            rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, W] miss positions (−1: none) and slots (distinct per region; S where none)."""
    miss = torch.rand(regions, width, device="cuda", generator=g) < rate
    pos = torch.randint(0, context, (regions, width), device="cuda", generator=g)
    slots = torch.rand(regions, size, device="cuda", generator=g).argsort(1)[:, :width]
    return torch.where(miss, pos, -1), torch.where(miss, slots, size)


def _fetch_case(g: torch.Generator, owner: object, row_shape: tuple, dtype: torch.dtype):
    """b = 64 regions (4 of them padded slots in the trash region), top-k 2,048, S = 4,096,
    block 64, a context of 8,192 (host pool pinned and mapped), block tables int32 with
    unallocated (−1) entries, mirrored_upto anywhere in the context."""
    b, width, size, blk, context, max_req = 64, 2048, 4096, 64, 8192, 64
    nb = context // blk
    region_rows = -(-(size + 1) // blk) * blk
    cpu = torch.Generator().manual_seed(1)
    num_host = (max_req + 1) * nb
    row_bytes = torch.empty(row_shape, dtype=dtype).view(torch.uint8).numel()
    host = torch.randint(0, 256, (num_host * blk, row_bytes), dtype=torch.uint8,
                         generator=cpu).view(dtype)  # [H·B, *row_shape]
    pin_host_memory(owner, host.view(torch.uint8).view(-1), "--test")
    gpu = torch.randint(0, 256, (2 * b * nb * blk, row_bytes), dtype=torch.uint8, device="cuda",
                        generator=g).view(dtype)
    hot = torch.zeros(max_req * region_rows, *row_shape, dtype=dtype, device="cuda")
    regions = torch.randperm(max_req, device="cuda", generator=g)[:b]
    regions[torch.randperm(b, device="cuda", generator=g)[:4]] = max_req  # the trash region
    host_table = torch.randperm(num_host, device="cuda", generator=g).view(max_req + 1, nb)
    block_table = torch.randint(-1, 2 * b * nb, (b + 3, nb), device="cuda", generator=g,
                                dtype=torch.int32)
    requests = torch.randperm(b + 3, device="cuda", generator=g)[:b]
    upto = torch.randint(0, context, (b,), device="cuda", generator=g)
    layout = dict(block_size=blk, buffer_rows=size, region_rows=region_rows,
                  trash_region=max_req)
    return (hot, host, gpu, regions, requests, upto, host_table, block_table), layout, (
        b, width, size, context)


@pytest.mark.parametrize("row_shape,dtype", [((656,), torch.uint8), ((576,), torch.bfloat16)])
@pytest.mark.parametrize("rate", [0.1, 0.01])  # 90 %, 99 % overlap
def test_fused_fetch_matches_the_reference(g, row_shape, dtype, rate) -> None:
    owner = _Owner()
    (hot, host, gpu, *tables), layout, (b, width, size, context) = _fetch_case(
        g, owner, row_shape, dtype)
    miss_pos, miss_slot = _misses(g, b, width, size, context, rate)
    want, got = hot.clone(), hot.clone()
    counts_want = torch.zeros(2, dtype=torch.int64, device="cuda")
    counts_got = counts_want.clone()
    fetch_misses_reference(want, host, gpu, miss_pos, miss_slot, *tables, counts_want, **layout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fetch_misses(got, host, gpu, miss_pos, miss_slot, *tables, counts_got, **layout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(counts_got, counts_want) and int(counts_want[1]) > 0
    del owner


def test_fused_fetch_replays_from_a_graph(g) -> None:
    owner = _Owner()
    (hot, host, gpu, *tables), layout, (b, width, size, context) = _fetch_case(
        g, owner, (656,), torch.uint8)
    miss_pos, miss_slot = _misses(g, b, width, size, context, 0.1)
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    fetch_misses(hot, host, gpu, miss_pos, miss_slot, *tables, counts, **layout)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fetch_misses(hot, host, gpu, miss_pos, miss_slot, *tables, counts, **layout)
    want, counts_want = hot.clone(), counts.clone()
    for _ in range(3):  # new misses into the same buffers, replayed
        pos, slot = _misses(g, b, width, size, context, 0.1)
        miss_pos.copy_(pos)
        miss_slot.copy_(slot)
        fetch_misses_reference(want, host, gpu, pos, slot, *tables, counts_want, **layout)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(hot, want)
        assert torch.equal(counts, counts_want)
    del owner
