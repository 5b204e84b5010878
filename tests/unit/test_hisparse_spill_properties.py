"""The scheduler's MLA page map over random histories (hypothesis): arrivals with shared prefixes,
aborts, MLA pages from the least the engine accepts upwards, hot buffers of any size. A fake
runner keeps a token-id "MLA cache" of the map's pages and a host copy per request, as the real
runner does (kv/hisparse/runtime.py): a step that reads its GPU pages reads every computed
position from its page (so the page must be there and hold that token), a hot step reads the host
copy, every written position needs a page, a prefix hit is mirrored from its pages. A spilled
block stays findable: the fake runner keeps its host rows when its request ends (`host_keep`)
and fills its new page from them, or from a live holder's host copy, on a hit (`host_restore`),
so a later read of that page checks the restore too. After every
step the page map's invariants hold; at the end every request produced its reference output and
none waited forever (no deadlock between prefills that need pages and decoders that hold them)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import mix, reference_output, req

from dsaserve.config import CacheConfig, SchedulerConfig
from dsaserve.core import ModelRunnerOutput, SchedulerOutput
from dsaserve.engine.scheduler import Scheduler
from dsaserve.kv.hisparse.mla_pages import reads_through_buffer

MAX_MODEL_LEN = 40
EOS = (101,)
SEEN = {"spills": 0, "hot_steps": 0, "prefix_hits": 0, "finished": 0, "restores": 0}


@dataclass
class _Req:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class SpillRunner:
    def __init__(self, sched: Scheduler, block_size: int, buffer_rows: int) -> None:
        assert sched.mla is not None
        self.sched, self.b, self.buffer_rows = sched, block_size, buffer_rows
        self.mla: list[tuple[int, int] | None] = [None] * (sched.mla.num_pages * block_size)
        self.page_of: dict[int, int] = {}
        self.host: dict[str, dict[int, int]] = {}  # request → position → token
        self.reqs: dict[str, _Req] = {}
        self.kept: dict[int, dict[int, int]] = {}  # block id → position → token (host-kept)

    def _slot(self, st: _Req, pos: int) -> int:
        block = st.block_ids[pos // self.b]
        assert block in self.page_of, f"position {pos} read or written without an MLA page"
        return self.page_of[block] * self.b + pos % self.b

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for block, page in so.mla_pages:
            if page >= 0:
                self.page_of[block] = page
            else:
                self.page_of.pop(block, None)
        for rid in so.finished_request_ids:
            st, host = self.reqs.pop(rid, None), self.host.pop(rid, None)
            for i, block in enumerate(st.block_ids if st is not None else ()):
                if block in so.host_keep:
                    self.kept[block] = self._block_rows(host, i)
        assert set(so.host_keep) <= self.kept.keys(), "a kept block's request did not end"
        for block in so.host_restore:
            rows = self.kept.pop(block, None)
            if block not in self.page_of:
                continue  # its page was taken again within the same diff
            if rows is None:  # a live holder's host copy
                rid, i = next((r, q.block_ids.index(block)) for r, q in self.reqs.items()
                              if block in q.block_ids)
                rows = self._block_rows(self.host[rid], i)
            for p, token in rows.items():
                self.mla[self.page_of[block] * self.b + p % self.b] = (p, token)
            SEEN["restores"] += 1
        for block in so.host_drop:
            del self.kept[block]
        for new in so.new_requests:
            st = _Req(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.reqs[new.request_id] = st
            # a prefix hit is mirrored from its pages into the request's host window
            self.host[new.request_id] = {p: self._read_page(st, p)
                                         for p in range(new.num_computed_tokens)}
            SEEN["prefix_hits"] += new.num_computed_tokens > 0
        for c in so.cached_requests:
            st = self.reqs[c.request_id]
            st.token_ids += c.new_token_ids
            if c.num_kept_blocks is not None:
                del st.block_ids[c.num_kept_blocks :]
            st.block_ids += c.new_block_ids
            st.num_computed_tokens = c.num_computed_tokens
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            st, host = self.reqs[rid], self.host[rid]
            assert st.block_ids == self.sched.requests[rid].block_ids
            start = st.num_computed_tokens
            hot = reads_through_buffer(start, n, self.buffer_rows, 1)
            SEEN["hot_steps"] += hot
            for p in range(start):
                got = host.get(p) if hot else self._read_page(st, p)
                assert got == st.token_ids[p], f"{rid}: position {p} read {got}"
            for p in range(start, start + n):
                self.mla[self._slot(st, p)] = (p, st.token_ids[p])
                host[p] = st.token_ids[p]  # the mirror at the end of the step
            st.num_computed_tokens = start + n
            sampled[rid] = [mix(st.token_ids)] if start + n == len(st.token_ids) else []
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _block_rows(self, host: dict[int, int], i: int) -> dict[int, int]:
        """Block i's positions → tokens from a host copy (a spilled block is all computed)."""
        rows = {p: host.get(p) for p in range(i * self.b, (i + 1) * self.b)}
        assert None not in rows.values(), f"block {i} is not whole in the host copy"
        return rows

    def _read_page(self, st: _Req, pos: int) -> int | None:
        row = self.mla[self._slot(st, pos)]
        assert row is not None and row[0] == pos, f"page row of {pos} holds {row}"
        return row[1]


def test_random_histories_with_spilling() -> None:
    for key in SEEN:
        SEEN[key] = 0
    one_history()
    assert all(count >= 10 for count in SEEN.values()), SEEN


