"""Reasoning: the text a model writes between `<think>` and `</think>` → `reasoning_content`.

The chat templates open the thinking themselves: GLM-5's generation prompt ends in
`<|assistant|><think>` (or `</think>` with `enable_thinking: false`), DeepSeek-V3.2's in `<think>`
with `thinking: true`. So the output starts inside the reasoning, without the opening tag, and
`</think>` ends it. Whether a request thinks comes from its `chat_template_kwargs`, as vLLM
decides it:

    glm45 / glm47   thinking unless `enable_thinking` or `thinking` is given and false
                    (vLLM's Glm47MoeParser: both absent → on)
    deepseek_v3     thinking only if `thinking` or `enable_thinking` is true
                    (vLLM's DeepSeekV3ReasoningParser: R1's parser if so, else none)
    deepseek_r1     always thinking

A thinking output: an opening `<think>` at its very start is dropped; the reasoning runs to the
first `</think>` (dropped) — or, for GLM, to the first `<tool_call>`, which stays in the content
(vLLM's GLM-4.7 parser ends the reasoning there); everything after is content. An output that
never closes its reasoning is all reasoning (vLLM: `reasoning, None`). A request that does not
think has no reasoning: its text is all content, tags included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsaserve.serve.tools.base import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """One `--reasoning-parser`: whether a request thinks by default, and the tags that end its
    reasoning and stay in the content."""

    thinking_by_default: bool
    kept_ends: tuple[str, ...] = ()
    always: bool = False  # thinks whatever the request says

    def thinks(self, template_kwargs: dict[str, Any] | None) -> bool:
        kwargs = template_kwargs or {}
        if self.always:
            return True
        flags = [kwargs.get(k) for k in ("thinking", "enable_thinking")]
        if all(f is None for f in flags):
            return self.thinking_by_default
        return any(bool(f) for f in flags)


class ReasoningSplitter:
    """One request's output text deltas → (reasoning, content) deltas. Split-invariant: the
    tail that may be the start of `<think>` (before any reasoning) or of an end tag is held
    back until the next delta decides it."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool) -> None:
        self._ends = (THINK_END, *fmt.kept_ends)
        self._kept = set(fmt.kept_ends)
        self._in_reasoning = thinking
        self._at_start = thinking  # nothing released yet: a `<think>` here is dropped
        self._buf = ""

    def push(self, delta: str) -> tuple[str, str]:
        if not self._in_reasoning:
            return "", delta
        self._buf += delta
        if self._at_start:
            if THINK_START.startswith(self._buf):
                return "", ""  # maybe the opening tag: wait
            self._buf = self._buf.removeprefix(THINK_START)
            self._at_start = False
        found = [(i, tag) for tag in self._ends if (i := self._buf.find(tag)) >= 0]
        if found:
            i, tag = min(found)
            reasoning, rest = self._buf[:i], self._buf[i + (0 if tag in self._kept else len(tag)):]
            self._buf, self._in_reasoning = "", False
            return reasoning, rest
        keep = max(partial_suffix(self._buf, tag) for tag in self._ends)
        reasoning = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The held tail: reasoning (the reasoning was never closed)."""
        text, self._buf = self._buf, ""
        if self._at_start:  # the whole output was a prefix of "<think>"
            text = "" if text == THINK_START else text
        return text, ""
