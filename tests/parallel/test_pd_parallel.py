"""P/D between multi-rank engines on gloo processes (shared memory transport): greedy output
through a prefill engine (1 rank, or DCP-sharded: PCP2 × DCP2 at interleave 1, READ staged, and
= block size, READ zero-copy; TP2 × DCP2) and a decode engine (1 rank, DP2, DP2 + EP, a spilling
HiSparse engine) equals the single-rank engine's, bf16 and fp8_ds_mla, MTP3 on the cells of every
prefill layout into DP2 and HiSparse (the decode side accepts the single rank's drafts: they read
the MTP rows that came over), and with --async-scheduling on both sides (the prefill engine's
params equal its sync ones); the bytes each request moved are what the layouts require; nothing
leaks on either side. A decode engine of two ranks or two replicas shut down mid-READ gives its
claims back."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

from dsaserve.config import DisaggConfig, HiSparseConfig, SpecConfig
from dsaserve.core import RequestStatus, SamplingParams
from dsaserve.disagg import descriptors, offline
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine

pytestmark = pytest.mark.parallel


def _with(config, role: str | None, dtype: str, spec: SpecConfig | None = None,
          model_path=None):
    """`config` with a cache dtype, MTP, a checkpoint and a P/D role (None: aggregated)."""
    cache = dataclasses.replace(config.cache, kv_cache_dtype=dtype)
    disagg = None if role is None else DisaggConfig(kv_role=role, backend="shm",
                                                    side_channel_port=0)
    return dataclasses.replace(config, cache=cache, speculative=spec, disagg=disagg,
                               model_path=str(model_path or config.model_path))


def _per_token(decode) -> int:
    """Bytes of one token over every cache layer (identical on every decode rank)."""
    from dsaserve.disagg.kvio import row_bytes

    if isinstance(decode, DataParallelEngine):
        return _per_token(decode.replicas[0])
    if decode.runner is not None:
        return row_bytes(decode.runner.caches).per_token
    return decode.executor.call("kv_row_bytes")[0]  # a worker process's runner


def _received(decode) -> int:
    replicas = decode.replicas if isinstance(decode, DataParallelEngine) else [decode]
    return sum(sum(r.executor.call("kv_bytes_received")) for r in replicas)


def _check_no_leak(*engines) -> None:
    """Every invariant of each engine, and every KV block free again."""
    for e in engines:
        e.check_integrity()
        s = e.stats()
        assert s.num_free_blocks == s.num_total_blocks, "a KV block leaked"


def _reference(config, prompts, params) -> tuple[list, int]:
    """An aggregated engine's greedy outputs and the drafts it accepted."""
    engine = LLMEngine.from_config(config)
    try:
        return engine.generate(prompts, params), engine.stats().spec_decode_num_accepted_tokens
    finally:
        engine.shutdown()


def _hits(decode) -> int:
    return decode.stats().prefix_cache_hits


def _read_paths(decode) -> tuple[int, int]:
    """(pairs READ staged, pairs READ zero-copy) over every decode rank (disagg/staging.py)."""
    replicas = decode.replicas if isinstance(decode, DataParallelEngine) else [decode]
    paths = [p for r in replicas for p in r.executor.call("kv_read_paths")]
    return sum(s for s, _ in paths), sum(z for _, z in paths)


