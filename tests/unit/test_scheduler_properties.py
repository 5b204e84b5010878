"""The scheduler against a model of its invariants, over random interleavings (hypothesis): arrivals
with shared prefixes and salts, aborts of waiting and running requests, steps under a KV pool so
small that requests are preempted, chunked prefill under any budget. After every step the
allocator's books balance (check_integrity) and the fake runner reads back every computed position
(a wrong prefix hit or a block reused too early shows up as a wrong token); at the end no block is
leaked, every request that was not aborted produced exactly its unscheduled reference output, and
none waited forever (all finish within a bound of steps)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import FakeRunner, make_sched, reference_output, req

MAX_MODEL_LEN = 40
EOS = (101,)  # one of the fake model's tokens (100..149): some requests stop early


SEEN = {"preemptions": 0, "prefix_hits": 0, "aborted_running": 0, "finished": 0}


def test_random_arrivals_aborts_and_preemptions() -> None:
    for key in SEEN:
        SEEN[key] = 0
    one_history()
    # The cases were not all trivial: each hazard happened, many times.
    assert all(count >= 10 for count in SEEN.values()), SEEN


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]), caching=st.booleans(),
       budget=st.integers(1, 24), max_num_seqs=st.integers(1, 5),
       spare_blocks=st.integers(0, 12))
def one_history(data, block_size, caching, budget, max_num_seqs, spare_blocks) -> None:
    num_blocks = -(-MAX_MODEL_LEN // block_size) + spare_blocks  # the least the config allows
    sched = make_sched(block_size, num_blocks, caching=caching, max_model_len=MAX_MODEL_LEN,
                       max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    runner = FakeRunner(sched, block_size)
    prefixes = [[(7 * k + i) % 90 for i in range(12)] for k in range(2)]
    added, aborted, outputs = [], set(), {}
    num_ops = data.draw(st.integers(1, 30), label="ops")
    for op in range(num_ops):
        kind = data.draw(st.sampled_from(["add", "add", "abort", "step", "step", "step"]))
        if kind == "add":
            prefix = data.draw(st.sampled_from(prefixes))[:data.draw(st.integers(0, 12))]
            tail = data.draw(st.lists(st.integers(0, 90), min_size=1, max_size=20))
            prompt = (prefix + tail)[:MAX_MODEL_LEN - 1]
            r = req(f"r{op}", prompt, max_tokens=data.draw(st.integers(1, 16)), eos=EOS,
                    salt=data.draw(st.sampled_from([None, None, "tenant"])),
                    ignore_eos=data.draw(st.booleans()))
            sched.add_request(r)
            added.append(r)
        elif kind == "abort" and sched.requests:
            rid = data.draw(st.sampled_from(sorted(sched.requests)))
            SEEN["aborted_running"] += sched.requests[rid] in sched.running
            sched.abort_requests([rid])
            aborted.add(rid)
        elif kind == "step" and sched.has_unfinished_requests():
            so = sched.schedule()
            sched.check_integrity()
            assert so.total_num_scheduled_tokens <= budget
            assert len(so.num_scheduled_tokens) <= max_num_seqs
            for o in sched.update_from_output(so, runner.execute(so)):
                outputs.setdefault(o.request_id, []).append(o)
            sched.check_integrity()
    # Then run dry: everything must finish (a bound far above need: no request starves).
    bound = 20 * sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in added) + 20
    for _ in range(bound):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for o in sched.update_from_output(so, runner.execute(so)):
            outputs.setdefault(o.request_id, []).append(o)
        sched.check_integrity()
    else:
        raise AssertionError(f"requests still unfinished after {bound} steps: {sched.requests}")
    for o in sched.take_aborted_outputs():
        outputs.setdefault(o.request_id, []).append(o)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    SEEN["preemptions"] += sched.num_preemptions
    SEEN["prefix_hits"] += sched.stats().prefix_cache_hits > 0
    for r in added:
        outs = outputs[r.request_id]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]), r.request_id
        if r.request_id in aborted:
            assert outs[-1].finish_reason in ("abort", "stop", "length")
            continue
        tokens = [t for o in outs for t in o.new_token_ids]
        expect, reason = reference_output(r.prompt_token_ids, r.sampling_params, EOS,
                                          MAX_MODEL_LEN)
        assert tokens == expect and outs[-1].finish_reason == reason, r.request_id
        SEEN["finished"] += 1
