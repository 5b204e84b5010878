"""A real server in front of an engine with MTP speculative decoding (k = 3), on a checkpoint
whose drafts are often accepted (tests/conftest.py: draftable_dirs): several tokens arrive per
step, yet streamed text, stop strings and usage counts equal offline generation without drafts,
and /metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, LiveServer, serve, server_engine_config

from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine

pytestmark = pytest.mark.server

SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'
PROMPT = "The harbour town woke early. Before the sun"


@pytest.fixture(scope="module")
def model_dir(draftable_dirs) -> Path:
    return draftable_dirs["tiny-glm5"]


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLMEngine:
    """No drafts: the reference."""
    return LLMEngine.from_config(server_engine_config(model_dir))


@pytest.fixture(scope="module")
def spec_engine(model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine.from_config(
        server_engine_config(model_dir, "--speculative-config", SPEC)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(spec_engine: AsyncEngine) -> Iterator[LiveServer]:
    with serve(spec_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _reference(offline: LLMEngine, max_tokens: int) -> str:
    assert offline.tokenizer is not None
    ids = offline.tokenizer.encode(PROMPT)
    out = offline.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True))[0]
    return offline.tokenizer.decode(out)


def _sample(exposition: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(exposition) for s in f.samples
               if s.name == name)


def test_streamed_text_and_usage_equal_offline(client, server, offline, spec_engine) -> None:
    ref = _reference(offline, 30)
    extra = {"ignore_eos": True}
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == ref
    assert chunks[-1].usage.completion_tokens == 30
    assert len(pieces) < 30  # some steps carried several tokens
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30,
                                  temperature=0.0, extra_body=extra)
    assert r.choices[0].text == ref and r.usage.completion_tokens == 30
    text = httpx.get(f"{server.url}/metrics").text
    assert _sample(text, "vllm:generation_tokens_total") == 60
    assert _sample(text, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert _sample(text, "vllm:spec_decode_num_drafts_total") > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-test",' \
           'position="2"}' in text
    spec_engine.call_in_core(lambda e: e.check_integrity())


def test_stop_string_inside_an_accepted_run(client, offline, spec_engine) -> None:
    full = _reference(offline, 40)
    stop = full[14:17]
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40,
                                  temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    spec_engine.call_in_core(lambda e: e.check_integrity())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_logprobs_end_at_the_token_completing_it(client, offline, stream) -> None:
    """Several tokens arrive per step: the entries, and usage's count, are those of the tokens
    up to the one whose text completes the stop string (as one token per step gives), none of
    the step's later ones, whatever the stop string's place in the run."""
    tok = offline.tokenizer
    assert tok is not None
    ids = offline.generate([tok.encode(PROMPT)], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    full = tok.decode(ids)

    def released(n: int) -> str:
        """The text after n tokens, one at a time: a trailing U+FFFD (maybe an unfinished
        character) is released with the token after it."""
        return tok.decode(ids[:max(m for m in range(n + 1)
                                   if not tok.decode(ids[:m]).endswith("\ufffd"))])

    extra = {"ignore_eos": True}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    for at in range(4, 34, 3):
        stop = full[at:at + 2]
        n = next(n for n in range(1, len(ids) + 1) if stop in released(n))
        want = [tok.decode([t], skip_special_tokens=False) for t in ids[:n]]
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40,
                                      temperature=0.0, stop=[stop], logprobs=0, stream=stream,
                                      extra_body=extra, **usage)
        chunks = list(r) if stream else [r]
        assert chunks[-1].usage.completion_tokens == n, (stop, chunks[-1].usage, n)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.tokens]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:full.index(stop)]
        assert tokens == want, (stop, tokens, want)
