"""Hybrid HiSparse decode on one rank (CPU reference path): greedy output equals the all-GPU
engine's with misses happening (contexts longer than the hot buffer, top-k below the context)
and without; bf16 and fp8_ds_mla; with MTP3. The host pool, hot buffers and the mirror's bytes
are checked after every step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsaserve.config import HiSparseConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine

HOST = HiSparseConfig(host_pool_bytes=16 << 20)


def _prompts(n: int, seed: int = 0, base: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (base + 13 * i,), generator=g).tolist() for i in range(n)]


def _config(engine_config, model_dir, *, kv: str = "auto", buffer: int | None = None,
            spec: int = 0, hisparse: bool = True, **kw):
    cfg = engine_config(model_dir, kv_cache_dtype=kv, max_model_len=160, **kw)
    if spec:
        cfg = replace(cfg, speculative=SpecConfig(num_speculative_tokens=spec))
    if not hisparse:
        return cfg
    att = replace(cfg.attention, hisparse_device_buffer_size=buffer, hisparse_config_given=True)
    return replace(cfg, attention=att, hisparse=HOST)


@pytest.fixture
def run(generate_checked):
    """run(engine, prompts, params) → outputs: every invariant checked after each step, and no
    HiSparse window or host block left behind."""
    def go(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
           ) -> list[list[int]]:
        out = generate_checked(engine, prompts, params)
        rt = engine.runner.hisparse
        assert not rt.entries and len(rt._free_blocks) == rt.num_host_blocks
        return out

    return go


@pytest.mark.parametrize(("preset", "kv"), [("tiny-glm5", "auto"), ("tiny-dsv32", "fp8_ds_mla")])
def test_greedy_equals_all_gpu_with_misses(run, model_dirs, engine_config, preset, kv):
    model_dir = model_dirs[preset]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2) + [_prompts(1, seed=5)[0][:9]]  # the short one turns hot late: mixed
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, hisparse=False))
    want = ref.generate(prompts, params)
    topk = ref.config.model.index_topk
    engine = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, buffer=topk))
    assert run(engine, prompts, params) == want
    # every decode read through a buffer of top-k rows over a longer context: misses happened,
    # most of them served by the host pool (the step's own rows come from their GPU pages)
    rt = engine.runner.hisparse
    assert 0 < int(rt.rows_from_host) < int(rt.rows_missed)


def test_fast_path_no_misses(run, model_dirs, engine_config):
    """Contexts within the (default) buffer read their GPU pages: no residency, no fetch."""
    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [p[:12] for p in _prompts(2, seed=1)]
    ref = LLMEngine.from_config(_config(engine_config, model_dir, hisparse=False))
    engine = LLMEngine.from_config(_config(engine_config, model_dir))
    assert engine.config.hisparse_buffer_rows == 2 * engine.config.model.index_topk
    assert run(engine, prompts, params) == ref.generate(prompts, params)
    assert int(engine.runner.hisparse.rows_missed) == 0


@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_greedy_equals_all_gpu_mtp3(run, draftable_dirs, engine_config, kv):
    """MTP3: four verify rows per request share one buffer of their top-k union (the minimum,
    4 × top-k); rejected drafts' rows are rewritten and their hot copies dropped."""
    model_dir = draftable_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2, seed=2, base=58)  # beyond the 64-row buffer after a few steps
    ref = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, hisparse=False))
    want = ref.generate(prompts, params)
    topk = ref.config.model.index_topk
    engine = LLMEngine.from_config(_config(engine_config, model_dir, kv=kv, spec=3,
                                           buffer=4 * topk))
    assert run(engine, prompts, params) == want
    assert int(engine.runner.hisparse.rows_from_host) > 0


