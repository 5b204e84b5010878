"""The single-rank engine end to end: greedy output is the same for every chunk size, with and
without prefix caching, under preemption and with the fp8 cache; nothing leaks."""

from __future__ import annotations

import pytest

from dsaserve.core import RequestError, SamplingParams
from dsaserve.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, prompts, params=GREEDY):
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    return outs


@pytest.fixture(scope="module")
def reference_outputs(model_dirs, mixed_prompts):
    """One request at a time, whole prompt in one step, no prefix cache."""
    from dsaserve.config import (
        AttentionConfig,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    out = {}
    for preset in ("tiny-glm5", "tiny-dsv32"):
        d = model_dirs[preset]
        cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                           cache=CacheConfig(block_size=16, num_gpu_blocks=64,
                                             enable_prefix_caching=False),
                           scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512,
                                                     max_model_len=256),
                           attention=AttentionConfig(sparse_mla_force_mqa=True))
        engine = LLMEngine.from_config(cfg)
        out[preset] = [_run(engine, [p])[0] for p in mixed_prompts()]
    return out


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
@pytest.mark.parametrize("budget,prefix", [(512, True), (7, False), (16, True), (33, True)])
def test_greedy_identical_for_every_chunk_size(model_dirs, engine_config, reference_outputs,
                                               preset, budget, prefix, mixed_prompts):
    engine = LLMEngine.from_config(engine_config(model_dirs[preset], prefix_caching=prefix,
                                                 max_num_batched_tokens=budget))
    assert _run(engine, mixed_prompts()) == reference_outputs[preset]
    # A second round hits the prefix cache (when enabled) and must not change anything.
    assert _run(engine, mixed_prompts()) == reference_outputs[preset]
    stats = engine.stats()
    assert (stats.prefix_cache_hits > 0) == prefix


def test_preemption_recomputes_to_the_same_output(model_dirs, engine_config, reference_outputs,
                                                  mixed_prompts):
    # 10 blocks of 16 tokens cannot hold five requests of 21–99 tokens at once: some get preempted.
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"], num_blocks=10,
                                                 max_model_len=128, max_num_batched_tokens=64))
    assert _run(engine, mixed_prompts()) == reference_outputs["tiny-glm5"]
    assert engine.stats().num_preemptions > 0


def test_fp8_cache_runs_and_is_deterministic(model_dirs, engine_config, mixed_prompts):
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-dsv32"],
                                                 kv_cache_dtype="fp8_ds_mla",
                                                 max_num_batched_tokens=16))
    first = _run(engine, mixed_prompts())
    assert _run(engine, mixed_prompts()) == first
    assert all(len(o) == GREEDY.max_tokens for o in first)


def test_dense_and_sparse_paths_agree_on_short_prompts(model_dirs, engine_config, mixed_prompts):
    short = [p[:10] for p in mixed_prompts()]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # stays ≤ top-k 16
    outs = [_run(LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"], force_mqa=f)),
                 short, params) for f in (False, True)]
    assert outs[0] == outs[1]


def test_seeded_sampling_is_reproducible(model_dirs, engine_config, mixed_prompts):
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"]))
    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    a = _run(engine, mixed_prompts(2), p)
    b = _run(engine, mixed_prompts(2), p)
    assert a == b


def test_bad_requests_are_rejected_without_side_effects(model_dirs, engine_config):
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"], max_model_len=64))
    with pytest.raises(RequestError, match="prompt has 80 tokens; max_model_len is 64"):
        engine.add_request("too-long", [5] * 80, GREEDY)
    with pytest.raises(RequestError):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("bad-id", [5, 512], GREEDY)
    engine.add_request("ok", [5, 6, 7], GREEDY)
    engine.abort_request("ok")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
