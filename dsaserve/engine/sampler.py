"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from dsaserve.core import SamplingParams


def make_generator(
    params: SamplingParams, device: torch.device, fallback_seed: int
) -> torch.Generator:
    """A request's own generator: a given seed makes its samples reproducible whatever the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [..., V] → logits with everything outside top-k / the top-p nucleus of each row set
    to −inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_on_device(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row [R] int64 and its log-probability under the unfiltered distribution
    [R] fp32, both left on the device (the step copies its results to the host once)."""
    logprobs = logits.log_softmax(-1)  # [R, V]
    tokens = logits.argmax(-1)  # [R]; greedy rows keep this
    for r, p in enumerate(params):  # each request draws from its own generator
        if p.greedy:
            continue
        row = filter_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p)
        tokens[r] = torch.multinomial(row.softmax(-1), 1, generator=generators[r])[0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """sample_on_device, read back: one token per row and its log-probability."""
    tokens, chosen = sample_on_device(logits, params, generators)
    return tokens.tolist(), chosen.tolist()
