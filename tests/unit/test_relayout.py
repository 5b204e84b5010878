"""P/D re-layout plans against a per-token brute force, over small layouts and random tables."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dsaserve.disagg.relayout import (
    CopyRuns,
    KVLayout,
    RowBytes,
    TransferPlan,
    expand_runs,
    owned_slots,
    plan_pieces,
    plan_transfer,
)
from dsaserve.kv import layout


def _random_layout(rng: random.Random, num_tokens: int, b: int, n: int, i: int) -> KVLayout:
    """A layout whose table covers num_tokens with distinct random block ids (plus spare)."""
    blocks = -(-num_tokens // (b * n)) + rng.randint(0, 1)
    ids = rng.sample(range(3 * blocks + 4), blocks)
    return KVLayout(tuple(ids), b, n, i)


def _brute(src: KVLayout, dst: KVLayout, start: int, end: int) -> dict:
    """Per token, in plain integers from DESIGN §4 (independent of layout.py and of the plan):
    position → (src rank, src slot, dst rank, dst slot)."""
    out = {}
    for t in range(start, end):
        row = []
        for kv in (src, dst):
            n, i, b = kv.dcp_size, kv.interleave, kv.block_size
            local = (t // (n * i)) * i + t % i
            row += [(t // i) % n, kv.block_ids[local // b] * b + local % b]
        out[t] = tuple(row)
    return out


def _interleaves(b: int) -> list[int]:
    return [i for i in (1, 2, 4, b) if i <= b and b % i == 0]


RANKS = [(1, 1), (2, 1), (4, 1), (3, 1), (4, 2), (2, 4), (2, 2)]  # (N_s, N_t)


def _layouts(ns: int, nt: int):
    """Every (I_s, B_s, I_t, B_t) with B ∈ {1, 2, 4} (source) and {1, 2, 4, 8} (target)."""
    for bs, bt in itertools.product((1, 2, 4), (1, 2, 4, 8)):
        for i_s, i_t in itertools.product(_interleaves(bs), _interleaves(bt)):
            yield i_s, bs, i_t, bt


@pytest.mark.parametrize("ns,nt", RANKS)
def test_plan_matches_brute_force(ns: int, nt: int) -> None:
    rng = random.Random(ns * 10 + nt)
    for i_s, bs, i_t, bt in _layouts(ns, nt):
        for _ in range(3):
            _check_plan(rng, ns, i_s, bs, nt, i_t, bt)


def _check_plan(rng: random.Random, ns: int, i_s: int, bs: int, nt: int, i_t: int,
                bt: int) -> None:
    num_tokens = rng.randint(1, 3 * max(ns * bs, nt * bt) + 3)
    src = _random_layout(rng, num_tokens, bs, ns, i_s)
    dst = _random_layout(rng, num_tokens, bt, nt, i_t)
    start = rng.choice([0, rng.randint(0, num_tokens)])
    plan = plan_transfer(src, dst, start, num_tokens)
    want = _brute(src, dst, start, num_tokens)

    # Every target token in range is written exactly once, from the rank that owns it, with the
    # source token at the same position.
    got = {}
    for pair in plan.pairs:
        for s, d in zip(pair.src_slots().tolist(), pair.dst_slots().tolist(), strict=True):
            key = (pair.dst_rank, d)
            assert key not in got, f"target slot {key} written twice"
            got[key] = (pair.src_rank, s)
    assert got == {(dr, ds): (sr, ss) for sr, ss, dr, ds in want.values()}
    assert plan.num_rows == num_tokens - start

    # Runs are maximal: no run continues exactly where the previous one of its pair stopped, and
    # each pair's runs are in position order (its rows pair up with the brute force's order).
    for pair in plan.pairs:
        assert bool((pair.length >= 1).all())
        end_s = pair.src_start[:-1] + pair.length[:-1]
        end_d = pair.dst_start[:-1] + pair.length[:-1]
        assert not bool(((end_s == pair.src_start[1:]) & (end_d == pair.dst_start[1:])).any())
        in_order = [v[1] for t, v in sorted(want.items())
                    if (v[0], v[2]) == (pair.src_rank, pair.dst_rank)]
        assert pair.src_slots().tolist() == in_order
    assert [(p.src_rank, p.dst_rank) for p in plan.pairs] == sorted(
        {(v[0], v[2]) for v in want.values()})


@pytest.mark.parametrize("ns,b", [(1, 4), (2, 4), (4, 2), (8, 16), (3, 8)])
def test_pages_line_up_into_whole_page_runs(ns: int, b: int) -> None:
    """I_s = B_s = B_t, DP target: every run is whole pages, except where the range starts or
    ends inside a page; consecutive block ids on both sides merge pages into one run."""
    rng = random.Random(ns * 100 + b)
    num_tokens = 7 * ns * b + 3  # ragged tail: a partial last page
    src = _random_layout(rng, num_tokens, b, ns, b)
    dst = _random_layout(rng, num_tokens, b, 1, 1)
    start = 2 * b + 1  # a partial first page: the decode side cached 2 pages and a token
    plan = plan_transfer(src, dst, start, num_tokens)
    _, ends = owned_slots(torch.tensor([start, num_tokens - 1]), dst)
    first_dst, last_dst = ends.tolist()
    for pair in plan.pairs:
        for s, d, n in zip(pair.src_start.tolist(), pair.dst_start.tolist(),
                           pair.length.tolist(), strict=True):
            assert s % b == d % b  # the same offset in the page on both sides
            assert d % b == 0 or d == first_dst
            assert (d + n) % b == 0 or d + n - 1 == last_dst
    assert plan.num_rows == num_tokens - start

    # Consecutive ids on both sides: each pair is one run of all its pages.
    src = KVLayout(tuple(range(10, 20)), b, ns, b)
    dst = KVLayout(tuple(range(100, 100 + 10 * ns)), b, ns, b)
    plan = plan_transfer(src, dst, 0, 4 * ns * b)
    assert [p.num_runs for p in plan.pairs] == [1] * ns
    assert [p.num_rows for p in plan.pairs] == [4 * b] * ns


def test_docstring_example() -> None:
    src = KVLayout((7, 3), block_size=4, dcp_size=2, interleave=2)
    dst = KVLayout((5, 0, 9, 2), block_size=4)
    plan = plan_transfer(src, dst, 4, 16)
    runs = {(p.src_rank, p.dst_rank): list(zip(p.src_start.tolist(), p.dst_start.tolist(),
                                               p.length.tolist(), strict=True))
            for p in plan.pairs}
    assert runs == {(0, 0): [(30, 0, 2), (12, 36, 2), (14, 8, 2)],
                    (1, 0): [(30, 2, 2), (12, 38, 2), (14, 10, 2)]}
    rb = RowBytes(kv=(656, 656), index=(132, 0))
    assert plan.nbytes(rb) == 12 * (656 * 2 + 132)


def test_rank_views_and_empty_range() -> None:
    src = KVLayout((0, 1, 2), block_size=2, dcp_size=4, interleave=1)
    dst = KVLayout((5, 6), block_size=8, dcp_size=2, interleave=2)
    plan = plan_transfer(src, dst, 3, 20)
    assert sum(p.num_rows for p in plan.from_source(1)) == len(
        [t for t in range(3, 20) if t % 4 == 1])
    assert sum(p.num_rows for p in plan.to_target(0)) == len(
        [t for t in range(3, 20) if (t // 2) % 2 == 0])
    # I_s = 1, I_t = 2, N_s = 4, N_t = 2: source rank r holds t ≡ r (mod 4), which target rank
    # (t // 2) % 2 = r // 2 owns: each target hears from two sources.
    assert [(p.src_rank, p.dst_rank) for p in plan.pairs] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert plan.pair(0, 1) is None and plan.pair(2, 1) is not None
    empty = plan_transfer(src, dst, 20, 20)
    assert empty.pairs == () and empty.num_rows == 0


def test_errors_are_clear() -> None:
    src = KVLayout((0,), block_size=4, dcp_size=2)
    with pytest.raises(ValueError, match="cannot hold position 8"):
        plan_transfer(src, KVLayout((0, 1, 2), 4), 0, 9)
    with pytest.raises(ValueError, match="unallocated"):
        plan_transfer(KVLayout((0, -1), 4, 2), KVLayout((0, 1, 2), 4), 0, 9)
    with pytest.raises(ValueError, match="num_cached_on_dst"):
        plan_transfer(src, src, 5, 4)
    with pytest.raises(ValueError, match="interleave"):
        KVLayout((0,), block_size=4, interleave=3)


def test_expand_runs_and_owned_slots() -> None:
    assert expand_runs(torch.tensor([5, 20]), torch.tensor([3, 2])).tolist() == [5, 6, 7, 20, 21]
    assert expand_runs(torch.tensor([], dtype=torch.int64),
                       torch.tensor([], dtype=torch.int64)).tolist() == []
    kv = KVLayout((3, 1), block_size=2, dcp_size=2, interleave=1)
    owner, slot = owned_slots(torch.arange(8), kv)
    assert owner.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert slot.tolist() == [6, 6, 7, 7, 2, 2, 3, 3]


def test_owned_slots_agree_with_layout_slot_mapping() -> None:
    """The brute force above re-derives DESIGN §4; this ties the plan's slots to layout.py."""
    kv = KVLayout((4, 0, 7, 2), block_size=4, dcp_size=3, interleave=2)
    pos = torch.arange(40)
    owner, slot = owned_slots(pos, kv)
    for rank in range(3):
        ref = layout.slot_mapping(pos, torch.zeros_like(pos), torch.tensor([kv.block_ids]), 4, 3,
                                  rank, 2)
        assert torch.equal(torch.where(owner == rank, slot, -1), ref)


