"""The batched sampler against its per-request reference (engine/sampler.py `sample_reference`,
`filter_top_k_top_p`; spec/rejection.py `target_probs_reference`): exactly for greedy rows and
the filtered distributions, in distribution for sampled tokens (total variation against the
exact probabilities, fixed seeds); seeded requests give the same tokens alone and batched, in
the sampler, the rejection sampler and the engine; the device table of sampling parameters
follows the diffs (engine/sampling_table.py). The min_tokens mask equals its per-request
reference (`mask_stop_ids_reference`) on random logits, through SamplingBatch.of and through
the table's rows and the rows' positions; no masked id is sampled or accepted as a draft."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import (
    SamplingBatch,
    filter_rows,
    filter_top_k_top_p,
    make_generator,
    mask_stop_ids,
    mask_stop_ids_reference,
    sample,
    sample_on_device,
    sample_reference,
    sampling_probs,
)
from dsaserve.engine.sampling_table import SamplingTable
from dsaserve.spec.rejection import (
    rejection_sample,
    rejection_sample_on_device,
    target_probs_reference,
)

CPU = torch.device("cpu")
MIX = [SamplingParams(temperature=0.0),
       SamplingParams(temperature=0.7),
       SamplingParams(temperature=1.3, top_p=0.8),
       SamplingParams(temperature=1.0, top_k=3),
       SamplingParams(temperature=0.9, top_k=4, top_p=0.7),
       SamplingParams(temperature=1.0, top_p=1e-7),  # greedy in effect
       SamplingParams(temperature=0.5, top_k=100)]  # k past the vocabulary: off


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).float() / samples.numel()
    return 0.5 * (freq - p).abs().sum().item()


def test_filters_equal_the_reference_row_by_row():
    logits = _logits(len(MIX), 12)
    batch = SamplingBatch.of(MIX, [None] * len(MIX), CPU)
    kept = filter_rows(logits, batch.top_k, batch.top_p).isfinite()
    for r, p in enumerate(MIX):
        top_k, top_p = (0, 1.0) if p.greedy else (p.top_k, p.top_p)
        assert kept[r].tolist() == filter_top_k_top_p(logits[r], top_k, top_p).isfinite().tolist()
    # ties at the k-th value stay, as in the reference
    tied = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    kept = filter_rows(tied, torch.tensor([2]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_target_probs_equal_the_reference():
    logits = torch.randn(len(MIX), 3, 10, generator=torch.Generator().manual_seed(1)) * 2
    batch = SamplingBatch.of(MIX, [None] * len(MIX), CPU)
    torch.testing.assert_close(sampling_probs(logits, batch), target_probs_reference(logits, MIX))
    greedy = [SamplingParams(temperature=0.0)] * 2
    torch.testing.assert_close(
        sampling_probs(logits[:2], SamplingBatch.of(greedy, [None] * 2, CPU)),
        target_probs_reference(logits[:2], greedy))


def test_greedy_rows_are_the_argmax_in_any_batch():
    logits = _logits(len(MIX), 50, seed=2)
    gens = [torch.Generator().manual_seed(i) for i in range(len(MIX))]
    tokens, lps = sample(logits, MIX, gens, torch.Generator().manual_seed(5))
    reference = sample_reference(logits, MIX, gens)
    for r, p in enumerate(MIX):
        if p.greedy:
            assert tokens[r] == reference[r] == logits[r].argmax().item()
    assert lps == pytest.approx(logits.log_softmax(-1).gather(
        1, torch.tensor(tokens)[:, None])[:, 0].tolist())


def test_sampled_tokens_follow_the_reference_distribution():
    """Each request of a mixed batch, repeated 20,000 times in one batched call: its tokens'
    frequencies are within TV 0.02 of the reference's exact distribution (sampling noise is
    about 0.006 on 8 tokens), and so are the reference loop's own multinomial draws. A
    sampler that drops the temperature misses the bound by far (checked: TV > 0.1)."""
    vocab, trials = 8, 20_000
    base = _logits(len(MIX), vocab, seed=3)
    exact = target_probs_reference(base[:, None], MIX)[:, 0]  # [R, V]
    rows = torch.arange(len(MIX)).repeat(trials)  # request r at rows r, r + R, ...
    params = [MIX[r] for r in rows.tolist()]
    batch = SamplingBatch.of(params, [None] * len(params), CPU, torch.Generator().manual_seed(7))
    tokens, _ = sample_on_device(base[rows], batch)
    g = torch.Generator().manual_seed(8)
    for r, p in enumerate(MIX):
        assert _tv(tokens[r :: len(MIX)], exact[r]) < 0.02, p
        if not p.greedy:  # the reference loop's draws, as a check of the bound itself
            ref = sample_reference(base[[r] * 4000], [p] * 4000, [g] * 4000)
            assert _tv(ref, exact[r]) < 0.04, p
    cold = dataclasses.replace(batch, temperature=torch.ones_like(batch.temperature))
    hot = sample_on_device(base[rows], cold)[0]
    assert _tv(hot[1 :: len(MIX)], exact[1]) > 0.1  # temperature 0.7 ignored


def test_speculative_sampling_of_a_mixed_batch_keeps_each_target_distribution():
    """The full batched verification (one draw of uniforms, the exponential race) over a batch
    mixing every kind of request: each request's first emitted token follows its p_0."""
    vocab, trials, k = 6, 12_000, 2
    kinds = [p for p in MIX if not p.greedy][:4]
    logits = torch.randn(len(kinds), k + 1, vocab, generator=torch.Generator().manual_seed(4))
    exact = target_probs_reference(logits, kinds)  # [K, k+1, V]
    drafts = torch.stack([torch.stack((e[0].argsort()[-2], e[1].argmax())) for e in exact])
    rows = torch.arange(len(kinds)).repeat(trials)
    out = rejection_sample(logits[rows], drafts[rows], torch.full((len(rows),), k),
                           [kinds[r] for r in rows.tolist()], [None] * len(rows),
                           generator=torch.Generator().manual_seed(9))
    first = torch.tensor([o[0] for o in out])
    for r, p in enumerate(kinds):
        assert _tv(first[r :: len(kinds)], exact[r, 0]) < 0.03, p


