"""Host → device: a step's small host-built tensors go over in one asynchronous copy.

Each `torch.tensor(list, device="cuda")` or `.to("cuda")` of pageable host memory is a blocking
copy: the host waits for the GPU queue to reach it. `upload` packs a step's host tensors, as
bytes, into one pinned buffer, copies it with non_blocking=True (the host does not wait) and
hands back device views of it in the original shapes and dtypes: no cast or copy kernel on the
device, whatever the dtypes (an int32 part cost a cast launch and an allocation each when the
buffer was int64). The pinned buffer is dropped at once: torch's pinned-memory allocator keeps
it from reuse until the copy that reads it has finished.

    parts   pos [N] int64 | req [N] int64 | table [R, W] int32       (host)
    bytes   |pos……………|req……………|table……|pad|                         each part at a 16-byte
    device  ──────────── one uint8 buffer ───────────► views           boundary (ALIGN)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Every part starts at a multiple of this many bytes: any dtype's view is aligned, and Triton,
# which specialises a kernel on whether a pointer is 16-byte aligned, sees every part aligned
# (one compiled variant, whatever the step's sizes).
ALIGN = 16


def byte_offsets(parts: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each part's first byte in the packed buffer, and the buffer's size: parts in order,
    each at an ALIGN boundary.

        sizes (bytes) 40, 8, 0, 20  →  offsets 0, 48, 64, 64; total 96 (84 rounded up)
    """
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets, at


def pack(parts: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Write each host part's bytes into out [total] uint8 (host) at its offset. Through numpy:
    a copy there costs a microsecond, a torch op several."""
    buf = out.numpy()
    for p, at in zip(parts, offsets, strict=True):
        if not p.numel():
            continue
        try:
            src = p.numpy()  # (any strides)
        except TypeError:  # a dtype numpy lacks (bfloat16): its bytes
            src = p.contiguous().view(-1).view(torch.uint8).numpy()
        np.copyto(buf[at : at + src.nbytes].view(src.dtype).reshape(src.shape), src)


def unpack(packed: torch.Tensor, parts: Sequence[torch.Tensor], offsets: Sequence[int]
           ) -> list[torch.Tensor]:
    """Views of packed [total] uint8 (total a multiple of ALIGN) shaped and typed as `parts`:
    no copies, one view per dtype and one per part."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for p, at in zip(parts, offsets, strict=True):
        flat = typed.get(p.dtype)
        if flat is None:
            flat = typed[p.dtype] = packed.view(p.dtype)
        out.append(flat.as_strided(p.shape, _contiguous_strides(p.shape),
                                   at // p.element_size()))
    return out


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def upload(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors → the same tensors on `device` (as they are on the CPU). On a GPU they are
    views of one buffer: writing into one leaves the others alone."""
    if device.type == "cpu":
        return list(parts)
    offsets, total = byte_offsets(parts)
    staged = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=True)
    pack(parts, staged, offsets)
    return unpack(staged.to(device, non_blocking=True), parts, offsets)


def upload_lists(lists: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Python int lists → int64 tensors on `device`, one copy for all."""
    return upload([torch.tensor(x, dtype=torch.int64) for x in lists], device)
