"""KV addressing: ownership, local indices, slot maps — exhaustive over small DCP layouts."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsaserve.kv import layout

DCP_SIZES = (1, 2, 3, 4)
BLOCK_SIZES = (1, 2, 4, 8)


def _layouts():
    """(N, I, B) with I ∈ {1, 2, 4, B} restricted to valid interleaves (I ≤ B, B % I == 0)."""
    for n, b in itertools.product(DCP_SIZES, BLOCK_SIZES):
        for i in sorted({1, 2, 4, b}):
            if i <= b and b % i == 0:
                yield n, i, b


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("n,i,b", LAYOUTS)
def test_ownership_is_a_partition_and_local_index_a_bijection(n: int, i: int, b: int) -> None:
    seq_len = 3 * n * b + 5  # several virtual blocks plus a ragged tail
    pos = torch.arange(seq_len)
    owner = layout.dcp_owner(pos, n, i)
    local = layout.dcp_local_index(pos, n, i)
    for t in range(seq_len):  # the tensor form agrees with the int form
        assert layout.dcp_owner(t, n, i) == owner[t].item()
        assert layout.dcp_local_index(t, n, i) == local[t].item()
    assert owner.min() >= 0 and owner.max() < n
    total = 0
    for r in range(n):
        mine = local[owner == r]
        local_len = layout.dcp_local_seq_len(seq_len, n, r, i)
        assert mine.tolist() == list(range(local_len)), "in position order, 0..local_len-1"
        back = layout.dcp_global_position(mine, n, r, i)
        assert torch.equal(back, pos[owner == r])
        total += local_len
    assert total == seq_len



def test_local_seq_len_tensor_form_matches_int_form() -> None:
    """The elementwise tensor form (the GPU indexer's per-query visible local keys) equals the
    int form."""
    lengths = torch.arange(1, 201)
    for n in (1, 2, 3):
        for i in (1, 2, 4):
            for r in range(n):
                ours = layout.dcp_local_seq_len(lengths, n, r, i)
                assert ours.tolist() == [layout.dcp_local_seq_len(int(x), n, r, i)
                                         for x in lengths]

@pytest.mark.parametrize("n,i", [(n, i) for n in DCP_SIZES for i in (1, 2, 4)])
def test_local_seq_len_counts_owned_prefix_positions(n: int, i: int) -> None:
    for seq_len in range(0, 4 * n * i + 3):
        owners = [layout.dcp_owner(t, n, i) for t in range(seq_len)]
        for r in range(n):
            assert layout.dcp_local_seq_len(seq_len, n, r, i) == owners.count(r)


def test_docstring_example() -> None:
    assert [layout.dcp_local_seq_len(11, 3, r, 2) for r in range(3)] == [4, 4, 3]
    assert [layout.dcp_owner(t, 2, 2) for t in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def _random_table(num_reqs: int, blocks_per_req: int, pool: int, seed: int) -> torch.Tensor:
    """Distinct virtual block ids drawn from a pool, as a scheduler would hand out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(pool, generator=g)[: num_reqs * blocks_per_req]
    return ids.view(num_reqs, blocks_per_req).to(torch.int32)


@pytest.mark.parametrize("n,i,b", LAYOUTS)
def test_slot_mapping_is_owner_writes_and_collision_free(n: int, i: int, b: int) -> None:
    num_reqs, blocks_per_req = 3, 3
    table = _random_table(num_reqs, blocks_per_req, pool=16, seed=n * 100 + i * 10 + b)
    seq_len = blocks_per_req * b * n
    pos = torch.arange(seq_len).repeat(num_reqs)  # [R·L]
    req = torch.arange(num_reqs).repeat_interleave(seq_len)  # [R·L]
    written = torch.zeros(num_reqs * seq_len, dtype=torch.int64)
    for r in range(n):
        slots = layout.slot_mapping(pos, req, table, b, n, r, i)
        owned = slots >= 0
        assert torch.equal(owned, layout.dcp_owner(pos, n, i) == r)
        written += owned.long()
        mine = slots[owned]
        assert mine.unique().numel() == mine.numel(), "two tokens share a slot on one rank"
        # The rank's local sequence is paged by the same table with page size B.
        local = layout.dcp_local_index(pos[owned], n, i)
        expect = table[req[owned], local // b].long() * b + local % b
        assert torch.equal(mine, expect)
        # The page of each slot is a block of the token's own request, at the right virtual index.
        assert torch.equal(mine // b, table[req[owned], pos[owned] // (b * n)].long())
    assert torch.equal(written, torch.ones_like(written)), "each token is written exactly once"


def test_slot_mapping_pads_unallocated_blocks() -> None:
    table = torch.tensor([[5, -1]], dtype=torch.int32)
    slots = layout.slot_mapping(torch.tensor([0, 3, 4, 7]), torch.zeros(4, dtype=torch.int64),
                                table, block_size=4)
    assert slots.tolist() == [20, 23, -1, -1]


@pytest.mark.parametrize("n,i,b", [(2, 1, 4), (3, 2, 4), (4, 4, 4), (2, 8, 8), (1, 1, 2)])
def test_logical_to_slots_matches_slot_mapping(n: int, i: int, b: int) -> None:
    table = _random_table(2, 4, pool=12, seed=7)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 4 * b * n, (5, 6), generator=g, dtype=torch.int32)  # [T, K]
    req = torch.tensor([0, 1, 1, 0, 1])  # [T]
    for r in range(n):
        out = layout.logical_to_slots(idx, req, table, b, n, r, i)
        assert out.shape == idx.shape and out.dtype == torch.int64
        for t, k in itertools.product(range(5), range(6)):
            p = int(idx[t, k])
            if p < 0:
                assert out[t, k] == -1
                continue
            ref = layout.slot_mapping(torch.tensor([p]), req[t : t + 1], table, b, n, r, i)
            assert out[t, k] == ref[0]


@pytest.mark.parametrize("n,i,b", LAYOUTS)
def test_context_slots_reads_what_slot_mapping_wrote(n: int, i: int, b: int) -> None:
    blocks = [9, 2, 7, 0]
    table = torch.tensor([blocks + [-1]], dtype=torch.int32)  # −1 padded row
    for seq_len in (1, b * n - 1, b * n + 1, len(blocks) * b * n):
        pos = torch.arange(seq_len)
        for r in range(n):
            slots, positions = layout.context_slots(seq_len, table[0], b, n, r, i)
            assert positions.tolist() == [t for t in range(seq_len)
                                          if layout.dcp_owner(t, n, i) == r]
            written = layout.slot_mapping(pos, torch.zeros_like(pos), table, b, n, r, i)
            assert torch.equal(slots, written[positions])


def test_context_slots_rejects_short_block_list() -> None:
    with pytest.raises(ValueError, match="block_ids"):
        layout.context_slots(9, [0, 1], block_size=4)
    with pytest.raises(ValueError, match="unallocated"):
        layout.context_slots(5, [3, -1], block_size=4)


@pytest.mark.parametrize("b,i", [(4, 8), (8, 3), (4, 0)])
def test_bad_interleave_names_the_flag(b: int, i: int) -> None:
    one = torch.zeros(1, dtype=torch.int64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size"):
        layout.slot_mapping(one, one, table, b, 2, 0, i)
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size"):
        layout.context_slots(1, [0], b, 2, 0, i)
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size"):
        layout.logical_to_slots(one.view(1, 1), one, table, b, 2, 0, i)


def test_bad_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="dcp_rank"):
        layout.dcp_local_seq_len(10, 2, 2, 1)
