"""HiSparse's residency kernel on the GPU at serving sizes: every output equals the PyTorch
reference's over consecutive steps (the tables carried from step to step), it does not
synchronise with the host, and the step (kernel + device stamp) replays from a CUDA graph. As
the runtime runs it (`resolve_tables`), it updates rows of larger tables in place."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kv.hisparse.residency import Residency, resolve, resolve_step, resolve_tables

pytestmark = pytest.mark.gpu


def _rows(g: torch.Generator, token: torch.Tensor, max_rows: int, k: int, context: int,
          overlap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """max_rows top-k rows per region, about `overlap` of each drawn from the positions the
    region holds, the rest fresh; 5 % pads; two rows of another request (not hot) first."""
    num_regions = token.shape[0]
    dev = token.device
    rows = []
    for _ in range(max_rows):
        score = torch.rand(num_regions, context, device=dev, generator=g)
        held = token.clamp(min=0)  # [R, S]; an empty slot boosts position 0, harmless
        boost = torch.rand(held.shape, device=dev, generator=g) < overlap * k / held.shape[1]
        score.scatter_add_(1, held, boost.float())
        rows.append(score.topk(k, dim=1).indices)  # [R, K] distinct positions
    topk = torch.stack(rows, dim=1).flatten(0, 1)  # [R·max_rows, K], a region's rows together
    topk[torch.rand(topk.shape, device=dev, generator=g) < 0.05] = -1
    region = torch.arange(num_regions, device=dev).repeat_interleave(max_rows)
    rank = torch.arange(max_rows, device=dev).repeat(num_regions)
    other = torch.randint(0, context, (2, k), device=dev, generator=g)
    return (torch.cat([other, topk]).int(), torch.cat([region.new_full((2,), -1), region]),
            torch.cat([rank.new_tensor([0, 1]), rank]))


def _equal(got: Residency, want: Residency) -> None:
    for name in Residency.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("b,k,size,max_rows", [(64, 2048, 4096, 1), (16, 2048, 10240, 4)])
def test_residency_kernel_equals_the_reference(g, b, k, size, max_rows) -> None:
    context = 131072
    token = torch.full((b, size), -1, dtype=torch.int64, device="cuda")
    stamp = torch.full_like(token, -1)
    now = torch.zeros((), dtype=torch.int64, device="cuda")
    for step in range(4):  # the first step fills empty slots; later ones evict by LRU
        topk, region, rank = _rows(g, token, max_rows, k, context, overlap=0.9)
        want = resolve(topk, region, rank, token, stamp, now, max_rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = resolve_step(topk, region, rank, token, stamp, now, max_rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _equal(got, want)
        assert int(want.num_misses.sum()) > 0, step
        token, stamp = got.slot_token, got.slot_stamp
        now += 1


def test_residency_kernel_updates_the_runtime_tables_in_place(g) -> None:
    """b = 60 request regions of 64 and 4 padded slots in the trash region (64): each step's
    rows of the tables equal the reference's on gathered copies, the others stay as they were."""
    b, k, size, context, max_req = 64, 2048, 4096, 131072, 64
    tok = torch.full((max_req + 1, size), -1, dtype=torch.int64, device="cuda")
    stamp = torch.full_like(tok, -1)
    regions = torch.randperm(max_req, device="cuda", generator=g)[:b]
    regions[-4:] = max_req
    now = torch.zeros((), dtype=torch.int64, device="cuda")
    for step in range(3):
        topk, region, rank = _rows(g, tok[regions], 1, k, context, overlap=0.9)
        region = torch.where((region >= 0) & (region < b - 4), region, -1)  # the trash: none
        want = resolve(topk, region, rank, tok[regions], stamp[regions], now, 1)
        before_tok, before_stamp = tok.clone(), stamp.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = resolve_tables(topk, region, rank, tok, stamp, regions, now, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.slot_token is tok and got.slot_stamp is stamp
        for name in ("hot_slots", "miss_pos", "miss_slot", "num_misses"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        assert torch.equal(tok[regions], want.slot_token)
        assert torch.equal(stamp[regions], want.slot_stamp)
        others = torch.ones(max_req + 1, dtype=torch.bool, device="cuda")
        others[regions] = False
        assert torch.equal(tok[others], before_tok[others])
        assert torch.equal(stamp[others], before_stamp[others])
        assert int(want.num_misses.sum()) > 0, step
        now += 1


def test_residency_step_replays_from_a_graph(g) -> None:
    b, k, size, context = 8, 2048, 4096, 131072
    token = torch.full((b, size), -1, dtype=torch.int64, device="cuda")
    stamp = torch.full_like(token, -1)
    now = torch.zeros((), dtype=torch.int64, device="cuda")
    topk, region, rank = _rows(g, token, 1, k, context, overlap=0.9)
    static = [topk.clone(), token.clone(), stamp.clone()]
    resolve_step(*static[:1], region, rank, *static[1:], now, 1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = resolve_step(static[0], region, rank, static[1], static[2], now, 1)
        now.add_(1)
    now.zero_()
    for _ in range(3):  # the tables carried: replay, check, copy the outputs back in
        want = resolve(static[0], region, rank, static[1], static[2], now.clone(), 1)
        graph.replay()
        _equal(out, want)
        static[1].copy_(out.slot_token)
        static[2].copy_(out.slot_stamp)
        static[0].copy_(_rows(g, static[1], 1, k, context, overlap=0.9)[0])