def _plan_per_token(src: KVLayout, dst: KVLayout, start: int, end: int) -> TransferPlan:
    """The per-token plan as it was first written (every position's owners and slots, then run
    breaks): the reference the pieces must reproduce run for run."""
    plan = TransferPlan(start, end, src.dcp_size, dst.dcp_size)
    pos = torch.arange(start, end, dtype=torch.int64)
    if pos.numel() == 0:
        return plan
    s_rank, s_slot = owned_slots(pos, src)
    d_rank, d_slot = owned_slots(pos, dst)
    pair = s_rank * dst.dcp_size + d_rank
    if src.dcp_size * dst.dcp_size > 1:
        order = torch.sort(pair, stable=True).indices
        pair, s_slot, d_slot = pair[order], s_slot[order], d_slot[order]
    breaks = torch.ones_like(pair, dtype=torch.bool)
    breaks[1:] = ((pair[1:] != pair[:-1]) | (s_slot[1:] != s_slot[:-1] + 1)
                  | (d_slot[1:] != d_slot[:-1] + 1))
    first = torch.nonzero(breaks).squeeze(1)
    length = torch.diff(first, append=torch.tensor([pair.numel()]))
    run_pair = pair[first]
    pairs = []
    for p in torch.unique_consecutive(run_pair).tolist():
        sel = run_pair == p
        pairs.append(CopyRuns(p // dst.dcp_size, p % dst.dcp_size, s_slot[first[sel]],
                              d_slot[first[sel]], length[sel]))
    return TransferPlan(start, end, src.dcp_size, dst.dcp_size, tuple(pairs))


