"""--async-scheduling on the CPU (engine/async_scheduler.py): step k + 1 is scheduled and launched
before step k's tokens are read; its inputs that continue from step k come from step k's samples
on the device. Greedy output equals sync scheduling on the tiny presets with prefix caching,
requests ending by max_tokens and by stop tokens at different steps, prefills joining running
decodes and preemption; no block leaks, and no block hash covers a token the host does not know
yet (the placeholders). With MTP3 (draftable checkpoints) greedy output equals sync MTP3's and
no-MTP greedy's in the same scenarios; seeded sampling is reproducible and synthetic acceptance
keeps its acceptance length."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dsaserve.config import SpecConfig
from dsaserve.core import PLACEHOLDER_TOKEN_ID, SamplingParams
from dsaserve.engine.args import add_engine_args, engine_config_from_args
from dsaserve.engine.async_scheduler import AsyncScheduler
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.prefix_cache import extend_block_hashes

# (prompt length, max_tokens, the step it joins at): prefills join while others decode; a
# repeated prompt start hits the prefix cache
_ARRIVALS = [(21, 9, 0), (37, 14, 0), (5, 3, 0), (21, 11, 2), (44, 6, 5), (13, 17, 5)]


def _async(config, on: bool = True):
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, async_scheduling=on))


def _prompt(i: int, n: int) -> list[int]:
    shared = list(range(3, 19))  # the first block (16 tokens) is shared: prefix hits
    return (shared + [(7 * i + 5 * j) % 200 + 20 for j in range(n)])[:n]


def _check_hashes(engine: LLMEngine) -> None:
    """Every block hash a request holds is the hash of its tokens known on the host."""
    size = engine.scheduler.block_size
    for req in engine.scheduler.requests.values():
        known = req.all_token_ids[: req.num_tokens - req.num_output_placeholders]
        assert PLACEHOLDER_TOKEN_ID not in known
        expected: list[bytes] = []
        extend_block_hashes(expected, known, size, req.cache_salt)
        assert req.block_hashes == expected[: len(req.block_hashes)]


def _run(config, params: list[SamplingParams], arrivals=_ARRIVALS, same_prompt_as=None
         ) -> tuple[dict[str, list[int]], LLMEngine]:
    """The arrivals through an engine, check_integrity and the hashes after every step; the
    output tokens of each request and how it finished. `same_prompt_as`: arrival → an
    earlier arrival whose prompt it repeats."""
    same_prompt_as = same_prompt_as or {}
    engine = LLMEngine.from_config(config)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    step = 0
    while step == 0 or engine.has_unfinished_requests():
        for i, (n, _, at) in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", _prompt(same_prompt_as.get(i, i), n), params[i])
                outputs[f"r{i}"] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:  # with the stop id that ended it, if one did
                reasons[out.request_id] = out.finish_reason if out.stop_token_id is None \
                    else (out.finish_reason, out.stop_token_id)
                assert out.num_output_tokens == len(outputs[out.request_id])
        engine.check_integrity()
        _check_hashes(engine)
        step += 1
        assert step < 200, "the engine did not finish"
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return {rid: outputs[rid] + [reasons[rid]] for rid in outputs}, engine


def _greedy(stops: dict[int, int] | None = None, arrivals=_ARRIVALS) -> list[SamplingParams]:
    stops = stops or {}
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                           stop_token_ids=(stops[i],) if i in stops else ())
            for i, (_, m, _) in enumerate(arrivals)]


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_async_greedy_equals_sync(engine_config, model_dirs, preset):
    cfg = engine_config(model_dirs[preset], max_num_seqs=8)
    sync, _ = _run(cfg, _greedy())
    got, engine = _run(_async(cfg), _greedy())
    assert isinstance(engine.scheduler, AsyncScheduler)
    assert got == sync
    assert all(out[-1] == "length" for out in got.values())
    assert engine.stats().prefix_cache_hits > 0


def test_async_stop_tokens_at_different_steps(engine_config, model_dirs):
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8)
    free, _ = _run(cfg, _greedy())
    # each request stops at a token it emits at a different step (its first occurrence)
    stops = {i: free[f"r{i}"][j] for i, j in [(0, 2), (1, 6), (3, 0), (5, 9)]}
    sync, _ = _run(cfg, _greedy(stops))
    assert [sync[f"r{i}"][-1] for i in stops] == [("stop", stops[i]) for i in stops]
    got, engine = _run(_async(cfg), _greedy(stops))
    assert got == sync
    engine.check_integrity()


def test_async_with_preemption(engine_config, model_dirs):
    # 8 blocks of 16 tokens hold one request of max_model_len, not these four together
    arrivals = [(30, 40, 0), (35, 40, 0), (40, 30, 1), (25, 45, 3)]
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=8, max_model_len=128)
    sync, sync_engine = _run(cfg, _greedy(arrivals=arrivals), arrivals)
    got, engine = _run(_async(cfg), _greedy(arrivals=arrivals), arrivals)
    assert engine.stats().num_preemptions > 0 and sync_engine.stats().num_preemptions > 0
    assert got == sync


def test_async_seeded_sampling_equals_sync(engine_config, model_dirs):
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8)
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=11 + i,
                             ignore_eos=True) for i, (_, m, _) in enumerate(_ARRIVALS)]
    sync, _ = _run(cfg, params)
    got, _ = _run(_async(cfg), params)
    assert got == sync


@pytest.mark.parametrize("k", [0, 3])
def test_async_abort_in_flight_leaks_nothing(engine_config, model_dirs, k):
    cfg = _async(engine_config(model_dirs["tiny-glm5"]))
    engine = LLMEngine.from_config(_mtp(cfg, k) if k else cfg)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", _prompt(0, 30), params)
    engine.add_request("b", _prompt(1, 30), params)
    for _ in range(4):
        engine.step()
    engine.abort_request("a")  # its step is in flight, and a placeholder is pending
    outs = [o for _ in range(3) for o in engine.step()]
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def _mtp(config, k: int = 3, spec_json: str | None = None):
    spec = (SpecConfig(num_speculative_tokens=k) if spec_json is None
            else SpecConfig.from_json(spec_json))
    return dataclasses.replace(config, speculative=spec)


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_async_mtp_greedy_equals_sync_mtp_and_no_mtp(engine_config, draftable_dirs, preset):
    """MTP3 with async scheduling: the step after a verifying step is scheduled as if every
    draft were accepted and moved back on the device; greedy output is sync MTP3's and plain
    greedy's, drafts are accepted, prefix hits happen."""
    cfg = engine_config(draftable_dirs[preset], max_num_seqs=8)
    arrivals = [*_ARRIVALS, (37, 8, 12)]  # r1's prompt again once r1 has cached its blocks
    params, same = _greedy(arrivals=arrivals), {len(_ARRIVALS): 1}
    plain, _ = _run(cfg, params, arrivals, same)
    sync, _ = _run(_mtp(cfg), params, arrivals, same)
    got, engine = _run(_async(_mtp(cfg)), params, arrivals, same)
    assert sync == plain
    assert got == sync
    stats = engine.stats()
    # drafts accepted, and some rejected: later steps' rows were moved back on the device
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.prefix_cache_hits > 0
    assert engine.runner._last.drafts is not None


