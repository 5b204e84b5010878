"""The chat output parsers (serve/tools) on texts written in the models' formats: the GLM and
DeepSeek-V3.2 (DSML) tool calls as the chat templates render them, <think> blocks, malformed and
unfinished calls (left in the content, never an exception); and the split invariance every
parser promises: any cut of the text into deltas gives what the whole text gives."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.serve.tools.base import ChatDelta, TagSplitter, partial_suffix
from dsaserve.serve.tools.dsml import DSML
from dsaserve.serve.tools.output import ChatOutputParser
from dsaserve.serve.tools.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ToolRequestError,
    chat_output_parser,
)
from dsaserve.serve.tools.values import coerce

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
            "hourly": {"type": "boolean"}, "fields": {"type": "array"},
            "filter": {"type": "object"}, "note": {"type": ["string", "null"]},
            "code": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                     "properties": {}}}},
]


def parser(tool_parser: str | None = "glm47", reasoning: str | None = None,
           kwargs: dict[str, Any] | None = None, **request: Any) -> ChatOutputParser:
    p = chat_output_parser(tool_call_parser=tool_parser, reasoning_parser=reasoning,
                           enable_auto_tool_choice=True, tools=request.get("tools", TOOLS),
                           tool_choice=request.get("tool_choice"),
                           parallel_tool_calls=request.get("parallel_tool_calls"),
                           template_kwargs=kwargs)
    assert p is not None
    return p


def run(p: ChatOutputParser, deltas: list[str]) -> ChatDelta:
    out = ChatDelta()
    for d in deltas:
        out.extend(p.push(d))
    out.extend(p.finish())
    return out


def whole(text: str, **kw: Any) -> tuple[str, str, list[tuple[str, Any]]]:
    out = run(parser(**kw), [text])
    return out.reasoning, out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]


# ---- GLM ----------------------------------------------------------------------------------------
def glm_call(name: str, args: dict[str, str], newlines: bool = False) -> str:
    """A call as GLM's chat templates write one (GLM-4.5 with newlines, 4.7 / 5 without)."""
    nl = "\n" if newlines else ""
    body = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}"
                   for k, v in args.items())
    return f"<tool_call>{name}{nl}{body}</tool_call>"


ALL_TYPES = {"city": "Paris, France", "days": "3", "scale": "-1.5e2", "hourly": "true",
             "fields": '["temp", "wind"]', "filter": '{"min": 0, "tags": [null, false]}',
             "note": "null", "code": "007"}
ALL_TYPES_JSON = {"city": "Paris, France", "days": 3, "scale": -150.0, "hourly": True,
                  "fields": ["temp", "wind"], "filter": {"min": 0, "tags": [None, False]},
                  "note": None, "code": "007"}


@pytest.mark.parametrize("newlines", [False, True], ids=["glm47", "glm45"])
def test_glm_calls_of_every_json_type_with_text_around(newlines) -> None:
    text = ("I will check. " + glm_call("get_weather", ALL_TYPES, newlines) + " and "
            + glm_call("now", {}, newlines) + "\nDone.")
    _, content, calls = whole(text)
    assert content == "I will check.  and \nDone."
    assert calls == [("get_weather", ALL_TYPES_JSON), ("now", {})]


def test_glm_string_parameters_stay_as_written() -> None:
    # a string parameter keeps its whitespace and JSON-looking text; an unknown tool's values
    # are read as JSON where they parse
    text = glm_call("get_weather", {"city": " 42 ", "code": '{"a": 1}'}) + glm_call(
        "unknown", {"n": "42", "s": "plain words"})
    assert whole(text)[2] == [("get_weather", {"city": " 42 ", "code": '{"a": 1}'}),
                              ("unknown", {"n": 42, "s": "plain words"})]


@pytest.mark.parametrize("text", [
    "<tool_call></tool_call> after",  # no name
    "<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    "before <tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",  # unfinished
    "a </tool_call> b <tool_ca",  # a stray end tag; a tail that never became a tag
])
def test_glm_malformed_or_unfinished_calls_stay_in_the_content(text) -> None:
    assert whole(text) == ("", text, [])


