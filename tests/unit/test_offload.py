"""The host KV tier on one rank: the copier moves every cache layer's bytes (the MTP layer's
included), a prefix served from the host tier gives the same greedy output as recomputing it
with a GPU pool too small to keep it, salted keys never cross tenants, an aborted load leaks
nothing, and bad flags name themselves."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from dsaserve.config import ConfigError, OffloadConfig
from dsaserve.core import KVTransfer, RequestStatus, SamplingParams, SchedulerOutput
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.copier import KVCopier, host_runs
from dsaserve.kv.host_pool import HostKVPool, bytes_per_host_block
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.model.dsa import LayerCache

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 16


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 512, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------
# the copier alone
# ------------------------------------------------------------------------------------------------
def test_host_runs() -> None:
    assert host_runs((7, 8, 9, 3, 4, 12)) == [(0, 7, 3), (3, 3, 2), (5, 12, 1)]
    assert host_runs(()) == []
    assert host_runs((7, 8, 9, 3, 4, 12), max_len=2) == [
        (0, 7, 2), (2, 9, 1), (3, 3, 2), (5, 12, 1)]


@pytest.mark.parametrize("fp8", [False, True])
def test_copier_round_trip_every_layer(fp8: bool) -> None:
    """Store blocks to the host, wipe the caches, load them into other blocks: every byte of
    every layer (the last one stands for the MTP layer; one has no indexer) comes back."""
    g = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        if fp8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    num_gpu, b = 10, 4
    caches = [LayerCache(kv=tensor(num_gpu, b, 12), index=tensor(num_gpu, b, 8) if i != 1 else None)
              for i in range(3)]
    pool = HostKVPool(caches, 6, pin=False, flag="--kv-offloading-size")
    assert pool.block_bytes == bytes_per_host_block(caches)
    assert pool.buffer.data_ptr() % 4096 == 0
    original = [(c.kv.clone(), None if c.index is None else c.index.clone()) for c in caches]
    copier = KVCopier(pool, torch.device("cpu"))
    store = KVTransfer(0, gpu_block_ids=(3, 1, 7, 8), host_block_ids=(4, 5, 0, 2))
    copier.start(SchedulerOutput((), (), {}, (), kv_stores=(store,)))
    for c in caches:
        c.kv.zero_()
        if c.index is not None:
            c.index.zero_()
    load = KVTransfer(0, gpu_block_ids=(0, 2, 9, 5), host_block_ids=(4, 5, 0, 2))
    copier.start(SchedulerOutput((), (), {}, (), kv_loads=(load,)))
    assert copier.poll() == (1, 1)
    for c, (kv, index) in zip(caches, original, strict=True):
        for src, dst in zip(store.gpu_block_ids, load.gpu_block_ids, strict=True):
            assert torch.equal(c.kv[dst].view(torch.uint8), kv[src].view(torch.uint8))
            if index is not None:
                assert torch.equal(c.index[dst].view(torch.uint8), index[src].view(torch.uint8))
    with pytest.raises(RuntimeError, match="expected 1"):  # jobs must arrive in order
        copier.start(SchedulerOutput((), (), {}, (), kv_loads=(replace(load, job_id=5),)))


# ------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------
def _config(engine_config, model_dir, *, kv_cache_dtype="auto", host_gib: float | None = 0.01,
            num_blocks: int = 12, budget: int = 64, async_scheduling: bool = False):
    cfg = engine_config(model_dir, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                        num_blocks=num_blocks, max_model_len=160, max_num_batched_tokens=budget)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, async_scheduling=async_scheduling))
    if host_gib is None:
        return cfg
    return replace(cfg, offload=OffloadConfig(cpu_bytes_to_use=int(host_gib * 2**30)))


def _check_drained(engine: LLMEngine) -> None:
    """Both pools balance, nothing held by a finished request, no copy in flight."""
    engine.check_integrity()
    sched = engine.scheduler
    assert not sched.requests and not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    if sched.offload is not None:
        assert not sched.offload.busy
        host = sched.offload.host
        assert host.num_free_blocks == host.num_blocks
        assert engine.runner.copier.num_in_flight == 0


def _session(seed: int) -> tuple[list[int], list[int]]:
    """(turn-1 prompt, the tokens turn 2 appends after turn 1's reply)."""
    return _tokens(seed, 70), _tokens(seed + 100, 9)


def _cache_rows(engine: LLMEngine, block_ids: list[int]) -> list[torch.Tensor]:
    rows = []
    for cache in engine.runner.caches:
        for t in (cache.kv, cache.index):
            if t is not None:
                rows.append(t[block_ids].view(torch.uint8).clone())
    return rows


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla"])
def test_host_hit_equals_recompute(model_dirs, engine_config, kv_cache_dtype,
                                   scheduling) -> None:
    """Turn 1 of session A, then sessions B and C evict it from a 12-block GPU pool; turn 2 of A
    finds its prefix only in the host tier. Outputs equal an engine without the tier, and the
    loaded blocks hold turn 1's exact bytes in every cache layer, the MTP layer's included.
    Async: copies start before step k + 1's launch, are polled after it, and their completion
    comes with that step's results."""
    model_dir = model_dirs["tiny-glm5"]
    engine = LLMEngine.from_config(_config(engine_config, model_dir,
                                           kv_cache_dtype=kv_cache_dtype,
                                           async_scheduling=scheduling == "async"))
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv_cache_dtype=kv_cache_dtype,
                                        host_gib=None))
    cfg = engine.config.model
    assert engine.runner.model.num_cache_layers == cfg.num_hidden_layers + 1, "no MTP layer"
    # This branch's forward never writes the MTP layer's cache: give it bytes worth restoring.
    mtp = engine.runner.caches[cfg.num_hidden_layers]
    g = torch.Generator().manual_seed(1)
    mtp.kv.view(torch.uint8).copy_(torch.randint(0, 256, mtp.kv.view(torch.uint8).shape,
                                                 generator=g, dtype=torch.uint8))

    prompt_a, more_a = _session(0)
    out_a1 = engine.generate([prompt_a], GREEDY)[0]
    assert out_a1 == ref.generate([prompt_a], GREEDY)[0]
    turn2 = prompt_a + out_a1 + more_a
    keys = request_block_hashes(turn2, BLOCK, None)[: (len(turn2) - 1) // BLOCK]
    num_stored = (len(prompt_a) + len(out_a1)) // BLOCK  # full computed blocks of turn 1
    gpu_ids = [engine.scheduler.kv.pool.lookup(k) for k in keys[:num_stored]]
    assert None not in gpu_ids
    before = _cache_rows(engine, gpu_ids)

    for seed in (1, 2):  # other sessions take every GPU block
        other = _tokens(seed, 120)
        assert engine.generate([other], GREEDY) == ref.generate([other], GREEDY)
    assert all(engine.scheduler.kv.pool.lookup(k) is None for k in keys[:num_stored])
    _check_drained(engine)

    mtp.kv.zero_()  # whatever the MTP rows hold after turn 2, the load put there
    hits_before = engine.stats().offload_hits
    out_a2 = engine.generate([turn2], GREEDY)[0]
    assert out_a2 == ref.generate([turn2], GREEDY)[0]
    stats = engine.stats()
    assert stats.offload_hits - hits_before == num_stored * BLOCK
    assert stats.offload_bytes_loaded == num_stored * engine.runner.copier.pool.block_bytes
    new_ids = [engine.scheduler.kv.pool.lookup(k) for k in keys[:num_stored]]
    assert None not in new_ids and new_ids != gpu_ids
    after = _cache_rows(engine, new_ids)
    assert len(after) == len(before)
    for b, a in zip(before, after, strict=True):  # MLA rows, indexer keys, MTP rows
        assert torch.equal(b, a)
    _check_drained(engine)


def test_salted_keys_never_hit_another_tenant(model_dirs, engine_config) -> None:
    engine = LLMEngine.from_config(_config(engine_config, model_dirs["tiny-glm5"]))
    prompt, _ = _session(3)
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    for seed in (4, 5):
        engine.generate([_tokens(seed, 120)], GREEDY)
    s0 = engine.stats()
    engine.generate([prompt], GREEDY, cache_salt="tenant-b")
    s1 = engine.stats()
    assert s1.offload_hits == s0.offload_hits and s1.prefix_cache_hits == s0.prefix_cache_hits
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert engine.stats().offload_hits > s1.offload_hits or (
        engine.stats().prefix_cache_hits > s1.prefix_cache_hits)
    _check_drained(engine)


def test_abort_while_loading_leaks_nothing(model_dirs, engine_config) -> None:
    engine = LLMEngine.from_config(_config(engine_config, model_dirs["tiny-glm5"]))
    prompt, more = _session(6)
    out = engine.generate([prompt], GREEDY)[0]
    for seed in (7, 8):
        engine.generate([_tokens(seed, 120)], GREEDY)
    engine.add_request("a2", prompt + out + more, GREEDY)
    so = engine.scheduler.schedule()
    assert so.kv_loads and not so.num_scheduled_tokens
    assert engine.scheduler.requests["a2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.check_integrity()
    engine.abort_request("a2")  # the copy is in flight: its blocks stay held until it lands
    engine.check_integrity()
    outputs = engine.scheduler.update_from_output(so, engine.executor.execute(so))
    assert [o.finish_reason for o in outputs] == ["abort"]
    while engine.has_unfinished_requests():
        engine.step()
    _check_drained(engine)


def test_host_pool_never_evicts_blocks_in_flight(model_dirs, engine_config) -> None:
    """A host tier of exactly one request's blocks under many sessions: stores are dropped or
    evict cached blocks, never ones being copied; outputs stay exact."""
    model_dir = model_dirs["tiny-glm5"]
    cfg = _config(engine_config, model_dir)
    engine = LLMEngine.from_config(cfg)
    per_block = engine.runner.copier.pool.block_bytes
    engine.shutdown()
    small = replace(cfg, offload=OffloadConfig(cpu_bytes_to_use=10 * per_block))
    engine = LLMEngine.from_config(small)
    ref = LLMEngine.from_config(_config(engine_config, model_dir, host_gib=None))
    prompts = [_tokens(s, 60 + 7 * s) for s in range(4)]
    prompts += [p[:50] + _tokens(90 + i, 5) for i, p in enumerate(prompts)]
    assert engine.generate(prompts, GREEDY) == ref.generate(prompts, GREEDY)
    _check_drained(engine)


# ------------------------------------------------------------------------------------------------
# flags
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def parse(model_dirs):
    from dsaserve.engine.args import add_engine_args, engine_config_from_args

    def run(argv: list[str]):
        parser = add_engine_args(argparse.ArgumentParser())
        return engine_config_from_args(parser.parse_args(argv), str(model_dirs["tiny-glm5"]))

    return run


def test_flags_both_spellings(parse) -> None:
    _parse = parse
    a = _parse(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "native"])
    assert a.offload.cpu_bytes_to_use == 2**29
    b = _parse(["--kv-transfer-config",
                '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                '"kv_connector_extra_config":{"cpu_bytes_to_use":536870912}}'])
    assert b.offload.cpu_bytes_to_use == 2**29
    assert not _parse([]).offload.enabled


@pytest.mark.parametrize("argv,flag", [
    (["--kv-offloading-size", "100000"], "--kv-offloading-size"),  # more than the machine has
    (["--kv-offloading-backend", "native"], "--kv-offloading-backend"),
    (["--kv-transfer-config", "{"], "--kv-transfer-config"),
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], "--kv-transfer-config"),
    (["--kv-transfer-config", '{"kv_connector":"OffloadingConnector"}'], "--kv-transfer-config"),
    # both spellings of the host tier at once (with a P/D or HiSparse connector it may be added)
    (["--kv-offloading-size", "1", "--kv-transfer-config",
      '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
      '"kv_connector_extra_config":{"cpu_bytes_to_use":536870912}}'], "--kv-offloading-size"),
    (["--kv-offloading-size", "1", "--kv-transfer-config", "{}"], "--kv-transfer-config"),
    (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "--kv-offloading-size"),
])
def test_bad_flags_name_themselves(parse, argv, flag) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse(argv)


