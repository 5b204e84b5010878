"""The rejection sampler (dsaserve/spec/rejection.py) and SpecConfig's synthetic rates.

Greedy verification on crafted logits; distribution preservation on a 6-token vocabulary with
temperature and top-p (a sampler that forgets the residual fails the same bound by a wide
margin); synthetic acceptance lengths; the config's vLLM semantics and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import ConfigError, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import (
    SamplingBatch,
    mask_stop_ids,
    masked_stop_ids,
    sample_probs,
    sampling_probs,
)
from dsaserve.spec.rejection import (
    draft_uniforms,
    num_accepted_drafts,
    recovery_probs,
    rejection_sample,
    rejection_sample_on_device,
)

GREEDY = SamplingParams(temperature=0.0)


def _one_hot_logits(argmaxes: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """[R, S, V] logits whose argmax at row (r, s) is argmaxes[r][s]."""
    t = torch.tensor(argmaxes)
    return torch.nn.functional.one_hot(t, vocab).float() * 5.0


def test_greedy_accepts_the_matching_prefix_then_emits_the_argmax() -> None:
    logits = _one_hot_logits([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 2, 2, 2]])
    drafts = torch.tensor([[3, 4, 5], [3, 7, 5], [0, 4, 5], [1, 2, -1]])
    num = torch.tensor([3, 3, 3, 2])
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = rejection_sample(logits, drafts, num, [GREEDY] * 4, gens)
    assert out == [
        [3, 4, 5, 6],  # all accepted + bonus
        [3, 4],  # rejected at 1: the target's argmax there
        [3],  # rejected at 0
        [1, 2, 2],  # d = 2 < k: padding never verified, bonus from row 2
    ]


def _batch(params: SamplingParams) -> SamplingBatch:
    return SamplingBatch.of([params], [None], torch.device("cpu"))


def _emitted(params: SamplingParams, logits: torch.Tensor, draft: list[int], trials: int,
             residual: bool = True) -> torch.Tensor:
    """[trials, 2]: the first two emitted tokens (−1 when only one was emitted) of `trials`
    verifications of the same drafts, each with its own seeded generator. residual=False is a
    deliberately broken sampler (it resamples p at a rejection, forgetting the residual)."""
    k = len(draft)
    drafts = torch.tensor(draft).expand(trials, k)
    num = torch.full((trials,), k)
    g = torch.Generator().manual_seed(1234)
    probs = sampling_probs(logits, _batch(params)).expand(trials, k + 1, -1)  # the same every trial
    accepted = num_accepted_drafts(probs, drafts, num, torch.rand(trials, k, generator=g))
    final = recovery_probs(probs, drafts, num, accepted, residual=residual)
    last = torch.multinomial(final, 1, generator=g)[:, 0]
    out = torch.full((trials, 2), -1)
    for pos in range(2):
        out[:, pos] = torch.where(accepted > pos, drafts[:, pos],
                                  torch.where(accepted == pos, last, out[:, pos]))
    return out


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).float() / samples.numel()
    return 0.5 * (freq - p).abs().sum().item()


@pytest.mark.parametrize("synthetic", [False, True], ids=["target", "synthetic"])
def test_all_greedy_verify_equals_the_distributions_path(synthetic: bool) -> None:
    """An all-greedy batch is verified from its rows' argmaxes alone: the same accepted
    counts, tokens and draws as the general path (one-hot distributions, their residual and
    the race), with ties in the logits, drafts matching the argmax at random depths,
    min_tokens masking stop ids (EOS 1 below min_tokens in some rows) and padded drafts."""
    g = torch.Generator().manual_seed(3)
    reqs, k, vocab = 64, 3, 12
    logits = torch.randint(0, 4, (reqs, k + 1, vocab), generator=g).float()  # many ties
    target = logits.argmax(-1)
    drafts = torch.where(torch.rand(reqs, k, generator=g) < 0.7, target[:, :k],
                         torch.randint(0, vocab, (reqs, k), generator=g))
    num = torch.randint(0, k + 1, (reqs,), generator=g)
    drafts = torch.where(torch.arange(k)[None, :] < num[:, None], drafts, -1)
    params = [SamplingParams(temperature=0.0, min_tokens=2 * (r % 3)) for r in range(reqs)]
    outputs = [r % 4 for r in range(reqs)]
    rates = torch.tensor([0.9, 0.6, 0.3]) if synthetic else None

    def batch() -> SamplingBatch:
        return SamplingBatch.of(params, [None] * reqs, torch.device("cpu"),
                                torch.Generator().manual_seed(11), num_output_tokens=outputs,
                                eos_token_ids=(1,), vocab_size=vocab)

    b = batch()
    assert not b.any_sampled and b.stop_ids is not None
    accepted, tokens = rejection_sample_on_device(logits, drafts, num, b, rates)
    # the general path, spelled out (what the function ran for every batch before)
    b = batch()
    probs = sampling_probs(mask_stop_ids(logits, b), b)
    uniforms = (draft_uniforms(reqs, k, b, logits.device) if synthetic
                else torch.zeros(reqs, k))
    want_acc = num_accepted_drafts(probs, drafts, num, uniforms, rates,
                                   masked_stop_ids(drafts, b) if synthetic else None)
    want_tok = sample_probs(recovery_probs(probs, drafts, num, want_acc,
                                           residual=not synthetic), b)
    assert torch.equal(accepted, want_acc) and torch.equal(tokens, want_tok)
    assert 0 < int(accepted.sum()) < int(num.sum())  # some accepted, some rejected


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.3, top_p=0.85),
                                    SamplingParams(temperature=1.0, top_k=4)])
def test_speculative_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """The first emitted token follows p_0, and the second (when draft 0 was accepted) follows
    p_1, within a total-variation bound of 0.02 over 40,000 trials (sampling noise is about
    0.005). The broken sampler that skips the residual gives p_0(x) + (1 − p_0(x))·p_0(x) for
    the draft x, a TV error of p_0(x)(1 − p_0(x)) ≈ 0.2 here, and must fail the same bound."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 6, generator=g) * 1.5  # [1, k+1, V]
    p = sampling_probs(logits, _batch(params))[0]  # [3, 6]
    draft = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a plausible, not certain, draft 0
    out = _emitted(params, logits, draft, 40_000)
    assert _tv(out[:, 0], p[0]) < 0.02
    second = out[out[:, 0] == draft[0], 1]
    assert second.numel() > 5_000 and _tv(second, p[1]) < 0.02
    broken = _emitted(params, logits, draft, 40_000, residual=False)
    assert _tv(broken[:, 0], p[0]) > 0.1


