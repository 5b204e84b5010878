"""P/D into a HiSparse decode engine with spilling (disagg/hostplan.py), two single-rank engines
in one process over shared memory (and NIXL where it imports): a received long prompt's MLA rows
below its write tail are READ straight into the decode rank's host pool (no GPU MLA page taken
or written for them), the tail's into GPU pages; greedy output equals the aggregated engine's,
bf16 and fp8_ds_mla, with several requests decoding at once over fewer MLA pages than their
blocks. Every invariant of both engines is checked after every step, and nothing leaks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from dsaserve.config import ConfigError, DisaggConfig, HiSparseConfig
from dsaserve.core import SamplingParams
from dsaserve.disagg import offline
from dsaserve.disagg.transport import nixl_available
from dsaserve.engine.engine import LLMEngine

B = 4  # small pages: a prompt spans many blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BACKENDS = ["shm"] + (["nixl"] if nixl_available() else [])  # NIXL: the host pool as DRAM


def _disagg(role: str, backend: str = "shm", abort_timeout_s: float = 30.0) -> DisaggConfig:
    return DisaggConfig(kv_role=role, backend=backend, side_channel_port=0,
                        abort_timeout_s=abort_timeout_s)


def _config(engine_config, model_dir, kv: str, **hisparse):
    cfg = engine_config(model_dir, kv_cache_dtype=kv, block_size=B, num_blocks=100,
                        max_model_len=64)
    if not hisparse:
        return cfg
    att = replace(cfg.attention, hisparse_device_buffer_size=hisparse["buffer"],
                  hisparse_device_mla_pages=hisparse["pages"], hisparse_config_given=True)
    return replace(cfg, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20))


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lens]


def _pd_at_once(p: LLMEngine, d: LLMEngine, prompts: list[list[int]], tag: str,
                check: Callable[[], object] = lambda: None) -> list[list[int]]:
    """Every prompt prefilled (held by the producer), then all decoded together on the consumer,
    both engines' invariants (and `check`) checked after every step."""
    def checks() -> None:
        d.check_integrity()
        p.check_integrity()
        check()

    out = offline.generate_together(p, d, prompts, GREEDY, tag, after_step=checks)
    d.step()  # an empty step tells the runner which requests ended
    d.check_integrity()
    check()
    return out


def _nothing_held(*engines: LLMEngine) -> None:
    """No request left, every block free (cached at most)."""
    for e in engines:
        assert not e.has_unfinished_requests()
        assert e.scheduler.kv.num_free_blocks == e.scheduler.kv.num_blocks


def _expected_rows(prompt_len: int, cached: int, buffer: int) -> tuple[int, int]:
    """(MLA rows into the host pool, into GPU pages) for one received prompt: positions
    [cached, prompt − 1) move; a long one's below its write tail block go to the host pool."""
    end = prompt_len - 1
    if end < buffer:  # short: it reads its GPU pages, every block has one
        return 0, end - cached
    tail = end // B * B
    return tail - cached, end - tail


@pytest.mark.parametrize(("preset", "kv", "backend"), [
    ("tiny-glm5", "auto", "shm"), ("tiny-dsv32", "fp8_ds_mla", BACKENDS[-1])])
