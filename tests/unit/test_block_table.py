"""engine/block_table.py: the device block table, updated from diffs, equals a plain table
rebuilt from scratch after any sequence of adds, appends, rollbacks, removals and row reuse;
and a decode step's upload no longer grows with the context."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.block_table import BlockTable, MirroredArray
from dsaserve.engine.engine import LLMEngine
from dsaserve.kernels import staging
from dsaserve.kv import layout

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _step(table: BlockTable, req_ids: list[str], device: torch.device) -> torch.Tensor:
    """What the runner does each step: the changes and the rows in one upload, applied, then
    the step's rows gathered → [R, width] on the device."""
    rows = table.rows(req_ids)
    width = int(table.num_blocks[rows].max())
    pairs_d, rows_d = staging.upload([table.pending(), torch.from_numpy(rows)], device)
    table.apply(pairs_d)
    return table.gather(rows_d, width)


def _reference(blocks: dict[str, list[int]], req_ids: list[str]) -> torch.Tensor:
    width = max(len(blocks[r]) for r in req_ids)
    out = torch.full((len(req_ids), width), -1, dtype=torch.int32)
    for i, r in enumerate(req_ids):
        out[i, : len(blocks[r])] = torch.tensor(blocks[r], dtype=torch.int32)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_random_diffs_match_a_plain_table(device, seed):
    """Random adds (new and resumed requests), appends, rollbacks of draft blocks, removals and
    re-adds, several between steps at times; the table starts small so that it grows in both
    directions. After every step the gathered table is the plain one, and the invariants
    hold."""
    rng = random.Random(seed)
    dev = torch.device(device)
    table = BlockTable(2, 3, dev)
    ref: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        live = sorted(ref)
        if op < 0.2 or not live:
            rid = f"r{next_id}" if rng.random() < 0.8 or not live else rng.choice(live)
            next_id += 1
            ref[rid] = [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
            table.add(rid, ref[rid])
        elif op < 0.6:
            rid = rng.choice(live)
            new = [rng.randrange(1000) for _ in range(rng.randrange(0, 3))]
            ref[rid] += new
            table.append(rid, new)
        elif op < 0.8:  # rejected drafts: cut back, sometimes appended to in the same diff
            rid = rng.choice(live)
            keep = rng.randrange(0, len(ref[rid]) + 1)
            del ref[rid][keep:]
            table.truncate(rid, keep)
            if rng.random() < 0.5:
                new = [rng.randrange(1000)]
                ref[rid] += new
                table.append(rid, new)
        else:
            rid = rng.choice(live)
            del ref[rid]
            table.remove(rid)
        table.check_integrity()  # queued changes are allowed between steps
        if ref and rng.random() < 0.5:
            step = rng.sample(sorted(ref), rng.randrange(1, len(ref) + 1))
            if max(len(ref[r]) for r in step) == 0:
                continue
            got = _step(table, step, dev)
            assert torch.equal(got.cpu(), _reference(ref, step)), (seed, step)
            table.check_integrity()
            for rid in ref:
                assert table.blocks(rid).tolist() == ref[rid]
    assert table.max_rows > 2 and table.max_blocks_per_row > 3, "the table never grew"


def test_a_decode_step_sends_only_what_changed():
    """Four requests of 40 blocks each at the start, one block appended to one: the step's
    upload holds one (index, value) pair, not 4 × 40 ids; nothing changed, nothing goes."""
    table = BlockTable(4, 64, torch.device("cpu"))
    for i in range(4):
        table.add(f"r{i}", list(range(40 * i, 40 * i + 40)))
    _step(table, ["r0", "r1", "r2", "r3"], torch.device("cpu"))
    table.append("r2", [999])
    pairs = table.pending()
    assert pairs.tolist() == [[2 * 64 + 40], [999]]
    table.apply(pairs)
    got = table.gather(torch.from_numpy(table.rows(["r3", "r2"])), 41)
    assert got.shape == (2, 41) and got[1, 40] == 999 and got[0, 40] == -1
    assert table.pending().shape == (2, 0)


def test_mirrored_array_sends_the_last_write_once():
    arr = MirroredArray(np.full(8, -1, dtype=np.int32), torch.device("cpu"))
    arr.write(np.array([3, 5]), [1, 2])
    arr.write(np.array([3]), [7])
    pairs = arr.pending()
    assert pairs.tolist() == [[3, 5], [7, 2]]
    with pytest.raises(AssertionError, match="not the host"):
        arr.check_integrity()  # sent for the step, not applied yet
    arr.apply(pairs)
    arr.check_integrity()
    arr.write(np.array([0]), [4])
    arr.check_integrity()  # queued: the device may differ there until the next step
    assert arr.device_array.tolist() == [-1, -1, -1, 7, -1, 2, -1, -1]  # entry 0: still queued


@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (2, 4)])
def test_page_slots_is_slot_mapping_through_the_page_table(dcp_size, interleave):
    """HiSparse's MLA slots from the block slots equal slot_mapping over the page table
    (page_of[block], −1 kept), for every DCP rank."""
    g = torch.Generator().manual_seed(0)
    B, R, W, num_blocks = 8, 5, 6, 40
    table = torch.randperm(num_blocks, generator=g)[: R * W].view(R, W).to(torch.int32)
    table[torch.rand(R, W, generator=g) < 0.2] = -1
    page_of = torch.randint(-1, 30, (num_blocks,), generator=g, dtype=torch.int32)
    pages = torch.where(table >= 0, page_of[table.clamp(min=0).long()], -1)
    pos = torch.randint(0, W * B * dcp_size, (200,), generator=g)
    req = torch.randint(0, R, (200,), generator=g)
    for rank in range(dcp_size):
        slots = layout.slot_mapping(pos, req, table, B, dcp_size, rank, interleave)
        want = layout.slot_mapping(pos, req, pages, B, dcp_size, rank, interleave)
        assert torch.equal(layout.page_slots(slots, page_of, B), want)


def _decode_upload_sizes(monkeypatch, engine: LLMEngine, prompt_len: int) -> list[int]:
    """Elements uploaded in each decode step of one request with a `prompt_len` prompt."""
    sizes: list[int] = []
    upload = staging.upload

    def counting(parts, device):
        sizes[-1] += sum(p.numel() for p in parts)
        return upload(parts, device)

    monkeypatch.setattr(staging, "upload", counting)
    engine.add_request("r", [5 + i % 50 for i in range(prompt_len)],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        sizes.append(0)
        engine.step()
        steps.append(sizes[-1])
    monkeypatch.setattr(staging, "upload", upload)
    engine.check_integrity()
    return steps[1:]  # the first step is the prompt's


def test_decode_upload_does_not_grow_with_context(model_dirs, engine_config, monkeypatch):
    """A decode step at 3 blocks of context and at 30 uploads the same number of elements,
    give or take the one block a step may add (an (index, value) pair): the whole table used to
    go up every step (30 ids at the longer context)."""
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"], block_size=8,
                                                 max_model_len=512, num_blocks=80,
                                                 prefix_caching=False))
    short = _decode_upload_sizes(monkeypatch, engine, 20)
    long = _decode_upload_sizes(monkeypatch, engine, 236)
    assert len(short) == len(long) == 5
    assert max(long) <= max(short) + 2 and min(long) == min(short), (short, long)
