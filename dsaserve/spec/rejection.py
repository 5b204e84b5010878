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
is not faithful.

The maths is in pure batched functions over [R, k(+1), V] tensors (no loop over tokens);
`rejection_sample` composes them with each request's own generator, so seeded requests are
reproducible whatever the batch.
"""

from __future__ import annotations

import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import filter_top_k_top_p


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, S, V] fp32 → the distributions the target samples from [R, S, V]: temperature,
    top-k and top-p applied per request; a greedy request's rows are one-hot at the argmax."""
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
) -> torch.Tensor:
    """Leading drafts accepted per request [R] int64 (0..d_r)."""
    k = draft_ids.shape[1]
    if conditional_rates is None:
        p_draft = probs[:, :k].gather(-1, draft_ids.clamp(min=0)[..., None])[..., 0]  # [R, k]
        accept = uniforms < p_draft
    else:
        # the target's verdict is ignored; a step may verify fewer than k drafts
        accept = uniforms < conditional_rates[None, :k]
    positions = torch.arange(k, device=draft_ids.device)[None, :]  # [1, k]
    accept &= positions < num_drafts[:, None]
    return accept.long().cumprod(-1).sum(-1)  # length of the leading run of accepts


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


def rejection_sample_on_device(
    logits: torch.Tensor,  # [R, k+1, V] fp32 target logits (rows past 1 + d_r: anything)
    draft_ids: torch.Tensor,  # [R, k] int64
    num_drafts: torch.Tensor,  # [R] int64
    params: list[SamplingParams],
    generators: list[torch.Generator],
    conditional_rates: torch.Tensor | None = None,  # [≥ k]: synthetic mode
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts → (accepted drafts [R] int64, the token emitted after
    them [R] int64), left on the device."""
    num_reqs, k = draft_ids.shape
    probs = target_probs(logits, params)  # [R, k+1, V]
    # 1. one uniform per draft from the request's generator (greedy requests draw nothing:
    #    u = 0 accepts exactly when p(x) = 1, i.e. x is the argmax)
    uniforms = torch.zeros(num_reqs, k, device=logits.device)
    for r, p in enumerate(params):
        if not p.greedy or conditional_rates is not None:
            uniforms[r] = torch.rand(k, generator=generators[r], device=logits.device)
    accepted = num_accepted_drafts(probs, draft_ids, num_drafts, uniforms, conditional_rates)
    # 2. the token after the accepted run, sampled with the request's generator
    final = recovery_probs(probs, draft_ids, num_drafts, accepted,
                           residual=conditional_rates is None)  # [R, V]
    tokens = final.argmax(-1)  # [R]; greedy requests keep this
    for r, p in enumerate(params):
        if not p.greedy:
            tokens[r] = torch.multinomial(final[r], 1, generator=generators[r])[0]
    return accepted, tokens


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
    generators: list[torch.Generator],
    conditional_rates: torch.Tensor | None = None,  # [≥ k]: synthetic mode
) -> list[list[int]]:
    """Verify every request's drafts: per request, its accepted drafts and one more token."""
    accepted, tokens = rejection_sample_on_device(logits, draft_ids, num_drafts, params,
                                                  generators, conditional_rates)
    accepted_l, tokens_l, drafts_l = accepted.tolist(), tokens.tolist(), draft_ids.tolist()
    return [drafts_l[r][: accepted_l[r]] + [tokens_l[r]] for r in range(draft_ids.shape[0])]
