"""Verification of draft tokens by rejection sampling (VLLM_NOTES §5.2–5.3).

Each verifying request ran the target on its last token and its d ≤ k drafts, so it has d + 1
target distributions p_0..p_d (row i predicts the token after input i). Drafts are greedy, so the
draft distribution q is one-hot and standard speculative sampling (Leviathan et al., Chen et al.)
reduces to:

    accept draft x_i   iff  u_i < p_i(x_i)                 (u_i ~ U[0, 1), drafts in order)
    first rejection j  →  emit a sample of (p_j − onehot(x_j))⁺ / Σ(...)   (the residual)
    all d accepted     →  emit a sample of p_d (the bonus token)

which emits tokens distributed exactly as the target would have sampled them one at a time. A
greedy target is the special case p = onehot(argmax): accept iff x_i == argmax, emit the argmax.
Synthetic mode (benchmarks) replaces the test by u_i < c_i (fixed conditional rates) and emits
the target's own sample of p_j at the first rejection: the acceptance length is fixed, the text
is not faithful. It keeps min_tokens' guarantee: a draft that is a masked stop id is rejected.

The maths is in pure batched functions over [R, k(+1), V] tensors, with no loop over tokens or
requests: per-request temperature / top-k / top-p are rows of a SamplingBatch
(engine/sampler.py), the uniforms one batched draw, the emitted token an exponential race. A
seeded request draws its own uniforms and noise from its own generator, so it is reproducible
whatever the batch. `target_probs_reference` is the per-request loop it is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import (
    SamplingBatch,
    filter_top_k_top_p,
    mask_stop_ids,
    masked_stop_ids,
    sample_probs,
    sampling_probs,
)


def target_probs_reference(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, S, V] fp32 → the distributions the target samples from [R, S, V], a loop over
    requests (the reference of engine/sampler.py `sampling_probs`, which the verify step
    uses)."""
    probs = torch.empty_like(logits)
    for r, p in enumerate(params):  # per request: its own temperature / top-k / top-p
        if p.greedy:
            probs[r] = torch.zeros_like(logits[r]).scatter_(-1, logits[r].argmax(-1, True), 1.0)
        else:
            probs[r] = filter_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p).softmax(-1)
    return probs


def num_accepted_drafts(
    probs: torch.Tensor,  # [R, k+1, V] target distributions
    draft_ids: torch.Tensor,  # [R, k] int64, padded past each request's drafts (any id)
    num_drafts: torch.Tensor,  # [R] int64, d_r ≤ k
    uniforms: torch.Tensor,  # [R, k] U[0, 1)
    conditional_rates: torch.Tensor | None = None,  # [≥ k] synthetic: P(accept i | 0..i−1)
    masked_drafts: torch.Tensor | None = None,  # [R, k] bool synthetic: stop ids below min_tokens
) -> torch.Tensor:
    """Leading drafts accepted per request [R] int64 (0..d_r)."""
    k = draft_ids.shape[1]
    if conditional_rates is None:
        p_draft = probs[:, :k].gather(-1, draft_ids.clamp(min=0)[..., None])[..., 0]  # [R, k]
        accept = uniforms < p_draft
    else:
        accept = synthetic_accepts(uniforms, conditional_rates, masked_drafts)
    return leading_run(accept, num_drafts)


def synthetic_accepts(uniforms: torch.Tensor,  # [R, k] U[0, 1)
                      conditional_rates: torch.Tensor,  # [≥ k] P(accept i | 0..i−1)
                      masked_drafts: torch.Tensor | None = None,  # [R, k] bool
                      ) -> torch.Tensor:  # [R, k] bool
    """Synthetic mode's verdict per draft: the target's is ignored (a step may verify fewer
    than k drafts), except min_tokens': the masked target gives a stop-id draft p = 0."""
    accept = uniforms < conditional_rates[None, :uniforms.shape[1]]
    if masked_drafts is not None:
        accept &= ~masked_drafts
    return accept


def leading_run(accept: torch.Tensor,  # [R, k] bool: draft i passes its test
                num_drafts: torch.Tensor,  # [R] int64, d_r ≤ k
                ) -> torch.Tensor:  # [R] int64
    """The accepted drafts per request: the leading run of passes among its d_r drafts."""
    positions = torch.arange(accept.shape[1], device=accept.device)[None, :]  # [1, k]
    accept = accept & (positions < num_drafts[:, None])
    return accept.long().cumprod(-1).sum(-1)