def test_host_size_below_one_request_names_the_flag(model_dirs, engine_config) -> None:
    cfg = _config(engine_config, model_dirs["tiny-glm5"])
    with pytest.raises(ConfigError, match="--kv-offloading-size: .* less than one request"):
        LLMEngine.from_config(replace(cfg, offload=OffloadConfig(cpu_bytes_to_use=4096)))


def test_slow_copies_keep_others_running(model_dirs, engine_config) -> None:
    """As on a GPU, copies land steps after they start (the copier reports them late): the
    loading request waits while another one keeps decoding, and nothing changes in the output."""
    model_dir = model_dirs["tiny-glm5"]
    engine = LLMEngine.from_config(_config(engine_config, model_dir, num_blocks=16))
    ref = LLMEngine.from_config(_config(engine_config, model_dir, host_gib=None, num_blocks=16))
    copier = engine.runner.copier
    real_poll = copier.poll
    history: list[tuple[int, int]] = []

    def late_poll() -> tuple[int, int]:  # report what was done three polls ago
        history.append(real_poll())
        return history[max(len(history) - 4, 0)]

    copier.poll = late_poll
    prompt, more = _session(9)
    out = engine.generate([prompt], GREEDY)[0]
    for seed in (10, 11):
        engine.generate([_tokens(seed, 120)], GREEDY)
    other = _tokens(12, 20)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("other", other, long)
    engine.step()  # "other" runs
    engine.add_request("a2", prompt + out + more, GREEDY)
    outputs: dict[str, list[int]] = {"other": [], "a2": []}
    waited_while_other_ran = 0
    cached_tokens = set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
            if o.request_id == "a2":
                cached_tokens.add(o.num_cached_tokens)
        a2 = engine.scheduler.requests.get("a2")
        if a2 is not None and a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            waited_while_other_ran += "other" in engine.scheduler.requests
        engine.check_integrity()
    assert waited_while_other_ran >= 2
    # usage.prompt_tokens_details.cached_tokens: GPU hits (none: evicted) + host hits
    assert cached_tokens == {(len(prompt) + len(out)) // BLOCK * BLOCK}
    assert outputs["a2"] == ref.generate([prompt + out + more], GREEDY)[0]
    _check_drained(engine)


def test_metrics_show_both_tiers() -> None:
    from dsaserve.core import EngineStats
    from dsaserve.serve.metrics import ServerMetrics

    stats = EngineStats(num_running=0, num_waiting=0, num_free_blocks=8, num_total_blocks=8,
                        prefix_cache_queries=100, prefix_cache_hits=32, num_preemptions=0,
                        offload_queries=100, offload_hits=48, offload_bytes_stored=4096,
                        offload_bytes_loaded=2048, num_host_blocks_used=3, num_host_blocks=12)
    text = ServerMetrics("m", lambda: stats).exposition().decode()
    for line in ('vllm:prefix_cache_hits_total{model_name="m"} 32.0',
                 'vllm:external_prefix_cache_queries_total{model_name="m"} 100.0',
                 'vllm:external_prefix_cache_hits_total{model_name="m"} 48.0',
                 'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="GPU_to_CPU"} '
                 '4096.0',
                 'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} '
                 '2048.0',
                 'vllm:kv_offload_cpu_usage_perc{model_name="m"} 0.25'):
        assert line in text, line
    off = ServerMetrics("m", lambda: replace(stats, num_host_blocks=0)).exposition().decode()
    assert "external_prefix_cache" not in off and "kv_offload" not in off


def test_data_parallel_engines_share_the_machine(parse) -> None:
    from dsaserve.config import physical_memory_bytes

    ram_gib = physical_memory_bytes() / 2**30
    with pytest.raises(ConfigError, match="--kv-offloading-size: 2 data-parallel engines"):
        parse(["--kv-offloading-size", f"{ram_gib * 0.6:.3f}", "-dp", "2"])


def test_load_waits_for_blocks_held_by_stores(model_dirs, engine_config) -> None:
    """A long request just finished and its stores still hold most of the GPU pool: the next
    turn waits for them and loads its prefix, rather than recomputing it (a 32-token chunk would
    fit in the blocks left, the whole prompt only once the stores land)."""
    engine = LLMEngine.from_config(_config(engine_config, model_dirs["tiny-glm5"], budget=32))
    copier = engine.runner.copier
    real_poll, history = copier.poll, []

    def late_poll() -> tuple[int, int]:
        history.append(real_poll())
        return history[max(len(history) - 9, 0)]  # longer than the filler's decode

    copier.poll = late_poll
    prompt, more = _tokens(13, 100), _tokens(113, 9)
    out = engine.generate([prompt], GREEDY)[0]
    engine.add_request("filler", _tokens(14, 150), GREEDY)  # 10 of 12 blocks: evicts most
    while not any(o.finished for o in engine.step()):
        pass
    assert engine.scheduler.offload.busy  # its stores still hold its blocks
    before = engine.stats()
    engine.generate([prompt + out + more], GREEDY)
    after = engine.stats()
    host = after.offload_hits - before.offload_hits
    gpu = after.prefix_cache_hits - before.prefix_cache_hits
    assert host > 0 and gpu + host == (len(prompt) + len(out)) // BLOCK * BLOCK
    _check_drained(engine)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_host_hit_with_mtp_drafts(model_dirs, engine_config, scheduling) -> None:
    """With MTP3 drafting, the MTP layer's own rows are written by the drafts and must come back
    from the host tier with the rest: turn 2 after eviction, served from the host, gives the
    greedy output of an engine without drafts or host tier, the loaded blocks hold turn 1's bytes
    in every layer (the MTP layer's included), and the hit's last block is recomputed."""
    from dsaserve.config import SpecConfig

    model_dir = model_dirs["tiny-glm5"]
    spec = SpecConfig(num_speculative_tokens=3)
    engine = LLMEngine.from_config(replace(_config(
        engine_config, model_dir, num_blocks=14, async_scheduling=scheduling == "async"),
        speculative=spec))
    ref = LLMEngine.from_config(_config(engine_config, model_dir, host_gib=None, num_blocks=14))
    prompt, more = _session(9)
    out1 = engine.generate([prompt], GREEDY)[0]
    assert out1 == ref.generate([prompt], GREEDY)[0]
    turn2 = prompt + out1 + more
    keys = request_block_hashes(turn2, BLOCK, None)[: (len(turn2) - 1) // BLOCK]
    num_stored = (len(prompt) + len(out1)) // BLOCK
    gpu_ids = [engine.scheduler.kv.pool.lookup(k) for k in keys[:num_stored]]
    assert None not in gpu_ids
    before = _cache_rows(engine, gpu_ids)
    mtp_rows = engine.runner.caches[engine.config.model.num_hidden_layers].kv[gpu_ids]
    assert mtp_rows.float().abs().sum() > 0  # the drafts wrote the MTP layer's rows
    for seed in (10, 11):
        other = _tokens(seed, 130)
        assert engine.generate([other], GREEDY) == ref.generate([other], GREEDY)
    assert all(engine.scheduler.kv.pool.lookup(k) is None for k in keys[:num_stored])
    hits = engine.stats().offload_hits
    assert engine.generate([turn2], GREEDY)[0] == ref.generate([turn2], GREEDY)[0]
    # As on the GPU, the last block of a hit is recomputed with MTP on: its last MTP row was
    # drafted from the token after it, which the block's key does not cover.
    num_loaded = num_stored - 1
    assert engine.stats().offload_hits - hits == num_loaded * BLOCK
    new_ids = [engine.scheduler.kv.pool.lookup(k) for k in keys[:num_loaded]]
    before = [rows[:num_loaded] for rows in before]  # per cache tensor, [blocks, ...]
    for b, a in zip(before, _cache_rows(engine, new_ids), strict=True):
        assert torch.equal(b, a)
    assert engine.stats().spec_decode_num_drafts > 0
    _check_drained(engine)


def test_host_tiers_are_counted_together(parse) -> None:
    """The host KV tier and the HiSparse pool each fit the machine, but not both at once."""
    from dsaserve.config import physical_memory_bytes

    ram_gib = physical_memory_bytes() / 2**30
    hisparse = ('{"kv_connector":"HiSparseConnector","kv_role":"kv_both",'
                f'"kv_connector_extra_config":{{"host_pool_gib":{ram_gib * 0.6:.3f}}}}}')
    with pytest.raises(ConfigError, match=r"--kv-offloading-size/--kv-transfer-config: 1 "
                                          r"data-parallel engines × \(.* host KV tier \+ .* "
                                          r"HiSparse host pool\)"):
        parse(["--kv-offloading-size", f"{ram_gib * 0.6:.3f}", "--kv-transfer-config", hisparse])
