"""Host → device: a step's small host-built tensors go over in one asynchronous copy.

Each `torch.tensor(list, device="cuda")` or `.to("cuda")` of pageable host memory is a blocking
copy: the host waits for the GPU queue to reach it. `upload` packs a step's host tensors into
one pinned int64 buffer, copies it with non_blocking=True (the host does not wait) and hands back
device views in the original shapes and dtypes. The pinned buffer is dropped at once: torch's
pinned-memory allocator keeps it from reuse until the copy that reads it has finished.

    parts   pos [N] int64 | req [N] int64 | table [R, W] int32     (host)
    packed  ─────────────── one int64 vector ──────────────────►   (device) → views, cast back
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors → the same tensors on `device` (as they are on the CPU)."""
    if device.type == "cpu":
        return list(parts)
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    staged = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
    staged.copy_(flat)
    on_device = staged.to(device, non_blocking=True)
    out, at = [], 0
    for p in parts:
        n = p.numel()
        out.append(on_device[at : at + n].view(p.shape).to(p.dtype))
        at += n
    return out


def upload_lists(lists: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Python int lists → int64 tensors on `device`, one copy for all."""
    return upload([torch.tensor(x, dtype=torch.int64) for x in lists], device)
