"""DeepSeek-V3.2's chat prompt format, as vLLM renders it with `--tokenizer-mode deepseek_v32`.

The checkpoint ships no Jinja chat template: DeepSeek publishes a Python encoder
(`encoding/encoding_dsv32.py`), and this module writes the text that encoder writes for an OpenAI
chat (its "chat" / "thinking" modes, vLLM's way of calling it). One prompt, no separators:

    <｜begin▁of▁sentence｜>                         BOS
    \n\n## Tools\n\n ... <functions>\n{schemas}\n</functions>\n    the request's tools, if any
    {system}                                       system messages' text, as they are
    <｜User｜>{user}<｜Assistant｜></think>           a user turn (not the last, or no thinking)
    {answer}<｜end▁of▁sentence｜>                    an assistant turn before the last user one
    \n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k"
        string="true">v</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>
                                                   its calls, before <｜end▁of▁sentence｜>
    \n\n<function_results>\n<result>{r1}</result>\n<result>{r2}</result>
        \n</function_results>\n\n</think>          the tool messages answering them
    <｜User｜>{last}<｜Assistant｜><think>            the last user turn, thinking on

Thinking marks: each user turn ends with `</think>`, except the last one in thinking mode, which
opens `<think>`; an assistant turn after the last user message then writes its reasoning and
`</think>` first (earlier turns' reasoning is dropped). The results of a group of tool calls end
the same way: `<think>` when thinking after the last user message, else `</think>`.
"""

from __future__ import annotations

import json
from typing import Any

from dsaserve.tokenizer import ChatTemplateError, text_content

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# The system-prompt section describing the request's tools, in DeepSeek's words byte for byte (the
# model was trained on them; the current published encoder, whose paragraphs are separated by
# blank lines). `{schemas}`: one JSON function schema a line.
_TOOLS_SECTION = "\n".join([
    "## Tools",
    "",
    "You have access to a set of tools you can use to answer the user's question.",
    f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following '
    "as part of your reply to the user:",
    f"<{DSML}function_calls>",
    f'<{DSML}invoke name="$FUNCTION_NAME">',
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>",
    "...",
    f"</{DSML}invoke>",
    f'<{DSML}invoke name="$FUNCTION_NAME2">',
    "...",
    f"</{DSML}invoke>",
    f"</{DSML}function_calls>",
    "",
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    "while lists and objects should use JSON format. The \"string\" attribute should be set to "
    "\"true\" for string type parameters and \"false\" for other types (numbers, booleans, "
    "arrays, objects).",
    "",
    "If the thinking_mode is enabled, then after function results you should strongly consider "
    "outputting a thinking block. Here is an example:",
    "",
    f"<{DSML}function_calls>",
    "...",
    f"</{DSML}function_calls>",
    "",
    "<function_results>",
    "...",
    "</function_results>",
    "",
    f"{THINK_START}...thinking about results{THINK_END}",
    "",
    "Here are the functions available in JSONSchema format:",
    "<functions>",
    "{schemas}",
    "</functions>",
    "",
])


class DSV32PromptError(ChatTemplateError):
    """A message shape the DeepSeek-V3.2 format cannot encode (the server answers 400)."""


def thinking_requested(template_kwargs: dict[str, Any] | None) -> bool:
    """Thinking mode as vLLM reads it for V3.2: `thinking` or `enable_thinking` in the request's
    `chat_template_kwargs`; off by default."""
    kwargs = template_kwargs or {}
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