@pytest.mark.parametrize("prefill_layout,decode_layout,dtype,path,mtp", [
    (dict(pcp=2, dcp=2, interleave=1), {}, "auto", "staged", False),
    (dict(pcp=2, dcp=2, interleave=1), {}, "fp8_ds_mla", "staged", False),
    (dict(pcp=2, dcp=2, interleave=16), dict(dp=2), "fp8_ds_mla", "zero-copy", False),
    (dict(pcp=2, dcp=2, interleave=16), dict(dp=2, ep=True), "auto", "zero-copy", False),
    (dict(pcp=2, dcp=2, interleave=16), {}, "auto", "zero-copy", False),
    (dict(tp=2, dcp=2), {}, "fp8_ds_mla", "staged", False),
    (dict(tp=2, dcp=2), dict(dp=2), "fp8_ds_mla", "staged", True),
    ({}, dict(dp=2), "auto", "zero-copy", True),
    (dict(pcp=2, dcp=2, interleave=1), dict(dp=2), "auto", "staged", True),
], ids=["pcp2dcp2-i1-to-1rank-bf16", "pcp2dcp2-i1-to-1rank-fp8", "pcp2dcp2-i16-to-dp2-fp8",
        "pcp2dcp2-i16-to-dp2ep-bf16", "pcp2dcp2-i16-to-1rank-bf16", "tp2dcp2-to-1rank-fp8",
        "tp2dcp2-to-dp2-fp8-mtp3", "1rank-to-dp2-bf16-mtp3", "pcp2dcp2-i1-to-dp2-bf16-mtp3"])
def test_pd_equals_single_rank(parallel_config, reference_outputs, draftable_dirs, prompts,
                               greedy, prefill_layout, decode_layout, dtype, path, mtp,
                               hang_guard):
    """Interleave 1 (one zero-copy segment per row) READs staged, interleave = block size
    (and one prefill rank: whole pages) zero-copy: every (prefill DCP rank → decode rank) pair
    of every request went that way. DP + EP on the decode side: the reference deployment's
    decode layout (the replicas step together while one READs). With MTP3 on both sides (a
    draftable checkpoint) the decode side also accepts as many drafts as the single-rank
    engine: its drafts read the MTP layer's rows that were moved."""
    prompts, reference = prompts[:2], reference_outputs[:2]
    spec = SpecConfig(num_speculative_tokens=3) if mtp else None
    model = draftable_dirs["tiny-glm5"] if mtp else None
    accepted = 0
    if dtype != "auto" or mtp:
        reference, accepted = _reference(_with(parallel_config(), None, dtype, spec, model),
                                         prompts, greedy)
    with hang_guard(300):
        p = LLMEngine.from_config(_with(parallel_config(**prefill_layout), "kv_producer", dtype,
                                        spec, model))
        d = LLMEngine.from_config(_with(parallel_config(**decode_layout), "kv_consumer", dtype,
                                        spec, model))
        try:
            hits = _hits(d)
            assert offline.generate(p, d, prompts, greedy) == reference
            assert d.stats().spec_decode_num_accepted_tokens == accepted
            assert accepted > 0 or not mtp
            # bytes: every prompt position but the last, less what the decode side had cached
            moved = sum(len(q) - 1 for q in prompts) - (_hits(d) - hits)
            assert _received(d) == moved * _per_token(d)
            pairs = prefill_layout.get("dcp", 1) * len(prompts)  # each prefill DCP rank → the
            assert _read_paths(d) == ((pairs, 0) if path == "staged" else (0, pairs))  # decoder
            _check_no_leak(p, d)
        finally:
            p.shutdown()
            d.shutdown()


def test_pd_mtp_from_pcp_prefill(parallel_config, draftable_dirs, prompts, greedy, hang_guard):
    """MTP3 on both sides, the prefill engine PCP2 × DCP2: the decode side's acceptance equals
    the single-rank engine's (its drafts read the MTP layer's rows that were moved)."""
    spec = SpecConfig(num_speculative_tokens=3)
    path = draftable_dirs["tiny-glm5"]
    prompts = prompts[:2]
    ref = LLMEngine.from_config(_with(parallel_config(), None, "auto", spec, path))
    reference = ref.generate(prompts, greedy)
    accepted = ref.stats().spec_decode_num_accepted_tokens
    ref.shutdown()
    with hang_guard(300):
        p = LLMEngine.from_config(_with(parallel_config(pcp=2, dcp=2), "kv_producer", "auto",
                                        spec, path))
        d = LLMEngine.from_config(_with(parallel_config(), "kv_consumer", "auto", spec, path))
        try:
            assert offline.generate(p, d, prompts, greedy) == reference
            assert accepted > 0 and d.stats().spec_decode_num_accepted_tokens == accepted
            for e in (p, d):
                e.check_integrity()
        finally:
            p.shutdown()
            d.shutdown()


