"""--step-log (engine/step_log.py): one JSON line per engine step with tokens, its counts the
scheduler's and the runner's, on the tiny engine (sync and --async-scheduling, MTP3 on and
off, prompts joining running decodes); the reader's table (dsaserve/bench/steplog.py) from a
hand-written log; the flag's parsing. On the CPU the GPU fields are null."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from dsaserve.bench import steplog
from dsaserve.config import SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.args import add_engine_args, engine_config_from_args
from dsaserve.engine.engine import LLMEngine

_SYNTHETIC = ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": '
              '"synthetic", "synthetic_acceptance_length": 2.99}')
# (prompt length, max_tokens, the step it joins at): prefills beside running decodes
_ARRIVALS = [(21, 9, 0), (37, 12, 0), (5, 4, 0), (30, 7, 3), (13, 10, 5)]


def _config(engine_config, model_dirs, tmp_path, *, async_: bool, mtp: bool):
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=4, max_num_batched_tokens=40,
                        num_blocks=128)
    cfg = dataclasses.replace(
        cfg, step_log=str(tmp_path / "steps.jsonl"),
        scheduler=dataclasses.replace(cfg.scheduler, async_scheduling=async_))
    if mtp:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig.from_json(_SYNTHETIC))
    return cfg


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("async_", [False, True])
def test_one_line_per_step_with_the_schedulers_counts(engine_config, model_dirs, tmp_path,
                                                      async_, mtp):
    cfg = _config(engine_config, model_dirs, tmp_path, async_=async_, mtp=mtp)
    engine = LLMEngine.from_config(cfg)
    # what the engine read, in order: each step's scheduler output and runner output, and
    # which of its requests had output tokens before it was scheduled (decoding)
    read: list[tuple] = []
    decoding: dict[int, set[str]] = {}
    schedule, update = engine.scheduler.schedule, engine.scheduler.update_from_output

    def spy_schedule():
        before = {r.request_id for r in engine.scheduler.running if r.output_token_ids}
        so = schedule()
        decoding[id(so)] = before
        return so

    def spy_update(so, out):
        read.append((so, out, decoding.pop(id(so))))
        return update(so, out)

    engine.scheduler.schedule, engine.scheduler.update_from_output = spy_schedule, spy_update
    emitted = 0
    step = 0
    while step == 0 or engine.has_unfinished_requests():
        for i, (n, max_tokens, at) in enumerate(_ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", [(5 * i + 3 * j) % 200 + 4 for j in range(n)],
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True))
        emitted += sum(len(o.new_token_ids) for o in engine.step())
        step += 1
    engine.shutdown()
    lines = [json.loads(t) for t in (tmp_path / "steps.jsonl").read_text().splitlines()]
    steps = [(so, out, dec) for so, out, dec in read if not so.is_empty]
    assert len(lines) == len(steps) > 5
    assert emitted == sum(max_tokens for _, max_tokens, _ in _ARRIVALS)
    for i, (line, (so, out, dec)) in enumerate(zip(lines, steps, strict=True)):
        assert line["step"] == i and line["async"] is async_ and line["dp_rank"] == 0
        assert (line["interval_ms"] is None) == (i == 0)
        assert line["schedule_ms"] >= 0 and line["launch_ms"] > 0
        assert line["num_reqs"] == len(so.num_scheduled_tokens)
        assert line["num_tokens"] == so.total_num_scheduled_tokens
        assert line["num_decode_rows"] == sum(n for rid, n in so.num_scheduled_tokens.items()
                                              if rid in dec)
        assert line["num_decode_rows"] + line["num_prefill_rows"] == line["num_tokens"]
        assert line["num_drafts"] == sum(map(len, so.scheduled_spec_token_ids.values()))
        got = {rid: len(t) for rid, t in out.sampled_token_ids.items() if t}
        assert line["num_sampling_reqs"] == len(got)
        assert line["num_sampled"] == sum(got.values())
        verifying = [rid for rid in got if so.scheduled_spec_token_ids.get(rid)]
        assert line["num_accepted"] == sum(got[rid] - 1 for rid in verifying)
        # the padded path: decode-only steps (eager on the CPU: no graph)
        assert (line["padded_size"] is None) == (line["num_prefill_rows"] > 0)
        if line["padded_size"] is not None:
            assert line["padded_size"] >= line["num_tokens"]
        assert line["graph"] is False and line["draft_graph"] is False
        assert line["gpu_forward_ms"] is None and line["gpu_step_ms"] is None
    # every token the user got is a token some step sampled (ignore_eos: none dropped)
    assert sum(line["num_sampled"] for line in lines) == emitted
    accepted = sum(line["num_accepted"] for line in lines)
    assert accepted == emitted - sum(line["num_sampling_reqs"] for line in lines)
    if mtp:
        assert accepted > 0 and sum(line["num_drafts"] for line in lines) >= accepted
    else:
        assert accepted == 0 and all(line["num_drafts"] == 0 for line in lines)


def test_log_off_records_nothing(engine_config, model_dirs):
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"]))
    assert engine.step_log is None and engine.runner.step_timer is None
    engine.add_request("r", list(range(5, 25)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _line(step: int, *, reqs: int, interval: float | None, gpu: float | None,
          sampled: int | None = None, graph: bool = True, drafts: int = 0,
          prefill: int = 0, async_: bool = False) -> str:
    sampled = reqs if sampled is None else sampled
    return json.dumps({
        "step": step, "dp_rank": 0, "interval_ms": interval, "schedule_ms": 0.1,
        "launch_ms": 0.5, "num_reqs": reqs, "num_tokens": reqs * (1 + drafts) + prefill,
        "num_decode_rows": reqs * (1 + drafts), "num_prefill_rows": prefill,
        "num_drafts": reqs * drafts, "num_accepted": sampled - reqs,
        "num_sampling_reqs": reqs, "num_sampled": sampled,
        "padded_size": None if prefill else reqs * (1 + drafts), "graph": graph,
        "draft_graph": graph and drafts > 0, "async": async_,
        "gpu_forward_ms": gpu, "gpu_step_ms": None if gpu is None else gpu + 0.1})


def test_reader_table_from_a_hand_written_log(tmp_path):
    log = tmp_path / "steps.jsonl"
    lines = [
        _line(0, reqs=2, interval=None, gpu=1.0, prefill=30),  # a prefill step: left out
        _line(1, reqs=2, interval=4.0, gpu=1.0),
        _line(2, reqs=2, interval=2.0, gpu=0.5),
        _line(3, reqs=2, interval=3.0, gpu=2.0),
        # MTP3: 2 requests × (1 + 2 and 1 + 1 accepted) = 5 tokens in a step of 10 ms
        _line(4, reqs=2, interval=10.0, gpu=4.0, sampled=5, drafts=3),
        _line(5, reqs=2, interval=10.0, gpu=4.0, sampled=6, drafts=3),
        _line(6, reqs=1, interval=2.0, gpu=None, graph=False),  # eager, GPU time unknown
    ]
    log.write_text("\n".join(lines) + "\n")
    rows = steplog.summarise(steplog.read(log))
    by_key = {(r.batch, r.mtp, r.graph, r.async_): r for r in rows}
    assert set(by_key) == {(2, False, True, False), (2, True, True, False),
                           (1, False, False, False)}
    plain = by_key[(2, False, True, False)]
    assert plain.num_steps == 3
    assert plain.wall_ms == 3.0 and plain.gpu_forward_ms == 1.0  # medians
    assert plain.tokens_per_step == 1.0 and plain.tokens_per_s_user == pytest.approx(1000 / 3)
    mtp = by_key[(2, True, True, False)]
    assert mtp.wall_ms == 10.0 and mtp.tokens_per_step == pytest.approx(11 / 4)
    assert mtp.tokens_per_s_user == pytest.approx(275.0)
    eager = by_key[(1, False, False, False)]
    assert eager.gpu_forward_ms is None and eager.wall_ms == 2.0
    text = "\n".join(steplog.table(rows, "title"))
    assert "| 2 | no | yes | no | 3 | 3.00 | 1.000 | 3.00 | 1.00 | 333.3 |" in text
    assert "| 1 | no | no | no | 1 | 2.00 | – | – | 1.00 | 500.0 |" in text
    assert steplog.main([str(log)]) == 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_flag_parsing(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    args = _parse(["--step-log", str(path)])
    assert args.step_log == str(path)
    cfg = engine_config_from_args(args, "tiny-glm5")
    assert cfg.step_log == str(path)
    assert engine_config_from_args(_parse([]), "tiny-glm5").step_log is None
    for bad, says in ((tmp_path / "no" / "such" / "log.jsonl", "no directory"),
                      (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as e:
            _parse(["--step-log", str(bad)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --step-log:" in err and says in err


class _FakeEvent:
    """A CUDA event on a fake stream: recorded at the stream's time `now`, passed once the
    device reached it (`device`); what StepTimer may read is only a passed event's time."""

    now = 0.0
    device = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.now

    def query(self) -> bool:
        return self.at <= _FakeEvent.device

    def synchronize(self) -> None:
        _FakeEvent.device = max(_FakeEvent.device, self.at)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not passed: a wait"
        return end.at - self.at


