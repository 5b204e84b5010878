"""Tool calls and reasoning over HTTP (--enable-auto-tool-choice, --tool-call-parser glm47,
--reasoning-parser glm45): a scripted engine emits GLM-5 output — a think block, text, calls —
in outputs of several tokens, and the responses, whole and streamed, through raw HTTP and the
official `openai` client, must carry it as vLLM does: reasoning_content, content, tool_calls,
finish_reason "tool_calls". The prompt is rendered by a GLM-style template that writes the
request's tools and the history's calls back in the model's format."""

from __future__ import annotations

import copy
import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_harness import MODEL_NAME
from test_logprob_text import ScriptedEngine

from dsaserve.core import SamplingParams
from dsaserve.serve.api import ServerConfig, create_app
from dsaserve.serve.async_engine import AsyncEngine, RequestStream
from dsaserve.tokenizer import Tokenizer

# GLM-5's way of writing tools, calls and results (a shortened template written for this test)
GLM_STYLE_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|></think>{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}<tool_call>{{ tc.name }}"
    "{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    "{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<|observation|><tool_response>"
    "{{ m.content }}</tool_response>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}"
    "{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
OUTPUT = ("The user wants Paris.</think>Let me look."
          "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
          "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
          "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Nice</arg_value></tool_call>")
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Nice"})]


class RecordingEngine(ScriptedEngine):
    """ScriptedEngine with a GLM-style chat template, remembering each request's prompt."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.tokenizer: Tokenizer = copy.copy(engine.tokenizer)
        self.tokenizer.chat_template = GLM_STYLE_TEMPLATE
        self.prompts: list[str] = []

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, **kw: Any) -> RequestStream:
        self.prompts.append(self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        return await super().add_request(request_id, prompt_token_ids, params, **kw)


@pytest.fixture(scope="module")
def scripted(engine: AsyncEngine) -> RecordingEngine:
    return RecordingEngine(engine)


def _app(scripted: RecordingEngine, **config: Any):
    return create_app(scripted, ServerConfig(served_model_name=MODEL_NAME, **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client(scripted: RecordingEngine):
    with TestClient(_app(scripted, enable_auto_tool_choice=True, tool_call_parser="glm47",
                         reasoning_parser="glm45")) as c:
        yield c


def script(tok: Tokenizer, text: str, per_output: int = 3) -> list[list[int]]:
    """`text`'s tokens then EOS (whose text is not returned), `per_output` tokens an output."""
    ids = [*tok.encode(text), tok.eos_token_id]
    return [ids[i:i + per_output] for i in range(0, len(ids), per_output)]


def _post(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 100} | body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": USER, "max_tokens": 100, "stream": True} | body
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _calls(tool_calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize("per_output", [1, 3, 50])
def test_glm_output_whole_response(client, scripted, per_output) -> None:
    scripted.script = script(scripted.tokenizer, OUTPUT, per_output)
    scripted.end = ("stop", None)
    out = _post(client, tools=TOOLS)
    choice = out["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "The user wants Paris."
    assert msg["content"] == "Let me look."
    assert _calls(msg["tool_calls"]) == CALLS
    assert all(c["type"] == "function" and c["id"] for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    assert choice["finish_reason"] == "tool_calls"
    assert out["usage"]["completion_tokens"] == len(scripted.tokenizer.encode(OUTPUT)) + 1
    # the tools reached the template; thinking on by default
    assert '"name": "get_weather"' in scripted.prompts[-1]
    assert scripted.prompts[-1].endswith("<|assistant|><think>")


@pytest.mark.parametrize("per_output", [1, 4])
def test_glm_output_streamed(client, scripted, per_output) -> None:
    scripted.script = script(scripted.tokenizer, OUTPUT, per_output)
    scripted.end = ("stop", None)
    chunks = _stream(client, tools=TOOLS, logprobs=True,
                     stream_options={"include_usage": True})
    *choices, usage_chunk = chunks
    deltas = [c["choices"][0]["delta"] for c in choices]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants Paris."
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert _calls(calls) == CALLS and all(tc["id"] and tc["type"] == "function" for tc in calls)
    assert [c["choices"][0]["finish_reason"] for c in choices] == [None] * (len(choices) - 1) \
        + ["tool_calls"]
    # every token's logprob entry is sent once, though the parser held text back
    entries = [e for c in choices for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == usage_chunk["usage"]["completion_tokens"] \
        == len(scripted.tokenizer.encode(OUTPUT)) + 1


def test_the_openai_client_reads_calls_whole_and_streamed(client, scripted) -> None:
    scripted.script = script(scripted.tokenizer, OUTPUT)
    scripted.end = ("stop", None)
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client,
                        max_retries=0)
    r = api.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me look."
    got: dict[int, dict[str, str]] = {}
    for chunk in api.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS,
                                             stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            slot = got.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
    assert [(got[i]["name"], json.loads(got[i]["arguments"])) for i in sorted(got)] == CALLS


def test_a_tool_round_trip_is_rendered_in_the_model_s_format(client, scripted) -> None:
    scripted.script = script(scripted.tokenizer, "It is sunny.")
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    msg = _post(client, messages=history, tools=TOOLS,
                chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    # thinking off: no reasoning, the text is content
    assert msg == {"role": "assistant", "content": "It is sunny.", "reasoning_content": None,
                   "reasoning": None, "tool_calls": []}
    assert scripted.prompts[-1].endswith(
        "<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<|observation|><tool_response>sunny, 21 C</tool_response><|assistant|></think>")


def test_reasoning_only_output_and_stop_strings(client, scripted) -> None:
    scripted.script = script(scripted.tokenizer, "thinking hard and never closing")
    scripted.end = ("length", None)
    msg = _post(client)["choices"][0]["message"]
    assert msg["reasoning_content"] == "thinking hard and never closing"
    assert msg["content"] is None and msg["tool_calls"] == []
    # a stop string cuts the text before the parsers see it
    scripted.script = script(scripted.tokenizer, "a</think>b STOP" + OUTPUT)
    out = _post(client, tools=TOOLS, stop=["STOP"])
    assert out["choices"][0]["message"]["content"] == "b "
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == "STOP"


def test_tool_choice_none_returns_the_calls_as_text(client, scripted) -> None:
    scripted.script = script(scripted.tokenizer, OUTPUT)
    out = _post(client, tools=TOOLS, tool_choice="none")
    msg = out["choices"][0]["message"]
    assert msg["tool_calls"] == [] and msg["content"] == OUTPUT.split("</think>")[1]
    assert out["choices"][0]["finish_reason"] == "length"


def test_malformed_call_is_content_not_an_error(client, scripted) -> None:
    text = "x</think>see <tool_call><arg_key>a</arg_key></tool_call> and <tool_call>get_w"
    scripted.script = script(scripted.tokenizer, text)
    msg = _post(client, tools=TOOLS)["choices"][0]["message"]
    assert msg["content"] == text.split("</think>")[1] and msg["tool_calls"] == []
    deltas = [c["choices"][0]["delta"] for c in _stream(client, tools=TOOLS)]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{not json"}}]}], "tools": TOOLS}, "messages"),
])
def test_tool_fields_it_cannot_honour_are_400(client, body, param) -> None:
    r = client.post("/v1/chat/completions", json={"messages": USER} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tools_without_enable_auto_tool_choice_are_vllm_s_400(scripted) -> None:
    with TestClient(_app(scripted)) as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser' \
            in r.json()["error"]["message"]
        scripted.script = script(scripted.tokenizer, OUTPUT)
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                 "tool_choice": "none", "max_tokens": 100})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == OUTPUT