# Schemas a client may send (only `parameters` being an object is checked): each raised inside the
# output parser (AttributeError, TypeError), failing the response once the model wrote a call.
@pytest.mark.parametrize("parameters", [
    {"properties": ["city"]}, {"properties": "city"},
    {"properties": {"city": {"anyOf": 5}}}, {"properties": {"city": {"oneOf": "string"}}},
    {"properties": {"city": {"enum": 5}}}, {"properties": {"city": {"enum": "abc"}}},
])
@pytest.mark.parametrize("tool_parser", ["glm47", "deepseek_v32"])
def test_malformed_parameter_schemas_read_values_as_json(parameters, tool_parser) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    text = (glm_call("f", {"city": "42"}) if tool_parser == "glm47"
            else dsml(dsml_invoke("f", [("city", "42", False)])))
    assert whole(text, tool_parser=tool_parser, tools=tools) == ("", "", [("f", {"city": 42})])


def test_glm_a_call_after_a_malformed_one_is_still_read() -> None:
    text = "<tool_call>\n</tool_call>x" + glm_call("now", {})
    assert whole(text) == ("", "<tool_call>\n</tool_call>x", [("now", {})])


# ---- DeepSeek-V3.2 DSML -------------------------------------------------------------------------
def dsml_invoke(name: str, params: list[tuple[str, str, bool]]) -> str:
    body = "".join(f'<{DSML}parameter name="{k}" string="{"true" if s else "false"}">{v}'
                   f"</{DSML}parameter>\n" for k, v, s in params)
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'


def dsml(*invokes: str) -> str:
    return f"<{DSML}function_calls>\n" + "".join(invokes) + f"</{DSML}function_calls>"


def test_dsml_several_invokes_every_json_type() -> None:
    params = [(k, v, k in ("city", "code")) for k, v in ALL_TYPES.items()]
    text = "Checking." + dsml(dsml_invoke("get_weather", params), dsml_invoke("now", [])) + " ok"
    assert whole(text, tool_parser="deepseek_v32") == (
        "", "Checking. ok", [("get_weather", ALL_TYPES_JSON), ("now", {})])


def test_dsml_string_true_keeps_the_text_string_false_reads_json() -> None:
    text = dsml(dsml_invoke("unknown", [("a", "42", True), ("b", "42", False),
                                        ("c", "not json", False)]))
    assert whole(text, tool_parser="deepseek_v32")[2] == [
        ("unknown", {"a": "42", "b": 42, "c": "not json"})]


@pytest.mark.parametrize("text", [
    dsml("no invoke here"),
    f"<{DSML}function_calls>\n" + dsml_invoke("now", []),  # never closed
    dsml(f'<{DSML}invoke name="now">unclosed invoke'),
])
def test_dsml_malformed_or_unfinished_blocks_stay_in_the_content(text) -> None:
    assert whole(text, tool_parser="deepseek_v32") == ("", text, [])


# ---- reasoning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_glm_reasoning_is_on_by_default_and_ends_at_think_end_or_a_call(name) -> None:
    assert whole("plan</think>answer", reasoning=name) == ("plan", "answer", [])
    assert whole("<think>plan</think>answer", reasoning=name) == ("plan", "answer", [])
    assert whole("still thinking", reasoning=name) == ("still thinking", "", [])
    # a call ends the reasoning (the template's <think> is never closed by the model)
    assert whole("plan" + glm_call("now", {}) + "x", reasoning=name) == ("plan", "x",
                                                                          [("now", {})])
    off = {"enable_thinking": False}
    assert whole("<think>a</think>b", reasoning=name, kwargs=off) == ("", "<think>a</think>b", [])


def test_deepseek_v3_reasoning_only_when_the_request_asks() -> None:
    assert whole("a</think>b", reasoning="deepseek_v3") == ("", "a</think>b", [])
    for kwargs in ({"thinking": True}, {"enable_thinking": True}):
        assert whole("a</think>b", reasoning="deepseek_v3", kwargs=kwargs) == ("a", "b", [])
    assert whole("a</think>b", reasoning="deepseek_r1", kwargs={"thinking": False}) == (
        "a", "b", [])


def test_reasoning_without_tool_parsing() -> None:
    p = parser(tool_parser=None, reasoning="glm45", tools=None)
    assert run(p, ["x</think>", "<tool_call>now</tool_call>"]) == ChatDelta(
        "x", "<tool_call>now</tool_call>")


