"""Sampling: greedy, seeds, top-k / top-p filtering, and parameter validation."""

from __future__ import annotations

import pytest
import torch

from dsaserve.core import RequestError, SamplingParams
from dsaserve.engine.sampler import filter_top_k_top_p, make_generator, sample


def _gens(params, seed=0):
    return [make_generator(p, torch.device("cpu"), seed + i) for i, p in enumerate(params)]


def test_greedy_is_argmax_and_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    tokens, lps = sample(logits, params, _gens(params))
    assert tokens == [1, 0]
    assert lps[0] == pytest.approx(logits[0].log_softmax(-1)[1].item())


def test_seed_reproduces_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [sample(logits[1:2], [p], _gens([p]))[0][0] for _ in range(3)]
    batched = sample(logits, [SamplingParams(temperature=1.0, seed=7), p,
                              SamplingParams(temperature=0.0)],
                     [make_generator(SamplingParams(seed=7), torch.device("cpu"), 0),
                      make_generator(p, torch.device("cpu"), 0),
                      make_generator(SamplingParams(), torch.device("cpu"), 0)])[0]
    assert len(set(alone)) == 1 and batched[1] == alone[0]


def test_top_k_and_top_p_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = filter_top_k_top_p(logits, top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    probs = logits.softmax(-1)  # ≈ [0.64, 0.24, 0.09, 0.03, 0.01]
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.7).isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    assert probs[0] < 0.7 < probs[:2].sum()
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.5).isfinite()
    assert kept.tolist() == [True, False, False, False, False]


def test_sampling_respects_filters():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    logits[0, 7] = 1.0
    p = SamplingParams(temperature=1.0, top_k=2, seed=0)
    g = _gens([p])
    seen = {sample(logits, [p], g)[0][0] for _ in range(50)}
    assert seen == {3, 7}


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_tokens": 5, "max_tokens": 2},
                                                            "min_tokens"),
])
def test_bad_values_raise_request_error(kwargs, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kwargs)