def test_async_mtp_stop_tokens_and_max_tokens_mid_run(engine_config, draftable_dirs):
    """Stops at different steps, inside an accepted run of drafts; max_tokens reached by a
    step whose placeholders counted more tokens than it emitted."""
    cfg = engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8)
    # joining early: MTP finishes in fewer steps, and the run ends when nothing is left
    arrivals = [(21, 9, 0), (37, 14, 0), (5, 3, 0), (21, 11, 1), (44, 6, 2), (13, 17, 2)]
    free, _ = _run(cfg, _greedy(arrivals=arrivals), arrivals)
    stops = {i: free[f"r{i}"][j] for i, j in [(0, 2), (1, 6), (3, 0), (5, 9), (4, 4)]}
    plain, _ = _run(cfg, _greedy(stops, arrivals), arrivals)
    got, engine = _run(_async(_mtp(cfg)), _greedy(stops, arrivals), arrivals)
    assert got == plain
    assert [got[f"r{i}"][-1] for i in stops] == [("stop", stops[i]) for i in stops]


def test_async_mtp_with_preemption(engine_config, draftable_dirs):
    arrivals = [(30, 40, 0), (35, 40, 0), (40, 30, 1), (25, 45, 3)]
    cfg = engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=9,
                        max_model_len=128)
    plain, _ = _run(cfg, _greedy(arrivals=arrivals), arrivals)
    got, engine = _run(_async(_mtp(cfg)), _greedy(arrivals=arrivals), arrivals)
    assert engine.stats().num_preemptions > 0
    assert got == plain


def test_async_mtp_small_budget_skips_and_resumes(engine_config, draftable_dirs):
    """A token budget smaller than the decodes' 1 + k rows: some steps verify fewer drafts
    or skip a request; it resumes from the host-known tokens and drafts."""
    cfg = engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8, max_num_batched_tokens=6)
    plain, _ = _run(cfg, _greedy())
    got, _ = _run(_async(_mtp(cfg)), _greedy())
    assert got == plain


def test_async_mtp_stops_at_max_model_len(engine_config, draftable_dirs):
    """Requests that reach max_model_len: the host's all-accepted count stops scheduling
    them early, and they resume once the step's real count is known."""
    arrivals = [(40, 200, 0), (52, 200, 0), (30, 200, 1)]
    cfg = engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8, max_model_len=64)
    plain, _ = _run(cfg, _greedy(arrivals=arrivals), arrivals)
    got, _ = _run(_async(_mtp(cfg)), _greedy(arrivals=arrivals), arrivals)
    assert got == plain
    assert all(out[-1] == "length" for out in got.values())


