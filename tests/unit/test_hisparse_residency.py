"""The residency step against a plain-Python LRU cache that follows the same rules."""

from __future__ import annotations

import random

import torch

from dsaserve.kv.hisparse.residency import resolve, union_positions


class PyLru:
    """One region: slots hold tokens; victims in (stamp, slot) order; misses in position order."""

    def __init__(self, size: int) -> None:
        self.token = [-1] * size
        self.stamp = [-1] * size

    def step(self, rows: list[list[int]], now: int) -> tuple[list[list[int]], int]:
        union = sorted({p for row in rows for p in row if p >= 0})
        where = {t: s for s, t in enumerate(self.token) if t >= 0}
        misses = []
        for p in union:
            if p in where:
                self.stamp[where[p]] = now
            else:
                misses.append(p)
        victims = sorted((st, s) for s, st in enumerate(self.stamp) if st != now)
        for p, (_, s) in zip(misses, victims, strict=False):
            self.token[s], self.stamp[s] = p, now
            where[p] = s
        return [[where[p] if p >= 0 else -1 for p in row] for row in rows], len(misses)


def _run(seed: int, num_regions: int, size: int, k: int, max_rows: int, span: int,
         steps: int) -> None:
    rng = random.Random(seed)
    models = [PyLru(size) for _ in range(num_regions)]
    token = torch.full((num_regions, size), -1, dtype=torch.int64)
    stamp = torch.full((num_regions, size), -1, dtype=torch.int64)
    for now in range(steps):
        rows, region, rank = [], [], []
        for g in range(num_regions):
            if rng.random() < 0.2:  # this region sits the step out
                continue
            for r in range(rng.randint(1, max_rows)):
                # a row's top-k: distinct positions of a growing context, −1 padded
                ctx = rng.randint(1, span)
                sel = rng.sample(range(ctx), min(k, ctx)) + [-1] * max(k - ctx, 0)
                rows.append(sel)
                region.append(g)
                rank.append(r)
        for _ in range(rng.randint(0, 2)):  # rows that read the paged cache
            rows.append([rng.randrange(span) for _ in range(k)])
            region.append(-1)
            rank.append(0)
        if not rows:
            continue
        out = resolve(torch.tensor(rows), torch.tensor(region), torch.tensor(rank), token, stamp,
                      now, max_rows)
        token, stamp = out.slot_token, out.slot_stamp
        for g in range(num_regions):
            mine = [i for i, x in enumerate(region) if x == g]
            want, n_miss = models[g].step([rows[i] for i in mine], now)
            got = out.hot_slots[mine].tolist() if mine else []
            assert got == want, (seed, now, g)
            assert int(out.num_misses[g]) == n_miss
            assert token[g].tolist() == models[g].token
            # the fetch list names exactly the missed positions, each in the slot it now holds
            fetch = {(p, s) for p, s in zip(out.miss_pos[g].tolist(), out.miss_slot[g].tolist(),
                                            strict=True) if p >= 0}
            assert len(fetch) == n_miss
            assert all(models[g].token[s] == p for p, s in fetch)
            assert all(s == size for p, s in zip(out.miss_pos[g].tolist(),
                                                 out.miss_slot[g].tolist(), strict=True) if p < 0)
        not_hot = [i for i, x in enumerate(region) if x < 0]
        assert (out.hot_slots[not_hot] == -1).all()


def test_residency_matches_python_lru():
    for seed in range(30):
        rng = random.Random(1000 + seed)
        k = rng.randint(1, 6)
        max_rows = rng.randint(1, 4)
        size = max_rows * k + rng.randint(0, 2 * k)  # the configured minimum and above
        _run(seed, num_regions=rng.randint(1, 4), size=size, k=k, max_rows=max_rows,
             span=rng.randint(1, 3 * size), steps=12)


def test_residency_fast_cases():
    # a context within the buffer: after the first step every row hits
    token = torch.full((1, 8), -1, dtype=torch.int64)
    stamp = torch.full((1, 8), -1, dtype=torch.int64)
    topk = torch.tensor([[0, 1, 2, -1]])
    one = torch.zeros(1, dtype=torch.int64)
    out = resolve(topk, one, one, token, stamp, 0, 1)
    assert out.num_misses.tolist() == [3]
    out = resolve(topk, one, one, out.slot_token, out.slot_stamp, 1, 1)
    assert out.num_misses.tolist() == [0]
    assert out.hot_slots.tolist() == [[0, 1, 2, -1]]


def test_union_positions_layout():
    topk = torch.tensor([[5, 6], [7, -1], [1, 2]])
    u = union_positions(topk, torch.tensor([1, 1, -1]), torch.tensor([0, 1, 0]), 2, 2)
    assert u.tolist() == [[-1, -1, -1, -1], [5, 6, 7, -1]]


def test_union_positions_beside_a_long_chunk():
    """A prefill chunk (not hot) in the batch ranks its rows past max_rows: they are ignored."""
    topk = torch.tensor([[3, 4], [1, -1], [2, 0], [0, 1], [5, 6]])
    region = torch.tensor([-1, -1, -1, -1, 0])  # a 4-row chunk, then one hot decode row
    rank = torch.tensor([0, 1, 2, 3, 0])
    u = union_positions(topk, region, rank, 1, 1)
    assert u.tolist() == [[5, 6]]


def test_resident_runs_skip_spilled_blocks_and_join_neighbours():
    from dsaserve.kv.hisparse.runtime import _resident_runs

    assert _resident_runs(2, 19, [3, -1, -1, 7, 2], 4) == [(2, 4), (12, 19)]
    assert _resident_runs(0, 8, [-1, -1], 4) == []
    assert _resident_runs(5, 5, [1, 2], 4) == []
    assert _resident_runs(1, 11, [0, 1, -1], 4) == [(1, 8)]
    for pages in ([0, -1, 2, 3, -1, 5], [-1, 1, -1, 3, 4, -1]):  # against a loop per position
        for lo in range(0, 24, 3):
            for hi in range(lo, 25, 5):
                runs = _resident_runs(lo, hi, pages, 4)
                got = [p for first, end in runs for p in range(first, end)]
                assert got == [p for p in range(lo, hi) if pages[p // 4] >= 0]
