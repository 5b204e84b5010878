"""KV layout maths and the PCP partition as properties (hypothesis), beside the exhaustive small
cases of test_layout.py and test_pcp_partition.py: any DCP size, interleave, block size, block
table and batch of query lengths.

- DCP: (owner, local index) is a bijection onto each rank's sequence; per-rank lengths sum to the
  total; every position of a request lands on exactly one rank's slot, inside its own block.
- PCP: every token is computed by some rank (replicated requests: by all), split requests are cut
  into 2N causally balanced chunks, and the restore map returns the gathered rows to batch order.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.kv import layout
from dsaserve.parallel import pcp

SETTINGS = settings(max_examples=150, deadline=None, database=None, derandomize=True)


@st.composite
def dcp_layouts(draw):
    n = draw(st.integers(1, 5))
    log_b = draw(st.integers(0, 4))
    block = 2**log_b
    interleave = 2 ** draw(st.integers(0, log_b))  # I divides B
    return n, block, interleave


@SETTINGS
@given(layout_=dcp_layouts(), seq_len=st.integers(0, 300))
def test_owner_and_local_index_are_a_bijection(layout_, seq_len) -> None:
    n, _, interleave = layout_
    seen: dict[tuple[int, int], int] = {}
    for t in range(seq_len):
        key = (layout.dcp_owner(t, n, interleave), layout.dcp_local_index(t, n, interleave))
        assert key not in seen
        seen[key] = t
        assert layout.dcp_global_position(key[1], n, key[0], interleave) == t
    lens = [layout.dcp_local_seq_len(seq_len, n, r, interleave) for r in range(n)]
    assert sum(lens) == seq_len
    for r in range(n):  # each rank's local sequence is dense: 0 .. len − 1
        assert sorted(local for owner, local in seen if owner == r) == list(range(lens[r]))


@SETTINGS
@given(layout_=dcp_layouts(), seq_len=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_slot_mapping_writes_each_position_once_in_its_block(layout_, seq_len, seed) -> None:
    n, block, interleave = layout_
    virtual = block * n
    num_blocks = -(-seq_len // virtual)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks].int()[None, :]  # [1, V]
    positions = torch.arange(seq_len)
    reqs = torch.zeros(seq_len, dtype=torch.int64)
    written = torch.zeros(seq_len, dtype=torch.int64)
    slots_seen: set[int] = set()
    for rank in range(n):
        slots = layout.slot_mapping(positions, reqs, table, block, n, rank, interleave)
        mine = slots >= 0
        written += mine.long()
        for t in positions[mine].tolist():
            slot = int(slots[t])
            assert slot // block == int(table[0, t // virtual])  # inside the token's own block
            assert (rank, slot) not in slots_seen
            slots_seen.add((rank, slot))
            assert layout.dcp_owner(t, n, interleave) == rank
    assert bool((written == 1).all())


@SETTINGS
@given(layout_=dcp_layouts(), runs=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 70)),
                                             max_size=6), seed=st.integers(0, 2**16))
def test_run_slots_are_slot_mapping(layout_, runs, seed) -> None:
    """The host's per-block slots of a step's runs of positions (layout.run_slots) are
    slot_mapping's at every rank, unallocated (−1) blocks, empty runs and shared rows
    included."""
    n, block, interleave = layout_
    g = torch.Generator().manual_seed(seed)
    width = -(-220 // (block * n))
    table = torch.randint(-1, 50, (len(runs) + 2, width), generator=g, dtype=torch.int32)
    rows = torch.randint(0, len(runs) + 2, (len(runs),), generator=g)
    starts, counts = [s for s, _ in runs], [c for _, c in runs]
    positions = torch.tensor([s + i for s, c in runs for i in range(c)], dtype=torch.int64)
    reqs = torch.tensor([r for r, (_, c) in enumerate(runs) for _ in range(c)],
                        dtype=torch.int64)
    for rank in range(n):
        want = layout.slot_mapping(positions, rows[reqs], table, block, n, rank, interleave)
        got = layout.run_slots(starts, counts, rows.numpy(), table.numpy(), block, n, rank,
                               interleave)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()


@SETTINGS
@given(query_lens=st.lists(st.integers(1, 90), min_size=1, max_size=6),
       num_ranks=st.integers(1, 4))
def test_pcp_partition_covers_balances_and_restores(query_lens, num_ranks) -> None:
    part = pcp.partition(query_lens, num_ranks)
    total = sum(query_lens)
    counts = torch.zeros(total, dtype=torch.int64)
    for rank_rows in part.local_indices:
        counts[list(rank_rows)] += 1
    start = 0
    for q, rep in zip(query_lens, part.replicated, strict=True):
        assert rep == pcp.is_replicated(q, num_ranks)
        rows = counts[start:start + q]
        assert bool((rows == (num_ranks if rep else 1)).all())  # all ranks, or exactly one
        if not rep:  # chunks r and 2N−1−r: equal causal work, but for the short last chunk
            chunk = -(-q // (2 * num_ranks))
            work = []
            for r in range(num_ranks):
                mine = [t - start for t in part.local_indices[r] if start <= t < start + q]
                work.append(sum(t + 1 for t in mine))  # keys each of its query rows attends
            assert len(set(work[1:])) <= 1  # whole chunks: the same work on every rank
            missing = 2 * num_ranks * chunk - q  # rank 0's last chunk is short by this much
            assert 0 <= work[-1] - work[0] <= missing * 2 * num_ranks * chunk
        start += q
    # The restore map takes the rank-major gathered rows back to batch order.
    gathered = torch.full((num_ranks * part.padded_len,), -1, dtype=torch.int64)
    for r, rank_rows in enumerate(part.local_indices):
        gathered[r * part.padded_len: r * part.padded_len + len(rank_rows)] = torch.tensor(
            rank_rows, dtype=torch.int64)
    assert gathered[part.restore_index].tolist() == list(range(total))
