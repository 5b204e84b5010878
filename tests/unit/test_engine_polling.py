"""A core loop that only polls transfers waits instead of spinning (`LLMEngine.only_polling`,
`engine.POLL_INTERVAL_S`): a P/D producer holding a prompt's blocks for its reader computes
nothing in its steps, and says so; a computing or idle engine does not. The server's core loop
takes new requests the moment they come during such a wait (`AsyncEngine._receive`)."""

from __future__ import annotations

import dataclasses
import queue
import threading

from dsaserve.config import DisaggConfig
from dsaserve.core import KVTransferParams, SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine

ONCE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_a_producer_holding_blocks_only_polls(model_dirs, engine_config):
    config = engine_config(model_dirs["tiny-glm5"], max_num_batched_tokens=16)
    producer = LLMEngine.from_config(dataclasses.replace(
        config, disagg=DisaggConfig(kv_role="kv_producer", backend="shm", side_channel_port=0)))
    try:
        assert not producer.only_polling  # nothing to do at all
        producer.add_request("a", list(range(4, 44)), ONCE,
                             kv_transfer_params=KVTransferParams(do_remote_decode=True))
        finished = False
        while not finished:  # 40 tokens in chunks of 16: three computing steps
            finished = any(o.finished for o in producer.step())
            assert not producer.only_polling or finished
        producer.step()  # holds the blocks for a reader: computes nothing
        assert producer.scheduler.connector.num_held == 1
        assert producer.has_unfinished_requests() and producer.only_polling
        producer.add_request("b", list(range(4, 20)), ONCE)
        producer.step()  # computes b's prompt
        assert not producer.only_polling
    finally:
        producer.shutdown()


def test_the_core_loop_wait_returns_at_a_new_message():
    core = AsyncEngine.__new__(AsyncEngine)  # _receive alone: no engine behind it
    core._inbox = queue.Queue()
    assert core._receive(block=False, timeout=0.01) == []  # nothing came within the wait
    threading.Timer(0.05, core._inbox.put, args=("request",)).start()
    assert core._receive(block=False, timeout=5.0) == ["request"]  # when it comes
    core._inbox.put("x")
    core._inbox.put("y")
    assert core._receive(block=False) == ["x", "y"]
