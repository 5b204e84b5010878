"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds — batched over requests.

A step's sampling parameters are [R] device tensors (`SamplingBatch`; the runner keeps them on
the device across steps, engine/sampling_table.py), so a step dispatches the same ops whatever
its batch and its mix of greedy and sampling requests (vLLM's sampler, in our own words):

    logits [R, V] ─ / temperature (greedy rows: / 1) ─ top-k, top-p per row ─ softmax → p [R, V]
    token = argmax_v p[r, v] / E[r, v],   E ~ Exp(1)      (greedy rows: argmax of the logits)

The exponential race picks v with probability p[r, v] (the minimum of independent Exp(p_v)
clocks E_v / p_v is the v-th with probability p_v / Σp), so it is multinomial in distribution
with one batched draw. A request with a seed draws its own row of E from its own generator:
its samples are reproducible whatever the batch. Every other row draws from the step's
generator, which the runner seeds identically on every rank of a replica.

min_tokens (vLLM's MinTokensLogitsProcessor): while a request's output is shorter than its
min_tokens, its stop ids (EOS unless ignore_eos, and stop_token_ids) are set to −inf in the
logits of the rows it samples from, so no row samples them; a row knows which output it samples
from the device (`SamplingBatch.min_tokens_left`), never from a host count that lags behind
the steps in flight. The log-probabilities stay those of the raw logits (vLLM's raw_logprobs).

`filter_top_k_top_p`, `sample_reference` and `mask_stop_ids_reference` are the per-request
reference the batched path is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.core import SamplingParams
from dsaserve.kernels.registry import use_kernels


def make_generator(
    params: SamplingParams, device: torch.device, fallback_seed: int
) -> torch.Generator:
    """A request's own generator: a given seed makes its samples reproducible whatever the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def row_values(params: SamplingParams) -> tuple[float, int, float]:
    """A request's row of a SamplingBatch: (temperature, 0 = greedy; top_k, 0 = off; top_p,
    1 = off). A greedy request is temperature 0 whatever its other values. A top_k past
    any vocabulary filters nothing: it is off too (the sampling table's int32 cannot hold
    every client's number)."""
    if params.greedy:
        return 0.0, 0, 1.0
    return params.temperature, params.top_k if 0 < params.top_k < 2**31 else 0, params.top_p


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling parameters, a row per sampling request, on the device. The flags
    are host-known bounds (True when some row may use the feature: the step then dispatches
    it for every row; False: no row does and the ops are skipped). Without any_sampled every
    row is greedy and the parameter rows are not read (None)."""

    temperature: torch.Tensor | None  # [R] fp32; 0: greedy
    top_k: torch.Tensor | None  # [R] int64; 0: off
    top_p: torch.Tensor | None  # [R] fp32; 1: off
    any_sampled: bool  # some row is not greedy (False: argmax only, no draws)
    any_top_k: bool
    any_top_p: bool
    seeded: tuple[tuple[int, torch.Generator], ...]  # (row, its request's generator)
    generator: torch.Generator | None  # every other row's draws (None: torch's default)
    # min_tokens: both None unless some live request still masks its stop ids (host-known)
    stop_ids: torch.Tensor | None = None  # [R, S] int64, −1 padding: ids kept from sampling
    # [R] int64: min_tokens − the output index of the row's token (a verifying request's
    # first row; its row j samples index + j): rows j < min_tokens_left[r] mask (≤ 0: none)
    min_tokens_left: torch.Tensor | None = None

    @staticmethod
    def of(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           device: torch.device, generator: torch.Generator | None = None, *,
           num_output_tokens: Sequence[int] | None = None, eos_token_ids: tuple[int, ...] = (),
           vocab_size: int = 2**31 - 1) -> SamplingBatch:
        """From per-request params (a loop over requests: for tests and one-off callers; the
        runner's rows stay on the device). generators[r] is used only where params[r] has a
        seed. With `num_output_tokens` (request r's outputs before its row's token) the
        requests' min_tokens masks too, `eos_token_ids` being every request's EOS ids."""
        rows = [row_values(p) for p in params]
        temperature, top_k, top_p = zip(*rows, strict=True) if rows else ((), (), ())
        stop_ids = left = None
        if num_output_tokens is not None:
            stops = [p.min_tokens_stop_ids(eos_token_ids, vocab_size) for p in params]
            if any(stops):
                width = max(map(len, stops))
                stop_ids = torch.tensor([list(ids) + [-1] * (width - len(ids)) for ids in stops],
                                        dtype=torch.int64, device=device)
                left = torch.tensor([p.min_tokens - n for p, n in zip(
                    params, num_output_tokens, strict=True)], dtype=torch.int64, device=device)
        return SamplingBatch(
            torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
            any_sampled=any(t > 0 for t in temperature),
            any_top_k=any(k > 0 for k in top_k), any_top_p=any(p < 1 for p in top_p),
            seeded=tuple((r, generators[r]) for r, p in enumerate(params)
                         if p.seed is not None and not p.greedy),
            generator=generator, stop_ids=stop_ids, min_tokens_left=left)


def _per_row(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[R] → [R, 1, ...] broadcasting against `like` [R, ..., V]."""
    return x.view(-1, *([1] * (like.dim() - 1)))


def mask_stop_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [R, V] (row r: request r's next token) or [R, J, V] (row j: the token j after
    it) → logits with request r's stop ids at −inf in its rows j < min_tokens_left[r], the
    rows whose token would be an output below min_tokens; unchanged without stop_ids."""
    if batch.stop_ids is None:
        return logits
    assert batch.min_tokens_left is not None
    rows = logits.reshape(logits.shape[0], -1, logits.shape[-1])  # [R, J, V]
    j = torch.arange(rows.shape[1], device=logits.device)  # [J]
    below = j[None, :] < batch.min_tokens_left[:, None]  # [R, J]
    ids = batch.stop_ids[:, None, :].expand(-1, rows.shape[1], -1)  # [R, J, S]
    # −inf added at each masked (row, id), 0 elsewhere: a padding entry (−1) adds 0 to id 0,
    # and sums of 0s and −inf are the same in whatever order duplicates land (no race)
    add = torch.where(below[..., None] & (ids >= 0), float("-inf"), 0.0).to(logits.dtype)
    return rows.scatter_add(-1, ids.clamp(min=0), add).view(logits.shape)


def masked_stop_ids(ids: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """ids [R, J] (request r's token j after its last; −1: padding) → [R, J] bool: the tokens
    `mask_stop_ids` gives no mass, request r's stop ids at j < min_tokens_left[r]; None
    without stop_ids."""
    if batch.stop_ids is None:
        return None
    assert batch.min_tokens_left is not None
    j = torch.arange(ids.shape[1], device=ids.device)  # [J]
    below = j[None, :] < batch.min_tokens_left[:, None]  # [R, J]
    stops = batch.stop_ids[:, None, :]  # [R, 1, S]
    hit = ((ids[..., None] == stops) & (stops >= 0)).any(-1)  # [R, J]
    return below & hit


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                any_top_k: bool = True, any_top_p: bool = True) -> torch.Tensor:
    """logits [R, ..., V], top_k [R] (0: off), top_p [R] (1: off) → logits with everything
    outside each row's top-k / top-p nucleus set to −inf (ties at the k-th value kept, the
    nucleus taken after top-k, as in `filter_top_k_top_p`). One sort for both filters."""
    if not (any_top_k or any_top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, ..., V]
    if any_top_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [R]
        k = _per_row(k, logits).expand(*logits.shape[:-1], 1)  # [R, ..., 1]
        kth = sorted_logits.gather(-1, k - 1)  # [R, ..., 1] the k-th largest value
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if any_top_p:
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always
        # stays); rows with top_p = 1 keep every token (no rounding of the sum may drop one).
        p = _per_row(top_p, logits)
        drop_sorted = ((probs.cumsum(-1) - probs) >= p) & (p < 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [R, ..., V] → the distributions rows sample from [R, ..., V]: temperature, top-k
    and top-p applied per row; a greedy row's distributions are one-hot at the argmax."""
    onehot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, True), 1.0)
    if not batch.any_sampled:
        return onehot
    greedy = _per_row(batch.temperature == 0, logits)  # [R, 1, ...]
    # greedy rows divide by 1, never by their zero temperature
    scaled = logits / torch.where(greedy, 1.0, _per_row(batch.temperature, logits))
    probs = filter_rows(scaled, batch.top_k, batch.top_p, batch.any_top_k,
                        batch.any_top_p).softmax(-1)
    return torch.where(greedy, onehot, probs)


def exponential_noise(shape: tuple[int, int], batch: SamplingBatch,
                      device: torch.device) -> torch.Tensor:
    """E ~ Exp(1) [R, V]: one draw from the step's generator, then each seeded row redrawn from
    its request's generator (two ops per seeded request)."""
    noise = torch.empty(shape, device=device).exponential_(generator=batch.generator)
    for r, g in batch.seeded:
        noise[r].exponential_(generator=g)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [R, V], noise [R, V] Exp(1) → [R] int64: argmax p / E, a sample of each row.
    E = 0 (possible in fp32) is clamped so that no p = 0 token reads 0 / 0."""
    return (probs / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(-1)


def sample_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """probs [R, V] (greedy rows one-hot) → one token per row [R] int64 on the device."""
    if not batch.any_sampled:
        return probs.argmax(-1)
    return race(probs, exponential_noise(tuple(probs.shape), batch, probs.device))


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [..., V] fp32, tokens [...] int64 → log_softmax(logits)[token] [...] fp32. On
    the GPU the tokens' logits minus each row's log-sum-exp, read once
    (kernels/triton/logsumexp.py): no [..., V] log-probabilities written; elsewhere
    log_softmax, then the gather."""
    if not use_kernels(logits):
        return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    from dsaserve.kernels.triton import logsumexp

    lse = logsumexp.row_logsumexp(logits.reshape(-1, logits.shape[-1]))  # [rows]
    return logits.gather(-1, tokens[..., None])[..., 0] - lse.view(tokens.shape)


def sample_on_device(
    logits: torch.Tensor,  # [R, V] fp32
    batch: SamplingBatch,
    logprobs: torch.Tensor | None = None,  # [R, V] fp32: logits.log_softmax(-1), if computed
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row [R] int64 and its log-probability under the unfiltered distribution
    [R] fp32, both left on the device (the step copies its results to the host once). A caller
    that also needs the rows' top-k passes their `logprobs`: one log_softmax serves both;
    else the chosen tokens' are computed alone (chosen_logprobs)."""
    raw = logits
    logits = mask_stop_ids(logits, batch)  # min_tokens: after the raw log-probabilities
    if batch.any_sampled:
        tokens = sample_probs(sampling_probs(logits, batch), batch)  # [R]
    else:
        tokens = logits.argmax(-1)
    if logprobs is None:
        return tokens, chosen_logprobs(raw, tokens)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def top_logprobs(logprobs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs [R, V] (the raw distribution's log_softmax, the one the chosen tokens' values
    were gathered from) → the `width` most likely tokens of each row: ids [R, W] int64 and
    log-probabilities [R, W] fp32, most likely first (W = min(width, V)). A step pays it only
    when some live request asked (SamplingParams.logprobs)."""
    values, ids = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
    return ids, values


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """sample_on_device from per-request params, read back: one token per row and its
    log-probability. generators[r]: request r's own (used where it has a seed); `generator`:
    the other rows' (None: torch's default)."""
    batch = SamplingBatch.of(params, generators, logits.device, generator)
    tokens, chosen = sample_on_device(logits, batch)
    return tokens.tolist(), chosen.tolist()


# ---- the per-request reference (the sampler before it was batched) --------------------------

def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [..., V] → logits with everything outside top-k / the top-p nucleus of each row set
    to −inf (one request's values)."""
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


def mask_stop_ids_reference(logits: torch.Tensor, params: list[SamplingParams],
                            eos_token_ids: tuple[int, ...],
                            num_output_tokens: Sequence[int]) -> torch.Tensor:
    """logits [R, J, V] → logits with request r's min_tokens stop ids at −inf in its row j
    whenever num_output_tokens[r] + j < min_tokens (vLLM's MinTokensLogitsProcessor), a loop
    over requests and rows."""
    out = logits.clone()
    for r, p in enumerate(params):
        ids = list(p.min_tokens_stop_ids(eos_token_ids, logits.shape[-1]))
        for j in range(logits.shape[1]):
            if ids and num_output_tokens[r] + j < p.min_tokens:
                out[r, j, ids] = float("-inf")
    return out


def sample_reference(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """One token per row [R] int64, a loop over requests: argmax for greedy ones, else a
    multinomial draw from the request's filtered distribution with its own generator."""
    tokens = logits.argmax(-1)
    for r, p in enumerate(params):
        if not p.greedy:
            row = filter_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p)
            tokens[r] = torch.multinomial(row.softmax(-1), 1, generator=generators[r])[0]
    return tokens
