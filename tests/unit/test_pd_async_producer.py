"""--async-scheduling on a P/D producer (engine/async_scheduler.py), two single-rank engines in
one process (shared memory): a prompt's blocks are held once its last step's token is read,
with the same kv_transfer_params as sync scheduling returns (the same blocks, the prompts
chunked and several in flight together, prefix hits among them, plain and MTP3), and the
consumer's greedy output through them equals the aggregated engine's; a producer's request
with its token in flight is not preempted (sync scheduling would already hold its blocks);
an abort while the prompt's step is in flight holds nothing and frees every block. Both
engines' invariants are checked after every step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest

from dsaserve.config import DisaggConfig, SpecConfig
from dsaserve.core import KVTransferParams, SamplingParams
from dsaserve.engine.engine import LLMEngine

SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ONCE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MAX_STEPS = 500  # a bound on every stepping loop: a bug fails the test rather than hangs it


def _pd(config, role: str, *, asynchronous: bool = False):
    return dataclasses.replace(
        config, disagg=DisaggConfig(kv_role=role, backend="shm", side_channel_port=0),
        scheduler=dataclasses.replace(config.scheduler, async_scheduling=asynchronous))


def _where(params: KVTransferParams) -> KVTransferParams:
    """The params without what names the engine instance (its id and side-channel port)."""
    return dataclasses.replace(params, remote_engine_id=None, remote_port=None)


def _prefill_together(p: LLMEngine, prompts: Sequence[list[int]], tag: str = "pd",
                      ) -> dict[str, KVTransferParams]:
    """Every prompt added at once to the producer, stepped until each ended → its params."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        p.add_request(rid, prompt, ONCE,
                      kv_transfer_params=KVTransferParams(do_remote_decode=True))
    params: dict[str, KVTransferParams] = {}
    for _ in range(MAX_STEPS):
        for out in p.step():
            if out.finished:
                assert out.kv_transfer_params is not None, out
                assert out.request_id in p.scheduler.connector.held
                params[out.request_id] = out.kv_transfer_params
        p.check_integrity()
        if len(params) == len(ids):
            return {rid: params[rid] for rid in ids}
    raise AssertionError("the producer stopped making progress")


def _decode_all(p: LLMEngine, d: LLMEngine, prompts: Sequence[list[int]],
                params: dict[str, KVTransferParams]) -> list[list[int]]:
    """Every held prompt decoded together on the consumer, the producer stepping beside it
    until it holds nothing; both engines' invariants after every step, no block left."""
    for (rid, kp), prompt in zip(params.items(), prompts, strict=True):
        d.add_request(rid, prompt, SAMPLING, kv_transfer_params=kp)
    tokens: dict[str, list[int]] = {rid: [] for rid in params}
    for _ in range(MAX_STEPS):
        if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
            break
        for out in d.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
        if p.has_unfinished_requests():
            p.step()
        p.check_integrity()
        d.check_integrity()
    else:
        raise AssertionError("the engines stopped making progress")
    for e in (p, d):
        s = e.stats()
        assert s.num_free_blocks == s.num_total_blocks, "a KV block leaked"
    return list(tokens.values())


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "mtp3"])
def test_async_producer_holds_what_sync_holds(engine_config, draftable_dirs, mixed_prompts, k):
    """Prompts of 21-87 tokens in chunks of at most 24, all in flight together (the second
    round from prefix hits): the async producer returns the sync producer's params for every
    request, and the consumer's output through them equals the aggregated engine's."""
    config = engine_config(draftable_dirs["tiny-glm5"], max_num_batched_tokens=24)
    if k:
        config = dataclasses.replace(config, speculative=SpecConfig(num_speculative_tokens=k))
    prompts = mixed_prompts()
    reference = LLMEngine.from_config(config).generate(prompts, SAMPLING)
    held: dict[bool, list[dict[str, KVTransferParams]]] = {}
    for asynchronous in (False, True):
        p = LLMEngine.from_config(_pd(config, "kv_producer", asynchronous=asynchronous))
        d = LLMEngine.from_config(_pd(config, "kv_consumer", asynchronous=asynchronous))
        try:
            held[asynchronous] = []
            for round_ in range(2):
                params = _prefill_together(p, prompts, tag=f"r{round_}")
                held[asynchronous].append(params)
                assert _decode_all(p, d, prompts, params) == reference
            assert p.stats().prefix_cache_hits > 0
        finally:
            p.shutdown()
            d.shutdown()
    for sync_round, async_round in zip(held[False], held[True], strict=True):
        assert {r: _where(x) for r, x in async_round.items()} == {
            r: _where(x) for r, x in sync_round.items()}


