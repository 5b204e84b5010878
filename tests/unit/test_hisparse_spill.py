"""HiSparse spilling on one rank (CPU): with far fewer MLA pages than the requests' blocks, long
decoders' older MLA pages spill (their rows stay in the host pool) and greedy output still equals
the all-GPU engine's; bf16 and fp8_ds_mla, with MTP3. Every invariant (page map, host pool, hot
buffers, mirror bytes of resident pages) is checked after every step, and nothing leaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsaserve.config import ConfigError, EngineConfig, HiSparseConfig, OffloadConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.block_pool import BlockPool
from dsaserve.kv.hisparse.admission import (
    MlaPageSizing,
    SharedBlocks,
    hot_region_rows,
    min_mla_pages,
    mla_pages_for,
    shared_blocks,
    shared_windows,
    size_mla_pages,
    spilling_holds,
    write_tail_pages,
)
from dsaserve.kv.hisparse.mla_pages import MlaPageMap

HOST = HiSparseConfig(host_pool_bytes=16 << 20)
B = 4  # small blocks: many pages per request, so spills are fine-grained


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(4, 512, (m,), generator=g).tolist() for m in lens]


def _config(engine_config, model_dir, *, kv: str = "auto", spec: int = 0,
            buffer: int | None = None, mla_pages: int | None = None, max_model_len: int = 64,
            num_blocks: int = 100):
    cfg = engine_config(model_dir, kv_cache_dtype=kv, block_size=B, num_blocks=num_blocks,
                        max_model_len=max_model_len)
    if spec:
        cfg = replace(cfg, speculative=SpecConfig(num_speculative_tokens=spec))
    if buffer is None:
        return cfg
    att = replace(cfg.attention, hisparse_device_buffer_size=buffer,
                  hisparse_device_mla_pages=mla_pages, hisparse_config_given=True)
    return replace(cfg, attention=att, hisparse=HOST)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
         ) -> tuple[list[list[int]], int, int]:
    """Step by step, every invariant checked after each step → (outputs, most requests running
    at once, most blocks those running requests held at once)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most_running = most_blocks = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        most_blocks = max(most_blocks, sum(len(r.block_ids) for r in running))
        engine.check_integrity()
    engine.step()  # an empty step tells the runner which requests ended
    engine.check_integrity()
    rt, mla = engine.runner.hisparse, engine.scheduler.mla
    # nothing leaks: the only host blocks still held keep free cached spilled blocks' rows,
    # and the only pages still mapped are free cached blocks' (prefix hits later)
    assert not rt.entries and set(rt.kept) == set(mla.host_kept())
    assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks
    pool = engine.scheduler.kv.pool
    assert all(pool.ref_count(b) == 0 and pool.block_hash(b) is not None
               for b in [*mla.page_of, *rt.kept])
    return [out[str(i)] for i in range(len(prompts))], most_running, most_blocks