def _assert_same_plan(got: TransferPlan, want: TransferPlan) -> None:
    assert (got.start, got.end, got.src_dcp_size, got.dst_dcp_size) == (
        want.start, want.end, want.src_dcp_size, want.dst_dcp_size)
    assert [(p.src_rank, p.dst_rank) for p in got.pairs] == [
        (p.src_rank, p.dst_rank) for p in want.pairs]
    for g, w in zip(got.pairs, want.pairs, strict=True):
        for name in ("src_start", "dst_start", "length"):
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name


def _table(rng: random.Random, num_blocks: int) -> tuple[int, ...]:
    """Block ids: all consecutive, all scattered, or consecutive stretches in random places."""
    kind = rng.choice(("consecutive", "scattered", "stretches"))
    if kind == "consecutive":
        first = rng.randint(0, 50)
        return tuple(range(first, first + num_blocks))
    if kind == "scattered":
        return tuple(rng.sample(range(3 * num_blocks + 4), num_blocks))
    ids: list[int] = []
    base = 0
    while len(ids) < num_blocks:
        n = rng.randint(1, 4)
        base += rng.randint(1, 3) * 5
        ids += range(base, base + n)
        base += n
    ids = ids[:num_blocks]
    rng.shuffle(chunks := [ids[k:k + 3] for k in range(0, num_blocks, 3)])
    return tuple(b for c in chunks for b in c)


