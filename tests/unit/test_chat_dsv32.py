"""DeepSeek-V3.2's chat prompts (serve/chat_dsv32.py) against prompts written out by hand from
the published encoder's format (DeepSeek-V3.2 `encoding/encoding_dsv32.py`, as vLLM calls it for
`--tokenizer-mode deepseek_v32`), and the message shapes it refuses (→ 400)."""

from __future__ import annotations

import pytest

from dsaserve.serve.chat_dsv32 import render_dsv32, thinking_requested
from dsaserve.tokenizer import ChatTemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# The published tools section, written out (DSML markers spelled in full).
TOOLS_SECTION = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<｜DSML｜function_calls>
...
</｜DSML｜function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""  # noqa: E501

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "now", "description": None, "parameters": None}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
SCHEMAS = ('{"name": "get_weather", "description": "Weather of a city", "parameters": '
           '{"type": "object", "properties": {"city": {"type": "string"}}}}\n'
           '{"name": "now", "description": null, "parameters": null}')


def test_system_and_user() -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"}]
    assert render_dsv32(messages) == \
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>"
    assert render_dsv32(messages, thinking=True) == \
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜><think>"


def test_content_parts_are_their_text() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                             {"type": "text", "text": "lo"}]}]
    # joined by newlines: vLLM reads V3.2's content in its "string" format
    assert render_dsv32(messages) == f"{BOS}<｜User｜>Hel\nlo<｜Assistant｜></think>"


MULTI_TURN = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]


def test_multi_turn_drops_earlier_reasoning() -> None:
    earlier = "S<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek." + EOS
    assert render_dsv32(MULTI_TURN) == \
        f"{BOS}{earlier}<｜User｜>1+1=?<｜Assistant｜></think>"
    assert render_dsv32(MULTI_TURN, thinking=True) == \
        f"{BOS}{earlier}<｜User｜>1+1=?<｜Assistant｜><think>"


def test_thinking_answer_after_the_last_user_keeps_its_reasoning() -> None:
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning": "R"}]
    assert render_dsv32(messages, thinking=True) == \
        f"{BOS}<｜User｜>Q<｜Assistant｜><think>R</think>A{EOS}"
    # chat mode: no reasoning is written, the user turn closed thinking already
    assert render_dsv32(messages) == f"{BOS}<｜User｜>Q<｜Assistant｜></think>A{EOS}"


def test_developer_message() -> None:
    messages = [{"role": "developer", "content": "Be brief"}]
    assert render_dsv32(messages, thinking=True) == \
        f"{BOS}<｜User｜>\n\n# The user's message is: Be brief<｜Assistant｜><think>"


TOOL_ROUND = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "now", "arguments": {"tz": ["UTC", "CET"], "exact": True}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]
CALLS = ("\n\n<｜DSML｜function_calls>\n"
         '<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
         "</｜DSML｜invoke>\n"
         '<｜DSML｜invoke name="now">\n'
         '<｜DSML｜parameter name="tz" string="false">["UTC", "CET"]</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="exact" string="false">true</｜DSML｜parameter>\n'
         "</｜DSML｜invoke>\n"
         "</｜DSML｜function_calls>")
RESULTS = ("\n\n<function_results>\n<result>sunny</result>\n<result>12:00</result>\n"
           "</function_results>\n\n")


def test_tools_call_and_results_thinking() -> None:
    expected = (BOS + "\n\n" + TOOLS_SECTION.replace("{schemas}", SCHEMAS) + "S"
                + "<｜User｜>Weather in Paris and the time?<｜Assistant｜><think>"
                + "Two calls.</think>" + CALLS + EOS + RESULTS + "<think>")
    assert render_dsv32(TOOL_ROUND, TOOLS, thinking=True) == expected


def test_tools_call_and_results_chat() -> None:
    expected = (BOS + "\n\n" + TOOLS_SECTION.replace("{schemas}", SCHEMAS) + "S"
                + "<｜User｜>Weather in Paris and the time?<｜Assistant｜></think>"
                + CALLS + EOS + RESULTS + "</think>")
    assert render_dsv32(TOOL_ROUND, TOOLS) == expected


def test_earlier_tool_round_is_closed_before_a_new_user_turn() -> None:
    messages = [*TOOL_ROUND, {"role": "assistant", "content": "Sunny, noon."},
                {"role": "user", "content": "Thanks"}]
    expected = (BOS + "S<｜User｜>Weather in Paris and the time?<｜Assistant｜></think>"
                + CALLS + EOS + RESULTS + "</think>" + "Sunny, noon." + EOS
                + "<｜User｜>Thanks<｜Assistant｜><think>")
    assert render_dsv32(messages, thinking=True) == expected


def test_thinking_from_template_kwargs() -> None:
    assert not thinking_requested(None)
    assert not thinking_requested({"thinking": False})
    assert thinking_requested({"thinking": True})
    assert thinking_requested({"enable_thinking": True})


@pytest.mark.parametrize(("messages", "complaint"), [
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
     "needs reasoning_content or tool_calls"),
    ([{"role": "tool", "content": "x"}], "must follow an assistant message"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
     "as many tool_calls as results"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}], "expected a JSON object"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}], "not JSON"),
    ([{"role": "function", "content": "Q"}], "'function' is not one of"),
    ([{"role": "user", "content": None}], "needs content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "unsupported part type"),
    ([{"role": "developer", "content": "D"}, {"role": "user", "content": "Q"}],
     "developer message must be the last user turn"),
])
def test_shapes_it_cannot_encode(messages, complaint) -> None:
    with pytest.raises(ChatTemplateError, match=complaint):
        render_dsv32(messages, thinking=True)