def test_seeded_requests_give_the_same_tokens_alone_and_batched():
    """Three steps: a seeded request alone, then at another row of a batch of unseeded,
    greedy and other seeded requests (drawing from other step generators): the same tokens."""
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    other = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.1, top_k=5, seed=9), SamplingParams(temperature=0.6)]
    logits = _logits(5, 64, seed=6)

    def run(batched: bool) -> list[int]:
        mine = make_generator(seeded, CPU, 0)
        others = [make_generator(p, CPU, 0) for p in other]
        step = torch.Generator().manual_seed(int(batched))
        got = []
        for _ in range(3):
            if batched:  # the seeded request is row 2
                params, gens = other[:2] + [seeded] + other[2:], others[:2] + [mine] + others[2:]
                got.append(sample(logits, params, gens, step)[0][2])
            else:
                got.append(sample(logits[2:3], [seeded], [mine], step)[0][0])
        return got

    assert run(False) == run(True)


def test_seeded_verification_alone_and_batched():
    seeded = SamplingParams(temperature=1.0, seed=77)
    logits = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(1))
    drafts = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(2))
    num = torch.tensor([3, 3, 2, 3])
    params = [SamplingParams(temperature=0.8), seeded, SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.9)]
    alone = rejection_sample(logits[1:2], drafts[1:2], num[1:2], [seeded],
                             [make_generator(seeded, CPU, 0)], generator=torch.Generator())
    gens = [make_generator(p, CPU, i) for i, p in enumerate(params)]
    batched = rejection_sample(logits, drafts, num, params, gens,
                               generator=torch.Generator().manual_seed(3))
    assert batched[1] == alone[0]


def test_engine_seeded_request_alone_and_batched(model_dirs, engine_config, mixed_prompts):
    """Through the runner's device table: a seeded request's tokens do not depend on the
    requests beside it (unseeded, greedy, other seeded ones)."""
    from dsaserve.engine.engine import LLMEngine

    prompts = mixed_prompts(4)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    others = [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.2, top_k=4, seed=5, ignore_eos=True)]
    cfg = engine_config(model_dirs["tiny-glm5"], prefix_caching=False)
    alone = LLMEngine.from_config(cfg).generate([prompts[1]], seeded)[0]
    engine = LLMEngine.from_config(cfg)
    batched = engine.generate(prompts, [others[0], seeded, *others[1:]])
    engine.check_integrity()
    assert batched[1] == alone