def _async(cfg):
    return replace(cfg, scheduler=replace(cfg.scheduler, async_scheduling=True))


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize(("preset", "kv"), [("tiny-glm5", "auto"), ("tiny-dsv32", "fp8_ds_mla")])
def test_spilled_pages_greedy_equals_all_gpu(model_dirs, engine_config, preset, kv, scheduling):
    """Four requests of 10-13 blocks each over 17 MLA pages (one max-length request's worth):
    all four decode at once, most of their MLA rows read from the host pool. Async: step k + 1
    runs from step k's samples on the device; the residency, fetch and mirror run as in sync."""
    model_dir = model_dirs[preset]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4, seed=11, lo=30, hi=45)
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv))
    want = ref.generate(prompts, params)
    topk = ref.config.model.index_topk
    pages = 16  # cdiv(max_model_len 64, B): the least the engine accepts
    cfg = _config(engine_config, model_dir, kv=kv, buffer=topk, mla_pages=pages)
    engine = LLMEngine.from_config(_async(cfg) if scheduling == "async" else cfg)
    assert engine.runner.caches[0].kv.shape[0] == pages  # the MLA cache is that small
    assert engine.runner.caches[0].index.shape[0] == 100  # the indexer keeps a page per block
    got, most_running, most_blocks = _run(engine, prompts, params)
    assert got == want
    assert engine.scheduler.mla.num_spills == engine.stats().hisparse_mla_spills > 0
    assert most_running == len(prompts)
    assert most_blocks > pages  # more KV at once than the MLA pages hold: concurrency beyond HBM
    assert engine.stats().num_preemptions == 0
    assert int(engine.runner.hisparse.rows_from_host) > 0


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_spilled_pages_greedy_equals_all_gpu_mtp3(draftable_dirs, engine_config, kv, scheduling):
    """MTP3: the write tail (1 + 3 verify rows and 2 lookahead slots) stays resident; rejected
    drafts' blocks go back with their pages. Async: the host counts a step in flight as all
    drafts accepted and the device moves the next step's rows back by those rejected; the rows
    so rewritten keep their MLA pages (the write tail starts k positions lower), are mirrored
    again, and neither the hot buffer nor the host pool is trusted at or above the first
    position really written."""
    model_dir = draftable_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(3, seed=12, lo=66, hi=90)
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, max_model_len=128))
    want = ref.generate(prompts, params)
    topk = ref.config.model.index_topk
    pages = 33  # cdiv(128 + 2 lookahead, B)
    cfg = _config(engine_config, model_dir, kv=kv, spec=3, buffer=4 * topk, mla_pages=pages,
                  max_model_len=128)
    engine = LLMEngine.from_config(_async(cfg) if scheduling == "async" else cfg)
    assert engine.scheduler.mla.write_lag == (3 if scheduling == "async" else 0)
    got, most_running, most_blocks = _run(engine, prompts, params)
    assert got == want
    assert engine.scheduler.mla.num_spills > 0
    assert most_running == len(prompts) and most_blocks > pages
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_without_pressure_nothing_spills(model_dirs, engine_config):
    """MLA pages for every block: the map is in use but no page ever spills."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(3, seed=13, lo=20, hi=40)
    ref = LLMEngine.from_config(_config(engine_config, model_dir))
    engine = LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages=100))
    assert _run(engine, prompts, params)[0] == ref.generate(prompts, params)
    assert engine.scheduler.mla.num_spills == 0


def test_dense_path_reads_mla_pages(model_dirs, engine_config):
    """Contexts within top-k take the dense path, which reads every row of the MLA pages (not
    the block ids); then they grow past the buffer and spill."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    prompts = [p[:9] for p in _prompts(4, seed=15, lo=9, hi=12)]
    ref_cfg = _config(engine_config, model_dir)
    ref_cfg = replace(ref_cfg, attention=replace(ref_cfg.attention, sparse_mla_force_mqa=False))
    want = LLMEngine.from_config(ref_cfg).generate(prompts, params)
    cfg = _config(engine_config, model_dir, buffer=16, mla_pages=16)
    cfg = replace(cfg, attention=replace(cfg.attention, sparse_mla_force_mqa=False))
    engine = LLMEngine.from_config(cfg)
    assert _run(engine, prompts, params)[0] == want
    assert engine.scheduler.mla.num_spills > 0


def test_later_turn_prefix_hit_with_spilling(model_dirs, engine_config):
    """A finished turn's cached blocks keep their pages (idle); another request's prefill takes
    some of them (tail blocks first, which leave the prefix cache) and a later turn still hits
    the head of the first turn, mirrored into its host window from those pages."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a, b, more = _prompts(3, seed=14, lo=28, hi=36)
    ref = LLMEngine.from_config(_config(engine_config, model_dir))
    engine = LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages=16))
    turn1 = _run(engine, [a], params)[0][0]
    assert turn1 == ref.generate([a], params)[0]
    idle = set(engine.scheduler.mla.page_of)
    assert _run(engine, [b], params)[0] == ref.generate([b], params)
    assert idle - set(engine.scheduler.mla.page_of)  # b took idle pages
    turn2 = a + turn1 + more[:9]
    assert _run(engine, [turn2], params)[0] == ref.generate([turn2], params)
    assert engine.stats().prefix_cache_hits > 0


def test_too_few_mla_pages_is_refused(model_dirs, engine_config):
    """The least the engine accepts is one window (a prefill reads its pages): the rule
    `dsaserve plan`'s suggestion starts from (kv/hisparse/admission.py)."""
    model_dir = model_dirs["tiny-glm5"]
    least = min_mla_pages(64, B)
    assert least == 16 == mla_pages_for(0, 64, B, tail_pages=2)
    with pytest.raises(ConfigError, match="device_mla_pages 15 cannot hold one request"):
        LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages=least - 1))
    with pytest.raises(ConfigError, match="device_mla_pages 101 exceeds the 100 KV blocks"):
        LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages=101))
    with pytest.raises(ConfigError, match='device_mla_pages "auto": 15 KV blocks .* cannot'):
        LLMEngine.from_config(_config(engine_config, model_dir, buffer=16, mla_pages="auto",
                                      num_blocks=15))
    cfg = _config(engine_config, model_dir, buffer=16, mla_pages=16)
    with pytest.raises(ConfigError, match="device_mla_pages does not run with the host KV"):
        replace(cfg, offload=OffloadConfig(cpu_bytes_to_use=8 << 20))


