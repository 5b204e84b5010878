"""The SM count the kernels size their grids by: read from the CUDA device once (a device
property query is a host call of every launch otherwise)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, elsewhere: int) -> int:
    """The SMs of a CUDA device (cached), else `elsewhere` (what a caller's interpreter runs
    size their grids by)."""
    if device.type != "cuda":
        return elsewhere
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