# ---- the request's tool fields ------------------------------------------------------------------
def test_tool_choice_none_parses_no_calls_and_parallel_false_keeps_one() -> None:
    text = glm_call("now", {}) + glm_call("now", {})
    assert chat_output_parser(tool_call_parser="glm47", reasoning_parser=None,
                              enable_auto_tool_choice=True, tools=TOOLS, tool_choice="none",
                              parallel_tool_calls=None, template_kwargs=None) is None
    assert len(whole(text)[2]) == 2
    assert len(whole(text, parallel_tool_calls=False)[2]) == 1


@pytest.mark.parametrize("enable, tool_parser, tools, choice, param", [
    (False, "glm47", TOOLS, None, "tools"),  # "auto" by default: needs the flags
    (True, None, TOOLS, "auto", "tools"),
    (True, "glm47", None, "auto", "tool_choice"),  # tool_choice without tools
    (True, "glm47", TOOLS, "required", "tool_choice"),
    (True, "glm47", TOOLS, {"type": "function", "function": {"name": "now"}}, "tool_choice"),
])
def test_tool_fields_the_server_cannot_honour(enable, tool_parser, tools, choice, param) -> None:
    with pytest.raises(ToolRequestError) as e:
        chat_output_parser(tool_call_parser=tool_parser, reasoning_parser=None,
                           enable_auto_tool_choice=enable, tools=tools, tool_choice=choice,
                           parallel_tool_calls=None, template_kwargs=None)
    assert e.value.param == param and str(e.value).startswith(f"{param}: ")
    if param == "tools":  # vLLM's message, which clients and docs quote
        assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser' \
            in str(e.value)


# ---- pieces -------------------------------------------------------------------------------------
def test_partial_suffix() -> None:
    assert partial_suffix("see <tool_ca", "<tool_call>") == 8
    assert partial_suffix("see <tool", "<think>") == 0
    assert partial_suffix("<tool_call>", "<tool_call>") == 0  # a whole tag is no partial one
    assert partial_suffix("", "<t>") == 0


def test_coerce() -> None:
    assert coerce("42", {"integer"}) == 42 and coerce("42", {"string"}) == "42"
    assert coerce("42", {"number"}) == 42 and coerce("1.5", {"integer", "string"}) == "1.5"
    assert coerce("True", {"boolean"}) is True and coerce("None", set()) is None
    assert coerce("hello", {"integer"}) == "hello" and coerce("{1, 2}", set()) == "{1, 2}"
    assert coerce(" [1] ", {"array"}) == [1] and coerce("null", {"string", "null"}) is None
    assert coerce("1e999", {"number"}) == "1e999" and coerce("[NaN]", set()) == "[NaN]"
    assert coerce("9" * 5000, {"integer"}) == "9" * 5000  # past Python's int-parsing limit


