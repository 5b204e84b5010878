"""MTP speculative decoding end to end on one rank (tiny presets, CPU).

Greedy output with k = 1 and 3 equals greedy output without drafting under chunked prefill,
prefix hits and preemption, several requests per batch; drafts are accepted at a real rate on a
checkpoint built to draft well (tests/conftest.py: draftable_dirs); the MTP layer's KV (and the
target's) after a speculative run equals a non-speculative computation at every computed
position, prefix hits included; stop rules cut an accepted run; seeded sampling is reproducible;
synthetic acceptance fixes the acceptance length. Every scenario ends with check_integrity().
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import SpecConfig
from dsaserve.core import NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import ModelRunner
from dsaserve.kernels import formats
from dsaserve.kv import layout

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draftable(draftable_dirs):
    return draftable_dirs


def _engine(engine_config, model_dir, k: int | None, **kw) -> LLMEngine:
    cfg = engine_config(model_dir, **kw)
    if k is not None:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    return LLMEngine.from_config(cfg)


def _run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    return outs


@pytest.fixture(scope="module")
def reference(draftable, model_dirs, mixed_prompts):
    """(checkpoint kind, preset) → greedy outputs without drafting, one request at a time."""
    from dsaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    cache = {}

    def get(kind: str, preset: str) -> list[list[int]]:
        if (kind, preset) not in cache:
            d = draftable[preset] if kind == "draftable" else model_dirs[preset]
            cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                               cache=CacheConfig(block_size=16, num_gpu_blocks=64,
                                                 enable_prefix_caching=False),
                               scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))
            engine = LLMEngine.from_config(cfg)
            cache[kind, preset] = [_run(engine, [p])[0] for p in mixed_prompts()]
        return cache[kind, preset]

    return get


@pytest.mark.parametrize("preset,kind,k,budget,num_blocks", [
    (preset, *case) for preset in ("tiny-glm5", "tiny-dsv32") for case in (
        ("draftable", 3, 512, 64),  # one batch, all prompts at once
        ("draftable", 1, 16, 64),  # chunked prefill beside verifying decodes
        ("draftable", 3, 64, 17),  # 17 blocks of 16 for 5 requests: preemption
    )] + [("tiny-glm5", "random", 3, 512, 64)])  # random weights: drafts (almost) all rejected
def test_greedy_with_mtp_equals_greedy_without(engine_config, draftable, model_dirs, reference,
                                               mixed_prompts, preset, kind, k, budget,
                                               num_blocks):
    d = draftable[preset] if kind == "draftable" else model_dirs[preset]
    engine = _engine(engine_config, d, k, max_num_batched_tokens=budget, num_blocks=num_blocks)
    expect = reference(kind, preset)
    assert _run(engine, mixed_prompts()) == expect
    # A second round hits the prefix cache (whole blocks minus the last matched one).
    assert _run(engine, mixed_prompts()) == expect
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_drafts > 0
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == k
    if num_blocks < 20:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_drafts_are_accepted_on_a_draftable_checkpoint(engine_config, draftable, mixed_prompts,
                                                       preset):
    engine = _engine(engine_config, draftable[preset], 3)
    _run(engine, mixed_prompts(), dataclasses.replace(GREEDY, max_tokens=16))
    s = engine.stats()
    per_pos = s.spec_decode_num_accepted_tokens_per_pos
    assert s.spec_decode_mean_acceptance_length > 1.8  # measured: 2.2 (glm5), 2.1 (dsv32)
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0  # accepting i needs 0..i−1 accepted
    assert s.spec_decode_num_accepted_tokens == sum(per_pos) < s.spec_decode_num_draft_tokens


def _mtp3_engine(engine_config, model_dir, keys: str) -> LLMEngine:
    """An MTP3 engine with `keys` added to its --speculative-config JSON."""
    spec = SpecConfig.from_json(f'{{"method": "mtp", "num_speculative_tokens": 3, {keys}}}')
    return LLMEngine.from_config(dataclasses.replace(
        engine_config(model_dir, max_num_batched_tokens=512, num_blocks=64), speculative=spec))


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_fp8_draft_head_keeps_output_and_acceptance(engine_config, draftable, reference,
                                                    mixed_prompts, preset):
    """Drafts through the FP8 copy of lm_head (`draft_lm_head`): greedy output equals the
    non-speculative run's (the target's logits keep lm_head), and the drafts are accepted as
    often as through lm_head itself, within a few drafts (a draft can differ only where the
    MTP's top two logits lie within the FP8 error)."""
    runs = {}
    for head in ("model", "fp8"):
        engine = _mtp3_engine(engine_config, draftable[preset], f'"draft_lm_head": "{head}"')
        model = engine.runner.model
        assert (model.draft_head is not None) == (head == "fp8")
        if head == "fp8":
            assert model.draft_head.weight.dtype == torch.float8_e4m3fn
            assert model.draft_head.weight.shape == model.lm_head.weight.shape
        assert _run(engine, mixed_prompts()) == reference("draftable", preset)
        runs[head] = engine.stats()
    model, fp8 = runs["model"], runs["fp8"]
    print(f"{preset}: accepted {model.spec_decode_num_accepted_tokens} of "
          f"{model.spec_decode_num_draft_tokens} drafts through lm_head, "
          f"{fp8.spec_decode_num_accepted_tokens} of {fp8.spec_decode_num_draft_tokens} "
          "through its FP8 copy")
    assert fp8.spec_decode_mean_acceptance_length > 0.95 * model.spec_decode_mean_acceptance_length


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_draft_vocab_keeps_output_and_bounds_the_drafts(engine_config, draftable, reference,
                                                        mixed_prompts, tmp_path, preset):
    """Drafts restricted to a vocabulary (`draft_vocab`, spec/draft_vocab.py), through the
    model's rows and through an FP8 copy: greedy output equals the non-speculative run's every
    time. With the tokens the output is made of, drafts are accepted about as often as over the
    whole vocabulary (where the full argmax is one of them it is still the drafts' argmax);
    with none of them, no draft can be right: acceptance length exactly 1."""
    want = reference("draftable", preset)
    emitted = sorted({t for out in want for t in out})
    vocab = engine_config(draftable[preset]).model.vocab_size
    subsets = {"emitted": emitted, "disjoint": [t for t in range(vocab) if t not in emitted]}
    lengths = {}
    for name, ids in subsets.items():
        path = tmp_path / f"{name}.json"
        path.write_text(str(ids))
        for head in ("model", "fp8") if name == "emitted" else ("fp8",):
            engine = _mtp3_engine(engine_config, draftable[preset],
                                  f'"draft_lm_head": "{head}", "draft_vocab": "{path}"')
            model = engine.runner.model
            assert model.draft_head.weight.shape[0] == len(ids)
            assert model.draft_ids.tolist() == ids
            assert _run(engine, mixed_prompts()) == want
            lengths[name, head] = engine.stats().spec_decode_mean_acceptance_length
    full = _engine(engine_config, draftable[preset], 3, max_num_batched_tokens=512,
                   num_blocks=64)
    _run(full, mixed_prompts())
    everything = full.stats().spec_decode_mean_acceptance_length
    print(f"{preset}: mean acceptance length {everything:.3f} over every token; {lengths}")
    assert lengths["disjoint", "fp8"] == 1.0
    assert lengths["emitted", "model"] > 0.95 * everything


def test_draft_tokens_are_the_argmax_over_the_draft_vocab(model_dirs) -> None:
    """DsaForCausalLM.draft_tokens with a draft vocabulary: the argmax of lm_head's logits over
    those ids only, ties to the lowest id."""
    from dsaserve.config import ModelConfig
    from dsaserve.kernels.registry import get_backend
    from dsaserve.model.dsa import DsaForCausalLM

    cfg = ModelConfig.from_file(model_dirs["tiny-glm5"])
    model = DsaForCausalLM.build(cfg, with_mtp=False, backend=get_backend("reference"),
                                 dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    model.lm_head.weight.data = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    ids = [3, 17, 18, 200, cfg.vocab_size - 1]
    model.lm_head.weight.data[18] = model.lm_head.weight.data[17]  # a tie: 17 wins
    hidden = torch.randn(6, cfg.hidden_size, generator=g)
    hidden[0] = model.lm_head.weight.data[17] * 8
    model.make_draft_head(ids, quantize=False)
    logits = model.lm_head(hidden)[:, ids]
    assert torch.equal(model.draft_tokens(hidden), torch.tensor(ids)[logits.argmax(-1)])
    assert model.draft_tokens(hidden)[0] == 17


def _cache_rows(runner: ModelRunner, layer: int, block_ids: list[int], n: int) -> torch.Tensor:
    """Layer `layer`'s latent KV rows [n, L+R] of positions 0..n−1 (and the index keys)."""
    slots, _ = layout.context_slots(n, block_ids, runner.block_size)
    cache = runner.caches[layer]
    kv = formats.read_mla_cache(cache.kv, slots, runner.model_cfg.kv_lora_rank,
                                runner.model_cfg.qk_rope_head_dim)
    if cache.index is None:  # a shared (IndexShare) layer keeps no index keys
        return kv
    index = cache.index.view(-1, cache.index.shape[-1])[slots]  # [n, D] (bf16 / fp32 cache)
    return torch.cat((kv, index.float()), dim=1)


def _reference_caches(engine_config, model_dir, tokens: list[int], n: int) -> ModelRunner:
    """A runner whose caches hold, at positions 0..n−1, what a non-speculative run computes: the
    target over tokens[:n], then MTP step 0 reading tokens[1:n+1] (MODEL_SPEC §5.2)."""
    runner = ModelRunner(engine_config(model_dir, num_blocks=32))
    blocks = tuple(range(-(-n // runner.block_size)))
    so = SchedulerOutput((NewRequestData("ref", tuple(tokens[:n]), SamplingParams(), blocks, 0),),
                         (), {"ref": n}, ())
    runner._apply_diff(so)
    batch = runner._prepare(["ref"], {"ref": n}, {})
    hidden = runner.model(batch.input_ids, batch.meta, runner.caches)
    runner.model.forward_mtp(torch.tensor(tokens[1 : n + 1]), hidden, batch.meta, runner.caches)
    return runner


@pytest.mark.parametrize("preset,budget", [("tiny-glm5", 512), ("tiny-dsv32", 13)])
def test_mtp_kv_after_speculative_steps_equals_a_non_speculative_run(
        engine_config, draftable, mixed_prompts, preset, budget):
    """Mid-generation (drafts accepted and rejected, chunked prefill with budget 13), every
    computed position's rows in every cache layer — the MTP layer's last — equal a
    non-speculative computation; the second request reads the first one's blocks (prefix hit)."""
    d = draftable[preset]
    engine = _engine(engine_config, d, 3, max_num_batched_tokens=budget)
    first, second = mixed_prompts()[0], mixed_prompts()[2]  # they share a 40-token prefix
    params = dataclasses.replace(GREEDY, max_tokens=40)
    engine.generate([first], dataclasses.replace(GREEDY, max_tokens=4))
    engine.add_request("b", second, params)
    sched, runner = engine.scheduler, engine.runner
    for _ in range(200):
        engine.step()
        req = sched.requests["b"]
        if len(req.output_token_ids) >= 14:
            break
    assert req.num_cached_tokens == 16  # 2 full blocks matched, the last one recomputed
    assert sched.stats().spec_decode_num_accepted_tokens > 0
    n = req.num_computed_tokens
    ref = _reference_caches(engine_config, d, req.all_token_ids, n)
    ref_blocks = list(range(-(-n // runner.block_size)))
    for layer in range(runner.model.num_cache_layers):
        ours = _cache_rows(runner, layer, req.block_ids, n)
        theirs = _cache_rows(ref, layer, ref_blocks, n)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")
    engine.abort_request("b")
    engine.step()
    engine.check_integrity()


def test_stop_rules_cut_an_accepted_run(engine_config, draftable, reference, mixed_prompts):
    """A stop token or max_tokens in the middle of a run of accepted drafts ends the request
    there, exactly as without drafting."""
    expect = reference("draftable", "tiny-glm5")
    prompts = mixed_prompts()
    engine = _engine(engine_config, draftable["tiny-glm5"], 3)
    stop = expect[1][6]
    params = [dataclasses.replace(GREEDY, stop_token_ids=(stop,)),
              dataclasses.replace(GREEDY, max_tokens=7)]
    outs = _run(engine, prompts[1:3], params)
    assert outs[0] == expect[1][: expect[1].index(stop) + 1]
    assert outs[1] == expect[2][:7]
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_with_drafts_is_reproducible(engine_config, draftable, mixed_prompts):
    params = SamplingParams(max_tokens=10, temperature=0.1, top_p=0.9, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = _engine(engine_config, draftable["tiny-dsv32"], 2)
        runs.append(_run(engine, mixed_prompts()[:2], params))
        assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert runs[0] == runs[1] and all(len(o) == 10 for o in runs[0])


def test_synthetic_acceptance_end_to_end(engine_config, model_dirs, mixed_prompts):
    """Random weights (real drafts are rejected), yet synthetic 2.99 accepts 1.99 drafts per
    step: the step count drops accordingly and the engine's counters say so."""
    cfg = engine_config(model_dirs["tiny-glm5"])
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3, '
                                '"rejection_sample_method": "synthetic", '
                                '"synthetic_acceptance_length": 2.99}')
    engine = LLMEngine.from_config(dataclasses.replace(cfg, speculative=spec))
    outs = _run(engine, [mixed_prompts()[0]], dataclasses.replace(GREEDY, max_tokens=31))
    s = engine.stats()
    assert len(outs[0]) == 31
    # 30 tokens after the prefill's first: 10 steps of 3 when the 99% draft is always accepted
    assert 10 <= s.spec_decode_num_drafts <= 12
    assert s.spec_decode_num_accepted_tokens_per_pos[0] == s.spec_decode_num_drafts
    assert s.spec_decode_num_accepted_tokens_per_pos[2] == 0
