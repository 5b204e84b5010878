"""The parsers by vLLM's names, and the choice of one request's output parser from its tool
fields (vLLM's rules)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dsaserve.serve.tools.base import ToolParser
from dsaserve.serve.tools.dsml import DeepSeekV32ToolParser
from dsaserve.serve.tools.glm import GlmToolParser
from dsaserve.serve.tools.output import ChatOutputParser
from dsaserve.serve.tools.reasoning import ReasoningFormat, ReasoningSplitter

# --tool-call-parser NAME → a parser for one request, given its `tools`
TOOL_PARSERS: dict[str, Callable[[list[dict[str, Any]] | None], ToolParser]] = {
    "glm45": GlmToolParser,
    "glm47": GlmToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
}

# --reasoning-parser NAME
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "glm45": ReasoningFormat(thinking_by_default=True, kept_ends=("<tool_call>",)),
    "glm47": ReasoningFormat(thinking_by_default=True, kept_ends=("<tool_call>",)),
    "deepseek_v3": ReasoningFormat(thinking_by_default=False),
    "deepseek_r1": ReasoningFormat(thinking_by_default=True, always=True),
}


class ToolRequestError(ValueError):
    """A request's tool fields this server cannot honour; `param` names the field (→ 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_output_parser(*, tool_call_parser: str | None, reasoning_parser: str | None,
                       enable_auto_tool_choice: bool, tools: list[dict[str, Any]] | None,
                       tool_choice: str | dict[str, Any] | None,
                       parallel_tool_calls: bool | None,
                       template_kwargs: dict[str, Any] | None) -> ChatOutputParser | None:
    """The parser of one chat request's output (None: its text is all content), as vLLM decides:
    `tool_choice` defaults to "auto" with tools and "none" without; "auto" needs the server's
    --enable-auto-tool-choice and --tool-call-parser (vLLM's 400 otherwise); "none" renders the
    tools but parses no calls. "required" and a named function need guided decoding, which this
    server does not have: a 400."""
    if tool_choice is not None and tools is None:
        raise ToolRequestError("tool_choice: when using `tool_choice`, `tools` must be set",
                               "tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise ToolRequestError(f"tool_choice: only \"auto\" and \"none\" are supported (no guided "
                               f"decoding for {json.dumps(tool_choice)})", "tool_choice")
    choice = tool_choice or ("auto" if tools else "none")
    if choice == "auto" and not (enable_auto_tool_choice and tool_call_parser):
        raise ToolRequestError('tools: "auto" tool choice requires --enable-auto-tool-choice and '
                               "--tool-call-parser to be set", "tools")
    parse_tools = choice == "auto" and bool(tools) and tool_call_parser is not None
    tool_parser = TOOL_PARSERS[tool_call_parser](tools) if parse_tools else None
    splitter = None
    if reasoning_parser is not None:
        fmt = REASONING_PARSERS[reasoning_parser]
        splitter = ReasoningSplitter(fmt, fmt.thinks(template_kwargs))
    if tool_parser is None and splitter is None:
        return None
    return ChatOutputParser(tool_parser, splitter, None if parallel_tool_calls is not False else 1)
