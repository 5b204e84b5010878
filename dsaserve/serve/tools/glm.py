"""GLM-4.5 / 4.7 / 5 tool calls (vLLM's `glm45` and `glm47` parsers), as the chat template writes
them back into the prompt:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 and 5 drop the newlines (`<tool_call>get_weather<arg_key>city</arg_key>…`), and a call may
have no arguments (`<tool_call>now</tool_call>`). Values are text: a string parameter's is kept
as written, any other's is read as JSON (values.coerce), so `3` is the number 3 and
`{"a": 1}` an object.
"""

from __future__ import annotations

import re

from dsaserve.serve.tools.base import BlockToolParser, ToolCall
from dsaserve.serve.tools.values import arguments_json, coerce

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"\n|<arg_key>")


class GlmToolParser(BlockToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_block(self, inner: str) -> list[ToolCall] | None:
        m = _NAME_END.search(inner)
        name = (inner[:m.start()] if m else inner).strip()
        if not name or "<" in name:  # no name, or one that is markup: not a call
            return None
        rest = inner[m.start():] if m else ""
        types = self.param_types(name)
        args = {k.strip(): coerce(v, types.get(k.strip(), set())) for k, v in _ARG.findall(rest)}
        return [ToolCall(name, arguments_json(args))]
