"""ChatOutputParser: one chat request's generated text, in deltas → reasoning, content and tool
calls."""

from __future__ import annotations

from dsaserve.serve.tools.base import ChatDelta, ToolParser
from dsaserve.serve.tools.reasoning import ReasoningSplitter


class ChatOutputParser:
    """One chat request's generated text, in deltas → ChatDelta's: first the reasoning is split
    off (if a reasoning parser is on), then the content goes through the tool parser (if the
    request's tools are parsed). `push` + `finish` deltas join to the whole text's parse.

        "I should look.</think>On it.<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value>
         </tool_call>"
        → reasoning "I should look.", content "On it.", calls [f({"x": 1})]
    """

    def __init__(self, tool_parser: ToolParser | None, reasoning: ReasoningSplitter | None,
                 max_calls: int | None = None) -> None:
        self._tools = tool_parser
        self._reasoning = reasoning
        self._max_calls = max_calls  # `parallel_tool_calls: false`: 1 (later calls are dropped)
        self.num_calls = 0

    def push(self, delta: str) -> ChatDelta:
        reasoning, content = self._reasoning.push(delta) if self._reasoning else ("", delta)
        return self._content(reasoning, content, last=False)

    def finish(self) -> ChatDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._content(reasoning, content, last=True)

    def _content(self, reasoning: str, content: str, last: bool) -> ChatDelta:
        if self._tools is None:
            out = ChatDelta(reasoning, content)
        else:
            out = self._tools.push(content) if content else ChatDelta()
            if last:
                out.extend(self._tools.finish())
            out.reasoning = reasoning
        if self._max_calls is not None:
            out.calls = out.calls[:max(self._max_calls - self.num_calls, 0)]
        self.num_calls += len(out.calls)
        return out
