"""A CUDA device's properties, read once per device: the SM count the kernels size their grids
by, the compute capability the CUDA top-k picks its clusters by (a property query is a host
call of every launch otherwise)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_properties(index: int):  # torch.cuda._CudaDeviceProperties
    return torch.cuda.get_device_properties(index)


def properties(device: torch.device):
    """The properties of a CUDA device (cached)."""
    return _cuda_properties(device.index if device.index is not None
                            else torch.cuda.current_device())


def sm_count(device: torch.device, elsewhere: int) -> int:
    """The SMs of a CUDA device (cached), else `elsewhere` (what a caller's interpreter runs
    size their grids by)."""
    return properties(device).multi_processor_count if device.type == "cuda" else elsewhere