def test_step_timer_reads_only_passed_events(monkeypatch):
    """StepTimer (the runner's half of the log) returns a step's GPU time once its last event
    has passed, oldest first, never waiting; drain waits for the last at shutdown."""
    import torch

    from dsaserve.core import StepGpuTime
    from dsaserve.engine.step_timer import StepTimer

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "now", 0.0)
    monkeypatch.setattr(_FakeEvent, "device", 0.0)
    assert StepTimer(torch.device("cpu")).timed is False
    timer = StepTimer(torch.device("cuda"))

    def launch(index: int, forward: float, rest: float) -> None:
        timer.record_start()
        _FakeEvent.now += forward
        timer.record_forward_end()
        _FakeEvent.now += rest
        timer.record_end(index)
        _FakeEvent.now += 1.0  # the host's gap to the next step

    launch(0, 2.0, 0.5)  # events at 0, 2, 2.5
    launch(1, 3.0, 1.0)  # at 3.5, 6.5, 7.5
    assert timer.poll() == ()  # the device has not started
    _FakeEvent.device = 7.0  # step 0 done, step 1 not
    assert timer.poll() == (StepGpuTime(0, 2.0, 2.5),)
    assert timer.poll() == ()
    launch(2, 1.0, 1.0)  # at 8.5, 9.5, 10.5
    _FakeEvent.device = 20.0
    assert timer.poll() == (StepGpuTime(1, 3.0, 4.0), StepGpuTime(2, 1.0, 2.0))
    _FakeEvent.device = 11.0
    launch(3, 4.0, 0.0)  # at 11.5, 15.5, 15.5: drain waits for them
    assert timer.poll() == ()
    assert timer.drain() == (StepGpuTime(3, 4.0, 4.0),)
    assert timer.drain() == ()