def test_page_map_spills_lru_and_keeps_idle_pages():
    """The map alone: free pages first, then idle cached blocks' pages (they leave the prefix
    cache), then victims in the order given; a freed uncached block gives its page back."""
    pool = BlockPool(8, enable_caching=True)
    mla = MlaPageMap(3, pool)
    a = pool.allocate(3)
    assert mla.make_resident(a, iter(()))
    assert sorted(mla.page_of.values()) == [0, 1, 2]
    pool.cache_block(a[0], b"h0")
    pool.free(a[:2])  # a[0] cached: idle, keeps its page; a[1] not cached: page back
    mla.freed(a[:2])
    assert a[0] in mla.page_of and a[1] not in mla.page_of and mla.num_free_pages == 1
    b = pool.allocate(2)
    assert mla.make_resident(b, iter(()))  # the free page, then a[0]'s idle one
    assert a[0] not in mla.page_of and pool.lookup(b"h0") is None
    c = pool.allocate(1)
    assert not mla.make_resident(c, iter(()))  # nothing left to take
    pool.cache_block(a[2], b"h2")
    assert mla.make_resident(c, iter([a[2]]))  # a spill: a[2] stays in the prefix cache
    assert a[2] not in mla.page_of and pool.lookup(b"h2") == a[2] and mla.num_spills == 1
    changes = dict(mla.take_changes())
    assert changes[a[2]] == -1 and changes[c[0]] >= 0 and not mla.take_changes()
    assert mla.take_host_changes() == ((), (), ())


def test_page_map_keeps_spilled_cached_blocks_by_hash():
    """A spilled cached block that becomes free is host-kept (the runtime keeps its host rows);
    a hit gives it a page again, to be restored from those rows; allocation and host-pool
    pressure evict kept blocks, least recently freed first."""
    pool = BlockPool(8, enable_caching=True)
    mla = MlaPageMap(2, pool)
    a = pool.allocate(3)
    assert mla.make_resident(a[:2], iter(()))
    for i, b in enumerate(a[:2]):
        pool.cache_block(b, b"h%d" % i)
    assert mla.make_resident(a[2:], iter(a[:2]))  # a[0] spills, still findable
    assert pool.lookup(b"h0") == a[0] and a[0] not in mla.page_of
    pool.free(a)
    mla.freed(a)
    mla.check_integrity([], 1, 1)
    assert mla.host_kept() == [a[0]] and mla.take_host_changes() == ((a[0],), (), ())
    # a later turn hits a[0]: it gets a page again, to be filled from the kept rows
    pool.touch([a[0]])
    assert mla.make_resident([a[0]], iter(()))
    assert a[0] in mla.page_of and mla.num_restores == 1
    mla.check_integrity([], 1, 1)
    assert mla.take_host_changes() == ((), (a[0],), ()) and not mla.host_kept()
    # spilled again by its holder, freed, kept; then allocation reuses the id: dropped
    mla.spill(a[0])
    pool.free([a[0]])
    mla.freed([a[0]])
    assert mla.take_host_changes() == ((a[0],), (), ())
    rest = pool.allocate(pool.num_free_blocks)
    assert a[0] in rest and pool.lookup(b"h0") is None
    assert mla.take_host_changes() == ((), (), (a[0],)) and not mla.host_kept()
    # host-pool pressure: the least recently freed kept block goes first
    pool.free(rest)
    mla.freed(rest)
    mla.check_integrity([], 1, 1)
    kept = rest[:3]
    for i, b in enumerate(kept):
        pool.touch([b])
        pool.cache_block(b, b"k%d" % i)
        pool.free([b])
        mla.freed([b])
    assert mla.host_kept() == kept
    mla.evict_host_kept(2)
    assert mla.host_kept() == kept[2:] and pool.lookup(b"k0") is None
    assert mla.take_host_changes() == (tuple(kept), (), tuple(kept[:2]))
    mla.check_integrity([], 1, 1)


