"""min_tokens masks the stop ids from sampling on the device, as vLLM's
MinTokensLogitsProcessor does (engine/sampler.py, engine/sampling_table.py): while a request's
output is shorter than min_tokens, its EOS ids (unless ignore_eos) and stop_token_ids are never
sampled; after it, the host's stop rules end the request at the first one.

The reference decodes greedily one token at a time from the logits of the whole sequence
(`execute_all_logits`, no cache reuse), setting the stop ids to −inf by hand below
min_tokens. The EOS id is the second token plain greedy decoding emits, the stop id one the
masked decoding emits a few tokens later, so the mask changes the output; min_tokens is put
exactly at, and one past, the first index where a stop id would win: a mask one token too
long or too short gives another output. The engine matches the reference with sync and async
scheduling, with and without MTP3 (a checkpoint built to draft well: drafts are accepted), all
requests in one batch beside requests without min_tokens; invariants checked every step."""

from __future__ import annotations

import dataclasses

import pytest

from dsaserve.config import SpecConfig
from dsaserve.core import NewRequestData, RequestError, SamplingParams, SchedulerOutput
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampling_table import MAX_STOP_IDS

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _greedy_reference(runner: ModelRunner, prompt: list[int], params: SamplingParams,
                      eos: int) -> list[int]:
    """Greedy output of `params` (EOS `eos`) with its stop ids set to −inf by hand below
    min_tokens and the stop rules applied, from full-sequence logits at every token."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    out: list[int] = []
    finished: tuple[str, ...] = ()
    while len(out) < params.max_tokens:
        ids, rid = prompt + out, f"ref{len(out)}"
        blocks = tuple(range(-(-len(ids) // runner.block_size)))
        so = SchedulerOutput((NewRequestData(rid, tuple(ids), SamplingParams(), blocks, 0),),
                             (), {rid: len(ids)}, finished)
        logits = runner.execute_all_logits(so)[rid][-1].clone()  # [V] the next token's
        if len(out) < params.min_tokens:
            logits[sorted(stops)] = float("-inf")
        out.append(int(logits.argmax()))
        finished = (rid,)
        if out[-1] in stops and len(out) >= params.min_tokens:
            break
    return out


def _first_win(runner: ModelRunner, prompt: list[int], stops: set[int], start: int) -> int:
    """The first output index ≥ start where greedy decoding with `stops` always masked would
    have picked one of them (the unmasked argmax)."""
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        ids, rid = prompt + out, f"win{len(out)}"
        blocks = tuple(range(-(-len(ids) // runner.block_size)))
        so = SchedulerOutput((NewRequestData(rid, tuple(ids), SamplingParams(), blocks, 0),),
                             (), {rid: len(ids)}, (f"win{len(out) - 1}",) if out else ())
        logits = runner.execute_all_logits(so)[rid][-1].clone()
        if len(out) >= start and int(logits.argmax()) in stops:
            return len(out)
        logits[sorted(stops)] = float("-inf")
        out.append(int(logits.argmax()))
    raise AssertionError("no stop id wins: pick another prompt")


def _engine(config, eos: int, *, k: int = 0, async_scheduling: bool = False) -> LLMEngine:
    if k:
        config = dataclasses.replace(config, speculative=SpecConfig(num_speculative_tokens=k))
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=async_scheduling))
    engine = LLMEngine.from_config(config)
    engine.eos_token_ids = (eos,)  # the model's EOS, as far as these requests know
    return engine


def _generate(engine: LLMEngine, prompts: list[list[int]],
              params: list[SamplingParams]) -> list[list[int]]:
    """Every request at once, check_integrity after every step → the outputs."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
        steps += 1
        assert steps < 200, "the engine did not finish"
    engine.step()  # tells the runner which requests ended
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    return [out[str(i)] for i in range(len(prompts))]


_CASES: dict[str, tuple] = {}  # built once per checkpoint (engine_config is function-scoped)


@pytest.fixture
def case(engine_config, draftable_dirs, model_dirs, mixed_prompts):
    """kind → (config, prompt, eos, stop id, w, the requests, their reference outputs, the
    plain greedy output) on the tiny-glm5 checkpoint of that kind ("draftable": MTP drafts
    are accepted; "random": nearly all rejected, so async rows move back on the device every
    step): w is the first index ≥ 2 where EOS or the stop id would win once masked before
    it."""
    def get(kind: str) -> tuple:
        if kind not in _CASES:
            d = draftable_dirs if kind == "draftable" else model_dirs
            _CASES[kind] = _build_case(engine_config(d["tiny-glm5"], max_num_seqs=16),
                                       mixed_prompts()[1])
        return _CASES[kind]

    return get