def test_lines_wait_for_their_gpu_time_in_order(tmp_path):
    """On a GPU a step's time comes with a later step's output (or with its own, when the
    GPU finished it before the runner polled: seen on an H100): its line (and every line
    after it) is written only then, in step order; at shutdown the drained times complete
    them, and a line whose time never came is written with nulls."""
    from dsaserve.core import ModelRunnerOutput, SchedulerOutput, StepGpuTime, StepStats
    from dsaserve.engine.step_log import StepLog

    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path), async_scheduling=True)
    so = SchedulerOutput(new_requests=(), cached_requests=(), num_scheduled_tokens={"a": 1},
                         finished_request_ids=())
    empty = SchedulerOutput(new_requests=(), cached_requests=(), num_scheduled_tokens={},
                            finished_request_ids=())

    def out(index: int, *times: StepGpuTime) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled_token_ids={"a": [7]}, gpu_times=times,
            step_stats=StepStats(index, 1, 0, 1, True, False, 0.2, timed=True))

    def written() -> list[dict]:
        return [json.loads(t) for t in path.read_text().splitlines()]

    log.scheduled(so, 0.05)
    log.record(so, out(0))
    log.record(so, out(1))
    assert written() == []
    log.record(so, out(2, StepGpuTime(1, 1.5, 2.0)))  # step 1's time first: 0 still waits
    assert written() == []
    log.record(empty, ModelRunnerOutput(sampled_token_ids={}))  # no line, nothing it brings
    log.record(so, out(3, StepGpuTime(0, 1.0, 1.25), StepGpuTime(2, 3.0, 3.5)))
    lines = written()
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [(line["gpu_forward_ms"], line["gpu_step_ms"]) for line in lines] == [
        (1.0, 1.25), (1.5, 2.0), (3.0, 3.5)]
    assert lines[0]["schedule_ms"] == 0.05 and lines[1]["schedule_ms"] is None
    assert lines[0]["interval_ms"] is None and lines[0]["graph"] is True
    log.record(so, out(4))
    log.record(so, out(5, StepGpuTime(5, 0.5, 0.75)))  # done before the runner polled
    log.close((StepGpuTime(3, 2.0, 2.5), StepGpuTime(9, 1.0, 1.0)))  # 9: a step with no line
    lines = written()
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5]
    assert lines[3]["gpu_forward_ms"] == 2.0 and lines[4]["gpu_forward_ms"] is None
    assert lines[5]["gpu_forward_ms"] == 0.5