def test_pd_into_spilling_hisparse_equals_aggregated(model_dirs, engine_config, preset, kv,
                                                     backend):
    model_dir = model_dirs[preset]
    plain = _config(engine_config, model_dir, kv)
    ref = LLMEngine.from_config(plain)
    topk = ref.config.model.index_topk
    # four long prompts (their first step reads through the buffer) and a short one
    prompts = _prompts(21, [37, 42, 30, 45, topk - 6])
    want = ref.generate(prompts, GREEDY)
    pages = 16  # one max-length window: less than the requests' blocks together
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer", backend)))
    d = LLMEngine.from_config(replace(_config(engine_config, model_dir, kv, buffer=topk,
                                              pages=pages), disagg=_disagg("kv_consumer", backend)))
    try:
        worker = d.runner.connector
        assert d.runner.caches[0].kv.shape[0] == pages
        got = _pd_at_once(p, d, prompts, "a")
        assert got == want

        # bytes: each received row crossed once; MLA rows below a long prompt's write tail went
        # into the host pool only, the rest (tails, the short prompt) into GPU MLA pages
        rows = [_expected_rows(len(x), 0, topk) for x in prompts]
        assert worker.mla_rows_to_host == sum(h for h, _ in rows) > 0
        assert worker.mla_rows_to_gpu == sum(g for _, g in rows)
        per_token = d.executor.call("kv_row_bytes")[0]
        assert worker.bytes_received == sum(len(x) - 1 for x in prompts) * per_token
        assert d.stats().num_preemptions == 0
        rt = d.runner.hisparse
        assert int(rt.rows_from_host) > 0
        most_blocks = sum(-(-(len(x) + 12) // B) for x in prompts[:4])
        assert most_blocks > pages  # more KV than the MLA pages hold, decoded at once

        # a later turn of the short request: the decode engine's own cached prefix (with pages)
        # is kept, the rest arrives, now long: spilled blocks between the hit and the tail
        turn2 = prompts[4] + got[4] + _prompts(22, [24])[0]
        want2 = ref.generate([turn2], GREEDY)
        hits = d.stats().prefix_cache_hits
        host_before, gpu_before = worker.mla_rows_to_host, worker.mla_rows_to_gpu
        assert _pd_at_once(p, d, [turn2], "b") == want2
        cached = d.stats().prefix_cache_hits - hits
        assert cached > 0
        h, g = _expected_rows(len(turn2), cached, topk)
        assert (worker.mla_rows_to_host - host_before, worker.mla_rows_to_gpu - gpu_before) == (
            h, g)
        assert h > 0

        # nothing leaks: host blocks still held keep free cached spilled blocks' rows
        pool, mla = d.scheduler.kv.pool, d.scheduler.mla
        assert not rt.entries and set(rt.kept) == set(mla.host_kept())
        assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks
        assert all(pool.ref_count(b) == 0 and pool.block_hash(b) is not None
                   for b in [*mla.page_of, *rt.kept])
        assert not p.has_unfinished_requests()
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_pd_burst_admits_the_plans_concurrency(model_dirs, engine_config, scheduling):
    """Six P/D arrivals that fill their whole window (a 104-token prompt and 24 outputs, 128 =
    max_model_len) at once into a decode engine whose KV budget binds (106 blocks: 3 windows
    of 32, a host pool of 5, 35 MLA pages from `size_mla_pages`): a READ starts only while
    `spilling_holds`, as a local admission does, so at most the plan's 3 are active at once
    and none is preempted (4 READs fitted the blocks of their prompts, and one was preempted
    once they grew); greedy output equals the aggregated engine's; no block, page or host
    window is left on either side."""
    from test_hisparse_spill import page_bound_config

    model_dir = model_dirs["tiny-glm5"]
    sizing, cfg = page_bound_config(engine_config, model_dir, 5, 3 * 32 + 10,
                                    scheduling=scheduling)
    assert sizing.concurrency == 3
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts(31, [104] * 6)
    plain = engine_config(model_dir, block_size=B, num_blocks=200, max_model_len=128)
    want = LLMEngine.from_config(plain).generate(prompts, params)
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(replace(cfg, disagg=_disagg("kv_consumer")))
    most_active = most_blocks = 0

    def checks() -> None:
        nonlocal most_active, most_blocks
        active = [*d.scheduler.running, *d.scheduler.receiving.values()]
        most_active = max(most_active, len(active))
        most_blocks = max(most_blocks, sum(len(r.block_ids) for r in active))
        d.check_integrity()
        p.check_integrity()

    try:
        assert d.scheduler.config.max_num_seqs == 5  # the host pool would admit 5
        got = offline.generate_together(p, d, prompts, params, "burst", after_step=checks)
        d.step()  # an empty step tells the runner which requests ended
        d.check_integrity()
        assert got == want
        assert d.stats().num_preemptions == 0
        assert most_active == sizing.concurrency
        # received spilled: more KV at once than the MLA pages hold
        assert most_blocks > sizing.num_mla_pages and d.runner.connector.mla_rows_to_host > 0
        # nothing leaks: every block free on both sides (cached at most), no host window held
        rt, mla = d.runner.hisparse, d.scheduler.mla
        assert not rt.entries and set(rt.kept) == set(mla.host_kept())
        assert len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks
        _nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_pd_arrival_waits_at_the_head_of_the_queue(model_dirs, engine_config):
    """A P/D arrival that `spilling_holds` does not admit yet keeps the head of the queue, as a
    local request does: a short local request queued behind it, which the blocks and pages
    would hold, waits until it has started its read (FIFO), then both finish with the
    aggregated engine's greedy tokens and nothing is preempted."""
    from test_hisparse_spill import page_bound_config

    model_dir = model_dirs["tiny-glm5"]
    sizing, cfg = page_bound_config(engine_config, model_dir, 5, 3 * 32 + 10)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts(32, [104] * 4 + [8])
    local = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = engine_config(model_dir, block_size=B, num_blocks=200, max_model_len=128)
    ref = LLMEngine.from_config(plain)
    want = ref.generate(prompts[:4], params) + ref.generate(prompts[4:], local)
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(replace(cfg, disagg=_disagg("kv_consumer")))
    try:
        ids = [f"r{i}" for i in range(4)]
        for rid, prompt in zip(ids, prompts[:4], strict=True):
            d.add_request(rid, prompt, params,
                          kv_transfer_params=offline.prefill(p, rid, prompt))
        d.add_request("local", prompts[4], local)
        got: dict[str, list[int]] = {rid: [] for rid in [*ids, "local"]}
        head_waited = False
        while d.has_unfinished_requests() or p.has_unfinished_requests():
            for out in d.step():
                got[out.request_id] += out.new_token_ids
            if p.has_unfinished_requests():
                p.step()
            waiting = [r.request_id for r in d.scheduler.waiting]
            if "r3" in waiting:  # the plan's 3 are active: the 4th waits, the local behind it
                head_waited = True
                assert waiting == ["r3", "local"]
            d.check_integrity()
            p.check_integrity()
        d.step()
        d.check_integrity()
        assert head_waited
        assert [got[rid] for rid in [*ids, "local"]] == want
        assert d.stats().num_preemptions == 0
        for e in (p, d):
            assert e.scheduler.kv.num_free_blocks == e.scheduler.kv.num_blocks
    finally:
        p.shutdown()
        d.shutdown()


def test_failed_read_and_abort_give_the_host_window_back(model_dirs, engine_config,
                                                          monkeypatch):
    """The runner reserves a received request's host window before its READ: a failed READ
    (the request ends with the reason) and an abort after arrival, before its first step, each
    give it back, with the pages and blocks, and the next request is served."""
    from dsaserve.disagg.transport import TransferError

    model_dir = model_dirs["tiny-glm5"]
    plain = _config(engine_config, model_dir, "auto")
    topk = plain.model.index_topk
    prompt = _prompts(23, [40])[0]
    # blocks of the failed read's request are freed by the producer's timeout (short here)
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer", abort_timeout_s=2.0)))
    d = LLMEngine.from_config(replace(_config(engine_config, model_dir, "auto", buffer=topk,
                                              pages=16), disagg=_disagg("kv_consumer")))
    rt, mla = d.runner.hisparse, d.scheduler.mla
    try:
        transport = d.runner.connector.transport

        def dead(*args, **kwargs):
            raise TransferError("the prefill engine is gone")

        monkeypatch.setattr(transport, "read_regions", dead)
        d.add_request("x", prompt, GREEDY, kv_transfer_params=offline.prefill(p, "x", prompt))
        outs = d.step()
        assert [o.request_id for o in outs] == ["x"] and "gone" in outs[0].error
        d.check_integrity()
        d.step()  # the runner learns that "x" ended
        d.check_integrity()
        assert not rt.entries and not mla.page_of
        monkeypatch.undo()

        d.add_request("y", prompt, GREEDY, kv_transfer_params=offline.prefill(p, "y", prompt))
        d.step()  # the READ: "y" runs from the next step
        assert "y" in rt.entries and rt.entries["y"].arriving
        d.check_integrity()
        d.abort_request("y")
        d.step()
        d.check_integrity()
        assert not rt.entries and not mla.page_of
        assert d.scheduler.kv.num_free_blocks == d.scheduler.kv.num_blocks

        params = offline.prefill(p, "z", prompt)
        want = LLMEngine.from_config(plain).generate([prompt], GREEDY)[0]
        assert offline.decode(p, d, "z", prompt, params, GREEDY) == want
        d.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()


def test_spilling_with_a_producer_role_is_refused(model_dirs, engine_config):
    cfg = _config(engine_config, model_dirs["tiny-glm5"], "auto", buffer=16, pages=16)
    for role in ("kv_producer", "kv_both"):
        with pytest.raises(ConfigError, match="device_mla_pages runs in a P/D engine only with "
                                              "kv_role 'kv_consumer'"):
            replace(cfg, disagg=_disagg(role))
    replace(cfg, disagg=_disagg("kv_consumer"))  # accepted


def _below_window_pages(topk: int) -> int:
    """The fewest MLA pages a P/D decode engine takes (no drafts): a prompt of the hot buffer's
    rows reads its pages beside one write tail; less than one max-model-len window (16)."""
    from dsaserve.kv.hisparse.admission import min_mla_pages, write_tail_pages

    return min_mla_pages(topk, B) + write_tail_pages(0, B)


@pytest.mark.parametrize(("preset", "kv"), [("tiny-glm5", "auto"), ("tiny-dsv32", "fp8_ds_mla")])
def test_pd_decode_engine_below_one_window(model_dirs, engine_config, preset, kv):
    """A P/D decode engine with fewer MLA pages than one request's window (the 1M case: what
    it receives long lands spilled, only write tails on pages): each long arrival's KV alone
    outgrows every page, and greedy output equals the aggregated engine's, several decoding
    at once, nothing preempted or leaked. What it would prefill itself is bounded by its
    pages: a longer local prompt is refused (a 400), a short one served; a received request
    preempted since (it would recompute here, past its pages) ends with an error."""
    from dsaserve.core import RequestError

    model_dir = model_dirs[preset]
    plain = _config(engine_config, model_dir, kv)
    ref = LLMEngine.from_config(plain)
    topk = ref.config.model.index_topk
    pages = _below_window_pages(topk)
    assert pages < 16  # max_model_len 64 in blocks of 4
    prompts = _prompts(41, [37, 42, 45, 10])  # three long arrivals and a short one
    want = ref.generate(prompts, GREEDY)
    p = LLMEngine.from_config(replace(plain, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(replace(_config(engine_config, model_dir, kv, buffer=topk,
                                              pages=pages), disagg=_disagg("kv_consumer")))
    try:
        assert d.runner.caches[0].kv.shape[0] == pages
        limit = d.scheduler.local_prefill_tokens
        assert limit == pages * B
        got = _pd_at_once(p, d, prompts, "a")
        assert got == want
        assert -(-(len(prompts[2]) + GREEDY.max_tokens) // B) > pages  # one request's KV
        worker = d.runner.connector
        assert worker.mla_rows_to_host > 0
        assert d.stats().num_preemptions == 0

        # a later turn of a long one: its cached prefix is mostly spilled, so it is kept only
        # up to its first spilled block (restoring the rest could take more pages than there
        # are) and the rest READ again
        turn2 = prompts[0] + got[0] + _prompts(43, [6])[0]
        # the finished requests' spilled blocks stay cached in the host pool, more than the
        # pages hold
        assert len(d.scheduler.mla.host_kept()) > pages
        moved, hits = worker.bytes_received, d.stats().prefix_cache_hits
        assert _pd_at_once(p, d, [turn2], "b") == ref.generate([turn2], GREEDY)
        used = d.stats().prefix_cache_hits - hits  # counted as hits: the resident prefix only
        assert used <= pages * B
        per_token = d.executor.call("kv_row_bytes")[0]
        assert worker.bytes_received - moved == (len(turn2) - 1 - used) * per_token

        # local prompts: up to the pages' worth prefilled here, longer ones refused
        local = _prompts(42, [limit, limit + 1])
        with pytest.raises(RequestError, match="device_mla_pages .* prefill engine"):
            d.add_request("too long", local[1], GREEDY)
        assert d.generate([local[0]], GREEDY) == ref.generate([local[0]], GREEDY)

        # a received long request preempted (white box: admission by whole windows leaves
        # none to preempt) cannot recompute here: it ends with an error, nothing held
        params = offline.prefill(p, "pre", prompts[1])
        d.add_request("pre", prompts[1], GREEDY, kv_transfer_params=params)
        outs = []
        while not any(r.request_id == "pre" for r in d.scheduler.running):
            outs += d.step()
            p.step()
        req = next(r for r in d.scheduler.running if r.request_id == "pre")
        d.scheduler.running.remove(req)
        d.scheduler._preempt(req)
        outs += d.step()
        (out,) = [o for o in outs if o.request_id == "pre" and o.finished]
        assert out.finish_reason == "abort" and "recompute" in out.error
        d.step()  # the runner learns that "pre" ended
        d.check_integrity()
        for _ in range(50):
            if not p.has_unfinished_requests():
                break
            p.step()
        _nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_pd_decode_engine_pages_too_few(model_dirs, engine_config):
    """Below one window only a P/D decode engine runs, and it needs a hot buffer's prompt
    beside a write tail; an aggregated engine still needs the whole window."""
    model_dir = model_dirs["tiny-glm5"]
    pages = _below_window_pages(16)
    cfg = _config(engine_config, model_dir, "auto", buffer=16, pages=pages - 1)
    with pytest.raises(ConfigError, match=f"device_mla_pages {pages - 1} is too few for a P/D "
                                          "decode engine"):
        LLMEngine.from_config(replace(cfg, disagg=_disagg("kv_consumer")))
    cfg = _config(engine_config, model_dir, "auto", buffer=16, pages=pages)
    with pytest.raises(ConfigError, match=f"device_mla_pages {pages} cannot hold one request"):
        LLMEngine.from_config(cfg)


def test_pd_decode_engine_below_one_window_with_mtp3(draftable_dirs, engine_config):
    """The same with MTP3 on both engines (a hot buffer of 4 query rows' top-k; the drafts'
    lookahead in the bounds; the drafts prove the MTP layer's rows arrived): greedy output
    equals the aggregated engine's without MTP, each long arrival's KV past every page, the
    local limit the pages less the lookahead."""
    from dsaserve.config import SpecConfig
    from dsaserve.kv.hisparse.admission import min_mla_pages, write_tail_pages

    model_dir = draftable_dirs["tiny-glm5"]
    plain = engine_config(model_dir, block_size=B, num_blocks=100, max_model_len=128)
    prompts = _prompts(43, [90, 100, 20])  # two long arrivals (past the buffer) and a short
    want = LLMEngine.from_config(plain).generate(prompts, GREEDY)
    mtp = SpecConfig(num_speculative_tokens=3)
    buffer = 4 * plain.model.index_topk  # the top-k union of a verify step's 4 rows
    pages = min_mla_pages(buffer + 2, B) + write_tail_pages(3, B)  # lookahead 2
    assert pages < min_mla_pages(128 + 2, B)
    att = replace(plain.attention, hisparse_device_buffer_size=buffer,
                  hisparse_device_mla_pages=pages, hisparse_config_given=True)
    spilling = replace(plain, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20))
    p = LLMEngine.from_config(replace(plain, speculative=mtp, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(replace(spilling, speculative=mtp, disagg=_disagg("kv_consumer")))
    try:
        assert d.scheduler.local_prefill_tokens == pages * B - 2
        assert _pd_at_once(p, d, prompts, "m") == want
        assert d.stats().num_preemptions == 0 and d.runner.connector.mla_rows_to_host > 0
        assert -(-(100 + GREEDY.max_tokens) // B) > pages
        assert d.stats().spec_decode_num_draft_tokens > 0
    finally:
        p.shutdown()
        d.shutdown()
