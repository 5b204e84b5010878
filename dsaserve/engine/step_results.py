"""A step's results stay on the device until one copy brings them all to the host.

Sampling, verification and drafting each leave tensors on the device; the host needs them only to
report tokens to the scheduler. `read_back` packs them into one fp64 vector (token ids < 2^53 and
fp32 log-probabilities are exact in fp64) and copies it once: the step's single host sync.

    packed = | plain tokens M | plain logprobs M | accepted V | emitted V·(k+1) |
             | emitted logprobs V·(k+1) | drafts D·k |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSamples:
    """What the step sampled, per sampling request, on the device."""

    plain: list[int]  # [M] batch index of each request sampled without drafts
    plain_tokens: torch.Tensor  # [M] int64
    plain_logprobs: torch.Tensor  # [M] fp32
    verify: list[int]  # [V] batch index of each request that verified drafts
    accepted: torch.Tensor  # [V] int64: drafts accepted
    emitted: torch.Tensor  # [V, k+1] int64: accepted drafts, then one more token, 0 after
    emitted_logprobs: torch.Tensor  # [V, k+1] fp32


@dataclass(frozen=True)
class HostSamples:
    """The same, on the host: per batch index, the tokens emitted and their log-probabilities;
    per drafting request (in `DraftInputs.request_ids` order), its drafts."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    drafts: list[list[int]]


def read_back(samples: DeviceSamples, drafts: torch.Tensor | None) -> HostSamples:
    """One device → host copy of everything the step produced (none when it sampled nothing)."""
    parts = [samples.plain_tokens, samples.plain_logprobs, samples.accepted,
             samples.emitted.flatten(), samples.emitted_logprobs.flatten()]
    if drafts is not None:
        parts.append(drafts.flatten())
    if sum(p.numel() for p in parts) == 0:
        return HostSamples({}, {}, [])
    flat = torch.cat([p.to(torch.float64) for p in parts]).cpu().tolist()  # the one sync
    m, v = len(samples.plain), len(samples.verify)
    width = samples.emitted.shape[1] if v else 0
    at = 0

    def take(n: int) -> list[float]:
        nonlocal at
        at += n
        return flat[at - n : at]

    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    plain_tokens, plain_lps = take(m), take(m)
    for i, r in enumerate(samples.plain):
        tokens[r], logprobs[r] = [int(plain_tokens[i])], [plain_lps[i]]
    accepted, emitted, emitted_lps = take(v), take(v * width), take(v * width)
    for i, r in enumerate(samples.verify):
        n = int(accepted[i]) + 1
        tokens[r] = [int(t) for t in emitted[i * width : i * width + n]]
        logprobs[r] = emitted_lps[i * width : i * width + n]
    out_drafts: list[list[int]] = []
    if drafts is not None:
        k = drafts.shape[1]
        rest = take(drafts.numel())
        out_drafts = [[int(t) for t in rest[d * k : (d + 1) * k]] for d in range(drafts.shape[0])]
    return HostSamples(tokens, logprobs, out_drafts)
