"""HiSparse host blocks found by prefix hash (CPU): a spilled block stays in the prefix cache, its
MLA rows kept in the host pool after its request ends, and a later turn's hit restores them to a
GPU page instead of recomputing them. Greedy output equals the all-GPU engine's. After every step
every invariant holds, and every cached block's MLA rows equal, byte for byte, what an all-GPU
cache would hold for its prefix hash: the bytes its GPU page held while resident (recorded after
every step, never changing), whether it is spilled now (its host rows) or restored (its page).
Another engine's bytes would not do: a different batch mix (spilling delays admissions) changes
the last bits of later layers' rows, though not the greedy output."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_hisparse_spill import B, _config, _prompts

from dsaserve.config import HiSparseConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.events import KVEventSink
from dsaserve.kv.prefix_cache import extend_block_hashes

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
RUNNING_AT_ONCE: dict[LLMEngine, int] = {}  # the last `run`'s most requests running at once


class AllGpuRows(KVEventSink):
    """What an all-GPU cache holds per prefix hash: each cached block's MLA rows (every layer,
    as bytes) as its GPU page held them, recorded after every step until the hash leaves the
    prefix cache (a recomputation may then cache other last bits under it). Listens to the
    block pool's KV events for that. A block received spilled (P/D) never had a page here: its
    rows are the prefill engine's (`sent_by`, all-GPU), found there by the same hash."""

    def __init__(self, engine: LLMEngine, sent_by: LLMEngine | None = None) -> None:
        self.rows: dict[bytes, list[torch.Tensor]] = {}
        self.engine, self.sent_by = engine, sent_by
        engine.scheduler.kv.pool.events = self

    def removed(self, block_hashes: list[bytes], medium: str = "GPU") -> None:
        for h in block_hashes:
            self.rows.pop(h, None)

    def check(self, engine: LLMEngine) -> int:
        """Record resident cached blocks (a hash's rows never change while cached, a restored
        page included) and compare every spilled cached block's host rows with its record;
        returns the blocks compared."""
        assert engine is self.engine
        pool, mla, caches = engine.scheduler.kv.pool, engine.scheduler.mla, engine.runner.caches
        spilled = []
        for b in range(pool.num_blocks):
            h = pool.block_hash(b)
            if h is None:
                continue
            if b not in mla.page_of:
                spilled.append(b)
                continue
            page = [c.kv[mla.page_of[b]].view(torch.uint8).clone() for c in caches]
            seen = self.rows.setdefault(h, page)
            assert all(map(torch.equal, seen, page)), f"block {b}: its page's rows changed"
        if spilled:
            host = engine.runner.hisparse_block_rows(spilled)
            for i, b in enumerate(spilled):
                want = self.rows.get(pool.block_hash(b)) or self._sent(pool.block_hash(b))
                assert all(torch.equal(h[i], w) for h, w in zip(host, want, strict=True)), (
                    f"block {b}: its host rows are not its GPU page's")
        return len(spilled)

    def _sent(self, block_hash: bytes) -> list[torch.Tensor]:
        assert self.sent_by is not None, "a spilled block whose page was never seen"
        b = self.sent_by.scheduler.kv.pool.lookup(block_hash)
        assert b is not None, "the prefill engine lost a block this one keeps"
        return [c.kv[b].view(torch.uint8) for c in self.sent_by.runner.caches]


def run(engine: LLMEngine, prompts: dict[str, list[int]], ref: AllGpuRows | None = None
        ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step by step → (outputs, cached prompt tokens) per request id; with `ref`, every
    invariant and the cached blocks' bytes after each step."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, PARAMS)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    RUNNING_AT_ONCE[engine] = 0
    while engine.has_unfinished_requests():
        RUNNING_AT_ONCE[engine] = max(RUNNING_AT_ONCE[engine], engine.scheduler.num_running)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
        if ref is not None:
            engine.check_integrity()
            ref.check(engine)
    engine.step()  # an empty step tells the runner which requests ended
    if ref is not None:
        engine.check_integrity()
        ref.check(engine)
    return out, cached


def two_turns(engine: LLMEngine, prompts: list[list[int]], more: list[int]
              ) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, int]]:
    """Turn 1: every prompt at once (conversation "0" among them); turn 2: conversation 0's
    whole context and a few new tokens."""
    turn1, _ = run(engine, {str(i): p for i, p in enumerate(prompts)})
    out2, cached = run(engine, {"0.2": prompts[0] + turn1["0"] + more})
    return turn1, out2, cached


@pytest.mark.parametrize(("preset", "kv"), [("tiny-glm5", "auto"), ("tiny-dsv32", "fp8_ds_mla")])
def test_later_turn_hits_spilled_blocks(model_dirs, engine_config, preset, kv):
    """Turn 1's long decoders spill most of their MLA pages; turn 2 of one conversation hits
    every cached block of it, the spilled ones restored from the host pool, so it computes
    exactly the tokens the all-GPU engine does, and its greedy output is the same."""
    model_dir = model_dirs[preset]
    prompts = _prompts(4, seed=21, lo=28, hi=36)
    more = _prompts(1, seed=22, lo=6, hi=6)[0]
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv))
    want1, want2, ref_cached = two_turns(ref, prompts, more)
    topk = ref.config.model.index_topk
    engine = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, buffer=topk,
                                           mla_pages=16))
    mla, rows = engine.scheduler.mla, AllGpuRows(engine)
    turn1, _ = run(engine, {str(i): p for i, p in enumerate(prompts)}, rows)
    assert turn1 == want1
    assert mla.num_spills > 0
    # conversation 0's spilled blocks are kept by hash: a later turn can find them
    kept = set(mla.host_kept())
    assert kept and set(engine.runner.hisparse.kept) == kept
    assert rows.check(engine) == len(kept)
    turn2 = prompts[0] + turn1["0"] + more
    hashes: list[bytes] = []  # turn 2's block hashes, as its lookup computes them
    extend_block_hashes(hashes, turn2, B, None)
    pool = engine.scheduler.kv.pool
    hit_kept = [pool.lookup(h) for h in hashes if pool.lookup(h) in kept]
    assert hit_kept, "no spilled block of conversation 0 was kept"
    out2, cached = run(engine, {"0.2": turn2}, rows)
    assert out2 == want2
    # nothing of the cached prefix recomputed: the same hit as the all-GPU engine's
    assert cached["0.2"] == ref_cached["0.2"] >= len(hit_kept) * B
    assert mla.num_restores >= len(hit_kept)
    rt = engine.runner.hisparse
    assert not rt.entries and set(rt.kept) == set(mla.host_kept())
    assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks


def test_host_pool_pressure_evicts_kept_blocks(model_dirs, engine_config):
    """A host pool of two windows and three blocks: the kept blocks of a finished batch are
    evicted, least recently freed first, when the next batch takes both windows, never
    refusing admission; output stays exact, and a later turn hits what is left."""
    model_dir = model_dirs["tiny-glm5"]
    prompts = _prompts(4, seed=23, lo=28, hi=36)
    more = _prompts(1, seed=24, lo=6, hi=6)[0]
    probe = LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages=16))
    per_token = sum(c.kv[0, 0].numel() * c.kv.element_size() for c in probe.runner.caches)
    window = probe.runner.hisparse.blocks_per_request
    host = HiSparseConfig(host_pool_bytes=(2 * window + 3) * B * per_token)
    cfg = _config(engine_config, model_dir, buffer=16, mla_pages=16)
    engine = LLMEngine.from_config(replace(cfg, hisparse=host))
    assert engine.scheduler.config.max_num_seqs == 2
    ref = LLMEngine.from_config(_config(engine_config, model_dir))
    want1, _ = run(ref, {str(i): p for i, p in enumerate(prompts[:2])})
    want2, _ = run(ref, {str(i): p for i, p in enumerate(prompts[2:], 2)})
    want3, ref_cached = run(ref, {"0.2": prompts[0] + want1["0"] + more})
    mla = engine.scheduler.mla
    rows = AllGpuRows(engine)
    got1, _ = run(engine, {str(i): p for i, p in enumerate(prompts[:2])}, rows)
    assert got1 == want1
    kept_before = mla.host_kept()
    assert len(kept_before) > 3  # more than the room beside two windows
    got2, _ = run(engine, {str(i): p for i, p in enumerate(prompts[2:], 2)}, rows)
    assert got2 == want2 and RUNNING_AT_ONCE[engine] == 2  # kept blocks refused no one
    # the two new windows left room for 3 kept blocks while they ran: the oldest went first
    assert not set(kept_before[:-3]) & set(mla.host_kept())
    got3, cached = run(engine, {"0.2": prompts[0] + got1["0"] + more}, rows)
    assert got3 == want3
    assert cached["0.2"] <= ref_cached["0.2"]
    rt = engine.runner.hisparse
    assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks


def test_pd_later_turn_hits_received_spilled_blocks(model_dirs, engine_config):
    """P/D (shm) into a spilling decode engine: turn 1's long prompt is READ into the host pool
    (its blocks below the write tail never had a page) and stays findable, with the prefill
    engine's bytes; turn 2 (turn 1's context and a few new tokens) hits every cached block of
    turn 1 on the decode side, the spilled ones restored from the host pool, and only the rest
    of its prompt is READ. Greedy output equals the aggregated engine's."""
    from test_pd_hisparse_spill import GREEDY, _disagg, _pd_at_once
    from test_pd_hisparse_spill import _config as pd_config

    model_dir = model_dirs["tiny-glm5"]
    plain = pd_config(engine_config, model_dir, "auto")
    ref = LLMEngine.from_config(plain)
    topk = ref.config.model.index_topk
    prompt = _prompts(1, seed=25, lo=30, hi=30)[0]
    want1 = ref.generate([prompt], GREEDY)[0]
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(replace(pd_config(engine_config, model_dir, "auto", buffer=topk,
                                                pages=16), disagg=_disagg("kv_consumer")))
    try:
        rows, worker, mla = AllGpuRows(d, sent_by=p), d.runner.connector, d.scheduler.mla
        assert _pd_at_once(p, d, [prompt], "a", lambda: rows.check(d)) == [want1]
        got1 = want1
        # the blocks received spilled are kept by hash, with the prefill engine's rows (check)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt, B, None)
        received = hashes[: (len(prompt) - 1) // B]
        assert {d.scheduler.kv.pool.lookup(h) for h in received} <= set(mla.host_kept())
        assert rows.check(d) >= len(received)

        turn2 = prompt + got1 + _prompts(1, seed=26, lo=6, hi=6)[0]
        want2 = ref.generate([turn2], GREEDY)[0]
        hits, read, restores = (d.stats().prefix_cache_hits, worker.bytes_received,
                                mla.num_restores)
        assert _pd_at_once(p, d, [turn2], "b", lambda: rows.check(d)) == [want2]
        cached = d.stats().prefix_cache_hits - hits
        # every computed block of turn 1 hit: none of the received spilled ones is READ again
        assert cached == (len(prompt) + len(got1) - 1) // B * B
        assert mla.num_restores - restores >= len(received)
        per_token = d.executor.call("kv_row_bytes")[0]
        assert worker.bytes_received - read == (len(turn2) - 1 - cached) * per_token
        rt = d.runner.hisparse
        assert not rt.entries and set(rt.kept) == set(mla.host_kept())
        assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks
    finally:
        p.shutdown()
        d.shutdown()
