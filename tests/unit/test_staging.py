"""kernels/staging.py: what goes up comes back in the same shapes, dtypes and values."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import staging

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_keeps_shapes_dtypes_values(device):
    parts = [torch.arange(5), torch.tensor([[1, -1], [7, 8]], dtype=torch.int32),
             torch.zeros(0, dtype=torch.int64), torch.tensor([2**40])]
    got = staging.upload(parts, torch.device(device))
    for p, g in zip(parts, got, strict=True):
        assert g.device.type == device and g.dtype == p.dtype and g.shape == p.shape
        assert torch.equal(g.cpu(), p)
    lists = staging.upload_lists([[3, 4], [], [5]], torch.device(device))
    assert [t.tolist() for t in lists] == [[3, 4], [], [5]]


def test_packed_views_keep_every_dtype_and_sit_on_aligned_boundaries():
    """The GPU path's packing, on host buffers: each part at an ALIGN-byte offset, its view
    back in its own dtype and shape with its values, writable without touching the others."""
    parts = [torch.arange(5), torch.tensor([[1, -1], [7, 8]], dtype=torch.int32),
             torch.zeros(0, dtype=torch.int64), torch.tensor([2**40]),
             torch.tensor([True, False, True]), torch.arange(6, dtype=torch.int16)[::2],
             torch.tensor(7, dtype=torch.int32), torch.arange(6).view(2, 3).t(),
             torch.tensor([1.5, -2.0], dtype=torch.bfloat16)]
    offsets, total = staging.byte_offsets(parts)
    assert all(at % staging.ALIGN == 0 for at in offsets) and total % staging.ALIGN == 0
    sizes = [p.numel() * p.element_size() for p in parts]
    ends = [at + n for at, n in zip(offsets, sizes, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))
    assert ends[-1] <= total < ends[-1] + staging.ALIGN
    host = torch.full((total,), 0xAB, dtype=torch.uint8)
    staging.pack(parts, host, offsets)
    got = staging.unpack(host.clone(), parts, offsets)  # (a copy: the "device" buffer)
    for p, g in zip(parts, got, strict=True):
        assert g.dtype == p.dtype and g.shape == p.shape and g.is_contiguous()
        assert torch.equal(g, p)
    got[1].fill_(-5)
    assert torch.equal(got[0], parts[0]) and torch.equal(got[3], parts[3])


def test_byte_offsets_example():
    parts = [torch.zeros(5, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
             torch.zeros(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int32)]
    assert staging.byte_offsets(parts) == ([0, 48, 64, 64], 96)


@pytest.mark.parametrize("parts", [[torch.arange(3), torch.zeros(2, 0, dtype=torch.int64)],
                                   [torch.zeros(0, dtype=torch.int32)], []],
                         ids=["empty_last", "only_empty", "none"])
def test_packed_empty_parts(parts):
    """Empty parts (at the buffer's end too) come back empty, in their shapes and dtypes."""
    offsets, total = staging.byte_offsets(parts)
    host = torch.empty(max(total, staging.ALIGN), dtype=torch.uint8)
    staging.pack(parts, host, offsets)
    got = staging.unpack(host.clone(), parts, offsets)
    assert [(g.shape, g.dtype) for g in got] == [(p.shape, p.dtype) for p in parts]
    assert all(torch.equal(g, p) for g, p in zip(got, parts, strict=True))