def test_pd_async_pcp_producer_equals_sync(parallel_config, reference_outputs, prompts, greedy,
                                           hang_guard):
    """The prefill engine of the reference layout (PCP2 × DCP2, prompts in chunks of at most
    24 tokens split over the PCP ranks) with --async-scheduling, into an async decode engine:
    every prompt's kv_transfer_params equal the sync prefill engine's (the same blocks), and
    the output equals the single-rank engine's; nothing leaks on either side."""
    prompts, reference = prompts[:3], reference_outputs[:3]
    held = {}
    with hang_guard(300):
        for asynchronous in (False, True):
            p_cfg = _with(parallel_config(pcp=2, dcp=2, max_num_batched_tokens=24),
                          "kv_producer", "auto")
            d_cfg = _with(parallel_config(), "kv_consumer", "auto")
            if asynchronous:
                p_cfg, d_cfg = (dataclasses.replace(c, scheduler=dataclasses.replace(
                    c.scheduler, async_scheduling=True)) for c in (p_cfg, d_cfg))
            p, d = LLMEngine.from_config(p_cfg), LLMEngine.from_config(d_cfg)
            try:
                got, held[asynchronous] = [], []
                for i, prompt in enumerate(prompts):
                    params = offline.prefill(p, f"pd-{i}", prompt)
                    held[asynchronous].append(dataclasses.replace(
                        params, remote_engine_id=None, remote_port=None))
                    got.append(offline.decode(p, d, f"pd-{i}", prompt, params, greedy))
                assert got == reference
                _check_no_leak(p, d)
            finally:
                p.shutdown()
                d.shutdown()
    assert held[True] == held[False]


def test_prefill_ranks_killed_then_next_request(parallel_config, prompts, greedy, hang_guard):
    """The prefill engine's worker processes are killed (and their memory swept) after its
    prefill, before the decode engine reads: that request fails with an error (no crash, no
    leaked block), and the decode engine serves the next request from a fresh prefill engine."""
    import base64
    import json
    import os
    import signal

    from dsaserve.disagg.transport import remove_shm_files

    with hang_guard(300):
        d = LLMEngine.from_config(_with(parallel_config(), "kv_consumer", "auto"))
        p = LLMEngine.from_config(_with(parallel_config(pcp=2, dcp=2), "kv_producer", "auto"))
        agents = [json.loads(base64.b64decode(json.loads(m)["transport"]))["agent"]
                  for m in p.scheduler.connector.rank_metadata]
        try:
            params = offline.prefill(p, "doomed", prompts[0])
            d.add_request("doomed", prompts[0], greedy, kv_transfer_params=params)  # checked
            for pid in p.executor.pids:
                os.kill(pid, signal.SIGKILL)
            # A dead shm agent's files would still hold the right bytes (nothing to fail on):
            # gone with a launcher's sweep, as on a real node its GPU memory is
            for agent in agents:
                remove_shm_files(agent)
            errors = []
            while d.has_unfinished_requests():
                errors += [o.error for o in d.step() if o.error]
            assert len(errors) == 1 and "prefill engine failed" in errors[0], errors
            d.check_integrity()
            s = d.stats()
            assert s.num_free_blocks == s.num_total_blocks
            p.shutdown()
            p = LLMEngine.from_config(_with(parallel_config(), "kv_producer", "auto"))
            reference = LLMEngine.from_config(_with(parallel_config(), None, "auto"))
            want = reference.generate([prompts[1]], greedy)
            reference.shutdown()
            assert offline.generate(p, d, [prompts[1]], greedy, tag="next") == want
            for e in (p, d):
                e.check_integrity()
        finally:
            p.shutdown()
            d.shutdown()
            for agent in agents:
                remove_shm_files(agent)