def test_seeded_requests_are_reproducible_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1))
    drafts = torch.randint(0, 16, (3, 3), generator=torch.Generator().manual_seed(2))
    num = torch.tensor([3, 3, 3])

    def run(rows: list[int]) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(7) for _ in rows]
        return rejection_sample(logits[rows], drafts[rows], num[rows], [params] * len(rows), gens)

    alone = [run([r])[0] for r in range(3)]
    assert run([0, 1, 2]) == alone and run([2, 0]) == [alone[2], alone[0]]


def test_synthetic_acceptance_length_is_the_configured_one() -> None:
    """2.99 with k = 3 → rates [1, 0.99, 0]: 1 + 1 + 0.99 tokens per step on average, whatever
    the target says (here the drafts are all wrong for a greedy target)."""
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3, '
                                '"rejection_sample_method": "synthetic", '
                                '"synthetic_acceptance_length": 2.99}')
    assert spec.synthetic_acceptance_rates == (1.0, 0.99, 0.0)
    steps = 4000
    logits = _one_hot_logits([[1, 1, 1, 1]]).expand(steps, 4, -1)
    drafts = torch.full((steps, 3), 2)
    rates = torch.tensor(spec.conditional_rates)
    gens = [torch.Generator().manual_seed(i) for i in range(steps)]
    out = rejection_sample(logits, drafts, torch.full((steps,), 3), [GREEDY] * steps, gens, rates)
    mean = sum(len(o) for o in out) / steps
    assert abs(mean - 2.99) < 0.02
    assert all(o[0] == 2 and o[-1] == 1 for o in out)  # drafts kept; the target's token last