def test_spill_metrics():
    """The page usage gauge and the spill counter appear only when spilling is on."""
    from dsaserve.core import EngineStats
    from dsaserve.serve.metrics import ServerMetrics

    base = dict(num_running=0, num_waiting=0, num_free_blocks=8, num_total_blocks=8,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    on = EngineStats(**base, num_mla_pages=16, num_mla_pages_free=4, hisparse_mla_spills=7)
    text = ServerMetrics("m", lambda: on).exposition().decode()
    assert 'vllm:hisparse_mla_pages_usage_perc{model_name="m"} 0.75' in text
    assert 'vllm:hisparse_mla_spilled_blocks_total{model_name="m"} 7.0' in text
    off = ServerMetrics("m", lambda: EngineStats(**base)).exposition().decode()
    assert "hisparse" not in off


def test_auto_mla_pages_from_the_given_blocks(model_dirs, engine_config):
    """device_mla_pages "auto" with the blocks given (--num-gpu-blocks-override): pages for the
    requests those blocks hold at once (100 // 16-block windows = 6, below the 16 the host
    admits), each keeping a one-page write tail, beside one window. Greedy output equals the
    all-GPU engine's, and the pages spill."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4, seed=11, lo=30, hi=45)
    want = LLMEngine.from_config(_config(engine_config, model_dir)).generate(prompts, params)
    engine = LLMEngine.from_config(_config(engine_config, model_dir, buffer=16,
                                           mla_pages="auto"))
    assert write_tail_pages(0, B) == 1
    assert engine.runner.num_mla_pages == engine.scheduler.mla.num_pages == 16 + 6 * 1
    assert engine.runner.num_blocks == 100
    got, most_running, most_blocks = _run(engine, prompts, params)
    assert got == want and engine.scheduler.mla.num_spills > 0
    assert most_blocks > engine.runner.num_mla_pages


@pytest.mark.parametrize("pd_decode", [False, True], ids=["aggregated", "pd_decode"])
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_auto_mla_pages_equal_the_plan(draftable_dirs, engine_config, monkeypatch, kv,
                                       pd_decode):
    """From a KV budget, "auto" gives the pages and blocks `dsaserve plan` suggests for the same
    budget, host pool and hot buffer (one function), with MTP3 (the test above decodes with
    "auto"). A P/D decode engine (kv_consumer; `dsaserve plan --pd-decode`) sizes its pages
    for one prompt of the hot buffer's rows, not one window: fewer pages, more blocks, and
    below one window its scheduler bounds what it prefills itself."""
    from dsaserve.config import DisaggConfig
    from dsaserve.engine import runner
    from dsaserve.plan import costmodel as cm

    model_dir = draftable_dirs["tiny-glm5"]
    ctx = 256  # well beyond the 64-row hot buffer, or spilling would save nothing
    cfg = _config(engine_config, model_dir, kv=kv, spec=3, buffer=64, mla_pages="auto",
                  num_blocks=None, max_model_len=ctx)
    cfg = replace(cfg, dtype="bfloat16")
    if pd_decode:
        cfg = replace(cfg, disagg=DisaggConfig(kv_role="kv_consumer", backend="shm",
                                               side_channel_port=0))
    plan_kv = cm.kv_bytes_per_token(cfg.model, "bf16" if kv == "auto" else kv)
    # one window (ctx + 2 lookahead slots: 65 blocks) of every cache on the GPU, per request
    window_bytes = (ctx + B) * (plan_kv.mla_all_layers + plan_kv.indexer_all_layers)
    budget = 3 * window_bytes  # one MLA page per block: 3 requests of the 16 the host admits
    monkeypatch.setattr(runner, "_CPU_KV_BUDGET_BYTES", budget)

    def plan_for(pd: bool) -> cm.HiSparseConcurrency:
        return cm.hisparse_concurrency(plan_kv, ctx, kv_room=budget,
                                       host_pool_bytes=cfg.hisparse.host_pool_bytes,
                                       hot_rows=cfg.hisparse_buffer_rows, block_size=B,
                                       pd_decode=pd)

    plan = plan_for(pd_decode)
    sizing = plan.mla_sizing
    assert sizing is not None and sizing.concurrency > 3 and plan.mla_pages > 0
    engine = LLMEngine.from_config(cfg)
    assert engine.runner.num_mla_pages == plan.mla_pages
    assert engine.runner.num_blocks == sizing.num_blocks
    if pd_decode:
        window = min_mla_pages(ctx + 2, B)
        aggregated = plan_for(False).mla_sizing
        tail = write_tail_pages(3, B)
        assert plan.mla_pages == min_mla_pages(64 + 2, B) + sizing.concurrency * tail < window
        assert plan.mla_pages < aggregated.num_mla_pages
        assert sizing.num_blocks > aggregated.num_blocks
        assert engine.scheduler.local_prefill_tokens == plan.mla_pages * B - 2
    else:
        assert engine.scheduler.local_prefill_tokens is None
    # the budget holds the pages, the blocks and each request's hot buffer
    mla_page, index_page = runner.cache_page_bytes(
        cfg.model, engine.runner.model.num_cache_layers, B, cfg.cache.fp8, torch.bfloat16)
    hot = engine.runner.hisparse.hot
    hot_bytes = sum(h.numel() * h.element_size() for h in hot)
    assert hot_bytes == engine.runner.hisparse.max_requests * (
        hot_region_rows(cfg.hisparse_buffer_rows, B) * mla_page // B)
    used = plan.mla_pages * mla_page + sizing.num_blocks * index_page
    assert used + sizing.concurrency * hot_bytes // engine.runner.hisparse.max_requests <= budget


def test_auto_mla_pages_size_alone():
    """The sizing function alone: spilling only when it holds more requests than one MLA page
    per block; the errors name the flag."""
    kw = dict(window_tokens=64, block_size=4, tail_pages=1, mla_page_bytes=100,
              index_page_bytes=10, hot_bytes_per_request=50)
    # 16 blocks a window: one MLA page per block holds budget // (16 · 110) requests
    roomy = size_mla_pages(max_requests=2, kv_bytes=10 * 16 * 110, **kw)
    assert roomy == MlaPageSizing(num_mla_pages=0, num_blocks=160, concurrency=2)
    tight = size_mla_pages(max_requests=8, kv_bytes=2 * 16 * 110, **kw)
    # (3,520 − 16 · 100) // (16 · 10 + 100 + 50) = 6 requests; 16 + 6 pages
    assert tight == MlaPageSizing(num_mla_pages=22, concurrency=6,
                                  num_blocks=(3520 - 22 * 100 - 6 * 50) // 10)
    assert tight.num_blocks >= 6 * 16
    # a P/D decode engine: one prompt of 8 tokens (2 pages) beside the tails, not a window:
    # (3,520 − 2 · 100) // 310 = 10 fit, the host's 8 decode; 2 + 8 pages
    pd = size_mla_pages(max_requests=8, kv_bytes=2 * 16 * 110, prefill_tokens=8, **kw)
    assert pd == MlaPageSizing(num_mla_pages=10, concurrency=8,
                               num_blocks=(3520 - 10 * 100 - 8 * 50) // 10)
    assert pd.num_blocks >= 8 * 16
    given = size_mla_pages(max_requests=8, num_blocks=40, **kw)
    assert given == MlaPageSizing(num_mla_pages=18, num_blocks=40, concurrency=2)
    assert size_mla_pages(max_requests=8, num_blocks=17, **kw).num_mla_pages == 0  # 17 ≥ blocks
    with pytest.raises(ConfigError, match='device_mla_pages "auto": a KV budget .* cannot hold'):
        size_mla_pages(max_requests=8, kv_bytes=16 * 100 + 309, **kw)
    with pytest.raises(ConfigError, match='"auto": 15 KV blocks .* cannot hold one request'):
        size_mla_pages(max_requests=8, num_blocks=15, **kw)


@pytest.mark.parametrize("max_requests", [1, 3, 6, 8, 40])
@pytest.mark.parametrize("room", [dict(kv_bytes=2 * 16 * 110), dict(kv_bytes=7 * 16 * 110),
                                  dict(num_blocks=40), dict(num_blocks=100)])
def test_the_sizing_holds_its_concurrency_and_no_more(max_requests, room):
    """What the scheduler admits (`spilling_holds`) on the pages and blocks `size_mla_pages`
    picks, for requests of the whole window: its concurrency, and one more only where the
    host pool was the bound (the engine's max_num_seqs then stops it)."""
    kw = dict(window_tokens=64, block_size=4, tail_pages=1, mla_page_bytes=100,
              index_page_bytes=10, hot_bytes_per_request=50)
    sizing = size_mla_pages(max_requests=max_requests, **kw, **room)
    if not sizing.num_mla_pages:
        return  # no spilling: the all-GPU engine's admission
    c = sizing.concurrency

    def holds(n: int) -> bool:
        return spilling_holds(n, 64, n * 16, block_size=4, tail_pages=1,
                              num_mla_pages=sizing.num_mla_pages, num_blocks=sizing.num_blocks)

    assert holds(c)
    if c < max_requests:  # the pages or blocks were the bound
        assert not holds(c + 1)


def test_shared_windows_count_a_shared_prefix_once():
    """The docstring's picture, and without sharing the plan's sum of windows."""
    a, b, c = [0, 1, 2], [0, 1, 3, 4], [5]
    assert shared_windows([a, b, c], [6, 7, 4], prefill=0) == (15, 0)
    assert shared_windows([a, b, c], [6, 7, 4], prefill=2) == (15, 2)
    assert shared_windows([a, b, c], [6, 7, 4], prefill=None) == (15, 2)
    assert shared_windows([[0, 1], [2], []], [6, 7, 4], prefill=2) == (17, 0)
    # a prefix hit on a free cached block (a waiting request's table) is a block it takes
    assert shared_windows([[0], [1, 2]], [3, 3], prefill=1) == (6, 0)
    # the pinned pages count beside the tails and the prefill
    kw = dict(block_size=4, tail_pages=1, num_mla_pages=20, num_blocks=40)
    assert spilling_holds(4, 64, 40, pinned_pages=0, **kw)  # 16 + 4 pages
    assert not spilling_holds(4, 64, 40, pinned_pages=1, **kw)


def page_bound_config(engine_config, model_dir, host_requests: int, sizing_blocks: int, *,
                      scheduling: str = "sync") -> tuple[MlaPageSizing, EngineConfig]:
    """A spilling engine of max_model_len 128, prefilling in 32-token chunks, on the pages and
    blocks `size_mla_pages` picks from `sizing_blocks` KV blocks and a host pool of
    `host_requests` windows: (the sizing, the config)."""
    ctx = 128
    cfg = _config(engine_config, model_dir, buffer=16, mla_pages=1, max_model_len=ctx,
                  num_blocks=sizing_blocks)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=32,
                                         async_scheduling=scheduling == "async"))
    probe = LLMEngine.from_config(replace(cfg, attention=replace(cfg.attention,
                                                                 hisparse_device_mla_pages=64)))
    per_token = sum(c.kv[0, 0].numel() * c.kv.element_size() for c in probe.runner.caches)
    del probe
    host = HiSparseConfig(host_pool_bytes=host_requests * ctx * per_token)
    sizing = size_mla_pages(max_requests=host_requests, window_tokens=ctx, block_size=B,
                            tail_pages=write_tail_pages(0, B), mla_page_bytes=1,
                            index_page_bytes=1, hot_bytes_per_request=0,
                            num_blocks=sizing_blocks)
    assert sizing.num_mla_pages > 0  # it spills
    return sizing, replace(cfg, hisparse=host, attention=replace(
        cfg.attention, hisparse_device_mla_pages=sizing.num_mla_pages))


