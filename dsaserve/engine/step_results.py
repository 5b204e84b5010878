"""A step's results stay on the device until one copy brings them all to the host.

Sampling, verification and drafting each leave tensors on the device; the host needs them only to
report tokens to the scheduler. `read_back` packs them into one fp64 vector (token ids < 2^53 and
fp32 log-probabilities are exact in fp64) and copies it once: the step's single host sync.
With --async-scheduling the copy is non-blocking into pinned memory (`start_read_back`) and
the host waits for it one engine step later, after scheduling and launching the next step.

    packed = | plain tokens M | plain logprobs M | accepted V | emitted V·(k+1) |
             | emitted logprobs V·(k+1) | drafts D·k |
             | top ids (M + V·(k+1))·W | top logprobs (M + V·(k+1))·W |

The last two only when some live request asked for logprobs (W > 0): the W most likely tokens
of every row emitted from, plain rows first, then each verifying request's k + 1 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from dsaserve.core import ModelRunnerOutput, StepGpuTime, StepStats


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
    verified: torch.Tensor | None = None  # [V] int64: drafts each verified (None: V = 0)
    # the W most likely tokens of each row (plain rows, then verifying rows), None: W = 0
    top_ids: torch.Tensor | None = None  # [M + V·(k+1), W] int64
    top_logprobs: torch.Tensor | None = None  # [M + V·(k+1), W] fp32

    @property
    def rejected(self) -> torch.Tensor:
        """[V] int64: verified drafts that were not accepted."""
        if self.verified is None:
            return torch.zeros_like(self.accepted)
        return self.verified - self.accepted


@dataclass(frozen=True)
class HostSamples:
    """The same, on the host: per batch index, the tokens emitted and their log-probabilities;
    per drafting request (in `DraftInputs.request_ids` order), its drafts."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    drafts: list[list[int]]
    # per batch index, per emitted token: the top-W (id, log-probability); empty when W = 0
    top: dict[int, list[tuple[tuple[int, float], ...]]] = field(default_factory=dict)


def read_back(samples: DeviceSamples, drafts: torch.Tensor | None) -> HostSamples:
    """One device → host copy of everything the step produced (none when it sampled nothing)."""
    return start_read_back(samples, drafts, non_blocking=False).wait()


def start_read_back(samples: DeviceSamples, drafts: torch.Tensor | None,
                    *, non_blocking: bool) -> PendingSamples:
    """Start the step's one device → host copy. Blocking: the copy is done on return (the sync
    is here). Non-blocking (--async-scheduling): into pinned memory behind the step's work on
    the stream, with an event; the host waits only in `PendingSamples.wait` (on the CPU the
    copy is done at once, and the read of its values is still where the wait is)."""
    parts = [samples.plain_tokens, samples.plain_logprobs, samples.accepted,
             samples.emitted.flatten(), samples.emitted_logprobs.flatten()]
    if drafts is not None:
        parts.append(drafts.flatten())
    if samples.top_ids is not None:
        parts += [samples.top_ids.flatten(), samples.top_logprobs.flatten()]
    shape = (tuple(drafts.shape) if drafts is not None else None)
    if sum(p.numel() for p in parts) == 0:
        return PendingSamples(samples, shape, None, None)
    flat = torch.cat([p.to(torch.float64) for p in parts])  # [total] on the device
    if not non_blocking:
        return PendingSamples(samples, shape, flat.cpu(), None)  # the one sync
    cuda = flat.device.type == "cuda"
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=cuda)
    host.copy_(flat, non_blocking=True)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
    return PendingSamples(samples, shape, host, ready)


@dataclass(frozen=True)
class PendingSamples:
    """A step's packed results on their way to the host: `host` [total] fp64 is complete once
    `ready` (a CUDA event; None: already complete) has passed."""

    samples: DeviceSamples
    drafts_shape: tuple[int, ...] | None  # [D, k]
    host: torch.Tensor | None  # None: the step sampled nothing
    ready: torch.cuda.Event | None

    def wait(self) -> HostSamples:
        """Wait for the copy and unpack it (the host's one read of the step's data)."""
        if self.host is None:
            return HostSamples({}, {}, [])
        if self.ready is not None:
            self.ready.synchronize()
        return _unpack(self.samples, self.drafts_shape, self.host.tolist())


def _unpack(samples: DeviceSamples, drafts_shape: tuple[int, ...] | None,
            flat: list[float]) -> HostSamples:
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
    if drafts_shape is not None:
        d, k = drafts_shape
        rest = take(d * k)
        out_drafts = [[int(t) for t in rest[i * k : (i + 1) * k]] for i in range(d)]
    top: dict[int, list[tuple[tuple[int, float], ...]]] = {}
    if samples.top_ids is not None:
        num_rows, w = samples.top_ids.shape
        ids, lps = take(num_rows * w), take(num_rows * w)

        def row(i: int) -> tuple[tuple[int, float], ...]:
            return tuple(zip(map(int, ids[i * w : (i + 1) * w]), lps[i * w : (i + 1) * w],
                             strict=True))

        for i, r in enumerate(samples.plain):
            top[r] = [row(i)]
        for i, r in enumerate(samples.verify):
            top[r] = [row(m + i * width + j) for j in range(len(tokens[r]))]
    return HostSamples(tokens, logprobs, out_drafts, top)


class PendingStep(Protocol):
    """A launched step whose ModelRunnerOutput is read later (--async-scheduling): one rank's
    (PendingOutput) or every rank's (engine/executor.py)."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class PendingOutput:
    """A launched step's ModelRunnerOutput: its requests (batch order), the drafting ones, and
    the copy of its samples (None: the step computed nothing)."""

    req_ids: list[str]
    drafting: list[str]
    copy: PendingSamples | None
    # --step-log (engine/step_log.py): passed on in the output
    stats: StepStats | None = None
    gpu_times: tuple[StepGpuTime, ...] = ()

    def result(self) -> ModelRunnerOutput:
        if self.copy is None:
            return ModelRunnerOutput(sampled_token_ids={}, step_stats=self.stats,
                                     gpu_times=self.gpu_times)
        host = self.copy.wait()
        return ModelRunnerOutput(
            sampled_token_ids={rid: host.tokens.get(r, []) for r, rid in enumerate(self.req_ids)},
            logprobs={self.req_ids[r]: lps for r, lps in host.logprobs.items()},
            top_logprobs={self.req_ids[r]: top for r, top in host.top.items()},
            draft_token_ids=dict(zip(self.drafting, host.drafts, strict=True)),
            step_stats=self.stats, gpu_times=self.gpu_times)


@dataclass(frozen=True)
class WithTransfers:
    """A launched step's output with the transfers polled after its launch, known at once:
    P/D READs landed or failed and held blocks read; host-tier copies done."""

    pending: PendingStep
    transfers: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        t = self.transfers
        return replace(self.pending.result(), kv_recvs_done=t.kv_recvs_done,
                       kv_recvs_failed=t.kv_recvs_failed, kv_sends_done=t.kv_sends_done,
                       num_kv_loads_done=t.num_kv_loads_done,
                       num_kv_stores_done=t.num_kv_stores_done)