def test_table_follows_the_diffs():
    table = SamplingTable(2, CPU, seed=0)
    table.add("a", 0, SamplingParams(temperature=0.5, top_k=3))
    table.add("b", 1, SamplingParams(temperature=0.0, seed=4))  # greedy: no generator
    table.add("c", 5, SamplingParams(temperature=1.5, top_p=0.6, seed=8))  # grows
    table.apply(table.pending())
    table.check_integrity()
    batch = table.batch(["c", "a", "b"], torch.tensor([5, 0, 1]))
    assert batch.temperature.tolist() == [1.5, 0.5, 0.0]
    assert batch.top_k.tolist() == [0, 3, 0]
    assert batch.top_p.tolist() == pytest.approx([0.6, 1.0, 1.0])
    assert (batch.any_sampled, batch.any_top_k, batch.any_top_p) == (True, True, True)
    assert [r for r, _ in batch.seeded] == [0]
    table.remove("a")
    table.remove("c")
    table.add("d", 0, SamplingParams(temperature=0.0))  # a reused row
    table.apply(table.pending())
    table.check_integrity()
    batch = table.batch(["d", "b"], torch.tensor([0, 1]))
    assert not batch.any_sampled and batch.temperature is None
    assert sampling_probs(torch.tensor([[0.0, 2.0, 1.0]]), batch).tolist() == [[0, 1, 0]]


def test_table_takes_a_top_k_past_int32_as_off():
    """A client's top_k of 2**31 or more (it passes SamplingParams: no upper bound, as in vLLM)
    filters nothing; written as is it overflowed the int32 row and failed the step for every
    request (the engine died)."""
    table = SamplingTable(2, CPU, seed=0)
    table.add("huge", 0, SamplingParams(temperature=0.8, top_k=2**70))
    table.add("edge", 1, SamplingParams(temperature=0.8, top_k=2**31 - 1))  # fits: kept
    table.apply(table.pending())
    table.check_integrity()
    batch = table.batch(["huge", "edge"], torch.tensor([0, 1]))
    assert batch.top_k.tolist() == [0, 2**31 - 1]
    table.remove("huge")
    table.remove("edge")
    assert table.num_top_k == 0  # counted alike on the way in and out
    table.check_integrity()


def test_step_generator_is_the_same_on_every_rank():
    """Two tables (two ranks) seeded alike draw the same noise each step, and a new noise
    each step."""
    draws = []
    for _ in range(2):
        table = SamplingTable(1, CPU, seed=3)
        table.add("a", 0, SamplingParams(temperature=1.0))
        table.apply(table.pending())
        draws.append([torch.rand(4, generator=table.batch(["a"], torch.tensor([0])).generator)
                      for _ in range(2)])
    assert all(torch.equal(x, y) for x, y in zip(*draws, strict=True))
    assert not torch.equal(draws[0][0], draws[0][1])


# ---- min_tokens ------------------------------------------------------------------------------
EOS = (2, 11)


def _min_tokens_mix(num: int, vocab: int, seed: int) -> tuple[list[SamplingParams], list[int]]:
    """`num` requests with random min_tokens (0 included), stop ids (several, repeats, one
    outside the vocabulary), ignore_eos and sampling; outputs so far below and past
    min_tokens → (params, num_output_tokens)."""
    g = torch.Generator().manual_seed(seed)

    def draw(hi: int) -> int:
        return int(torch.randint(0, hi, (), generator=g))

    params, num_output = [], []
    for _ in range(num):
        stops = tuple(draw(vocab) for _ in range(draw(4))) + ((vocab + 3,) if draw(4) == 0
                                                              else ())
        params.append(SamplingParams(max_tokens=20, min_tokens=draw(7), stop_token_ids=stops,
                                     ignore_eos=draw(3) == 0, temperature=draw(2) * 0.8))
        num_output.append(draw(9))
    return params, num_output


def test_min_tokens_mask_equals_the_reference():
    """[R, J, V] (a verifying request's rows: output index + j) and [R, V] rows."""
    vocab, num = 20, 64
    params, num_output = _min_tokens_mix(num, vocab, seed=11)
    logits = torch.randn(num, 4, vocab, generator=torch.Generator().manual_seed(12))
    batch = SamplingBatch.of(params, [None] * num, CPU, num_output_tokens=num_output,
                             eos_token_ids=EOS, vocab_size=vocab)
    want = mask_stop_ids_reference(logits, params, EOS, num_output)
    assert torch.equal(mask_stop_ids(logits, batch), want)
    assert torch.equal(mask_stop_ids(logits[:, 0], batch), want[:, 0])
    masked = want[:, 0].isinf()
    assert masked.any() and not masked.all(1).any()  # some rows mask, none masks everything
    # the rows the batch says are below min_tokens are exactly the reference's
    assert ((batch.min_tokens_left > 0) & (batch.stop_ids >= 0).any(1)).tolist() == [
        bool(p.min_tokens_stop_ids(EOS, vocab)) and n < p.min_tokens
        for p, n in zip(params, num_output, strict=True)]
    # no request masks: no tensors, logits untouched
    plain = SamplingBatch.of([dataclasses.replace(p, min_tokens=0) for p in params],
                             [None] * num, CPU, num_output_tokens=num_output,
                             eos_token_ids=EOS, vocab_size=vocab)
    assert plain.stop_ids is None and mask_stop_ids(logits, plain) is logits