def render_dsv32(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 thinking: bool = False) -> str:
    """The prompt text for OpenAI chat `messages` (assistant tool-call arguments as JSON text or
    objects), the request's function `tools` (OpenAI's form) and the thinking mode. Raises
    DSV32PromptError naming the message for shapes the format has no encoding for."""
    if not isinstance(messages, list) or not messages:
        raise DSV32PromptError("messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DSV32PromptError(f"messages[{i}]: expected an object with a string 'role'")
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")),
                    default=-1)
    if thinking and messages[-1]["role"] == "user":
        # The encoder drops earlier turns' reasoning here, and with it (a flaw it has) developer
        # messages before the last user one, then fails: vLLM answers such requests with an error.
        early = next((i for i, m in enumerate(messages[:last_user]) if m["role"] == "developer"),
                     None)
        if early is not None:
            raise DSV32PromptError(f"messages[{early}]: in thinking mode a developer message "
                                   "must be the last user turn (DeepSeek-V3.2's encoder cannot "
                                   "write an earlier one)")
    parts = [BOS]
    if tools:  # vLLM puts them in a system message of their own, before the conversation
        parts.append("\n\n" + tools_section(tools))
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            parts.append(text_content(m, i))
        elif role in ("user", "developer"):
            parts.append(_user_turn(m, i, opens_thinking=thinking and i == last_user))
        elif role == "assistant":
            parts.append(_assistant_turn(m, i, with_reasoning=thinking and i > last_user))
        elif role == "tool":
            parts.append(_tool_result(messages, i, opens_thinking=thinking and i >= last_user))
        else:
            raise DSV32PromptError(f"messages[{i}].role: {role!r} is not one of system, user, "
                                   "developer, assistant, tool")
    return "".join(parts)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system-prompt section listing the tools' function schemas."""
    schemas = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise DSV32PromptError(f"tools[{j}]: expected an object with a 'function' object")
        schemas.append(_to_json(function))
    return _TOOLS_SECTION.replace("{schemas}", "\n".join(schemas))


def _user_turn(m: dict[str, Any], i: int, opens_thinking: bool) -> str:
    content = m.get("content")
    if content is None:
        raise DSV32PromptError(f"messages[{i}].content: a {m['role']} message needs content")
    text = text_content(m, i)
    if m["role"] == "developer":
        if not text:
            raise DSV32PromptError(f"messages[{i}].content: a developer message needs content")
        text = f"\n\n# The user's message is: {text}"
    return f"{USER}{text}{ASSISTANT}{THINK_START if opens_thinking else THINK_END}"


def _assistant_turn(m: dict[str, Any], i: int, with_reasoning: bool) -> str:
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise DSV32PromptError(f"messages[{i}].tool_calls: expected a list")
    reasoning = ""
    if with_reasoning:  # an answer after the last user message, in thinking mode
        thought = m.get("reasoning") or m.get("reasoning_content")
        if not thought and not calls:
            raise DSV32PromptError(
                f"messages[{i}]: in thinking mode an assistant message after the last user "
                "message needs reasoning_content or tool_calls")
        if thought is not None and not isinstance(thought, str):
            raise DSV32PromptError(f"messages[{i}].reasoning_content: expected a string")
        reasoning = (thought or "") + THINK_END
    invokes = "\n".join(_invoke(call, i, j) for j, call in enumerate(calls))
    calls_text = f"\n\n<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>" if calls \
        else ""
    return f"{reasoning}{text_content(m, i)}{calls_text}{EOS}"


def _invoke(call: Any, i: int, j: int) -> str:
    """One tool call: each argument a parameter, strings as they are, other values as JSON."""
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DSV32PromptError(f"{where}: expected an object with a 'function' naming it")
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise DSV32PromptError(f"{where}.function.arguments: not JSON: {e}") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise DSV32PromptError(f"{where}.function.arguments: expected a JSON object")
    params = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
              f"{v if isinstance(v, str) else _to_json(v)}</{DSML}parameter>"
              for key, v in args.items()]
    body = "\n".join(params)
    return f'<{DSML}invoke name="{function["name"]}">\n{body}\n</{DSML}invoke>'


def _tool_result(messages: list[dict[str, Any]], i: int, opens_thinking: bool) -> str:
    """One tool message: the k-th result of the assistant message before its group opens the
    <function_results> block, the last one (k = the number of calls) closes it."""
    call_at = i - 1
    while call_at >= 0 and messages[call_at]["role"] == "tool":
        call_at -= 1
    calls = messages[call_at].get("tool_calls") if call_at >= 0 \
        and messages[call_at]["role"] == "assistant" else None
    k = i - call_at  # 1-based position in the group
    if not isinstance(calls, list) or len(calls) < k:
        raise DSV32PromptError(f"messages[{i}]: a tool result must follow an assistant message "
                               "with as many tool_calls as results")
    if messages[i].get("content") is None:
        raise DSV32PromptError(f"messages[{i}].content: a tool message needs content")
    text = ("\n\n<function_results>" if k == 1 else "") + \
        f"\n<result>{text_content(messages[i], i)}</result>"
    if k == len(calls):
        text += f"\n</function_results>\n\n{THINK_START if opens_thinking else THINK_END}"
    return text


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