def _random_side(rng: random.Random, num_tokens: int, n: int) -> KVLayout:
    b = rng.choice((16, 64))
    i = rng.choice((1, 2, b // 4, b // 2, b))
    blocks = -(-num_tokens // (b * n)) + rng.randint(0, 1)
    return KVLayout(_table(rng, blocks), b, n, i)


DCP = (1, 2, 4, 8)


@pytest.mark.parametrize("ns,nt", list(itertools.product(DCP, DCP)))
def test_pieces_equal_the_per_token_plan(ns: int, nt: int) -> None:
    """plan_pieces (and plan_transfer, whichever path it takes) give the per-token plan's pairs
    and runs exactly, over random layouts: interleave 1, 2, B/4, B/2, B; B 16 or 64 per side;
    a decode-side cached prefix of 0, mid-page or mid-chunk; consecutive or scattered ids."""
    rng = random.Random(ns * 10 + nt)
    for _ in range(30):
        num_tokens = rng.randint(1, 3 * 64 * max(ns, nt) + 100)
        src, dst = _random_side(rng, num_tokens, ns), _random_side(rng, num_tokens, nt)
        side = rng.choice((src, dst))
        start = rng.choice((
            0,
            rng.randint(0, num_tokens),
            min(num_tokens, rng.randint(0, num_tokens // side.tokens_per_block) * side.block_size
                * side.dcp_size + rng.randint(1, side.block_size - 1)),  # mid-page
            min(num_tokens, rng.randint(0, num_tokens // side.interleave) * side.interleave
                + rng.randint(0, side.interleave - 1)),  # mid-chunk
        ))
        want = _plan_per_token(src, dst, start, num_tokens)
        _assert_same_plan(plan_pieces(src, dst, start, num_tokens), want)
        _assert_same_plan(plan_transfer(src, dst, start, num_tokens), want)


def test_pieces_take_long_ranges_and_fail_as_per_token() -> None:
    """A long range with whole-page interleaves goes through the pieces (few runs, same plan);
    a table too short or with a −1 block fails with the per-token plan's message."""
    src = KVLayout(tuple(range(40)), 64, 8, 64)
    dst = KVLayout(tuple(range(100, 420)), 64)
    plan = plan_transfer(src, dst, 1000, 20000)
    _assert_same_plan(plan, _plan_per_token(src, dst, 1000, 20000))
    assert [p.num_runs for p in plan.pairs] == [
        len({t // 512 for t in range(1000, 20000) if (t // 64) % 8 == r}) for r in range(8)]
    short = KVLayout(tuple(range(300)), 64)
    for bad in (short, KVLayout((*range(100, 150), -1, *range(150, 400)), 64)):
        with pytest.raises(ValueError) as per_token:
            _plan_per_token(src, bad, 1000, 20000)
        with pytest.raises(ValueError) as pieces:
            plan_pieces(src, bad, 1000, 20000)
        assert str(pieces.value) == str(per_token.value)
