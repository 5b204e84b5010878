"""The device block table on a GPU (engine/block_table.py): a step's upload, scatter and
gather never synchronise, and give the mirror's rows. Run on the device machine with
`pytest -m gpu tests/gpu/test_block_table_gpu.py` (tests/unit/test_block_table.py runs its
random diffs on CUDA too where one is present)."""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve.engine.block_table import BlockTable
from dsaserve.kernels import staging

pytestmark = pytest.mark.gpu


def _step(table: BlockTable, req_ids: list[str], device: torch.device) -> torch.Tensor:
    """The runner's use each step: changes and rows in one upload, applied, rows gathered."""
    rows = table.rows(req_ids)
    width = int(table.num_blocks[rows].max())
    pairs_d, rows_d = staging.upload([table.pending(), torch.from_numpy(rows)], device)
    table.apply(pairs_d)
    return table.gather(rows_d, width)


def test_a_step_does_not_synchronise():
    """64 requests of 2,048 blocks (128K context, 64-token blocks): after the first fill, a
    decode step's one-block appends go up, are scattered and the step's rows gathered with the
    sync debug mode set to error."""
    rng = random.Random(0)
    dev = torch.device("cuda")
    table = BlockTable(64, 2048, dev)
    req_ids = [f"r{i}" for i in range(64)]
    for rid in req_ids:
        table.add(rid, [rng.randrange(1 << 20) for _ in range(2000)])
    _step(table, req_ids, dev)
    torch.cuda.synchronize()  # the first fill: 128K ids, once
    for rid in req_ids[::3]:
        table.append(rid, [rng.randrange(1 << 20)])
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _step(table, req_ids, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.shape == (64, 2001)
    rows = torch.from_numpy(table.host[table.rows(req_ids), :2001])
    assert torch.equal(got.cpu(), rows)
    table.check_integrity()