@pytest.mark.parametrize("prefill_layout,decode_layout", [
    ({}, dict(tp=2, dcp=2)), (dict(pcp=2, dcp=2), dict(tp=2))],
    ids=["1rank-to-tp2dcp2-zero-copy", "pcp2dcp2-i1-to-tp2-staged"])
def test_abort_while_receiving_then_the_same_id_on_two_decode_ranks(parallel_config, prompts,
                                                                    greedy, prefill_layout,
                                                                    decode_layout, hang_guard):
    """A decode engine of two ranks (TP2 × DCP2, each READs its share; or TP2, each READs
    every row): a request aborted right
    after its READs were posted (each rank may have landed, reported or still be reading its
    share) is sent again at once under the same id; every rank cancels what it still has in
    flight before the retry's READs are posted (into blocks the first one held), the executor's
    tally forgets the first one's reports, and the retry's output equals the single-rank
    engine's; nothing leaks on either side. From a PCP2 × DCP2 prefill engine at interleave 1
    into TP2 the READs are staged: the staging buffers (checked with every step's invariants)
    go back at the cancel, and no staged row of the aborted READs lands in the retry's blocks."""
    prompts = prompts[:2]
    reference = LLMEngine.from_config(_with(parallel_config(), None, "auto"))
    want = reference.generate(prompts, greedy)
    reference.shutdown()
    with hang_guard(300):
        p = LLMEngine.from_config(_with(parallel_config(**prefill_layout), "kv_producer",
                                        "auto"))
        d = LLMEngine.from_config(_with(parallel_config(**decode_layout), "kv_consumer",
                                        "auto"))
        try:
            tokens: dict[str, list[int]] = {"a": [], "b": []}
            d.add_request("a", prompts[0], greedy,
                          kv_transfer_params=offline.prefill(p, "a", prompts[0]))
            d.add_request("b", prompts[1], greedy,
                          kv_transfer_params=offline.prefill(p, "b", prompts[1]))
            retry = offline.prefill(p, "b-retry", prompts[1])
            for o in d.step():  # both posted
                tokens[o.request_id] += o.new_token_ids
            d.abort_request("b")
            d.add_request("b", prompts[1], greedy, kv_transfer_params=retry)
            tokens["b"] = []
            reasons = {}
            for _ in range(500):
                if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
                    break
                for o in d.step():
                    tokens[o.request_id] += o.new_token_ids
                    if o.finished:
                        reasons[o.request_id] = (o.finish_reason, o.error)
                p.step()
                d.check_integrity()
                p.check_integrity()
            assert sorted(reasons) == ["a", "b"] and all(e is None for _, e in reasons.values())
            assert reasons["b"][0] != "abort"  # the retry's own end, not the first one's
            assert [tokens["a"], tokens["b"]] == want
            staged, zero_copy = _read_paths(d)
            assert (staged if prefill_layout else zero_copy) > 0
            assert (zero_copy if prefill_layout else staged) == 0
            d.step()  # the runners learn that the last requests ended
            _check_no_leak(p, d)
        finally:
            p.shutdown()
            d.shutdown()


