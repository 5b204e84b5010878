"""One rank's host memory for the KV tier: a single pinned, page-aligned allocation carved into
one region per GPU cache tensor, so that a host block holds this rank's whole per-token record
of one scheduler block (MLA rows, indexer keys, the MTP layer's rows).

    GPU caches (per layer)          host regions (one allocation, layer-major)
    kv[l]    [G, page_kv]   ◄──►    |kv 0  [H, page_kv]|idx 0 [H, page_idx]|kv 1 ...|pad|
    index[l] [G, page_idx]          a host block h = row h of every region

Layer-major regions make a job of n consecutive host blocks one contiguous copy per region
(~100 copies for GLM-5.3 however long the prefix), not one per block and layer. Which host block
holds which key is the scheduler's business (`kv/offload.py`): every rank uses the same host
block ids, and under DCP each rank keeps only its own B tokens of each B·N-token block, so one
logical host block is N pieces found by one key.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsaserve.config import ConfigError

if TYPE_CHECKING:
    from dsaserve.model.dsa import LayerCache

PAGE_BYTES = 4096  # the allocation starts on a page and every region on a 256-byte line


def cache_regions(caches: list[LayerCache]) -> list[torch.Tensor]:
    """Every cache tensor of this rank as a byte view [num_gpu_blocks, page_bytes] (a block's
    bytes are contiguous in each: the cache tensors are block-major)."""
    views = []
    for cache in caches:
        for t in (cache.kv, cache.index):
            if t is not None:
                views.append(t.view(torch.uint8).reshape(t.shape[0], -1))
    return views


def bytes_per_host_block(caches: list[LayerCache]) -> int:
    """This rank's bytes of one scheduler block over every cache layer."""
    return sum(v.shape[1] for v in cache_regions(caches))


def num_host_blocks(cpu_bytes_to_use: int, world_size: int, block_bytes: int,
                    blocks_per_request: int, flag: str) -> int:
    """Host blocks per rank: the engine's bytes split evenly over its ranks. Fewer than one
    request's blocks would make the tier useless (it could never hold a whole prefix)."""
    per_rank = cpu_bytes_to_use // world_size
    num = per_rank // block_bytes
    if num < blocks_per_request:
        raise ConfigError(
            f"{flag}: {cpu_bytes_to_use / 2**30:.3f} GiB over {world_size} rank(s) holds {num} "
            f"host blocks of {block_bytes} B per rank, less than one request of "
            f"--max-model-len needs ({blocks_per_request} blocks, "
            f"{blocks_per_request * block_bytes * world_size / 2**30:.3f} GiB)"
        )
    return num


def pin_host_memory(owner: object, raw: torch.Tensor, flag: str) -> None:
    """Page-lock `raw` in place (cudaHostRegister) while `owner` lives. Not `pin_memory=True`:
    PyTorch's pinned allocator rounds every allocation up to a power of two, which would turn a
    40 GiB tier into 64 GiB of locked memory. Mapped too, so kernels can read it in place
    (HiSparse's zero-copy fetch)."""
    cudart = torch.cuda.cudart()
    nbytes = raw.numel()
    err = cudart.cudaHostRegister(raw.data_ptr(), nbytes, 3)  # Portable | Mapped
    if int(err) != 0:
        raise ConfigError(
            f"{flag}: could not pin {nbytes / 2**30:.2f} GiB of host memory on this rank "
            f"(cudaHostRegister error {int(err)}); lower it or raise the locked-memory limit")
    # Unregistered when the owner dies, before its last reference to `raw` is dropped.
    weakref.finalize(owner, cudart.cudaHostUnregister, raw.data_ptr())


@dataclass
class HostRegionPair:
    gpu: torch.Tensor  # [num_gpu_blocks, page_bytes] uint8 view of one GPU cache tensor
    host: torch.Tensor  # [num_host_blocks, page_bytes] uint8 view into the host allocation


class HostKVPool:
    """The host memory of one rank and its pairing with the GPU caches. Pinned on CUDA (so
    copies are asynchronous DMA); ordinary memory on CPU, where the same code runs in CI."""

    def __init__(self, caches: list[LayerCache], num_blocks: int, *, pin: bool, flag: str) -> None:
        gpu_views = cache_regions(caches)
        offsets, total = [], 0
        for v in gpu_views:
            offsets.append(total)
            total += -(-num_blocks * v.shape[1] // 256) * 256
        self.num_blocks = num_blocks
        self.block_bytes = sum(v.shape[1] for v in gpu_views)
        self.nbytes = total
        try:
            raw = torch.empty(total + PAGE_BYTES, dtype=torch.uint8)
        except RuntimeError as e:
            raise ConfigError(
                f"{flag}: could not allocate {total / 2**30:.2f} GiB of host memory on this "
                f"rank ({e})") from None
        if pin:
            pin_host_memory(self, raw, flag)
        skip = -raw.data_ptr() % PAGE_BYTES
        self._raw = raw  # keeps the allocation alive; regions are views
        self.buffer = raw[skip : skip + total]  # [total] uint8, page-aligned
        self.regions = [
            HostRegionPair(gpu=v, host=self.buffer[o : o + num_blocks * v.shape[1]]
                           .view(num_blocks, v.shape[1]))
            for v, o in zip(gpu_views, offsets, strict=True)
        ]

    @property
    def pinned(self) -> bool:
        return self._raw.is_pinned()
