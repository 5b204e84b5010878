"""The decode step's host fast paths make what the plain code makes: `RequestOutput.of` and
`CachedRequestData.of` the objects their constructors build, and the scheduler's all-at-once
token append (`Scheduler._none_stops`) the same request state as the per-token stop checks,
over every stop rule at and around its bound."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from dsaserve.config import CacheConfig, SchedulerConfig
from dsaserve.core import (
    CachedRequestData,
    KVTransferParams,
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from dsaserve.engine.scheduler import Scheduler


def _same_object(cls, values: dict) -> None:
    assert set(values) == {f.name for f in dataclasses.fields(cls)}
    fast, plain = cls.of(**values), cls(**values)
    assert type(fast) is cls and fast == plain and hash(fast) == hash(plain)
    assert vars(fast) == vars(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.request_id = "s"


def test_cached_request_data_of_is_the_constructors_object():
    _same_object(CachedRequestData, dict(request_id="r", new_token_ids=(1, 2),
                                         new_block_ids=(5,), num_computed_tokens=9,
                                         num_kept_blocks=None))


def test_request_output_of_is_the_constructors_object():
    values = dict(request_id="r", new_token_ids=(3, 4), finished=True, finish_reason="stop",
                  num_prompt_tokens=7, num_cached_tokens=2, num_output_tokens=9,
                  kv_transfer_params=KVTransferParams(do_remote_decode=True), error="e",
                  logprobs=(TokenLogprob(3, -0.5), TokenLogprob(4, -1.0, ((4, -1.0),))),
                  stop_token_id=4, queued_time=1.0, scheduled_time=None, output_time=3.0)
    _same_object(RequestOutput, values)
    # the scheduler replaces a failed request's output's error
    assert dataclasses.replace(RequestOutput.of(**values), error="x") == dataclasses.replace(
        RequestOutput(**values), error="x")


def _request(params: SamplingParams, num_output: int) -> Request:
    return Request("r", [5] * 6, params, eos_token_ids=(0, 9),
                   output_token_ids=[6] * num_output)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_append_all_at_once_equals_per_token_checks(ignore_eos):
    max_model_len = 14
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=max_model_len),
                      CacheConfig(block_size=4), 16)
    runs = [list(t) for n in (1, 2, 4) for t in itertools.product((1, 0, 9, 3), repeat=n)]
    for max_tokens, min_tokens, num_output, stops, tokens in itertools.product(
            (3, 5, 8), (0, 4), (0, 2, 4), ((), (3,)), runs):
        if min_tokens > max_tokens:
            continue
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                stop_token_ids=stops, ignore_eos=ignore_eos)
        if 6 + num_output >= max_model_len or num_output >= max_tokens:
            continue  # such a request has finished already
        fast, slow = _request(params, num_output), _request(params, num_output)
        assert sched._append_tokens(fast, tokens) == sched._append_each(slow, tokens)
        assert (fast.output_token_ids, fast.status, fast.stop_token_id) == (
            slow.output_token_ids, slow.status, slow.stop_token_id)