def _stepper(p: LLMEngine, request_id: str, sink: list[int]) -> Callable[[], list]:
    """A step of `p` that adds `request_id`'s new tokens to `sink`, then checks invariants."""
    def step() -> list:
        outs = p.step()
        sink.extend(t for o in outs if o.request_id == request_id for t in o.new_token_ids)
        p.check_integrity()
        return outs
    return step


def test_async_producer_keeps_a_request_with_its_token_in_flight(engine_config, model_dirs):
    """Blocks run out while a producer's prompt has its token in flight: an older request
    decoding on the same engine needs a block, and the prompt (the newest) is not the victim
    (sync scheduling holds its blocks by then); the older one is preempted instead, as in
    sync, and recomputed once the consumer read the prompt. Params equal sync's, outputs the
    aggregated engine's."""
    import torch

    config = engine_config(model_dirs["tiny-glm5"], num_blocks=8, max_num_batched_tokens=64,
                           max_model_len=128)
    g = torch.Generator().manual_seed(3)
    older, prompt = (torch.randint(4, 512, (n,), generator=g).tolist() for n in (60, 40))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    aggregated = LLMEngine.from_config(config)
    want_older = aggregated.generate([older], long)[0]
    want = aggregated.generate([prompt], SAMPLING)
    held = {}
    for asynchronous in (False, True):
        p = LLMEngine.from_config(_pd(config, "kv_producer", asynchronous=asynchronous))
        d = LLMEngine.from_config(_pd(config, "kv_consumer", asynchronous=asynchronous))
        try:
            p.add_request("older", older, long)
            got_older: list[int] = []
            step_producer = _stepper(p, "older", got_older)

            # "older" holds 5 of the 8 blocks; the prompt takes the other 3 in the step that
            # computes position 79, and position 80 needs a 6th block in the next step
            while p.scheduler.requests["older"].num_computed_tokens < 79:
                step_producer()
            assert p.scheduler.requests["older"].num_computed_tokens == 79
            p.add_request("pd", prompt, ONCE,
                          kv_transfer_params=KVTransferParams(do_remote_decode=True))
            for _ in range(MAX_STEPS):
                done = [o for o in step_producer() if o.request_id == "pd" and o.finished]
                if done:
                    held[asynchronous] = done[0].kv_transfer_params
                    break
            step_producer()  # (sync: the step after the prompt ended needs the 6th block)
            assert p.scheduler.requests["older"].num_preemptions == 1
            assert len(held[asynchronous].remote_block_ids) == 3
            d.add_request("pd", prompt, SAMPLING, kv_transfer_params=held[asynchronous])
            got: list[int] = []
            for _ in range(MAX_STEPS):
                if not (d.has_unfinished_requests() or p.has_unfinished_requests()):
                    break
                got += [t for o in d.step() for t in o.new_token_ids]
                step_producer()
                d.check_integrity()
            assert [got] == want and got_older == want_older
            for e in (p, d):
                s = e.stats()
                assert s.num_free_blocks == s.num_total_blocks, "a KV block leaked"
        finally:
            p.shutdown()
            d.shutdown()
    assert _where(held[True]) == _where(held[False])


def test_async_producer_abort_in_flight_holds_nothing(engine_config, model_dirs, mixed_prompts):
    """A prompt aborted while its last step is in flight: "abort", no params, nothing held,
    every block free; a prompt prefilled beside it is held and decodes as aggregated."""
    config = engine_config(model_dirs["tiny-glm5"], max_num_batched_tokens=24)
    prompts = mixed_prompts()[:2]
    reference = LLMEngine.from_config(config).generate(prompts[1:], SAMPLING)
    p = LLMEngine.from_config(_pd(config, "kv_producer", asynchronous=True))
    d = LLMEngine.from_config(_pd(config, "kv_consumer", asynchronous=True))
    try:
        for rid, prompt in (("gone", prompts[0]), ("kept", prompts[1])):
            p.add_request(rid, prompt, ONCE,
                          kv_transfer_params=KVTransferParams(do_remote_decode=True))
        outs = []
        # "gone" (43 tokens) ends in its second chunk: abort once that step is launched
        while p.scheduler.requests["gone"].num_output_placeholders == 0:
            outs += p.step()
            p.check_integrity()
        p.abort_request("gone")
        params = {}
        for _ in range(MAX_STEPS):
            for out in p.step():
                outs.append(out)
                if out.kv_transfer_params is not None:
                    params[out.request_id] = out.kv_transfer_params
            p.check_integrity()
            if "kept" in params:
                break
        gone = [o for o in outs if o.request_id == "gone"]
        assert [(o.finish_reason, o.kv_transfer_params) for o in gone if o.finished] == [
            ("abort", None)]
        assert list(p.scheduler.connector.held) == ["kept"]
        assert _decode_all(p, d, prompts[1:], params) == reference
    finally:
        p.shutdown()
        d.shutdown()