@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_plan_concurrency_equals_engine_admission(model_dirs, engine_config, kv):
    """`dsaserve plan`'s HiSparse bound by host memory is what the engine admits."""
    from dsaserve.plan import costmodel as cm

    model_dir = model_dirs["tiny-glm5"]
    cfg = _config(engine_config, model_dir, kv=kv, dtype="bfloat16")
    plan_kv = cm.kv_bytes_per_token(cfg.model, "bf16" if kv == "auto" else kv)
    ctx = cfg.scheduler.max_model_len
    host = (5 * ctx + 40) * plan_kv.mla_all_layers  # room for 5 requests and change
    cfg = replace(cfg, hisparse=HiSparseConfig(host_pool_bytes=host))
    plan = cm.hisparse_concurrency(plan_kv, ctx, kv_room=1 << 40, host_pool_bytes=host,
                                   hot_rows=cfg.hisparse_buffer_rows,
                                   block_size=cfg.cache.block_size)
    assert plan.by_host == 5
    engine = LLMEngine.from_config(cfg)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(6, seed=3)):
        engine.add_request(str(i), p, params)
    engine.step()
    assert len(engine.scheduler.running) == plan.by_host
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


@pytest.mark.parametrize("offload", [False, True])
def test_later_turn_prefix_is_mirrored(run, model_dirs, engine_config, offload):
    """A second turn starts from a computed prefix (a GPU prefix hit, or with the host KV tier
    in the same engine, as a MultiConnector sets up, a prefix evicted by other sessions and
    loaded back): it is mirrored on arrival, so its hot reads from the host pool are exact."""
    from dsaserve.config import OffloadConfig

    model_dir = model_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, b, c, more = _prompts(4, seed=7, base=30)
    blocks = 12 if offload else 64
    ref = LLMEngine.from_config(_config(engine_config, model_dir, hisparse=False))
    cfg = _config(engine_config, model_dir, buffer=16, num_blocks=blocks)
    if offload:
        cfg = replace(cfg, offload=OffloadConfig(cpu_bytes_to_use=8 << 20))
    engine = LLMEngine.from_config(cfg)
    turn1 = run(engine, [a], params)[0]
    assert turn1 == ref.generate([a], params)[0]
    if offload:  # other sessions take the GPU pool
        run(engine, [b + c], params)
        run(engine, [c + more], params)
    turn2 = a + turn1 + more[:9]
    assert run(engine, [turn2], params) == ref.generate([turn2], params)
    st = engine.stats()
    hits = st.offload_hits if offload else st.prefix_cache_hits
    assert hits > 0


@pytest.mark.parametrize("spec", [0, 3])
def test_index_groups_resolve_once(run, draftable_dirs, engine_config, monkeypatch, spec):
    """IndexShare (tiny-glm5: layers 1 and 3 take the top-k of 0 and 2): each group's residency
    is resolved once per forward, by the layer with the indexer, and its other layers reuse it
    and fetch their own rows; output equals the all-GPU engine's (the runtime's invariants
    also check every layer's hot slots and that a group's tables stay equal)."""
    from dsaserve.kv.hisparse import runtime

    model_dir = draftable_dirs["tiny-glm5"]
    calls: list[int] = []  # the layer of each resolve call
    resolve = runtime.HiSparseRuntime.resolve

    def counted(self, layer, *args):
        calls.append(layer)
        return resolve(self, layer, *args)

    monkeypatch.setattr(runtime.HiSparseRuntime, "resolve", counted)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2, seed=4, base=66)
    ref = LLMEngine.from_config(_config(engine_config, model_dir, spec=spec, hisparse=False))
    topk = ref.config.model.index_topk
    engine = LLMEngine.from_config(_config(engine_config, model_dir, spec=spec,
                                           buffer=(1 + spec) * topk))
    rt = engine.runner.hisparse
    assert rt.leader == [0, 0, 2, 2, 4][: len(rt.caches)]  # the MTP layer has its own indexer
    assert run(engine, prompts, params) == ref.generate(prompts, params)
    target = [layer for layer in calls if layer < 4]
    assert target and [target.count(i) for i in range(4)] == [target.count(0)] * 4
    # the residency step ran for the leaders only: layers 0 and 2 (and the MTP layer)
    assert rt.num_resolves == sum(layer in (0, 2, 4) for layer in calls) < len(calls)
    assert int(rt.rows_from_host) > 0
