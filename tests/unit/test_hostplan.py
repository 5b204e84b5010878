"""P/D into a spilling HiSparse rank (disagg/hostplan.py): every received position's indexer key
goes to its indexer page and its MLA row to exactly one place (its GPU MLA page, or the host
pool row host_blocks[p // B]·B + p % B when its block is spilled), against a per-token brute
force over source layouts, page maps and cached prefixes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dsaserve.disagg.hostplan import SPILLED, HostDest, plan_into_hisparse
from dsaserve.disagg.relayout import KVLayout, plan_positions, plan_transfer


def _src_slot(src: KVLayout, t: int) -> tuple[int, int]:
    n, i, b = src.dcp_size, src.interleave, src.block_size
    local = (t // (n * i)) * i + t % i
    return (t // i) % n, src.block_ids[local // b] * b + local % b


def _copies(plan) -> dict[int, tuple[int, int]]:
    """target slot → (source rank, source slot), each target slot written once."""
    out: dict[int, tuple[int, int]] = {}
    for pair in plan.pairs:
        assert pair.dst_rank == 0
        for s, d in zip(pair.src_slots().tolist(), pair.dst_slots().tolist(), strict=True):
            assert d not in out, f"target slot {d} written twice"
            out[d] = (pair.src_rank, s)
    return out


@pytest.mark.parametrize("ns,i_s,bs,b", [(1, 1, 4, 4), (2, 1, 4, 4), (2, 4, 4, 4), (4, 2, 2, 4),
                                         (3, 1, 1, 2), (2, 8, 8, 4), (1, 1, 2, 8)])
def test_plan_matches_brute_force(ns: int, i_s: int, bs: int, b: int) -> None:
    rng = random.Random(ns * 100 + i_s * 10 + bs + b)
    for _ in range(20):
        num_tokens = rng.randint(1, 40)
        nblk_s = -(-num_tokens // (bs * ns))
        src = KVLayout(tuple(rng.sample(range(3 * nblk_s + 4), nblk_s)), bs, ns, i_s)
        nblk = -(-num_tokens // b)
        blocks = tuple(rng.sample(range(3 * nblk + 4), nblk))
        host = tuple(rng.sample(range(100, 100 + 3 * nblk + 4), nblk + rng.randint(0, 2)))
        start = rng.choice([0, rng.randint(0, num_tokens), (num_tokens - 1) // b * b])
        # the scheduler's shape (hits and the write tail resident, between them spilled), or any
        if rng.random() < 0.5:
            hits, tail = start // b, (num_tokens - 1) // b
            pages_iter = iter(rng.sample(range(50), nblk))
            pages = tuple(next(pages_iter) if k < hits or k >= tail else SPILLED
                          for k in range(nblk))
        else:
            pages = tuple(rng.choice([SPILLED, 200 + k]) for k in range(nblk))
        dst = KVLayout(blocks, b)
        plan = plan_into_hisparse(src, dst, HostDest(host, pages), start, num_tokens)

        want_index, want_gpu, want_host = {}, {}, {}
        for t in range(start, num_tokens):
            s = _src_slot(src, t)
            want_index[blocks[t // b] * b + t % b] = s
            if pages[t // b] != SPILLED:
                want_gpu[pages[t // b] * b + t % b] = s
            else:
                want_host[host[t // b] * b + t % b] = s
        assert _copies(plan.index) == want_index
        assert _copies(plan.gpu) == want_gpu
        assert _copies(plan.host) == want_host
        assert plan.num_rows == num_tokens - start == plan.gpu.num_rows + plan.host.num_rows


def test_scheduler_shape_moves_whole_pages_to_the_host() -> None:
    """vLLM's layout (I = B on both sides): the spilled blocks' MLA rows arrive as whole host
    pages, one run per page, and only the write tail's rows touch a GPU MLA page."""
    b, n = 4, 2
    num_tokens = 27  # the tail block (6) holds received positions 24-25 and the last token 26
    src = KVLayout(tuple(range(10, 14)), b, n, b)
    dst = KVLayout(tuple(range(7)), b)
    pages = (5, SPILLED, SPILLED, SPILLED, SPILLED, SPILLED, 9)  # hit block 0, tail block 6
    host = (40, 41, 42, 43, 44, 45, 46, 47)
    plan = plan_into_hisparse(src, dst, HostDest(host, pages), 4, num_tokens - 1)
    assert plan.host.num_rows == 20 and plan.gpu.num_rows == 2
    assert sum(p.num_runs for p in plan.host.pairs) == 5  # one per spilled block
    assert all(bool((p.length == b).all()) for p in plan.host.pairs)
    assert sorted(_copies(plan.gpu)) == [36, 37]  # page 9, rows 0-1


def test_errors_and_plan_positions_subset() -> None:
    src, dst = KVLayout((3, 1), 4), KVLayout((0, 2), 4)
    with pytest.raises(ValueError, match="no DCP"):
        plan_into_hisparse(src, KVLayout((0, 2), 4, 2), HostDest((0, 1), (0, 1)), 0, 8)
    with pytest.raises(ValueError, match="mla_pages"):
        plan_into_hisparse(src, dst, HostDest((0, 1), (0,)), 0, 8)
    # a subset of a range: the whole range's runs restricted to it
    whole = _copies(plan_transfer(src, dst, 0, 8))
    for keep in itertools.combinations(range(8), 3):
        part = _copies(plan_positions(src, dst, torch.tensor(keep), 0, 8))
        assert part == {d: s for d, s in whole.items() if d % 4 + 4 * (d // 4 == 2) in keep}
