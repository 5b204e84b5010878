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
