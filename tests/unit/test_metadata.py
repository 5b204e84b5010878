"""AttentionMetadata.for_requests and scattered_block_table: the step builder kernel tests and
benchmarks share."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels.metadata import AttentionMetadata, scattered_block_table
from dsaserve.kv import layout


def test_scattered_block_table_gives_each_request_distinct_blocks():
    table = scattered_block_table([3, 0, 2], torch.Generator().manual_seed(0))
    assert table.shape == (3, 3) and table.dtype == torch.int32
    assert bool((table[1] == -1).all()) and int(table[2, 2]) == -1
    used = torch.cat([table[0], table[2, :2]])
    assert sorted(used.tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dcp", [(1, 0), (2, 1)])
def test_for_requests_flattens_the_last_tokens_of_each_request(dcp):
    table = torch.tensor([[4, 7, -1], [2, -1, -1], [0, 5, 6]], dtype=torch.int32)
    meta = AttentionMetadata.for_requests((10, 3, 40), (3, 1, 0), table, 8, dcp_size=dcp[0],
                                          dcp_rank=dcp[1])
    assert meta.query_start_loc == (0, 3, 4, 4) and meta.seq_lens == (10, 3, 40)
    assert meta.positions.tolist() == [7, 8, 9, 2]
    assert meta.req_indices.tolist() == [0, 0, 0, 1]
    expected = layout.slot_mapping(meta.positions, meta.req_indices, table, 8, *dcp)
    assert torch.equal(meta.slot_mapping, expected)
    assert (meta.dcp_size, meta.dcp_rank) == dcp and meta.num_tokens == 4


def test_for_requests_rejects_more_new_tokens_than_context():
    with pytest.raises(ValueError, match="request 1 has 5 new tokens of 3"):
        AttentionMetadata.for_requests((4, 3), (1, 5), torch.zeros(2, 1, dtype=torch.int32), 8)


def test_runner_host_tensors_match_the_python_loops():
    """The runner's positions / request index / int lists, built without Python loops over
    tokens, equal the loops they replaced (zero-token requests and empty lists included)."""
    from dsaserve.engine.runner import _flat_ids, _positions

    starts, counts = [5, 0, 1_000_000, 7], [3, 0, 4, 1]
    pos, req = _positions(starts, counts)
    want_pos = [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)]
    want_req = [r for r, n in enumerate(counts) for _ in range(n)]
    assert pos.tolist() == want_pos and req.tolist() == want_req
    assert pos.dtype == req.dtype == torch.int64
    # the first counts[r] ids of each request's row tokens (known, drafts, the next known)
    seqs, counts = [[3, -1, 7], [], [2**40, 2**31 - 1, 0, 9], [5]], [2, 0, 3, 1]
    ids = _flat_ids(seqs, counts)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, -1, 2**40, 2**31 - 1, 0, 5]
    assert _flat_ids([], []).shape == (0,)
    with pytest.raises(ValueError):  # a row with fewer tokens than it computes
        _flat_ids([[1, 2]], [3])
