"""DeepSeek-V3.2 tool calls (vLLM's `deepseek_v32` parser): DSML, one block of one or more
invocations, each parameter saying whether its value is a string:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"` values are kept as written; the others are read as JSON (values.coerce, with the
tool's schema types). The calls of a block are released when the block closes.
"""

from __future__ import annotations

import re

from dsaserve.serve.tools.base import BlockToolParser, ToolCall
from dsaserve.serve.tools.values import arguments_json, coerce

BAR = "\uff5c"  # "｜", FULLWIDTH VERTICAL LINE, as in DeepSeek's special tokens
DSML = f"{BAR}DSML{BAR}"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)'
                    rf'</{DSML}parameter>', re.DOTALL)


class DeepSeekV32ToolParser(BlockToolParser):
    start = f"<{DSML}function_calls>"
    end = f"</{DSML}function_calls>"

    def parse_block(self, inner: str) -> list[ToolCall] | None:
        calls = []
        for name, body in _INVOKE.findall(inner):
            types = self.param_types(name)
            args = {k: v if is_str == "true" else coerce(v, types.get(k, set()))
                    for k, is_str, v in _PARAM.findall(body)}
            calls.append(ToolCall(name, arguments_json(args)))
        return calls or None
