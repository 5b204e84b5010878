"""The in-process AgentX replay against a real server on 127.0.0.1 (tiny model), and the parsing
and headline maths shared with the harness path (which CI never runs: the harness is not
installed here)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from openai.types.chat import ChatCompletionChunk
from server_harness import MODEL_NAME

from dsaserve.bench.agentx import (
    StreamMeter,
    headline,
    main,
    parse_prefix_cache,
    parse_profile_export,
    percentile,
    replay,
    scrape_prefix_cache,
    weka_block_size,
)
from dsaserve.bench.traces import Workload, WorkloadSpec, generate, write_workload
from dsaserve.serve.async_engine import AsyncEngine
from dsaserve.tokenizer import Tokenizer

pytestmark = pytest.mark.server

BLOCK_SIZE = 16  # server_harness.TEST_FLAGS; the workload uses the server's block size
SPEC = WorkloadSpec(num_sessions=4, num_turns=3, block_size=BLOCK_SIZE, system_tokens=48,
                    tool_tokens=16, task_tokens=32, tool_result_tokens=(16, 48),
                    output_tokens=(4, 8), think_time_s=(0.0, 0.05), seed=11)


@pytest.fixture(scope="module")
def tok(engine: AsyncEngine) -> Tokenizer:
    assert engine.tokenizer is not None
    return engine.tokenizer


@pytest.fixture(scope="module")
def workload(tok: Tokenizer) -> Workload:
    return generate(SPEC, tok)


def test_replay_every_request_succeeds_with_usage_and_cache_hits(server, workload, tok) -> None:
    before = scrape_prefix_cache(server.url)
    records = asyncio.run(replay(workload, server.url, MODEL_NAME, concurrency=2))
    after = scrape_prefix_cache(server.url)

    assert len(records) == workload.num_requests == 12
    by_key = {(r.session_id, r.turn_index): r for r in records}
    for s in workload.sessions:
        prev_prompt = 0
        for t in s.turns:
            r = by_key[(s.id, t.index)]
            assert r.error is None, r.error  # includes "usage in the last chunk"
            # usage.prompt_tokens is the whole rendered prompt, as the server's tokenizer sees it
            rendered = tok.apply_chat_template(s.prompt(t.index), add_generation_prompt=True)
            assert r.prompt_tokens == len(tok.encode(rendered))
            assert r.output_tokens == t.output_tokens  # ignore_eos: exactly max_completion_tokens
            assert r.ttft_ms is not None and r.ttft_ms <= r.latency_ms
            if t.index > 0:
                # The previous prompt is a token prefix of this one: its whole blocks are cached.
                assert r.cached_tokens >= prev_prompt // BLOCK_SIZE * BLOCK_SIZE > 0
            prev_prompt = r.prompt_tokens

    h = headline(records, source="test")
    assert (h.num_requests, h.num_errors) == (12, 0)
    assert h.prompt_tokens == sum(r.prompt_tokens for r in records)
    assert h.cached_tokens == sum(r.cached_tokens for r in records)
    assert h.throughput_per_gpu > 0 and h.interactivity_p90 > 0
    # The server's prefix-cache counters saw the same hits the usage fields report.
    assert after.hits - before.hits == h.cached_tokens
    assert after.rate_since(before) == pytest.approx(h.cached_tokens / h.prompt_tokens)


def test_cli_replay_prints_the_headline(server, workload, tmp_path: Path, capsys) -> None:
    write_workload(workload, tmp_path)
    rc = main(["--trace", str(tmp_path), "--url", server.url, "--mode", "replay",
               "--think-time-scale", "0", "--num-gpus", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"requests \(profiling\) +12\n", out) and re.search(r"errors +0\n", out)
    assert "throughput per GPU (tok/s, 2 GPU)" in out


def test_harness_mode_refuses_traces_it_would_misread(server, workload, tmp_path: Path,
                                                       capsys) -> None:
    write_workload(workload, tmp_path)  # block_size 16: the harness always tiles 64
    assert weka_block_size(tmp_path / "weka") == BLOCK_SIZE
    rc = main(["--trace", str(tmp_path), "--url", server.url, "--harness", str(tmp_path / "agentx"),
               "--artifact-dir", str(tmp_path / "artifacts")])
    assert rc == 1 and "declare block_size 16" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The stream meter, profile_export.jsonl and the headline maths (no server)
# ------------------------------------------------------------------------------------------------
def _chunk(content: str | None, usage: dict | None = None) -> ChatCompletionChunk:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return ChatCompletionChunk.model_validate({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": choices, "usage": usage})


def test_stream_meter_takes_ttft_from_content_and_usage_from_the_last_chunk() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
             "prompt_tokens_details": {"cached_tokens": 8}}
    meter = StreamMeter("s", 0)
    meter.on_chunk(_chunk(""))  # the role chunk: no content, no TTFT
    assert meter._first_content_ns is None
    for piece in ("a", "b", "c"):
        meter.on_chunk(_chunk(piece))
    meter.on_chunk(_chunk(None, usage))
    r = meter.finish()
    assert r.error is None and (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (10, 8, 3)
    assert r.itl_ms == pytest.approx((r.latency_ms - r.ttft_ms) / 2)

    late = StreamMeter("s", 1)
    late.on_chunk(_chunk(None, usage))
    late.on_chunk(_chunk("x"))  # usage not in the last chunk
    assert late.finish().error == "no usage in the last chunk before [DONE]"


def _row(phase: str, start_ms: float, end_ms: float, *, ttft: float, itl: float | None,
         prompt: int, cached: int, out: int, error: dict | None = None) -> str:
    metrics = {"time_to_first_token": {"value": ttft, "unit": "ms"},
               "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
               "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"},
               "usage_completion_tokens": {"value": out, "unit": "tokens"},
               "input_sequence_length": {"value": prompt + 1, "unit": "tokens"}}
    if itl is not None:
        metrics["inter_token_latency"] = {"value": itl, "unit": "ms"}
    row = {"metadata": {"conversation_id": "s0", "turn_index": 1, "benchmark_phase": phase,
                        "request_start_ns": int(start_ms * 1e6),
                        "request_end_ns": int(end_ms * 1e6)},
           "metrics": metrics}
    if error is not None:
        row["error"] = error
    return json.dumps(row)


def test_profile_export_headline_by_hand(tmp_path: Path) -> None:
    # The row shape of agentx-harness 1.0.12's profile_export.jsonl (trimmed).
    lines = [
        _row("warmup", 0, 50, ttft=50, itl=None, prompt=100, cached=0, out=1),
        _row("profiling", 1000, 2000, ttft=100, itl=10, prompt=300, cached=200, out=10),
        _row("profiling", 1500, 3000, ttft=300, itl=30, prompt=500, cached=400, out=50),
        _row("profiling", 1600, 1700, ttft=1, itl=1, prompt=7, cached=0, out=2,
             error={"code": 500, "type": "InternalServerError", "message": "boom"}),
    ]
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = parse_profile_export(path)
    assert [r.phase for r in records] == ["warmup", "profiling", "profiling", "profiling"]
    assert records[3].error == "InternalServerError: boom"

    h = headline(records, num_gpus=2)
    assert (h.num_requests, h.num_errors) == (3, 1)  # warmup excluded, the error counted
    assert h.ttft_median_ms == pytest.approx(200) and h.ttft_p90_ms == pytest.approx(280)
    assert h.itl_p90_ms == pytest.approx(28) and h.interactivity_p90 == pytest.approx(1000 / 28)
    # latency / output tokens: 1.0 s / 10 = 0.1 s, 1.5 s / 50 = 0.03 s → P90 = 0.093 s
    assert h.e2e_interactivity_p90 == pytest.approx(1 / 0.093)
    # window 1.0 s → 3.0 s; (300 + 500 prompt + 10 + 50 output) / 2 s / 2 GPUs
    assert h.window_s == pytest.approx(2.0)
    assert h.throughput_per_gpu == pytest.approx(860 / 2.0 / 2)
    assert (h.prompt_tokens, h.cached_tokens, h.output_tokens) == (800, 600, 60)


def test_percentile_matches_numpy_and_empty_is_nan() -> None:
    rng = random.Random(0)
    for n in (1, 2, 5, 37):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 90))
    assert math.isnan(headline([]).ttft_p90_ms)


def test_prefix_cache_counters_are_summed_over_labels() -> None:
    text = ("# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{model_name="a"} 100.0\n'
            'vllm:prefix_cache_queries_total{model_name="b"} 50.0\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{model_name="a"} 30.0\n')
    now = parse_prefix_cache(text)
    assert (now.queries, now.hits) == (150.0, 30.0)
    assert now.rate_since(parse_prefix_cache("")) == pytest.approx(0.2)
    assert now.rate_since(now) is None  # no queries in between