@pytest.mark.parametrize("decode_layout", [dict(tp=2), dict(dp=2)], ids=["tp2", "dp2"])
def test_a_multi_rank_decode_engine_shut_down_gives_its_claims_back(parallel_config, prompts,
                                                                    greedy, decode_layout,
                                                                    hang_guard):
    """A decode engine of two ranks (TP2) or two replicas (DP2, one request each) shut down in
    the step after its READs were posted, one request aborted just before (no step told its
    ranks to cancel and notify): the worker processes cancel their READs as they stop, then the
    engine core (each replica's) gives back every claim not fully read, so the producer frees
    its blocks long before its 120 s timeout; nothing leaks on either side."""
    producer = _with(parallel_config(), "kv_producer", "auto")
    producer = dataclasses.replace(producer, disagg=dataclasses.replace(
        producer.disagg, abort_timeout_s=120.0))
    with hang_guard(300):
        p = LLMEngine.from_config(producer)
        d = LLMEngine.from_config(_with(parallel_config(**decode_layout), "kv_consumer",
                                        "auto"))
        try:
            for rid, prompt in zip("ab", prompts[:2], strict=True):
                d.add_request(rid, prompt, greedy,
                              kv_transfer_params=offline.prefill(p, rid, prompt))
            d.step()  # posted: each rank may have landed, reported or still be reading
            d.abort_request("b")
            d.shutdown()
            t0 = time.monotonic()
            while p.scheduler.connector.held:
                assert time.monotonic() - t0 < 30, "held until the producer's timeout"
                p.step()
                p.check_integrity()
            _check_no_leak(p)
            replicas = d.replicas if isinstance(d, DataParallelEngine) else [d]
            for r in replicas:  # executors gone: the schedulers' own checks
                r.scheduler.check_integrity()
                s = r.stats()
                assert s.num_free_blocks == s.num_total_blocks and not r.scheduler.requests
                assert r.connector.num_claimed == 0
        finally:
            p.shutdown()
            d.shutdown()


def _spilling_consumer(engine_config, model_dir):
    """(aggregated config, spilling HiSparse consumer config): pages of 4 tokens, 16 MLA pages
    (one max-length window, fewer than the requests' blocks together), as in
    tests/unit/test_pd_hisparse_spill.py."""
    plain = engine_config(model_dir, block_size=4, num_blocks=100, max_model_len=64)
    att = dataclasses.replace(plain.attention, hisparse_config_given=True,
                              hisparse_device_buffer_size=plain.model.index_topk,
                              hisparse_device_mla_pages=16)
    consumer = dataclasses.replace(
        plain, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20),
        disagg=DisaggConfig(kv_role="kv_consumer", backend="shm", side_channel_port=0))
    return plain, consumer