def recovery_probs(
    probs: torch.Tensor,  # [R, k+1, V]
    draft_ids: torch.Tensor,  # [R, k]
    num_drafts: torch.Tensor,  # [R]
    num_accepted: torch.Tensor,  # [R]
    residual: bool = True,
) -> torch.Tensor:
    """The distribution of the token emitted after the accepted drafts [R, V]: the normalised
    residual (p_j − onehot(x_j))⁺ at a rejection j (`residual`; synthetic mode passes False and
    gets p_j), p_d when every draft was accepted (the bonus token)."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    p = probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < num_drafts  # [R]
    if residual:  # computed for every row and selected: no host test of `rejected`
        x = draft_ids.gather(1, num_accepted.clamp(max=draft_ids.shape[1] - 1)[:, None])  # [R, 1]
        res = p.scatter_add(-1, x.clamp(min=0), -torch.ones_like(x, dtype=p.dtype)).clamp(min=0)
        # A rejection implies p_j(x_j) < 1, so the residual has mass; guard against rounding.
        mass = res.sum(-1, keepdim=True)
        res = torch.where(mass > 0, res / mass.clamp(min=1e-30), p)
        p = torch.where(rejected[:, None], res, p)
    return p


def draft_uniforms(num_reqs: int, k: int, batch: SamplingBatch,
                   device: torch.device) -> torch.Tensor:
    """U[0, 1) [R, k]: one draw from the step's generator, then each seeded request's row from
    its own. A greedy row's uniform is harmless: against a one-hot p, u < p(x) iff x is the
    argmax for any u in [0, 1)."""
    uniforms = torch.rand(num_reqs, k, device=device, generator=batch.generator)
    for r, g in batch.seeded:
        uniforms[r] = torch.rand(k, device=device, generator=g)
    return uniforms


def rejection_sample_on_device(
    logits: torch.Tensor,  # [R, k+1, V] fp32 target logits (rows past 1 + d_r: anything)
    draft_ids: torch.Tensor,  # [R, k] int64
    num_drafts: torch.Tensor,  # [R] int64
    batch: SamplingBatch,
    conditional_rates: torch.Tensor | None = None,  # [≥ k]: synthetic mode
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts → (accepted drafts [R] int64, the token emitted after
    them [R] int64), left on the device."""
    num_reqs, k = draft_ids.shape
    # min_tokens: the target rows whose token would be an output below min_tokens give the
    # stop ids no mass, so a draft that is one is rejected (p = 0) and no emitted token is
    # one; greedy MTP emits what greedy without drafts does. The drafts are not masked: the
    # draft chain runs inside the decode graph, where masking would need each request's
    # stop ids and output index in static buffers, and all it would win is the acceptance of
    # the drafts after a stop-id draft, in the few steps before min_tokens where the model
    # wants to end. Synthetic acceptance ignores the target's verdict but keeps this one: a
    # stop-id draft below min_tokens ends the accepted run, and the token after it is drawn
    # from the masked target row, so a request never ends before min_tokens in either mode.
    logits = mask_stop_ids(logits, batch)
    masked_drafts = None if conditional_rates is None else masked_stop_ids(draft_ids, batch)
    if not batch.any_sampled:
        return _greedy_verify(logits, draft_ids, num_drafts, batch, conditional_rates,
                              masked_drafts)
    probs = sampling_probs(logits, batch)  # [R, k+1, V]
    # 1. one uniform per draft (a greedy row's is harmless: against its one-hot p, u < p(x)
    #    iff x is the argmax)
    uniforms = draft_uniforms(num_reqs, k, batch, logits.device)
    accepted = num_accepted_drafts(probs, draft_ids, num_drafts, uniforms, conditional_rates,
                                   masked_drafts)
    # 2. the token after the accepted run: a sample of the residual or of the bonus row
    final = recovery_probs(probs, draft_ids, num_drafts, accepted,
                           residual=conditional_rates is None)  # [R, V]
    return accepted, sample_probs(final, batch)


def _greedy_verify(
    logits: torch.Tensor,  # [R, k+1, V] fp32, min_tokens' stop ids masked
    draft_ids: torch.Tensor,  # [R, k] int64
    num_drafts: torch.Tensor,  # [R] int64
    batch: SamplingBatch,  # every row greedy
    conditional_rates: torch.Tensor | None,
    masked_drafts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample_on_device when every row is greedy, from the rows' argmaxes alone: p
    is one-hot at each row's argmax, so u < p(x) is x == argmax, and the residual at a
    rejection (x ≠ argmax) and the bonus row are one-hot at the argmax. The same tokens and
    the same draws (synthetic mode's uniforms), without the [R, k+1, V] distributions, their
    residual and the race over them: one pass over the logits instead of about eight."""
    target = logits.argmax(-1)  # [R, k+1]
    if conditional_rates is None:
        accept = draft_ids == target[:, :-1]
    else:
        uniforms = draft_uniforms(*draft_ids.shape, batch, logits.device)
        accept = synthetic_accepts(uniforms, conditional_rates, masked_drafts)
    accepted = leading_run(accept, num_drafts)  # [R]
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def emitted_tokens(draft_ids: torch.Tensor, accepted: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """draft_ids [R, k], accepted [R], tokens [R] → [R, k+1] the tokens each request emits
    (its accepted drafts, then the token after them), 0 past them."""
    k = draft_ids.shape[1]
    col = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, k+1]
    drafts = torch.cat((draft_ids.clamp(min=0), draft_ids.new_zeros(draft_ids.shape[0], 1)), 1)
    out = torch.where(col < accepted[:, None], drafts, 0)
    return torch.where(col == accepted[:, None], tokens[:, None], out)


def rejection_sample(
    logits: torch.Tensor,  # [R, k+1, V] fp32 target logits (rows past 1 + d_r: anything)
    draft_ids: torch.Tensor,  # [R, k] int64
    num_drafts: torch.Tensor,  # [R] int64
    params: list[SamplingParams],
    generators: Sequence[torch.Generator | None],
    conditional_rates: torch.Tensor | None = None,  # [≥ k]: synthetic mode
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Verify every request's drafts: per request, its accepted drafts and one more token.
    generators[r]: request r's own (used where it has a seed); `generator`: the other rows'
    (None: torch's default)."""
    batch = SamplingBatch.of(params, generators, logits.device, generator)
    accepted, tokens = rejection_sample_on_device(logits, draft_ids, num_drafts, batch,
                                                  conditional_rates)
    accepted_l, tokens_l, drafts_l = accepted.tolist(), tokens.tolist(), draft_ids.tolist()
    return [drafts_l[r][: accepted_l[r]] + [tokens_l[r]] for r in range(draft_ids.shape[0])]