def test_synthetic_rates_from_a_length_and_to_conditional() -> None:
    assert SpecConfig.acceptance_length_to_rates(2.99, 3) == (1.0, 0.99, 0.0)
    assert SpecConfig.acceptance_length_to_rates(1.0, 2) == (0.0, 0.0)
    assert SpecConfig.acceptance_length_to_rates(4.0, 3) == (1.0, 1.0, 1.0)
    assert SpecConfig.acceptance_length_to_rates(2.5, 5) == (1.0, 0.5, 0.0, 0.0, 0.0)
    spec = SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                      synthetic_acceptance_rates=(0.8, 0.4, 0.0))
    assert spec.conditional_rates == pytest.approx((0.8, 0.5, 0.0))
    zero = SpecConfig(num_speculative_tokens=2, rejection_sample_method="synthetic",
                      synthetic_acceptance_rates=(0.0, 0.0))
    assert zero.conditional_rates == (0.0, 0.0)


@pytest.mark.parametrize("text,match", [
    ("{", "invalid JSON"),
    ("[1]", "JSON object"),
    ('{"method": "mtp"}', "required"),
    ('{"method": "eagle", "num_speculative_tokens": 1}', "method must be 'mtp'"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "integer >= 1"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft": 1}', "unknown keys"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}',
     "needs synthetic_acceptance_length"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 2.0, "synthetic_acceptance_rates": [1, 0, 0]}', "not both"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 4.5}', r"\[1, num_speculative_tokens \+ 1 = 4\]"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5, 0.9, 0.1]}', "non-increasing"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [1.0, 0.5]}', "3\\) entries"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [1.5, 0.5]}', r"\[0, 1\]"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0}',
     "only with"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "fly"}',
     "'standard' or 'synthetic'"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft_lm_head": "int4"}',
     r"draft_lm_head must be one of \['auto', 'fp8', 'model'\]"),
])
def test_bad_speculative_config_names_the_flag(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpecConfig.from_json(text)
    assert e.match(match)


@pytest.mark.parametrize("content,match", [
    (None, "draft_vocab .*cannot be read"),
    ("[1, 2", "not JSON"),
    ("{}", "non-empty JSON list of token ids"),
    ("[]", "non-empty JSON list of token ids"),
    ("[1, -2]", "non-empty JSON list of token ids"),
    ("[1, true]", "non-empty JSON list of token ids"),
    ("[4, 1, 4]", "token ids repeat"),
])
def test_bad_draft_vocab_names_the_flag(tmp_path, content, match) -> None:
    path = tmp_path / "vocab.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 2, '
                             f'"draft_vocab": "{path}"}}')
    assert e.match(match)


def test_draft_vocab_is_read_ascending_and_checked_against_the_model(tmp_path,
                                                                     engine_config,
                                                                     draftable_dirs) -> None:
    path = tmp_path / "vocab.json"
    path.write_text("[9, 2, 5]")
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 2, '
                                f'"draft_vocab": "{path}"}}')
    assert spec.draft_vocab == (2, 5, 9)
    with pytest.raises(ConfigError, match="ascending"):
        SpecConfig(num_speculative_tokens=2, draft_vocab=(5, 2))
    assert "draft_vocab" not in repr(spec)  # (a real one holds ~10^4 ids)
    cfg = engine_config(draftable_dirs["tiny-glm5"])
    path.write_text(f"[2, {cfg.model.vocab_size}]")
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 2, '
                                f'"draft_vocab": "{path}"}}')
    with pytest.raises(ConfigError, match=r"--speculative-config: draft_vocab: token id \d+ is "
                                          "outside the model's vocabulary"):
        dataclasses.replace(cfg, speculative=spec)
