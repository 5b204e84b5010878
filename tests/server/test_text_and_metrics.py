"""Pure pieces of the server: stop-string matching and hold-back against brute force, the metric
tracker against hand-computed histograms, and the response shapes the openai client parses."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace

import openai.types
import openai.types.chat
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsaserve.core import CountHistogram, EngineStats, RequestOutput
from dsaserve.serve.api import Generation, find_stop, held_back
from dsaserve.serve.async_engine import RequestStream
from dsaserve.serve.metrics import ServerMetrics, buckets_1_2_5
from dsaserve.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from dsaserve.tokenizer import Tokenizer


def brute_find(text: str, stop: list[str], num_new: int | None = None) -> int:
    """Read one character at a time: the first stop string completed (the first listed of those
    completed by the same character), among those ending in the last `num_new` characters."""
    first = 1 if num_new is None else max(len(text) - num_new + 1, 1)
    for end in range(first, len(text) + 1):
        for s in stop:
            if text.endswith(s, 0, end):
                return end - len(s)
    return -1


def brute_held(text: str, stop: list[str]) -> int:
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stop_matching_and_hold_back_equal_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(1, 3))]
        assert held_back(text, stop) == brute_held(text, stop), (text, stop)
        assert find_stop(text, stop) == brute_find(text, stop), (text, stop)
        num_new = rng.randint(0, len(text))
        assert find_stop(text, stop, num_new) == brute_find(text, stop, num_new), (text, stop)


def test_stop_examples() -> None:
    assert find_stop("abcSTOPxSTOP", ["STOP", "x"]) == 3  # earliest wins
    # the one that completes first, as one token at a time finds it, not the one starting first
    assert find_stop("xABCD", ["ABCD", "C"]) == 3
    assert find_stop("xAB", ["AB", "B"]) == 1  # both end at 3: the first listed
    assert find_stop("xAB", ["B", "AB"]) == 2
    assert find_stop("STOP and", ["STOP", "and"], num_new=4) == 5  # "STOP" was searched already
    assert find_stop("abc", ["STOP"]) == -1
    assert held_back("the answer is ST", ["STOP"]) == 2
    assert held_back("the answer is", ["STOP"]) == 0
    assert held_back("", ["STOP"]) == 0


def run_generation(tok: Tokenizer, text: str, stop: tuple[str, ...], finish_reason: str = "length"
                   ) -> tuple[list[str], Generation, list[str]]:
    """Feed `text` one character (one byte-level token) per engine output through a Generation."""
    ids = [i for ch in text for i in tok.encode(ch)]
    assert len(ids) == len(text)  # ASCII: one token per character, so stops straddle outputs

    async def go() -> tuple[list[str], Generation, list[str]]:
        aborted: list[str] = []
        stream = RequestStream("r", SimpleNamespace(_abort=aborted.append),
                               asyncio.get_running_loop())
        for k, t in enumerate(ids):
            last = k == len(ids) - 1
            stream.queue.put_nowait(RequestOutput("r", (t,), last, finish_reason if last else None,
                                                  num_prompt_tokens=3, num_cached_tokens=0,
                                                  num_output_tokens=k + 1))
        metrics = ServerMetrics("tiny", lambda: stats())
        gen = Generation(stream, tok, [5, 6, 7], stop, metrics.track())
        return [p async for p in gen.deltas()], gen, aborted

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tok(model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dirs["tiny-glm5"])


def test_generation_cuts_a_stop_string_that_straddles_outputs(tok: Tokenizer) -> None:
    pieces, gen, aborted = run_generation(tok, "the answer is STOP and more", ("STOP", "xyz"))
    assert "".join(pieces) == "the answer is "
    assert not any("S" in p for p in pieces)  # the held-back "S", "ST", "STO" never leaked
    assert gen.finish_reason == "stop" and aborted == ["r"]  # the engine is told to stop
    assert gen.usage.completion_tokens == len("the answer is STOP")


def test_generation_releases_held_text_at_the_end(tok: Tokenizer) -> None:
    pieces, gen, aborted = run_generation(tok, "ends with ST", ("STOP",))
    assert "".join(pieces) == "ends with ST" and pieces[-1].endswith("ST")
    assert gen.finish_reason == "length" and aborted == []
    pieces, _, _ = run_generation(tok, "no stops at all", ())
    assert pieces == list("no stops at all")  # one piece per output: nothing delayed


def stats(**kw: int | tuple[int, ...]) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_free_blocks=10, num_total_blocks=10,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    return EngineStats(**(base | kw))


def samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = m.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_tracker_records_ttft_itl_e2e_and_counters() -> None:
    m = ServerMetrics("tiny", lambda: stats())
    t = m.track(arrival_time=100.0)
    t.on_tokens(1, now=100.25)  # TTFT 0.25
    t.on_tokens(0, now=100.3)  # a chunk with no token: nothing
    t.on_tokens(1, now=100.3)  # ITL 0.05
    t.on_tokens(2, now=100.5)  # ITL 0.2 (two tokens in one output, e.g. speculative decoding)
    t.on_finish("length", num_prompt_tokens=7, now=101.0)
    t.on_finish("abort", num_prompt_tokens=7, now=102.0)  # once only
    s = samples(m)
    lab = (("model_name", "tiny"),)
    assert s[("vllm:time_to_first_token_seconds_count", lab)] == 1
    assert abs(s[("vllm:time_to_first_token_seconds_sum", lab)] - 0.25) < 1e-9
    assert s[("vllm:inter_token_latency_seconds_count", lab)] == 2
    assert abs(s[("vllm:inter_token_latency_seconds_sum", lab)] - 0.25) < 1e-9
    assert s[("vllm:e2e_request_latency_seconds_count", lab)] == 1
    assert abs(s[("vllm:e2e_request_latency_seconds_sum", lab)] - 1.0) < 1e-9
    assert s[("vllm:generation_tokens_total", lab)] == 4
    assert s[("vllm:prompt_tokens_total", lab)] == 7
    success = (("finished_reason", "length"), ("model_name", "tiny"))
    assert s[("vllm:request_success_total", success)] == 1
    assert ("vllm:request_success_total", (("finished_reason", "abort"), lab[0])) not in s


def output(num_tokens: int, at: float, finished: bool = False,
           scheduled: float | None = 10.5) -> RequestOutput:
    """An engine output of `num_tokens` tokens made at engine time `at` (queued at 10.0)."""
    return RequestOutput("r", (7,) * num_tokens, finished, "length" if finished else None,
                         num_prompt_tokens=7, num_cached_tokens=0, num_output_tokens=0,
                         queued_time=10.0, scheduled_time=scheduled, output_time=at)


def test_tracker_records_phases_from_engine_times() -> None:
    """vLLM's phases from the engine's times, not the server's: queue = first scheduled −
    queued, prefill = first token − first scheduled, decode = last token − first token,
    inference = prefill + decode; token counts and sampling parameters per finished request."""
    m = ServerMetrics("tiny", lambda: stats(), max_model_len=512)
    t = m.track(arrival_time=100.0, max_tokens=30, n=1)  # the server's clock differs
    t.on_output(output(0, 10.7))  # a prefill chunk: no token
    t.on_output(output(1, 11.0))  # first token
    t.on_output(output(2, 11.25))
    t.on_output(output(1, 12.0, finished=True))
    t.on_finish("length", num_prompt_tokens=7, now=103.0)
    s = samples(m)
    lab = (("model_name", "tiny"),)
    for name, want in (("queue", 0.5), ("prefill", 0.5), ("decode", 1.0), ("inference", 1.5)):
        assert s[(f"vllm:request_{name}_time_seconds_count", lab)] == 1, name
        assert abs(s[(f"vllm:request_{name}_time_seconds_sum", lab)] - want) < 1e-9, name
    assert s[("vllm:request_prompt_tokens_sum", lab)] == 7
    assert s[("vllm:request_generation_tokens_sum", lab)] == 4
    assert s[("vllm:request_generation_tokens_bucket", (("le", "5.0"),) + lab)] == 1
    assert s[("vllm:request_generation_tokens_bucket", (("le", "2.0"),) + lab)] == 0
    assert s[("vllm:request_params_max_tokens_sum", lab)] == 30
    assert s[("vllm:request_params_n_sum", lab)] == 1
    assert s[("vllm:e2e_request_latency_seconds_sum", lab)] == 3.0  # the server's


def test_request_aborted_while_queued_has_no_phases() -> None:
    m = ServerMetrics("tiny", lambda: stats())
    t = m.track(arrival_time=100.0, max_tokens=8)
    t.on_output(output(0, 10.3, finished=True, scheduled=None))
    t.on_finish("abort", num_prompt_tokens=7, now=100.5)
    s = samples(m)
    lab = (("model_name", "tiny"),)
    assert s[("vllm:request_queue_time_seconds_count", lab)] == 0
    assert s[("vllm:request_prefill_time_seconds_count", lab)] == 0
    assert s[("vllm:request_prompt_tokens_count", lab)] == 1
    assert s[("vllm:request_generation_tokens_sum", lab)] == 0


def test_token_buckets_are_vllm_s_1_2_5() -> None:
    assert buckets_1_2_5(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert buckets_1_2_5(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_1_2_5(1) == (1,)


def test_iteration_tokens_histogram_from_engine_stats() -> None:
    """Bucket i of CountHistogram holds counts in (bounds[i-1], bounds[i]]; the exposition's
    buckets are cumulative, with +Inf the number of steps."""
    h = CountHistogram(bounds=(1, 8, 16), counts=(2, 0, 1, 1), total=1 + 1 + 12 + 40)
    lab = (("model_name", "tiny"),)
    s = samples(ServerMetrics("tiny", lambda: stats(iteration_tokens=h)))
    got = {dict(k[1])["le"]: v for k, v in s.items()
           if k[0] == "vllm:iteration_tokens_total_bucket"}
    assert got == {"1.0": 2, "8.0": 2, "16.0": 3, "+Inf": 4}
    assert s[("vllm:iteration_tokens_total_count", lab)] == 4
    assert s[("vllm:iteration_tokens_total_sum", lab)] == 54
    # DP replicas merge bucket by bucket
    assert (h + h).counts == (4, 0, 2, 2) and (h + h).total == 108
    with pytest.raises(ValueError):
        h + CountHistogram(bounds=(1, 8), counts=(0, 0, 0))


def test_engine_stats_are_read_at_scrape_time() -> None:
    current = [stats()]
    m = ServerMetrics("tiny", lambda: current[0])
    lab = (("model_name", "tiny"),)
    assert samples(m)[("vllm:kv_cache_usage_perc", lab)] == 0.0
    current[0] = stats(num_running=3, num_waiting=2, num_free_blocks=4, prefix_cache_queries=96,
                       prefix_cache_hits=64, num_preemptions=1)
    s = samples(m)
    assert s[("vllm:num_requests_running", lab)] == 3
    assert s[("vllm:num_requests_waiting", lab)] == 2
    assert abs(s[("vllm:kv_cache_usage_perc", lab)] - 0.6) < 1e-9
    assert s[("vllm:prefix_cache_queries_total", lab)] == 96
    assert s[("vllm:prefix_cache_hits_total", lab)] == 64
    assert s[("vllm:num_preemptions_total", lab)] == 1
    # Each app has its own registry: a second one starts from zero.
    assert samples(ServerMetrics("other", lambda: stats()))[
        ("vllm:num_requests_running", (("model_name", "other"),))] == 0


def test_spec_decode_counters_under_vllm_names() -> None:
    """vLLM's spec_decode counters appear once speculative decoding is configured (a per-position
    tuple of length k), with a position label on the per-position one."""
    lab = (("model_name", "tiny"),)
    assert not any("spec_decode" in name for name, _ in samples(ServerMetrics("tiny", stats)))
    m = ServerMetrics("tiny", lambda: stats(
        spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=19, spec_decode_num_accepted_tokens_per_pos=(10, 9, 0)))
    s = samples(m)
    assert s[("vllm:spec_decode_num_drafts_total", lab)] == 10
    assert s[("vllm:spec_decode_num_draft_tokens_total", lab)] == 30
    assert s[("vllm:spec_decode_num_accepted_tokens_total", lab)] == 19
    for pos, want in enumerate((10, 9, 0)):
        key = (("model_name", "tiny"), ("position", str(pos)))
        assert s[("vllm:spec_decode_num_accepted_tokens_per_pos_total", key)] == want
    assert stats(spec_decode_num_drafts=10, spec_decode_num_accepted_tokens=19
                 ).spec_decode_mean_acceptance_length == 2.9


def test_response_shapes_parse_as_openai_types() -> None:
    usage = Usage.of(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
    chunk = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatChunkChoice(
        delta=DeltaMessage(content="hi"))], usage=usage)
    parsed = openai.types.chat.ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert parsed.choices[0].delta.content == "hi"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    assert parsed.usage.total_tokens == 13
    completion = CompletionResponse(id="cmpl-1", model="m", choices=[CompletionChoice(
        text="x", finish_reason="stop")])
    parsed_c = openai.types.Completion.model_validate_json(completion.model_dump_json())
    assert parsed_c.choices[0].text == "x" and parsed_c.choices[0].finish_reason == "stop"