def test_async_mtp_seeded_sampling_is_reproducible(engine_config, draftable_dirs):
    """Sampling with drafts: the same seeds give the same outputs, every request its
    max_tokens. (Not sync's tokens: near max_tokens the host counts a step in flight as
    all-accepted and verifies fewer drafts than sync would, which draws other uniforms.)"""
    cfg = _async(_mtp(engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8)))
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=11 + i,
                             ignore_eos=True) for i, (_, m, _) in enumerate(_ARRIVALS)]
    first, engine = _run(cfg, params)
    again, _ = _run(cfg, params)
    assert first == again
    assert [len(out) - 1 for out in first.values()] == [m for _, m, _ in _ARRIVALS]
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_async_mtp_synthetic_acceptance(engine_config, model_dirs):
    """Random weights (real drafts are rejected), yet synthetic 2.99 accepts 1.99 drafts per
    step: the accepted counts drawn on the device move the next step's rows as real
    acceptance does, and the counters say so (as in sync MTP: test_spec_decode.py)."""
    spec = ('{"method": "mtp", "num_speculative_tokens": 3, '
            '"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.99}')
    cfg = _async(_mtp(engine_config(model_dirs["tiny-glm5"]), spec_json=spec))
    arrivals = [(21, 31, 0)]
    got, engine = _run(cfg, _greedy(arrivals=arrivals), arrivals)
    s = engine.stats()
    assert len(got["r0"]) == 32 and got["r0"][-1] == "length"
    # 30 tokens after the prefill's first: 10 steps of 3 when the 99% draft is always accepted
    assert 10 <= s.spec_decode_num_drafts <= 12
    assert s.spec_decode_num_accepted_tokens_per_pos[0] == s.spec_decode_num_drafts
    assert s.spec_decode_num_accepted_tokens_per_pos[2] == 0


def test_async_scheduling_flag(model_dirs):
    parser = add_engine_args(argparse.ArgumentParser())
    model = str(model_dirs["tiny-glm5"])
    base = ["--device", "cpu", "--max-model-len", "256"]
    assert not engine_config_from_args(parser.parse_args(base), model).scheduler.async_scheduling
    cfg = engine_config_from_args(parser.parse_args([*base, "--async-scheduling"]), model)
    assert cfg.scheduler.async_scheduling
    several = [*base, "--async-scheduling", "-tp", "2", "--data-parallel-size", "2"]
    assert engine_config_from_args(parser.parse_args(several), model).scheduler.async_scheduling
    pcp = [*base, "--async-scheduling", "--prefill-context-parallel-size", "2"]
    assert engine_config_from_args(parser.parse_args(pcp), model).scheduler.async_scheduling
    pd = '{"kv_connector":"NixlConnector","kv_role":"%s","kv_connector_extra_config":' \
         '{"backend":"shm"}}'
    for role in ("kv_consumer", "kv_producer", "kv_both"):
        pd_args = [*base, "--async-scheduling", "--kv-transfer-config", pd % role]
        assert engine_config_from_args(parser.parse_args(pd_args), model).scheduler.async_scheduling


def _two_turns(config, stop: int | None = None) -> tuple[list[list[int]], list[int], LLMEngine]:
    """An agent conversation: turn 2's prompt is turn 1's prompt + its output + new tokens.
    Turn 1's last token completes a block (37 + 28 tokens: 64 computed, 4 full blocks); the
    outputs, each turn's prefix hit (num_cached_tokens) and the engine; check_integrity after
    every step."""
    engine = LLMEngine.from_config(config)
    prompt = _prompt(1, 37)
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(stop,) if stop is not None else ())
    outputs: list[list[int]] = []
    num_cached: list[int] = []
    for turn in range(2):
        engine.add_request(f"t{turn}", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                if out.finished:
                    num_cached.append(out.num_cached_tokens)
            engine.check_integrity()
            _check_hashes(engine)
        outputs.append(tokens)
        prompt = prompt + tokens + [(11 * j) % 200 + 20 for j in range(9)]
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return outputs, num_cached, engine


@pytest.mark.parametrize("k", [0, 3])
def test_async_finished_request_caches_its_last_blocks(engine_config, draftable_dirs, k):
    """A request that ends under async scheduling registers the full blocks its last steps
    computed, as sync scheduling does: the next turn of the conversation, which extends its
    prompt + output, hits exactly as many cached tokens (plain and MTP3)."""
    cfg = engine_config(draftable_dirs["tiny-glm5"], max_num_seqs=8)
    cfg = _mtp(cfg, k) if k else cfg
    sync, sync_cached, sync_engine = _two_turns(cfg)
    got, cached, engine = _two_turns(_async(cfg))
    assert got == sync
    # the 4 blocks turn 1 filled, its last token's block included (MTP trusts a hit block only
    # when the next one matched too: the 4th is recomputed)
    assert sync_cached[1] == (48 if k else 64)
    assert cached == sync_cached
    assert engine.stats().prefix_cache_hits == sync_engine.stats().prefix_cache_hits
    # ended by a stop token mid-block (the placeholders after it dropped): the same again
    stop = sync[0][20]
    sync, sync_cached, _ = _two_turns(cfg, stop)
    got, cached, _ = _two_turns(_async(cfg), stop)
    assert got == sync and cached == sync_cached
