"""The PCP partition: exhaustive over small batches."""

from __future__ import annotations

import itertools

import torch

from dsaserve.parallel.pcp import is_replicated, partition


def test_dual_chunk_assignment_n4():
    p = partition([16], 4)
    assert p.local_indices[0] == (0, 1, 14, 15)
    assert p.local_indices[1] == (2, 3, 12, 13)
    assert p.local_indices[3] == (6, 7, 8, 9)
    assert p.padded_len == 4 and p.replicated == (False,)


def test_replication_rule():
    assert is_replicated(1, 2) and is_replicated(3, 2)
    assert not is_replicated(4, 2)  # 4 chunks of 1
    assert is_replicated(5, 2)  # c = 2: chunks 2,2,1,0 → one would be empty
    assert not is_replicated(8, 4) and is_replicated(7, 4)
    assert all(is_replicated(q, 1) for q in range(1, 10))


def test_partition_exhaustive():
    """Every small batch, with and without requests replicated on request (async scheduling:
    rows that continue from the last step)."""
    cases = itertools.product((1, 2, 3, 4), itertools.product([1, 2, 3, 5, 6, 8, 13], repeat=2),
                              [(), (0,), (1,), (0, 1)])
    for n, lens, replicate in cases:
        p = partition(list(lens), n, replicate)
        assert p.replicated == tuple(i in replicate or is_replicated(q, n)
                                     for i, q in enumerate(lens))
        total = sum(lens)
        # Every token is computed by ≥ 1 rank; split tokens by exactly one.
        counts = torch.zeros(total, dtype=torch.int64)
        for r in range(n):
            counts[list(p.local_indices[r])] += 1
        starts = [0, lens[0]]
        for i, q in enumerate(lens):
            seg = counts[starts[i] : starts[i] + q]
            assert bool((seg == (n if p.replicated[i] else 1)).all()), (n, lens)
        # restore_index inverts the gather.
        gathered = torch.full((n * p.padded_len,), -1, dtype=torch.int64)
        for r in range(n):
            li = list(p.local_indices[r])
            gathered[r * p.padded_len : r * p.padded_len + len(li)] = torch.tensor(li)
        assert torch.equal(gathered[p.restore_index], torch.arange(total))
        # Rows of one request stay grouped and in order on each rank.
        for r in range(n):
            assert list(p.local_indices[r]) == sorted(p.local_indices[r])
        # Balanced: split requests give every rank within one chunk of the same count.
        split = [q for q, rep in zip(lens, p.replicated, strict=True) if not rep]
        if split and n > 1:
            sizes = [len(x) for x in p.local_indices]
            assert max(sizes) - min(sizes) <= 2 * max(-(-q // (2 * n)) for q in split)


def test_empty_batch():
    p = partition([], 2)
    assert p.padded_len == 1 and p.restore_index.numel() == 0