class _LaggingEvent:
    """A CUDA event that passes once a later step has recorded its events (3 per step), or
    when waited for: the GPU path's timing on the CPU."""

    recorded = 0
    waited = -1  # the last event waited for: it and every earlier one (one stream) passed

    def __init__(self, enable_timing: bool = False) -> None:
        self.seq = -1

    def record(self) -> None:
        self.seq = _LaggingEvent.recorded
        _LaggingEvent.recorded += 1

    def query(self) -> bool:
        return self.seq <= _LaggingEvent.waited or _LaggingEvent.recorded - self.seq > 3

    def synchronize(self) -> None:
        _LaggingEvent.waited = max(_LaggingEvent.waited, self.seq)

    def elapsed_time(self, end: _LaggingEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not passed: a wait"
        return float(end.seq**2 - self.seq**2)  # times that tell the steps apart


@pytest.mark.parametrize("async_", [False, True])
def test_gpu_times_reach_their_lines(engine_config, model_dirs, tmp_path, monkeypatch,
                                     async_):
    """The GPU path end to end on the CPU (events that pass a step late): every line gets its
    own step's forward and step times, written in order one step or more late, the last
    ones at shutdown (the runner's drain)."""
    import torch

    from dsaserve.engine.step_timer import StepTimer

    monkeypatch.setattr(torch.cuda, "Event", _LaggingEvent)
    monkeypatch.setattr(_LaggingEvent, "recorded", 0)
    monkeypatch.setattr(_LaggingEvent, "waited", -1)
    cfg = _config(engine_config, model_dirs, tmp_path, async_=async_, mtp=True)
    engine = LLMEngine.from_config(cfg)
    engine.runner.step_timer = StepTimer(torch.device("cpu"))
    engine.runner.step_timer.timed = True
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 30 + 9 * i)),
                           SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    path = tmp_path / "steps.jsonl"
    before = len(path.read_text().splitlines())
    engine.shutdown()
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert before < len(lines) <= steps
    assert [line["step"] for line in lines] == list(range(len(lines)))
    # step i's events are the 3i-th to (3i + 2)-th recorded, at "times" seq²: its own
    for i, line in enumerate(lines):
        assert (line["gpu_forward_ms"], line["gpu_step_ms"]) == (6 * i + 1, 12 * i + 4)