# ---- split invariance ---------------------------------------------------------------------------
def splits(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


GLM_TEXT = ("plan <think> x</think>Hi <tool_ca " + glm_call("get_weather", ALL_TYPES) + "\n"
            + glm_call("now", {}, newlines=True) + "<tool_call>\n</tool_call> bye <tool_call>now")
DSML_TEXT = ("<think>plan</think>Hi <" + dsml(dsml_invoke("get_weather", [
    (k, v, k == "city") for k, v in ALL_TYPES.items()]), dsml_invoke("now", [])) + " then "
    + dsml("junk") + f" <{DSML}function_calls>" + dsml_invoke("now", []))
CASES = [("glm47", "glm45", GLM_TEXT, None), ("glm47", "glm45", GLM_TEXT, {"thinking": False}),
         ("glm45", None, GLM_TEXT, None), ("deepseek_v32", "deepseek_v3", DSML_TEXT,
                                           {"thinking": True}),
         ("deepseek_v32", "deepseek_v3", DSML_TEXT, None)]


@pytest.mark.parametrize("tool_parser, reasoning, text, kwargs", CASES)
@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(data=st.data())
def test_any_split_gives_the_whole_text_s_parse(tool_parser, reasoning, text, kwargs,
                                                data) -> None:
    def key(out: ChatDelta) -> tuple[str, str, list[tuple[str, str]]]:
        return out.reasoning, out.content, [(c.name, c.arguments) for c in out.calls]

    prefix = text[:data.draw(st.integers(0, len(text)), "end")]  # unfinished outputs too
    deltas = splits(data.draw, prefix)
    want = run(parser(tool_parser, reasoning, kwargs), [prefix])
    assert key(run(parser(tool_parser, reasoning, kwargs), deltas)) == key(want)


def test_the_whole_texts_parse_as_written() -> None:
    assert whole(GLM_TEXT, reasoning="glm45") == (
        "plan <think> x", "Hi <tool_ca \n<tool_call>\n</tool_call> bye <tool_call>now",
        [("get_weather", ALL_TYPES_JSON), ("now", {})])
    assert whole(DSML_TEXT, tool_parser="deepseek_v32", reasoning="deepseek_v3",
                 kwargs={"thinking": True}) == (
        "plan", "Hi < then " + dsml("junk") + f" <{DSML}function_calls>"
        + dsml_invoke("now", []), [("get_weather", ALL_TYPES_JSON), ("now", {})])


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(data=st.data(), text=st.text("<>ab/", max_size=30))
def test_tag_splitter_any_split_equals_whole(data, text) -> None:
    """Random texts over the tags' own characters: overlapping, repeated and partial tags."""
    def pieces(deltas: list[str]) -> list[tuple[str, bool]]:
        s = TagSplitter("<ab>", "</ab>")
        out = [p for d in deltas for p in s.push(d)] + s.finish()
        merged: list[tuple[str, bool]] = []
        for p in out:  # adjacent text pieces may be cut differently: compare them joined
            if merged and not p.is_block and not merged[-1][1]:
                merged[-1] = (merged[-1][0] + p.text, False)
            else:
                merged.append((p.text, p.is_block))
        return merged

    got = pieces(splits(data.draw, text))
    assert got == pieces([text])
    # nothing lost: the pieces with their tags put back are the text
    assert "".join(f"<ab>{t}</ab>" if b else t for t, b in got) == text


def test_registries_use_vllm_names() -> None:
    assert set(TOOL_PARSERS) == {"glm45", "glm47", "deepseek_v32"}
    assert set(REASONING_PARSERS) == {"glm45", "glm47", "deepseek_v3", "deepseek_r1"}


def test_a_long_argument_streamed_in_small_deltas_costs_linear_time() -> None:
    """A 400 KB file-content argument two characters at a time: every delta is searched only
    where a closing tag can end (quadratic work would take minutes here)."""
    value = "line of code <arg_value> & </arg\n" * 12_000
    text = "thinking</think>" + glm_call("get_weather", {"code": value}) + " done"
    start = time.monotonic()
    out = run(parser(reasoning="glm45"), [text[i:i + 2] for i in range(0, len(text), 2)])
    assert time.monotonic() - start < 20
    assert (out.reasoning, out.content) == ("thinking", " done")
    assert [json.loads(c.arguments) for c in out.calls] == [{"code": value}]


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
             "<arg_value>", "</arg_value>", "<", "</", "think>", "tool_", "f", "\n", "1", " "]


@pytest.mark.parametrize("tool_parser, reasoning, kwargs", [
    ("glm47", "glm45", None), ("glm47", "glm45", {"enable_thinking": False}),
    (None, "deepseek_r1", None), ("glm45", None, None)])
@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(data=st.data(), parts=st.lists(st.sampled_from(FRAGMENTS), max_size=24))
def test_random_tag_soup_any_split_equals_whole(tool_parser, reasoning, kwargs, data,
                                                parts) -> None:
    """Texts made of the formats' tags and their pieces, in any order: the same parse for every
    split, and no exception whatever the model wrote."""
    text = "".join(parts)
    tools = TOOLS if tool_parser else None

    def go(deltas: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
        out = run(parser(tool_parser, reasoning, kwargs, tools=tools), deltas)
        return out.reasoning, out.content, [(c.name, c.arguments) for c in out.calls]

    whole_parse = go([text])
    assert go(splits(data.draw, text)) == whole_parse
    if not whole_parse[2] and reasoning is None:  # no calls, no reasoning: the text unchanged
        assert whole_parse[1] == text