@pytest.mark.parametrize("prefill_layout,dtype", [
    (dict(tp=2, dcp=2), "fp8_ds_mla"), (dict(pcp=2, dcp=2, interleave=16), "auto"),
], ids=["tp2dcp2-fp8", "pcp2dcp2-i16-bf16"])
def test_pd_into_a_spilling_hisparse_engine_with_mtp3(parallel_config, engine_config,
                                                      draftable_dirs, prefill_layout, dtype,
                                                      hang_guard):
    """MTP3 on both sides, a DCP-sharded prefill engine (TP2 × DCP2, PCP2 × DCP2 at interleave
    = block size) into a spilling HiSparse decode engine: greedy output and accepted drafts
    equal the aggregated engine's (the drafts read the MTP layer's rows that were moved, the
    spilled ones from the host pool); nothing leaks on either side."""
    from dsaserve.kv.hisparse.admission import min_mla_pages, write_tail_pages

    spec = SpecConfig(num_speculative_tokens=3)
    path = draftable_dirs["tiny-glm5"]
    block = 4
    plain = engine_config(path, block_size=block, num_blocks=100, max_model_len=128)
    plain = dataclasses.replace(plain, speculative=spec, cache=dataclasses.replace(
        plain.cache, kv_cache_dtype=dtype))
    buffer = 4 * plain.model.index_topk  # the top-k union of a verify step's 4 rows
    pages = min_mla_pages(buffer + 2, block) + write_tail_pages(3, block)  # lookahead 2
    att = dataclasses.replace(plain.attention, hisparse_config_given=True,
                              hisparse_device_buffer_size=buffer,
                              hisparse_device_mla_pages=pages)
    consumer = dataclasses.replace(
        plain, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20),
        disagg=DisaggConfig(kv_role="kv_consumer", backend="shm", side_channel_port=0))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    # longer than the pages hold: their early blocks' MLA rows go to the host pool
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (90, 100)]
    assert -(-(90 + greedy.max_tokens) // block) > pages
    want, accepted = _reference(plain, prompts, greedy)
    with hang_guard(300):
        p = LLMEngine.from_config(_with(parallel_config(**prefill_layout), "kv_producer", dtype,
                                        spec, path))
        d = LLMEngine.from_config(consumer)
        try:
            assert offline.generate(p, d, prompts, greedy) == want
            assert accepted > 0 and d.stats().spec_decode_num_accepted_tokens == accepted
            assert d.runner.connector.mla_rows_to_host > 0
            _check_no_leak(p, d)
        finally:
            p.shutdown()
            d.shutdown()


def _prefill_rows(p, params, positions: list[int], regions: list[int]) -> list[list[bytes]]:
    """Per position, the prefill engine's bytes of its rows in cache tensors `regions` (the
    `read_blocks` order), read from the DCP rank that owns it."""
    from dsaserve.kv import layout

    b, n, i = params.remote_block_size, params.remote_dcp_size, params.remote_interleave
    ids = list(params.remote_block_ids)
    ranks = [json.loads(m)["dcp_rank"] for m in p.scheduler.connector.rank_metadata]
    pages = p.executor.call("read_blocks", ids)  # per rank, per tensor [n, page_bytes]
    pos = torch.tensor(positions)
    table = torch.tensor([ids], dtype=torch.int32)
    out: list[list[bytes]] = [[] for _ in positions]
    for rank, dcp_rank in enumerate(ranks):
        slots = layout.slot_mapping(pos, torch.zeros_like(pos), table, b, n, dcp_rank, i)
        for k, slot in enumerate(slots.tolist()):
            if slot < 0 or out[k]:
                continue
            block, row = ids.index(slot // b), slot % b
            out[k] = [pages[rank][t][block].view(b, -1)[row].numpy().tobytes()
                      for t in regions]
    return out


def test_pd_staged_into_a_spilling_hisparse_host_pool(parallel_config, engine_config, tiny_dir,
                                                      hang_guard, monkeypatch):
    """PCP2 × DCP2 at interleave 1 (every pair staged) into a spilling HiSparse decode engine:
    the MLA rows of spilled blocks are READ into a host-memory staging buffer (regions SH*) and
    scattered into the host pool there, the caches' staging buffer carries only the keys and
    the tail's rows; the host pool's rows equal the prefill ranks' bytes; greedy output equals
    the aggregated engine's; an abort while such READs are in flight gives both buffers back;
    every invariant after every step, nothing leaks."""
    from dsaserve.disagg.shmcopy import CopyThread

    plain, consumer = _spilling_consumer(engine_config, tiny_dir)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(21)
    # long prompts (spilled below their write tail) whose tails hold 3 received rows: 2 of one
    # prefill rank, a pair the caches' staging buffer takes (one row each is zero-copy)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (40, 44, 48, 40)]
    ref = LLMEngine.from_config(plain)
    want = ref.generate(prompts[:3], greedy)
    ref.shutdown()
    with hang_guard(300):
        p = LLMEngine.from_config(_with(parallel_config(pcp=2, dcp=2, interleave=1),
                                        "kv_producer", "auto"))
        d = LLMEngine.from_config(consumer)
        try:
            worker, rt = d.runner.connector, d.runner.hisparse
            reads: dict[tuple[str, str], int] = {}  # bytes READ per (local, remote) region
            real_read = worker.transport.read_regions

            def read(peer, items, notify=b""):
                for local, remote, segments in items:
                    reads[local, remote] = reads.get((local, remote), 0) + sum(
                        n for _, _, n in segments)
                return real_read(peer, items, notify)

            monkeypatch.setattr(worker.transport, "read_regions", read)
            names = list(descriptors.cache_regions(d.runner.caches))  # read_blocks' order
            kv_regions = [k for k, name in enumerate(names) if name.endswith(".kv")]
            ids = [f"r{k}" for k in range(3)]
            params = {rid: offline.prefill(p, rid, q)
                      for rid, q in zip(ids, prompts[:3], strict=True)}
            for rid, q in zip(ids, prompts[:3], strict=True):
                d.add_request(rid, q, greedy, kv_transfer_params=params[rid])
            tokens: dict[str, list[int]] = {rid: [] for rid in ids}
            compared = 0
            unchecked = set(ids)
            for _ in range(500):
                if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
                    break
                for o in d.step():
                    tokens[o.request_id] += o.new_token_ids
                p.step()
                d.check_integrity()
                p.check_integrity()
                # arrived (every READ landed and scattered): its spilled blocks' host rows
                for rid in [r for r in unchecked
                            if d.scheduler.requests[r].status == RequestStatus.RUNNING]:
                    unchecked.discard(rid)
                    req = d.scheduler.requests[rid]
                    blocks = list(req.block_ids)
                    spilled = [j for j, blk in enumerate(blocks)
                               if blk not in d.scheduler.mla.page_of
                               and j * 4 < len(req.prompt_token_ids) - 1]
                    host = d.runner.hisparse_block_rows([blocks[j] for j in spilled])
                    pos = [j * 4 + o for j in spilled for o in range(4)
                           if j * 4 + o < len(req.prompt_token_ids) - 1]
                    sent = _prefill_rows(p, params[rid], pos, kv_regions)
                    for q, rows in zip(pos, sent, strict=True):
                        got = [h[spilled.index(q // 4), q % 4].numpy().tobytes() for h in host]
                        assert got == rows, f"{rid}: position {q}'s host rows"
                        compared += 1
            assert [tokens[rid] for rid in ids] == want
            assert compared > 0 and not unchecked and int(rt.rows_from_host) > 0
            # the MLA rows of spilled blocks READ into the host buffers (SH*) only, never into
            # the caches' staging buffer (S<k>) nor zero-copy into the pool (H*); the tail's
            # into the caches' buffer or, where a pair is a row or two, zero-copy (L*)
            kv_bytes = sum(f.kv_bytes for f in worker.formats)
            mla_into = dict.fromkeys(("SH", "S", "H", "L"), 0)
            for (local, remote), n in reads.items():
                if remote.endswith(".kv"):
                    mla_into["SH" if local.startswith("SH") else local[0]] += n
            assert mla_into["SH"] == worker.mla_rows_to_host * kv_bytes > 0
            assert mla_into["H"] == 0
            assert mla_into["S"] + mla_into["L"] == worker.mla_rows_to_gpu * kv_bytes
            host_pool, dev_pool = worker.host_staging, worker.staging
            assert host_pool is not None and dev_pool is not None
            assert worker.pairs_staged > 0 and host_pool.allocated > 0 < dev_pool.allocated
            d.step()  # the runner learns that the last requests ended
            _check_no_leak(p, d)
            assert not host_pool.in_use and not dev_pool.in_use

            # an abort while staged READs into the host pool are in flight: both buffers back
            release = threading.Event()
            real_copy = CopyThread._copy

            def held(thread, job) -> bool:
                while not (release.wait(0.002) or job.cancelled):
                    pass
                return real_copy(thread, job)

            monkeypatch.setattr(CopyThread, "_copy", held)
            try:
                d.add_request("x", prompts[3], greedy,
                              kv_transfer_params=offline.prefill(p, "x", prompts[3]))
                d.step()  # posted, held in flight
                assert "x" in d.scheduler.receiving
                assert (len(dev_pool.in_use), len(host_pool.in_use)) == (1, 1)
                d.check_integrity()
                d.abort_request("x")
                d.step()  # the runner cancels
                assert (len(dev_pool.in_use), len(host_pool.in_use)) == (0, 0)
            finally:
                release.set()
            for _ in range(50):
                if not p.scheduler.connector.held:
                    break
                p.step()
                time.sleep(0.01)
            d.step()
            _check_no_leak(p, d)
        finally:
            p.shutdown()
            d.shutdown()
