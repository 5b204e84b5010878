"""The P/D connector in the engine, two single-rank engines in one process (shm; NIXL where it
imports): greedy output through P/D equals the aggregated engine's (bf16 and fp8_ds_mla; MTP
and multi-rank layouts are in tests/parallel/test_pd_parallel.py), bytes moved equal what the
layouts require, a later turn moves only the blocks the decode engine lacks, corrupt or replayed
params (after the first READ, or racing it) are refused, unread blocks are freed after the
timeout, a HiSparse decode engine reads the transferred prefix through its host pool, and nothing
leaks on either side."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dsaserve.config import ConfigError, DisaggConfig, OffloadConfig
from dsaserve.core import KVTransferParams, RequestError, SamplingParams
from dsaserve.disagg import descriptors, offline
from dsaserve.disagg.transport import nixl_available
from dsaserve.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BACKENDS = ["shm"] + (["nixl"] if nixl_available() else [])


def _disagg(role: str, backend: str = "shm", **kw) -> DisaggConfig:
    return DisaggConfig(kv_role=role, backend=backend, side_channel_port=0, **kw)


def _engines(config, backend="shm", **kw) -> tuple[LLMEngine, LLMEngine]:
    p = LLMEngine.from_config(dataclasses.replace(config, disagg=_disagg("kv_producer", backend,
                                                                         **kw)))
    d = LLMEngine.from_config(dataclasses.replace(config, disagg=_disagg("kv_consumer", backend)))
    return p, d


def _prefill(p: LLMEngine, rid: str, prompt: list[int]) -> KVTransferParams:
    return offline.prefill(p, rid, prompt)


def _decode(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int],
            params: KVTransferParams, sampling: SamplingParams = GREEDY) -> list[int]:
    return offline.decode(p, d, rid, prompt, params, sampling)


def _pd(p, d, prompts, sampling=GREEDY, tag="r") -> list[list[int]]:
    outs = offline.generate(p, d, prompts, sampling, tag)
    for e in (p, d):
        e.check_integrity()
    assert not p.has_unfinished_requests(), "the producer still holds blocks"
    return outs


def _received(d: LLMEngine) -> int:
    return sum(d.executor.call("kv_bytes_received"))


@pytest.mark.parametrize("backend,dtype", [("shm", "auto"), (BACKENDS[-1], "fp8_ds_mla")])
def test_pd_equals_aggregated(model_dirs, engine_config, mixed_prompts, backend, dtype):
    config = engine_config(model_dirs["tiny-glm5"], kv_cache_dtype=dtype)
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts, GREEDY)
    p, d = _engines(config, backend)
    try:
        assert _pd(p, d, prompts) == reference
        # bytes: every prompt position but the last (recomputed), minus the decode side's own
        # cached prefix, × the bytes of one token over every cache layer
        from dsaserve.disagg.kvio import row_bytes

        per_token = row_bytes(d.runner.caches).per_token
        assert per_token > 0
        before, times = _received(d), d.runner.kv_read_times()
        d_hits = d.stats().prefix_cache_hits
        params = _prefill(p, "again", prompts[0])
        out = _decode(p, d, "again", prompts[0], params)
        assert out == reference[0]
        # the READ timings (benchmarks/pd_e2e.py's columns): one more request, polled at
        # least once, its posting and flight counted
        after = d.runner.kv_read_times()
        assert after.requests == times.requests + 1 and after.polls > times.polls
        assert after.post_s > times.post_s and after.in_flight_s > times.in_flight_s
        cached = d.stats().prefix_cache_hits - d_hits  # whole blocks the decode side held
        assert cached > 0
        assert _received(d) - before == (len(prompts[0]) - 1 - cached) * per_token
    finally:
        p.shutdown()
        d.shutdown()


def test_second_turn_moves_only_new_blocks(model_dirs, engine_config, mixed_prompts):
    """Also: the prefill engine keeps its host KV tier (MultiConnector: NIXL + offloading)."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompt = mixed_prompts()[4]  # 87 tokens
    p = LLMEngine.from_config(dataclasses.replace(
        config, offload=OffloadConfig(cpu_bytes_to_use=64 << 20), disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(dataclasses.replace(config, disagg=_disagg("kv_consumer")))
    try:
        first = _pd(p, d, [prompt], tag="t1-")[0]
        from dsaserve.disagg.kvio import row_bytes

        per_token = row_bytes(d.runner.caches).per_token
        turn2 = prompt + first + mixed_prompts(seed=1)[0][:20]
        before = _received(d)
        reference = LLMEngine.from_config(config).generate([turn2], GREEDY)[0]
        assert _pd(p, d, [turn2], tag="t2-")[0] == reference
        # the decode engine holds the first turn's full blocks (16 tokens each)
        held = (len(prompt) + len(first) - 1) // 16 * 16
        assert _received(d) - before == (len(turn2) - 1 - held) * per_token
    finally:
        p.shutdown()
        d.shutdown()


def test_bad_and_replayed_params_are_refused(model_dirs, engine_config, mixed_prompts):
    config = engine_config(model_dirs["tiny-glm5"])
    prompt = mixed_prompts()[0]
    p, d = _engines(config)
    try:
        params = _prefill(p, "a", prompt)
        with pytest.raises(RequestError, match="already in use"):  # its blocks are held
            p.add_request("a", prompt, PREFILL)
        bad = [
            (dataclasses.replace(params, remote_engine_id="nope"), "unknown remote_engine_id"),
            (dataclasses.replace(params, remote_block_ids=params.remote_block_ids[::-1]),
             "remote_block_ids"),
            (dataclasses.replace(params, remote_request_id="zzz"), "not held"),
            (dataclasses.replace(params, remote_num_tokens=3), "prompt tokens"),
            (dataclasses.replace(params, remote_port=1), "cannot be reached"),
        ]
        for wrong, message in bad:
            with pytest.raises(RequestError, match=message):
                d.add_request("x", prompt, GREEDY, kv_transfer_params=wrong)
            d.check_integrity()
        # the real one still works; a replay racing its READ (checked, the READ not posted
        # yet: the prefill engine still holds the blocks) is refused, as is one after it
        d.add_request("a", prompt, GREEDY, kv_transfer_params=params)
        with pytest.raises(RequestError, match="already being read by another decode"):
            d.add_request("a2", prompt, GREEDY, kv_transfer_params=params)
        d.check_integrity()
        tokens = []
        for _ in range(500):
            if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
                break
            for out in d.step():
                assert out.error is None and out.request_id == "a"
                tokens += out.new_token_ids
            p.step()
        assert len(tokens) == GREEDY.max_tokens and not p.scheduler.connector.held
        assert not p.scheduler.connector._claims  # forgotten with the blocks
        with pytest.raises(RequestError, match="not held"):  # replayed: already consumed
            d.add_request("a2", prompt, GREEDY, kv_transfer_params=params)
        with pytest.raises(RequestError, match="kv_role"):  # the producer does not consume
            p.add_request("b", prompt, GREEDY, kv_transfer_params=params)
        for e in (p, d):
            e.check_integrity()
            assert e.stats().num_free_blocks == e.stats().num_total_blocks
    finally:
        p.shutdown()
        d.shutdown()


def test_unread_blocks_freed_after_timeout(model_dirs, engine_config, mixed_prompts):
    config = engine_config(model_dirs["tiny-glm5"])
    p = LLMEngine.from_config(dataclasses.replace(
        config, disagg=_disagg("kv_producer", abort_timeout_s=0.3)))
    try:
        _prefill(p, "orphan", mixed_prompts()[0])
        assert p.has_unfinished_requests()  # held for a consumer that never comes
        assert p.stats().num_free_blocks < p.stats().num_total_blocks
        p.check_integrity()
        deadline = time.monotonic() + 10
        while p.has_unfinished_requests() and time.monotonic() < deadline:
            p.step()
        p.check_integrity()
        assert p.stats().num_free_blocks == p.stats().num_total_blocks
    finally:
        p.shutdown()


def test_no_connector_refuses_params(model_dirs, engine_config, mixed_prompts):
    e = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"]))
    with pytest.raises(RequestError, match="no P/D connector"):
        e.add_request("a", mixed_prompts()[0], PREFILL,
                      kv_transfer_params=KVTransferParams(do_remote_decode=True))
    e.check_integrity()


def test_params_json_round_trip_and_errors():
    p = KVTransferParams(do_remote_prefill=True, remote_engine_id="e", remote_request_id="r",
                         remote_block_ids=(3, 1), remote_host="127.0.0.1", remote_port=5600,
                         remote_block_size=16, remote_num_tokens=40)
    assert KVTransferParams.from_json(p.to_json()) == p
    # vLLM's proxy asks for a prefill with every remote_* field present and null
    vllm_proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert KVTransferParams.from_json(vllm_proxy) == KVTransferParams(do_remote_decode=True)
    for raw, field in [([], "expected an object"), ({"do_remote_decode": 1}, "do_remote_decode"),
                       ({"remote_block_ids": [-1]}, "remote_block_ids"),
                       ({"remote_port": "x"}, "remote_port"),
                       ({"do_remote_decode": True, "do_remote_prefill": True}, "both")]:
        with pytest.raises(RequestError, match=field):
            KVTransferParams.from_json(raw)


def test_transfer_config_parsing():
    nixl = ('{"kv_connector":"NixlConnector","kv_role":"kv_consumer",'
            '"kv_connector_extra_config":{"backend":"shm"}}')
    c = DisaggConfig.from_json(nixl, env={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "12"})
    assert (c.kv_role, c.backend, c.abort_timeout_s, c.is_producer) == ("kv_consumer", "shm",
                                                                         12.0, False)
    multi = ('{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":'
             '{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},'
             '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
             '"kv_connector_extra_config":{"cpu_bytes_to_use":1048576}}]}}')
    assert DisaggConfig.from_json(multi, env={}).kv_role == "kv_both"
    assert OffloadConfig.from_flags(None, None, multi).cpu_bytes_to_use == 1048576
    assert OffloadConfig.from_flags(None, None, nixl).cpu_bytes_to_use == 0
    assert DisaggConfig.from_json('{"kv_connector":"OffloadingConnector"}', env={}) is None
    for text, message in [
        ('{"kv_connector":"NixlConnector"}', "kv_role"),
        ('{"kv_connector":"NixlConnector","kv_role":"x"}', "kv_role"),
        ('{"kv_connector":"NixlConnector","kv_role":"kv_both",'
         '"kv_connector_extra_config":{"backend":"tcp"}}', "backend"),
        ('{"kv_connector":"MultiConnector"}', "connectors"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DisaggConfig.from_json(text, env={})
    with pytest.raises(ConfigError, match="VLLM_NIXL_ABORT_REQUEST_TIMEOUT"):
        DisaggConfig.from_json(nixl, env={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "0"})


def _long_prompts(config) -> list[list[int]]:
    """Two prompts longer than the tiny model's top-k (so decode reads through the buffer)."""
    import torch

    g = torch.Generator().manual_seed(7)
    n = config.model.index_topk + 8
    return [torch.randint(4, 512, (n + 5 * i,), generator=g).tolist() for i in range(2)]


@pytest.mark.parametrize("dtype", ["auto", "fp8_ds_mla"])
def test_pd_into_a_hisparse_decode_engine(model_dirs, engine_config, dtype):
    """Decode {HiSparse}: the rows read from the prefill engine land in GPU pages and are
    mirrored into the decode engine's host pool at admission; decoding through a hot buffer of
    top-k rows (misses served from that pool) gives the aggregated engine's greedy output."""
    from dsaserve.config import HiSparseConfig

    config = engine_config(model_dirs["tiny-glm5"], kv_cache_dtype=dtype, max_model_len=160)
    prompts = _long_prompts(config)
    reference = LLMEngine.from_config(config).generate(prompts, GREEDY)
    topk = config.model.index_topk
    hot = dataclasses.replace(
        config, hisparse=HiSparseConfig(host_pool_bytes=16 << 20),
        attention=dataclasses.replace(config.attention, hisparse_device_buffer_size=topk,
                                      hisparse_config_given=True))
    p = LLMEngine.from_config(dataclasses.replace(config, disagg=_disagg("kv_producer")))
    d = LLMEngine.from_config(dataclasses.replace(hot, disagg=_disagg("kv_consumer")))
    try:
        assert _pd(p, d, prompts) == reference
        d.step()  # an empty step tells the runner which requests ended
        d.executor.call("check_hisparse")
        rt = d.runner.hisparse
        assert int(rt.rows_from_host) > 0  # the transferred prefix was read from the host pool
        assert not rt.entries and len(rt._free_blocks) == rt.num_host_blocks
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_posts_one_read_per_peer(model_dirs, engine_config, mixed_prompts, monkeypatch,
                                           backend):
    """A request's READs (every layer and part) are one transport call per producer rank and
    memory kind: here one rank, all of one kind → one `read_regions`, no per-layer `read`; its
    items move exactly the bytes counted, those the prompt needs."""
    config = engine_config(model_dirs["tiny-glm5"])
    prompt = mixed_prompts()[0]
    p, d = _engines(config, backend)
    try:
        worker = d.runner.connector
        calls: list[tuple[str, list]] = []
        real = worker.transport.read_regions

        def read_regions(peer, items, notify=b""):
            calls.append((peer, list(items)))
            return real(peer, items, notify)

        def read(*args, **kw):
            raise AssertionError("a per-layer read was posted")

        monkeypatch.setattr(worker.transport, "read_regions", read_regions)
        monkeypatch.setattr(worker.transport, "read", read)
        from dsaserve.disagg.kvio import row_bytes

        before = _received(d)
        params = _prefill(p, "one", prompt)
        _decode(p, d, "one", prompt, params)
        assert len(calls) == 1
        peer, items = calls[0]
        assert peer in worker.transport.peers
        # every layer's parts in the one call
        assert {remote for _, remote, _ in items} == set(
            descriptors.cache_regions(d.runner.caches))
        moved = sum(n for _, _, segs in items for _, _, n in segs)
        assert moved == _received(d) - before == (
            (len(prompt) - 1) * row_bytes(d.runner.caches).per_token)
        for e in (p, d):
            e.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()


def test_a_decode_request_is_hashed_once_its_reads_are_posted(model_dirs, engine_config,
                                                             mixed_prompts, monkeypatch):
    """A P/D arrival's prompt is not hashed in add_request: the lookup before its READs hashes
    only the blocks it walks (16 of 24, none cached), and the step that posts them hashes the
    rest while they are in flight (what the first token waited for at 128K: 4–5 ms). Its
    hashes are then a local prompt's, and the output the aggregated engine's."""
    from dsaserve.kv.prefix_cache import request_block_hashes

    config = engine_config(model_dirs["tiny-glm5"], block_size=8)
    prompt = [t for p in mixed_prompts() for t in p][:200]  # 25 full blocks of 8
    assert len(prompt) == 200
    reference = LLMEngine.from_config(config).generate([prompt], GREEDY)[0]
    p, d = _engines(config)
    try:
        params = _prefill(p, "r", prompt)
        seen = []
        post = d.runner.connector.start_receives

        def posting(recvs, dests=None):
            seen.append(len(d.scheduler.requests["r"].block_hashes))
            return post(recvs, dests)
        monkeypatch.setattr(d.runner.connector, "start_receives", posting)
        d.add_request("r", prompt, GREEDY, kv_transfer_params=params)
        req = d.scheduler.requests["r"]
        assert req.block_hashes == []
        tokens = [t for o in d.step() for t in o.new_token_ids]
        assert seen == [16]  # posted with the lookup's hashes only
        assert req.block_hashes == request_block_hashes(prompt, 8, None)
        while d.has_unfinished_requests():
            tokens += [t for o in d.step() for t in o.new_token_ids]
            p.step()
        assert tokens == reference
        while p.has_unfinished_requests():
            p.step()
        for e in (p, d):
            e.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()