def _build_case(config, prompt: list[int]) -> tuple:
    runner = ModelRunner(config)
    free = _greedy_reference(runner, prompt, dataclasses.replace(GREEDY, ignore_eos=True), 0)
    eos = free[1]  # plain greedy decoding would end at its second token
    assert eos != free[0]
    masked = _greedy_reference(runner, prompt, dataclasses.replace(
        GREEDY, ignore_eos=True, min_tokens=MAX_TOKENS, stop_token_ids=(eos,)), eos)
    stop = next(t for j, t in enumerate(masked) if j >= 3 and t not in masked[:j])
    w = _first_win(runner, prompt, {eos, stop}, 2)
    params = [dataclasses.replace(GREEDY, stop_token_ids=(stop,), min_tokens=m)
              for m in sorted({5, w, w + 1})]
    params += [dataclasses.replace(GREEDY, stop_token_ids=(stop,), min_tokens=w + 1,
                                   ignore_eos=True),  # only the stop id masked
               dataclasses.replace(GREEDY, stop_token_ids=(stop, eos, 7, 9), min_tokens=3),
               dataclasses.replace(GREEDY, ignore_eos=True)]  # no mask
    want = [_greedy_reference(runner, prompt, p, eos) for p in params]
    return config, prompt, eos, stop, w, params, want, free


@pytest.mark.parametrize("kind", ["draftable", "random"])
def test_the_reference_exercises_the_mask(case, kind):
    """The cases are those the module's docstring promises: without the mask the request
    would end at its second token; with min_tokens = w it ends exactly at w on a stop id, with
    w + 1 it goes past it."""
    _, _, eos, stop, w, params, want, free = case(kind)
    assert free[1] == eos and want[-1] == free  # no min_tokens, ignore_eos: plain greedy
    for p, out in zip(params, want, strict=True):
        masked = set(p.stop_token_ids) | (set() if p.ignore_eos else {eos})
        assert not masked & set(out[: p.min_tokens]), p
    by_m = {p.min_tokens: out for p, out in zip(params, want, strict=True)
            if not p.ignore_eos}
    assert len(by_m[w]) == w + 1 and by_m[w][-1] in (eos, stop)
    assert by_m[w + 1][w] not in (eos, stop) and len(by_m[w + 1]) > w + 1
    assert by_m[5][:2] != free[:2]


@pytest.mark.parametrize("kind,k,async_scheduling", [
    ("draftable", 0, False), ("draftable", 3, False), ("draftable", 0, True),
    ("draftable", 3, True), ("random", 3, False), ("random", 3, True)])
def test_min_tokens_equals_the_masked_reference(case, kind, k, async_scheduling):
    config, prompt, eos, _, _, params, want, _ = case(kind)
    engine = _engine(config, eos, k=k, async_scheduling=async_scheduling)
    assert _generate(engine, [prompt] * len(params), params) == want
    if k:
        stats = engine.stats()
        if kind == "draftable":
            assert stats.spec_decode_num_accepted_tokens > 0
        else:  # rejected drafts: under async the next step's rows moved back on the device
            assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_stop_set_past_the_table_bound_is_a_request_error(engine_config, model_dirs):
    """EOS (id 0 here) and 1..128: one id past the bound; without min_tokens nothing is
    masked, and at the bound (the table grows to it) no masked id is emitted."""
    engine = _engine(engine_config(model_dirs["tiny-glm5"]), eos=0)
    ids = tuple(range(1, MAX_STOP_IDS + 1))
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request("a", [5, 6, 7], SamplingParams(stop_token_ids=ids, min_tokens=1))
    unmasked = SamplingParams(stop_token_ids=ids, max_tokens=2, temperature=0.0)
    at_bound = SamplingParams(stop_token_ids=ids[:-1], min_tokens=3, max_tokens=3,
                              temperature=0.0, seed=1)
    # nearly flat over 512 ids: unmasked, a quarter of its tokens would be masked ones
    sampled = dataclasses.replace(at_bound, temperature=50.0, min_tokens=12, max_tokens=12)
    outs = _generate(engine, [[5, 6, 7]] * 3, [unmasked, at_bound, sampled])
    assert len(outs[0]) <= 2
    assert all(t >= MAX_STOP_IDS for out in outs[1:] for t in out) and len(outs[2]) == 12


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_synthetic_acceptance_keeps_min_tokens(case, async_scheduling):
    """Synthetic acceptance ignores the target's verdict, not min_tokens': with every draft
    accepted (rates 1, 1, 1) on the draftable checkpoint, whose drafts propose the stop id
    early (a request without min_tokens ends on it), no request emits a masked stop id below
    its min_tokens, and each ends at max_tokens or on a stop id past min_tokens (the token
    after a rejected stop-id draft comes from the masked target row)."""
    config, prompt, eos, stop, _, params, _, _ = case("draftable")
    spec = SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                      synthetic_acceptance_rates=(1.0, 1.0, 1.0))
    config = dataclasses.replace(config, speculative=spec, scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=async_scheduling))
    engine = LLMEngine.from_config(config)
    engine.eos_token_ids = (eos,)
    control = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    outs = _generate(engine, [prompt] * (len(params) + 1), [*params, control])
    # the control ends on the stop id at index 3: the prefill emits index 0, the first
    # verifying step drafts 1..3, so the stop id was a draft, and it was accepted
    assert len(outs[-1]) == 4 and outs[-1][-1] == stop
    assert any(p.min_tokens > 3 and stop in p.stop_token_ids for p in params)  # masked there
    for p, out in zip(params, outs, strict=False):
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {eos})
        assert not stops & set(out[: p.min_tokens]), (p, out)
        assert len(out) == p.max_tokens or (out[-1] in stops and len(out) > p.min_tokens), out
    stats = engine.stats()  # at rates 1, only the masked stop-id drafts were rejected
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
