"""P/D in one process: a prefill engine and a decode engine driven by hand, the two steps the
proxy makes over HTTP (tests, benchmarks). Either engine may be multi-rank or data-parallel."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dsaserve.core import KVTransferParams, RequestError, SamplingParams

if TYPE_CHECKING:
    from dsaserve.engine.dp import DataParallelEngine
    from dsaserve.engine.engine import LLMEngine

    Engine = LLMEngine | DataParallelEngine


def prefill(engine: Engine, request_id: str, prompt: Sequence[int]) -> KVTransferParams:
    """Step 1: prefill `prompt` for one token on the producer; the params the decode side needs.
    Its blocks stay held until a consumer has read them (or the timeout)."""
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, once,
                       kv_transfer_params=KVTransferParams(do_remote_decode=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                if out.kv_transfer_params is None:
                    raise RequestError(f"request {request_id!r}: the prefill ended without "
                                       f"kv_transfer_params ({out.error or out.finish_reason})")
                return out.kv_transfer_params


def decode(prefill_engine: Engine, decode_engine: Engine, request_id: str,
           prompt: Sequence[int], params: KVTransferParams, sampling: SamplingParams,
           drain_timeout_s: float = 30.0) -> list[int]:
    """Step 2: the same prompt on the consumer with the producer's params; its output tokens.
    The producer keeps stepping meanwhile (it learns that its blocks were read), and afterwards
    until it holds nothing (or `drain_timeout_s`)."""
    decode_engine.add_request(request_id, prompt, sampling, kv_transfer_params=params)
    tokens: list[int] = []
    while decode_engine.has_unfinished_requests():
        for out in decode_engine.step():
            if out.error is not None:
                raise RequestError(f"request {request_id!r}: {out.error}")
            tokens += out.new_token_ids
        if prefill_engine.has_unfinished_requests():
            prefill_engine.step()
    deadline = time.monotonic() + drain_timeout_s
    while prefill_engine.has_unfinished_requests() and time.monotonic() < deadline:
        prefill_engine.step()
    return tokens


def generate(prefill_engine: Engine, decode_engine: Engine,
             prompts: Sequence[Sequence[int]], sampling: SamplingParams,
             tag: str = "pd") -> list[list[int]]:
    """Each prompt through both steps, one at a time; the output tokens of each."""
    outs = []
    for i, prompt in enumerate(prompts):
        params = prefill(prefill_engine, f"{tag}-{i}", prompt)
        outs.append(decode(prefill_engine, decode_engine, f"{tag}-{i}", prompt, params,
                           sampling))
    return outs


def generate_together(prefill_engine: Engine, decode_engine: Engine,
                      prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                      tag: str = "pd", after_step: Callable[[], None] | None = None,
                      ) -> list[list[int]]:
    """Every prompt prefilled first (the producer holds them all), then all decoded together on
    the consumer, the producer stepping beside it; `after_step` runs after every step of the
    pair (e.g. both engines' invariants). The output tokens of each."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    params = [prefill(prefill_engine, rid, prompt) for rid, prompt in zip(ids, prompts,
                                                                            strict=True)]
    for rid, prompt, kp in zip(ids, prompts, params, strict=True):
        decode_engine.add_request(rid, prompt, sampling, kv_transfer_params=kp)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while decode_engine.has_unfinished_requests() or prefill_engine.has_unfinished_requests():
        for out in decode_engine.step():
            if out.error is not None:
                raise RequestError(f"request {out.request_id!r}: {out.error}")
            tokens[out.request_id] += out.new_token_ids
        if prefill_engine.has_unfinished_requests():
            prefill_engine.step()
        if after_step is not None:
            after_step()
    return [tokens[rid] for rid in ids]
