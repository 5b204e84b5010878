"""kernels/triton/logsumexp.py run by Triton's CPU interpreter against torch.logsumexp, and the
sampler's chosen log-probabilities through it against log_softmax's. Skipped when triton is not
installed."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted


@pytest.fixture(scope="module")
def lse():
    yield from interpreted("dsaserve.kernels.triton.logsumexp")


# −inf − −inf in the branch a where() drops, and log(0) of the −inf row: numpy warns about both
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning",
                            "ignore:divide by zero encountered in log:RuntimeWarning")
def test_row_logsumexp_matches_torch(lse):
    """Rows longer than a block and not a multiple of it, strided, of very different scales;
    −inf entries (masked tokens), a row of −inf only (−inf out), and a row whose every lane
    sees −inf first and a finite value later (its running sum rescaled from zero), also far below
    zero."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1, 10, 100, 0.01, 1, 1])[:, None]
    x = torch.randn(6, 5000 + 3, generator=g)[:, 3:] * scales
    x[1, ::7] = float("-inf")
    x[4] = float("-inf")
    x[5, :4096] = float("-inf")
    x[0, :2048] = float("-inf")  # then values far below 0: the lanes' first rescale clamped
    x[0, 2048:] -= 500
    got = lse.row_logsumexp(x)
    want = torch.logsumexp(x, dim=-1)
    assert got[4] == float("-inf")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp32"):
        lse.row_logsumexp(x.double())


def test_chosen_logprobs_equal_log_softmax_gather(lse, monkeypatch):
    """engine/sampler.chosen_logprobs on the kernel path ([M, k+1, V] verify rows) against the
    log_softmax it replaces."""
    from dsaserve.engine import sampler

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # sampler.use_kernels: the kernel path
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 1000, generator=g) * 4
    tokens = torch.randint(0, 1000, (3, 4), generator=g)
    want = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(sampler.chosen_logprobs(logits, tokens), want, rtol=1e-5,
                               atol=1e-5)