def _page_bound(engine_config, model_dir, host_requests: int, sizing_blocks: int, *,
                scheduling: str = "sync") -> tuple[MlaPageSizing, list[list[int]], int, LLMEngine]:
    """Six requests that fill their whole window (a 104-token prompt and 24 outputs, 128 =
    max_model_len) on `page_bound_config`'s engine: (the sizing, greedy outputs, the most
    requests running at once, the engine)."""
    ctx = 128
    sizing, cfg = page_bound_config(engine_config, model_dir, host_requests, sizing_blocks,
                                    scheduling=scheduling)
    engine = LLMEngine.from_config(cfg)
    params = SamplingParams(max_tokens=ctx - 104, temperature=0.0, ignore_eos=True)
    got, most_running, _ = _run(engine, _prompts(6, seed=5, lo=104, hi=104), params)
    return sizing, got, most_running, engine


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_budget_bound_admits_the_plans_concurrency(model_dirs, engine_config, scheduling):
    """The KV budget binds before the host pool (106 blocks hold 3 windows of 32, the host 5):
    `size_mla_pages` gives 35 pages, one prefill window beside 3 write tails. The engine admits
    the 3 those pages hold, the plan's concurrency (`mla_pages_for`, one function for both),
    all at once and none preempted (it admitted a 4th and preempted it before); greedy output
    equals the all-GPU engine's."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = LLMEngine.from_config(_config(engine_config, model_dir, max_model_len=128)).generate(
        _prompts(6, seed=5, lo=104, hi=104), params)
    sizing, got, most_running, engine = _page_bound(engine_config, model_dir, 5, 3 * 32 + 10,
                                                    scheduling=scheduling)
    assert sizing.concurrency == 3 and engine.scheduler.mla.num_pages == 32 + 3
    assert got == want
    assert most_running == sizing.concurrency
    assert engine.stats().num_preemptions == 0
    assert engine.scheduler.mla.num_spills > 0


def test_host_bound_admits_the_host_windows(model_dirs, engine_config):
    """The host pool binds first (2 windows; the blocks hold 3): the engine admits 2 at once,
    as before, none preempted."""
    model_dir = model_dirs["tiny-glm5"]
    sizing, _, most_running, engine = _page_bound(engine_config, model_dir, 2, 3 * 32 + 10)
    assert sizing.concurrency == 2 == engine.scheduler.config.max_num_seqs
    assert most_running == 2 and engine.stats().num_preemptions == 0


def _shared_prefix_prompts(n: int, seed: int, prefix: int, total: int) -> list[list[int]]:
    """`n` prompts of `total` tokens whose first `prefix` are the same."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(4, 512, (prefix,), generator=g).tolist()
    return [head + torch.randint(4, 512, (total - prefix,), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_shared_prefix_counts_its_blocks_once(model_dirs, engine_config, scheduling):
    """Five requests of a whole window (104-token prompts and 24 outputs) whose first 96
    prompt tokens are one cached prefix of 24 blocks, on the budget-bound engine above (106
    blocks, 35 MLA pages; the plan's concurrency is 3): the shared blocks count once
    (`shared_windows`: 24 + 5 × 8 blocks by the end of the windows), so all five run at once
    (the host pool's bound), none preempted, the shared pages resident; greedy output equals
    the all-GPU engine's."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _shared_prefix_prompts(5, seed=6, prefix=96, total=104)
    want = LLMEngine.from_config(_config(engine_config, model_dir, max_model_len=128)).generate(
        prompts, params)
    sizing, cfg = page_bound_config(engine_config, model_dir, 5, 3 * 32 + 10,
                                    scheduling=scheduling)
    assert sizing.concurrency == 3
    engine = LLMEngine.from_config(cfg)
    got, most_running, _ = _run(engine, prompts, params)
    assert got == want
    assert most_running == 5 == engine.scheduler.config.max_num_seqs
    assert engine.stats().num_preemptions == 0
    assert engine.stats().prefix_cache_hits >= 4 * 96


def test_a_shared_prefix_pins_its_pages(model_dirs, engine_config):
    """A shared prefix's blocks never spill (two requests hold them), so their pages count
    beside the tails and a prefill of other tokens (`shared_windows`' pinned pages): four
    requests sharing a 96-token prefix decode while a fifth, unrelated one waits until their
    pinned pages and its window fit the 35 MLA pages, rather than being admitted and then
    preempted when its prefill cannot find pages; greedy output equals the all-GPU engine's."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _shared_prefix_prompts(4, seed=7, prefix=96, total=104) + _prompts(
        1, seed=8, lo=104, hi=104)
    want = LLMEngine.from_config(_config(engine_config, model_dir, max_model_len=128)).generate(
        prompts, params)
    _, cfg = page_bound_config(engine_config, model_dir, 5, 3 * 32 + 10)
    engine = LLMEngine.from_config(cfg)
    got, most_running, _ = _run(engine, prompts, params)
    assert got == want
    assert engine.stats().num_preemptions == 0
    assert most_running == 4  # the sharers; the fifth ran once they had ended


def test_shared_windows_from_kept_shared_blocks():
    """The scheduler keeps `shared_blocks` between steps: as the tables grow by blocks of
    their own, the kept count gives what a fresh walk gives."""
    a, b, c = [0, 1, 2], [0, 1, 3, 4], [5]
    kept = shared_blocks([a, b, c], 0)
    assert kept == SharedBlocks(repeats=2, pinned=0)
    grown = [a + [6], b + [7, 8], c + [9]]
    for windows in ([6, 7, 4], [4, 4, 2]):
        assert shared_windows(grown, windows, 0, kept) == shared_windows(grown, windows, 0)
