"""SamplingParams.logprobs end to end on one rank (tiny presets, CPU).

Every emitted token's log-probability, and the top-N, equal log_softmax of a reference forward
(the whole sequence prefilled at once) at the row the token came from: greedy and sampled, with
several requests per batch, chunked prefill and MTP drafts (accepted drafts and the bonus
token come from the verification rows); greedy with MTP3 equals greedy without, logprobs
included. The top-N are sorted and hold the chosen token whenever it ranks within N; each
request gets its own N; a request above --max-logprobs is refused. Every scenario ends with
check_integrity().
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dsaserve.config import SpecConfig
from dsaserve.core import (
    Completion,
    NewRequestData,
    RequestError,
    SamplingParams,
    SchedulerOutput,
    TokenLogprob,
)
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampler import sample_on_device, top_logprobs
from dsaserve.engine.sampling_table import SamplingTable

ATOL = 2e-3  # a batched decode against one prefill of the whole sequence (fp32 CPU: ~1e-5)
N = 5


def _engine(engine_config, model_dir, k: int | None = None, **kw) -> LLMEngine:
    cfg = engine_config(model_dir, **kw)
    if k is not None:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    return LLMEngine.from_config(cfg)


def _run(engine: LLMEngine, prompts, params) -> list[Completion]:
    outs = engine.generate_with_logprobs(prompts, params)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    return outs


def _reference_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, the whole sequence in one prefill [T, V]."""
    rid = f"ref-{len(ids)}-{sum(ids)}"
    blocks = tuple(range(-(-len(ids) // 16)))
    so = SchedulerOutput((NewRequestData(rid, tuple(ids), SamplingParams(), blocks, 0),), (),
                         {rid: len(ids)}, ())
    logits = runner.execute_all_logits(so)[rid]
    runner.execute(SchedulerOutput((), (), {}, (rid,)))  # drop the request
    return logits.float().log_softmax(-1)


def _check_against_reference(runner: ModelRunner, prompt: list[int], out: Completion,
                             n: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = _reference_logprobs(runner, prompt + list(out.token_ids[:-1]))
    for i, e in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]  # the distribution token i was drawn from
        assert e.token_id == out.token_ids[i]
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=ATOL), i
        _check_top(e, row, n)


def _check_top(e: TokenLogprob, row: torch.Tensor, n: int) -> None:
    """e.top: the n most likely tokens of `row`, sorted; the chosen token among them when it
    ranks within n (ties within ATOL of the n-th may go either way)."""
    assert len(e.top) == n
    values = [lp for _, lp in e.top]
    assert values == sorted(values, reverse=True)
    ids = [t for t, _ in e.top]
    assert len(set(ids)) == n
    want = row.topk(n).values
    assert torch.allclose(torch.tensor(values), want, atol=ATOL)
    for t, lp in e.top:
        assert lp == pytest.approx(row[t].item(), abs=ATOL)
    if n and row[e.token_id] > want[-1] + ATOL:
        assert e.token_id in ids
        assert dict(e.top)[e.token_id] == e.logprob  # the same value, not a near one


@pytest.fixture(scope="module")
def draftable(draftable_dirs):
    return draftable_dirs


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=N),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, top_k=40, seed=7, ignore_eos=True,
                   logprobs=N),
], ids=["greedy", "sampled"])
def test_logprobs_equal_log_softmax_of_a_reference_forward(engine_config, model_dirs,
                                                           mixed_prompts, preset, params):
    d = model_dirs[preset]
    # a small budget: chunked prefill beside decodes
    engine = _engine(engine_config, d, max_num_batched_tokens=48)
    prompts = mixed_prompts()
    outs = _run(engine, prompts, params)
    runner = ModelRunner(engine_config(d, block_size=16, num_blocks=16))
    for prompt, out in zip(prompts, outs, strict=True):
        _check_against_reference(runner, prompt, out, N)


@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_mtp_emits_logprobs_of_the_verification_rows(engine_config, draftable, mixed_prompts,
                                                     temperature):
    """Accepted drafts and the bonus token: each one's entry is its verification row's."""
    d = draftable["tiny-glm5"]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True,
                            logprobs=N)
    engine = _engine(engine_config, d, k=3)
    prompts = mixed_prompts()
    outs = _run(engine, prompts, params)
    assert engine.stats().spec_decode_num_accepted_tokens > 0, "no draft accepted: untested"
    runner = ModelRunner(engine_config(d, block_size=16, num_blocks=16))
    for prompt, out in zip(prompts, outs, strict=True):
        _check_against_reference(runner, prompt, out, N)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_mtp3_equals_without_logprobs_included(engine_config, draftable,
                                                          mixed_prompts, async_scheduling):
    d = draftable["tiny-glm5"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=N)

    def run(k: int | None) -> list[Completion]:
        cfg = engine_config(d)
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(
            cfg.scheduler, async_scheduling=async_scheduling))
        if k is not None:
            cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
        return _run(LLMEngine.from_config(cfg), mixed_prompts(), params)

    plain, mtp = run(None), run(3)
    for a, b in zip(plain, mtp, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=ATOL)
            assert [lp for _, lp in x.top] == pytest.approx([lp for _, lp in y.top], abs=ATOL)


