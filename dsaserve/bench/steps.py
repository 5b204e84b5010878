"""Scheduler outputs that drive a `ModelRunner` directly, for benchmarks and tests that time or
count one step: a prefill of fresh requests, and a decode step that can be repeated.

The KV pages hold whatever the runner's caches hold (zeros, or earlier steps' rows): a step's
cost does not depend on their values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsaserve.core import NewRequestData, SamplingParams, SchedulerOutput

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
# The decode benchmarks' MTP3 (--speculative-config): synthetic acceptance at issue #28's
# mean acceptance length, vLLM's semantics
MTP3_SYNTHETIC = ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": '
                  '"synthetic", "synthetic_acceptance_length": 2.99}')


def blocks_per_request(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def prefill(prompt_len: int, vocab: int, block_size: int, tag: str, seed: int = 0,
            batch: int = 1, finished: tuple[str, ...] = ()) -> SchedulerOutput:
    """`batch` new requests of `prompt_len` random tokens, each prefilled whole in this step,
    in blocks [r·n, (r + 1)·n) (n = blocks of a prompt and its next token); their ids are
    f"{tag}-{r}". `finished` ends earlier requests first, so the same blocks serve again."""
    per_request = blocks_per_request(prompt_len + 1, block_size)
    g = torch.Generator().manual_seed(seed)
    new = tuple(NewRequestData(
        f"{tag}-{r}", tuple(torch.randint(4, vocab, (prompt_len,), generator=g).tolist()),
        GREEDY, tuple(range(r * per_request, (r + 1) * per_request)), 0) for r in range(batch))
    return SchedulerOutput(new, (), {req.request_id: prompt_len for req in new}, finished)


def decode(context: int, batch: int, vocab: int, block_size: int, drafts: int = 0,
           params: Sequence[SamplingParams] = (GREEDY,)
           ) -> tuple[SchedulerOutput, SchedulerOutput]:
    """(the step that hands the runner its requests, the step repeated after it): every
    request has `context` tokens computed, one known token left and `drafts` to verify.
    Request r samples with params[r % len(params)]."""
    per_request = blocks_per_request(context + 2 * drafts + 2, block_size)
    g = torch.Generator().manual_seed(0)
    new, sched, spec = [], {}, {}
    for r in range(batch):
        tokens = tuple(torch.randint(4, vocab, (context + 1,), generator=g).tolist())
        blocks = tuple(range(r * per_request, (r + 1) * per_request))
        new.append(NewRequestData(f"r{r}", tokens, params[r % len(params)], blocks, context))
        sched[f"r{r}"] = 1 + drafts
        if drafts:
            spec[f"r{r}"] = tuple(torch.randint(4, vocab, (drafts,), generator=g).tolist())
    first = SchedulerOutput(tuple(new), (), sched, (), spec)
    return first, SchedulerOutput((), (), sched, (), spec)