@settings(max_examples=120, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]), caching=st.booleans(),
       budget=st.integers(1, 24), max_num_seqs=st.integers(1, 5),
       spare_pages=st.integers(0, 6), buffer_rows=st.integers(1, 16))
def one_history(data, block_size, caching, budget, max_num_seqs, spare_pages,
                buffer_rows) -> None:
    min_pages = -(-MAX_MODEL_LEN // block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                      max_num_batched_tokens=budget),
                      CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                      num_blocks=4 * min_pages, num_mla_pages=min_pages + spare_pages,
                      hisparse_buffer_rows=buffer_rows)
    runner = SpillRunner(sched, block_size, buffer_rows)
    prefixes = [[(7 * k + i) % 90 for i in range(12)] for k in range(2)]
    added, aborted, outputs = [], set(), {}

    def step() -> None:
        so = sched.schedule()
        sched.check_integrity()
        for o in sched.update_from_output(so, runner.execute(so)):
            outputs.setdefault(o.request_id, []).append(o)
        sched.check_integrity()

    for op in range(data.draw(st.integers(1, 30), label="ops")):
        kind = data.draw(st.sampled_from(["add", "add", "abort", "step", "step", "step", "turn",
                                          "turn"]))
        done = [r for r in added if r.request_id in outputs and outputs[r.request_id][-1].finished
                and r.request_id not in aborted]
        tokens = None
        if kind == "turn" and done:  # a later turn: a finished request's context and more
            prev = data.draw(st.sampled_from(done))
            tokens = prev.prompt_token_ids + [t for o in outputs[prev.request_id]
                                              for t in o.new_token_ids]
            tokens += data.draw(st.lists(st.integers(0, 90), min_size=1, max_size=6))
        elif kind == "add":
            prefix = data.draw(st.sampled_from(prefixes))[:data.draw(st.integers(0, 12))]
            tokens = prefix + data.draw(st.lists(st.integers(0, 90), min_size=1, max_size=20))
        if tokens is not None:
            r = req(f"r{op}", tokens[:MAX_MODEL_LEN - 1],
                    max_tokens=data.draw(st.integers(1, 16)), eos=EOS,
                    ignore_eos=data.draw(st.booleans()))
            sched.add_request(r)
            added.append(r)
        elif kind == "abort" and sched.requests:
            rid = data.draw(st.sampled_from(sorted(sched.requests)))
            sched.abort_requests([rid])
            aborted.add(rid)
        elif kind == "step" and sched.has_unfinished_requests():
            step()
    bound = 20 * sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in added) + 20
    for _ in range(bound):
        if not sched.has_unfinished_requests():
            break
        step()
    else:
        raise AssertionError(f"requests still unfinished after {bound} steps: {sched.requests}")
    for o in sched.take_aborted_outputs():
        outputs.setdefault(o.request_id, []).append(o)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    assert all(sched.kv.pool.ref_count(b) == 0 for b in sched.mla.page_of), "pages leaked"
    runner.execute(sched.schedule())  # an empty step tells the runner which requests ended
    assert set(runner.kept) == set(sched.mla.host_kept()), "kept host rows leaked"
    SEEN["spills"] += sched.mla.num_spills
    for r in added:
        outs = outputs[r.request_id]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]), r.request_id
        if r.request_id in aborted:
            continue
        tokens = [t for o in outs for t in o.new_token_ids]
        expect, reason = reference_output(r.prompt_token_ids, r.sampling_params, EOS,
                                          MAX_MODEL_LEN)
        assert tokens == expect and outs[-1].finish_reason == reason, r.request_id
        SEEN["finished"] += 1


def test_a_hit_is_not_spilled_before_the_runner_mirrors_it() -> None:
    """A later turn whose prefix hit covers all but its last token is a long decoder from its
    first step. A prefill admitted after it in the same step must not spill its hit blocks:
    the runner fills the new request's host window from their pages when it adds it, so they
    must still have them (the prefill waits a step instead, and later spills them)."""
    b, buffer_rows = 4, 4
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                                      max_num_batched_tokens=24),
                      CacheConfig(block_size=b, enable_prefix_caching=True),
                      num_blocks=40, num_mla_pages=MAX_MODEL_LEN // b,
                      hisparse_buffer_rows=buffer_rows)
    runner = SpillRunner(sched, b, buffer_rows)
    first = [(3 * i + 1) % 90 for i in range(25)]
    turns = {"a": first, "b": first[:24] + [7], "c": [(5 * i + 2) % 90 for i in range(20)]}
    outputs: dict[str, list[int]] = {}

    def run(rids: list[str]) -> list[SchedulerOutput]:
        for rid in rids:
            sched.add_request(req(rid, turns[rid], max_tokens=3, eos=EOS, ignore_eos=True))
        sent = []
        while sched.has_unfinished_requests():
            so = sched.schedule()
            sent.append(so)
            sched.check_integrity()
            for o in sched.update_from_output(so, runner.execute(so)):
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            sched.check_integrity()
        return sent

    run(["a"])  # six full blocks cached, idle with their pages; four pages free
    steps = run(["b", "c"])
    assert sched.requests == {} and sched.mla.num_spills > 0  # c spilled b's hit blocks later
    assert [list(so.num_scheduled_tokens) for so in steps[:2]] == [["b"], ["b", "c"]]
    for rid, tokens in turns.items():
        assert outputs[rid] == reference_output(tokens, req(rid, tokens, max_tokens=3,
                                                             ignore_eos=True).sampling_params,
                                                EOS, MAX_MODEL_LEN)[0]