def test_each_request_gets_its_own_n(engine_config, model_dirs, mixed_prompts):
    """One batch of requests asking for none, 0, 2 and 7: each gets exactly its own."""
    engine = _engine(engine_config, model_dirs["tiny-glm5"])
    asks = [None, 0, 2, 7, None]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=n)
              for n in asks]
    outs = _run(engine, mixed_prompts(), params)
    plain = engine.generate(mixed_prompts(), params)  # generate's return type is unchanged
    assert [list(o.token_ids) for o in outs] == plain
    for n, out in zip(asks, outs, strict=True):
        if n is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == 6
        assert all(len(e.top) == n for e in out.logprobs)
        if n:  # greedy: the chosen token is the most likely one
            assert all(e.top[0] == (e.token_id, e.logprob) for e in out.logprobs)


def test_step_width_is_the_largest_n_of_the_live_requests():
    table = SamplingTable(4, torch.device("cpu"), seed=0)
    table.add("a", 0, SamplingParams(logprobs=3))
    table.add("b", 1, SamplingParams(logprobs=7))
    table.add("c", 2, SamplingParams())
    table.add("d", 3, SamplingParams(logprobs=3))
    assert table.top_logprobs_width == 7
    table.remove("b")
    assert table.top_logprobs_width == 3
    table.remove("a")
    assert table.top_logprobs_width == 3
    table.check_integrity()
    table.remove("d")
    assert table.top_logprobs_width == 0  # no step top-k any more
    table.check_integrity()


def test_stop_token_cuts_the_entries_with_the_tokens(engine_config, model_dirs, mixed_prompts):
    engine = _engine(engine_config, model_dirs["tiny-glm5"])
    prompt = mixed_prompts()[0]
    free = _run(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0]
    stop = free.token_ids[3]
    out = _run(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=(stop,), logprobs=1))[0]
    cut = free.token_ids.index(stop) + 1
    assert out.token_ids == free.token_ids[:cut]
    assert [e.token_id for e in out.logprobs] == list(out.token_ids)


def test_logprobs_above_max_logprobs_are_refused(engine_config, model_dirs):
    cfg = engine_config(model_dirs["tiny-glm5"])
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_logprobs=3))
    engine = LLMEngine.from_config(cfg)
    with pytest.raises(RequestError, match="logprobs: 4 exceeds .*--max-logprobs 3"):
        engine.add_request("r", [5, 6, 7], SamplingParams(logprobs=4))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, logprobs=3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    with pytest.raises(RequestError, match="logprobs must be None or an integer >= 0"):
        SamplingParams(logprobs=-1)


def test_top_logprobs_op():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 5.0, -1.0]])
    ids, lps = top_logprobs(logits.log_softmax(-1), 2)
    assert ids.tolist() == [[1, 2], [2, 0]]
    assert torch.allclose(lps, logits.log_softmax(-1).gather(1, ids))
    ids, _ = top_logprobs(logits.log_softmax(-1), 9)  # wider than the vocabulary: all of it
    assert ids.shape == (2, 4)


def test_sample_on_device_takes_the_callers_log_softmax():
    """Given the rows' log_softmax (the runner keeps it for the top-N), the same tokens and
    values as without."""
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=3)]

    def batch():  # a fresh table each time: the same draws
        table = SamplingTable(3, torch.device("cpu"), seed=0)
        for i, p in enumerate(params):
            table.add(f"r{i}", i, p)
        return table.batch(["r0", "r1", "r2"], torch.arange(3))

    logprobs = logits.log_softmax(-1)
    own, given = sample_on_device(logits, batch()), sample_on_device(logits, batch(), logprobs)
    assert torch.equal(own[0], given[0]) and torch.equal(own[1], given[1])
    assert torch.equal(given[1], logprobs.gather(1, given[0][:, None])[:, 0])


class _LogSoftmaxRows(TorchFunctionMode):
    """Counts the rows every log_softmax of the step normalises."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.log_softmax, torch.log_softmax,
                    torch.nn.functional.log_softmax):
            self.rows += args[0].numel() // args[0].shape[-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [None, 3])
def test_one_log_softmax_per_emitting_row(engine_config, draftable, k):
    """A decode step with logprobs asked: each row a token comes from (the plain requests' last
    rows, each verifying request's k + 1 rows) is normalised once, for its token's
    log-probability and the top-N alike."""
    cfg = engine_config(draftable["tiny-glm5"], max_num_seqs=4)
    if k is not None:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    engine = LLMEngine.from_config(cfg)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 30 + 9 * i)),
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                          logprobs=N if i != 1 else None))
    for _ in range(3):  # prefill, then decode steps (with MTP: drafts to verify)
        engine.step()
    so = engine.scheduler.schedule()
    drafts = so.scheduled_spec_token_ids
    assert all(n == 1 + len(drafts.get(rid, ())) for rid, n in so.num_scheduled_tokens.items())
    if k is not None:
        assert drafts, "no drafts verified"
    # rows emitted from: one per plain request, k + 1 per verifying one (k: the most drafts)
    width = 1 + max((len(d) for d in drafts.values()), default=0)
    rows = sum(1 if rid not in drafts else width for rid in so.num_scheduled_tokens)
    with _LogSoftmaxRows() as mode:
        out = engine.runner.execute(so)
    assert mode.rows == rows
    assert all(len(top) == N for tops in out.top_logprobs.values() for top in tops)
    engine.scheduler.update_from_output(so, out)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