def test_no_masked_id_is_sampled_or_accepted():
    """Logits that favour a masked id by far: greedy and sampled rows never emit it before
    min_tokens; a draft that is one is rejected, the verified rows below min_tokens emit
    none; past min_tokens the favoured id comes back."""
    vocab, trials = 8, 2000
    favour = torch.zeros(vocab)
    favour[2] = 10.0  # EOS 2
    params = [SamplingParams(min_tokens=3, temperature=t) for t in (0.0, 1.0)] * trials
    logits = favour.repeat(len(params), 1)
    below = SamplingBatch.of(params, [None] * len(params), CPU, torch.Generator().manual_seed(1),
                             num_output_tokens=[2] * len(params), eos_token_ids=EOS,
                             vocab_size=vocab)
    tokens, _ = sample_on_device(logits, below)
    assert 2 not in tokens.tolist() and 11 not in tokens.tolist()
    past = dataclasses.replace(below, min_tokens_left=below.min_tokens_left - 1)
    assert sample_on_device(logits, past)[0][::2].eq(2).all()  # greedy rows
    # verification at output index 1: rows 0, 1 masked, rows 2, 3 not
    verify = favour.repeat(len(params), 4, 1)
    drafts = torch.tensor([[2, 5, 5]]).repeat(len(params), 1)
    at_one = dataclasses.replace(below, min_tokens_left=below.min_tokens_left + 1)
    accepted, final = rejection_sample_on_device(verify, drafts, torch.full((len(params),), 3),
                                                 at_one)
    assert accepted.eq(0).all() and 2 not in final.tolist()
    ok = torch.tensor([[5, 5, 2]]).repeat(len(params), 1)
    accepted, final = rejection_sample_on_device(verify, ok, torch.full((len(params),), 3),
                                                 at_one)
    # greedy rows: draft 5 is not the masked argmax (the zeros' first, id 0); a token emitted
    # at output index 1 + accepted is masked below 3
    assert accepted[::2].eq(0).all() and final[::2].eq(0).all()
    assert final[accepted < 2].ne(2).all() and final[accepted == 3].eq(2).any()


def test_table_min_tokens_rows_follow_the_diffs():
    """Rows of (min_end, stop ids) per request, the stop columns grown for a larger set, ids
    outside the vocabulary left out; the mask from the rows and the positions of their tokens
    equals the reference; the host flag counts the requests short of min_end."""
    vocab, num = 20, 12
    params, num_output = _min_tokens_mix(num, vocab, seed=21)
    params[3] = dataclasses.replace(params[3], min_tokens=4,
                                    stop_token_ids=tuple(range(3, 12)) + (vocab, -1))
    num_output[3] = 1
    prompts = [5 + 3 * r for r in range(num)]
    table = SamplingTable(4, CPU, seed=0, vocab_size=vocab)
    rows = torch.randperm(16, generator=torch.Generator().manual_seed(2))[:num]
    for r, p in enumerate(params):
        table.add(f"r{r}", int(rows[r]), p, prompts[r], EOS, prompts[r] + num_output[r])
        table.check_integrity()
    table.apply(table.pending())
    table.check_integrity()
    masking = [bool(p.min_tokens_stop_ids(EOS, vocab)) and n < p.min_tokens
               for p, n in zip(params, num_output, strict=True)]
    assert table.num_masking == sum(masking)
    ids = [f"r{r}" for r in range(num)]
    positions = torch.tensor([prompts[r] + num_output[r] for r in range(num)])
    batch = table.batch(ids, rows, positions)
    logits = torch.randn(num, 3, vocab, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mask_stop_ids(logits, batch),
                       mask_stop_ids_reference(logits, params, EOS, num_output))
    # grown past its first 4 stop columns for r3's ids (its EOS ids with them)
    assert batch.stop_ids.shape[1] >= len(params[3].min_tokens_stop_ids(EOS, vocab)) > 4
    # r3's known tokens reach min_end: the flag no longer counts it; its row still says so
    table.tokens_known("r3", prompts[3] + 3)
    assert table.num_masking == sum(masking)
    table.tokens_known("r3", prompts[3] + 4)
    assert table.num_masking == sum(masking) - 1
    table.check_integrity()
    for r in range(num):
        table.remove(f"r{r}")
    table.add("plain", int(rows[3]), SamplingParams(temperature=0.0))  # a reused row
    table.apply(table.pending())
    table.check_integrity()
    assert table.num_masking == 0
    batch = table.batch(["plain"], rows[3:4], None)
    assert batch.stop_ids is None and batch.temperature is None
