"""The synthetic agentic workload: determinism, exact token lengths, growing prompts with a shared
prefix, and Weka files that satisfy the AgentX harness's loader (its schema and its
reconstruction's block geometry, re-implemented here: CI never installs the harness)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsaserve.bench.traces import (
    HARNESS_BLOCK_SIZE,
    WEKA_DIR,
    WORKLOAD_FILE,
    Workload,
    WorkloadSpec,
    generate,
    load_workload,
    main,
    write_workload,
)
from dsaserve.config import ConfigError
from dsaserve.tokenizer import Tokenizer

SPEC = WorkloadSpec(num_sessions=3, num_turns=4, seed=5)


@pytest.fixture(scope="module")
def workload(tok: Tokenizer) -> Workload:
    return generate(SPEC, tok)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# Determinism and the typed form
# ------------------------------------------------------------------------------------------------
def test_same_spec_gives_byte_identical_directories(tok, workload, tmp_path) -> None:
    write_workload(workload, tmp_path / "a")
    write_workload(generate(SPEC, tok), tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    other = generate(replace(SPEC, seed=6), tok)
    assert other.sessions[0].turns[0].new_messages[1].content != \
        workload.sessions[0].turns[0].new_messages[1].content


def test_typed_form_round_trips(workload, tmp_path) -> None:
    write_workload(workload, tmp_path)
    assert load_workload(tmp_path) == workload


def test_rewriting_a_smaller_workload_leaves_no_stale_traces(tok, workload, tmp_path) -> None:
    write_workload(workload, tmp_path)
    write_workload(generate(replace(SPEC, num_sessions=1), tok), tmp_path)
    assert len(list((tmp_path / WEKA_DIR).glob("*.json"))) == 1


# ------------------------------------------------------------------------------------------------
# Lengths, growth, shared prefix
# ------------------------------------------------------------------------------------------------
def test_every_message_encodes_to_its_intended_length(tok, workload) -> None:
    bs = SPEC.block_size
    for s in workload.sessions:
        for t in s.turns:
            for m in t.new_messages:
                assert m.num_tokens == len(tok.encode(m.content)), (s.id, t.index, m.kind)
            if t.index == 0:
                prefix, task = t.new_messages
                assert (prefix.role, prefix.num_tokens) == ("system", SPEC.prefix_tokens)
                assert (task.role, task.num_tokens) == ("user", SPEC.task_tokens)
            else:
                reply, tool = t.new_messages
                prev_out = s.turns[t.index - 1].output_tokens
                assert reply.role == "assistant"
                assert reply.num_tokens == math.ceil(prev_out / bs) * bs
                assert tool.role == "user" and tool.num_tokens % bs == 0
                assert SPEC.tool_result_tokens[0] <= tool.num_tokens <= SPEC.tool_result_tokens[1]
            assert SPEC.output_tokens[0] <= t.output_tokens <= SPEC.output_tokens[1]


def test_prompts_grow_every_turn_and_extend_the_previous_prompt(tok, workload) -> None:
    for s in workload.sessions:
        prev_ids: list[int] = []
        for t in s.turns:
            messages = s.prompt(t.index)
            assert t.input_tokens == sum(len(tok.encode(m["content"])) for m in messages)
            assert t.input_tokens == len(t.hash_ids) * SPEC.block_size
            # The rendered prompt's token ids extend the previous turn's: all of it can be reused
            # from the prefix cache.
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
            assert len(ids) > len(prev_ids) and ids[: len(prev_ids)] == prev_ids
            prev_ids = ids
        assert [t.think_time_s for t in s.turns][0] == 0.0
        lo, hi = SPEC.think_time_s
        assert all(lo <= t.think_time_s <= hi for t in s.turns[1:])


def test_system_prompt_and_tools_are_shared_across_sessions_unless_asked(tok, workload) -> None:
    prefixes = {s.turns[0].new_messages[0].content for s in workload.sessions}
    tasks = {s.turns[0].new_messages[1].content for s in workload.sessions}
    assert len(prefixes) == 1 and len(tasks) == len(workload.sessions)
    own = generate(replace(SPEC, shared_prefix=False), tok)
    assert len({s.turns[0].new_messages[0].content for s in own.sessions}) == len(own.sessions)


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("num_turns", 0, "num_turns"),
    ("system_tokens", 100, "system_tokens + tool_tokens"),
    ("task_tokens", 0, "task_tokens"),
    ("tool_result_tokens", (64, 100), "tool_result_tokens"),
    ("tool_result_tokens", (128, 64), "tool_result_tokens"),
    ("output_tokens", (0, 4), "output_tokens"),
    ("think_time_s", (-1.0, 1.0), "think_time_s"),
])
def test_bad_specs_name_the_field(field: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        WorkloadSpec(**{field: value})


# ------------------------------------------------------------------------------------------------
# The Weka files, checked as the harness's loader reads them
# ------------------------------------------------------------------------------------------------
# agentx-harness 1.0.12, aiperf/dataset/loader/weka_trace_models.py: pydantic models with
# extra="forbid"; requests are discriminated by "type".
_TRACE_REQUIRED = {"id": str, "models": list, "block_size": int, "hash_id_scope": str,
                   "requests": list}
_TRACE_OPTIONAL = {"tool_tokens": int, "system_tokens": int, "totals": dict}
_REQUEST_REQUIRED = {"t": (int, float), "type": str, "model": str, "in": int, "out": int}
_REQUEST_OPTIONAL = {"hash_ids": list, "input_types": list, "output_types": list, "stop": str,
                     "api_time": (int, float), "think_time": (int, float), "ttft": (int, float)}


def _check_schema(trace: dict[str, Any]) -> None:
    assert set(trace) <= set(_TRACE_REQUIRED) | set(_TRACE_OPTIONAL)
    for key, kind in _TRACE_REQUIRED.items():
        assert isinstance(trace[key], kind), key
    for key, kind in _TRACE_OPTIONAL.items():
        assert key not in trace or isinstance(trace[key], kind), key
    assert trace["block_size"] > 0 and trace["hash_id_scope"] == "local"
    assert all(isinstance(m, str) for m in trace["models"])
    for req in trace["requests"]:
        assert req["type"] in ("n", "s")  # no subagents in these workloads
        assert set(req) <= set(_REQUEST_REQUIRED) | set(_REQUEST_OPTIONAL)
        for key, kind in _REQUEST_REQUIRED.items():
            assert isinstance(req[key], kind) and not isinstance(req[key], bool), key
        for key, kind in _REQUEST_OPTIONAL.items():
            assert key not in req or isinstance(req[key], kind), key
        assert all(isinstance(h, int) for h in req.get("hash_ids", []))
        assert req.get("stop", "") in ("", "tool_use", "end_turn")


def _check_harness_geometry(trace: dict[str, Any]) -> None:
    """The reconstruction the harness applies (weka_synth_buf.ConversationReconstructor) must
    only append: whole blocks, each turn's hash ids extending the previous turn's, a user segment
    in every turn (turn 0 longer than the system + tools blocks; later turns with more new blocks
    than the reply's ceil(out / B)), and delays equal to the think times."""
    bs = HARNESS_BLOCK_SIZE
    reqs = trace["requests"]
    prefix_blocks = math.ceil((trace["tool_tokens"] + trace["system_tokens"]) / bs)
    assert len(reqs[0]["hash_ids"]) > prefix_blocks
    for k, req in enumerate(reqs):
        assert req["in"] % bs == 0 and len(req["hash_ids"]) == req["in"] // bs
        if k == 0:
            continue
        prev = reqs[k - 1]
        assert req["hash_ids"][: len(prev["hash_ids"])] == prev["hash_ids"]
        new_blocks = len(req["hash_ids"]) - len(prev["hash_ids"])
        assert new_blocks > math.ceil(prev["out"] / bs)
        assert "api_time" not in prev  # so the end-to-start delay is t_k - t_{k-1}
        assert req["t"] - prev["t"] == pytest.approx(req["think_time"], abs=1e-6)
        assert req["input_types"] == ["tool_result"] and prev["stop"] == "tool_use"
    assert reqs[-1]["stop"] == "end_turn"


def test_weka_directory_parses_as_the_harness_loader_expects(workload, tmp_path) -> None:
    write_workload(workload, tmp_path)
    weka = tmp_path / WEKA_DIR
    files = sorted(weka.iterdir())
    # The loader reads every *.json of the directory; anything else there would be a trace too.
    assert all(p.suffix == ".json" for p in files) and len(files) == len(workload.sessions)
    ids = set()
    for path in files:
        trace = json.loads(path.read_bytes())
        _check_schema(trace)
        _check_harness_geometry(trace)
        ids.add(trace["id"])
        session = next(s for s in workload.sessions if s.id == trace["id"])
        assert [(r["in"], r["out"], tuple(r["hash_ids"])) for r in trace["requests"]] == \
            [(t.input_tokens, t.output_tokens, t.hash_ids) for t in session.turns]
    assert len(ids) == len(files)  # the loader rejects duplicate trace ids


def test_cli_writes_both_forms(tok_dir: Path, tmp_path: Path, capsys) -> None:
    rc = main([str(tmp_path / "out"), "--sessions", "2", "--turns", "2", "--seed", "3",
               "--tool-result-tokens", "64:192", "--tokenizer", str(tok_dir)])
    assert rc == 0 and "2 sessions x 2 turns" in capsys.readouterr().out
    w = load_workload(tmp_path / "out")
    assert w.spec.tool_result_tokens == (64, 192) and w.num_requests == 4
    assert (tmp_path / "out" / WORKLOAD_FILE).is_file()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--task-tokens", "100", "--tokenizer", str(tok_dir)])
    assert "task_tokens" in capsys.readouterr().err
