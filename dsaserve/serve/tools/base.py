"""The vocabulary of parsed chat output and the incremental tag splitter every parser builds on."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsaserve.serve.tools.values import schema_types


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object as text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass
class ChatDelta:
    """What one piece of generated text adds to the message: reasoning, content, whole calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser(Protocol):
    """One request's tool-call parser: text deltas in, content and complete calls out."""

    def push(self, delta: str) -> ChatDelta: ...

    def finish(self) -> ChatDelta: ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: characters that
    may be the start of `tag` and must wait for the next delta.

        text = "see <tool_ca"   tag = "<tool_call>"   → 8
        text = "see <tool"      tag = "<think>"       → 0 ("<t" is not a suffix of it)
    """
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Piece:
    """A TagSplitter output: text outside blocks, or one whole block's inner text."""

    text: str
    is_block: bool = False


class TagSplitter:
    """Splits streamed text into the text outside `start … end` blocks and the blocks' insides.

    Outside a block, text is released at once except a tail that may be the start of `start`;
    inside, nothing is released until `end` arrives. An unfinished block (or a held tail) is
    returned as text by `finish`, tags included, so nothing the model wrote is lost. The
    pieces do not depend on how the text was cut into deltas: each `start` and `end` is the first
    occurrence after the previous tag, exactly as in the whole text.

        deltas: "a <to", "ol_call>f", "</tool_call> b"
        pieces:  "a "    (hold "<to")   block "f", " b"

    A block's text is kept as a list of deltas and only the newest delta (with the few characters
    before it) is searched for `end`, so a long argument costs linear time, not quadratic.
    """

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._held = ""  # outside: a tail that may be the start of `start`
        self._inside = False
        self._parts: list[str] = []  # inside: the block's text so far
        self._tail = ""  # inside: its last len(end) - 1 characters

    def push(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._inside:
                window = self._tail + delta
                i = window.find(self.end)
                if i < 0:
                    self._parts.append(delta)
                    self._tail = window[max(len(window) - len(self.end) + 1, 0):]
                    return out
                inner = "".join(self._parts)  # ends with self._tail, where window starts
                cut = len(inner) - len(self._tail) + i
                text = inner + delta
                out.append(Piece(text[:cut], is_block=True))
                delta = text[cut + len(self.end):]
                self._parts, self._tail, self._inside = [], "", False
            else:
                text = self._held + delta
                i = text.find(self.start)
                if i < 0:
                    keep = partial_suffix(text, self.start)
                    if len(text) > keep:
                        out.append(Piece(text[:len(text) - keep]))
                    self._held = text[len(text) - keep:]
                    return out
                if i:
                    out.append(Piece(text[:i]))
                delta = text[i + len(self.start):]
                self._held, self._inside = "", True

    def finish(self) -> list[Piece]:
        text = self.start + "".join(self._parts) if self._inside else self._held
        self._held, self._parts, self._tail, self._inside = "", [], "", False
        return [Piece(text)] if text else []


class BlockToolParser(ABC):
    """A ToolParser whose calls sit in `start … end` blocks: `parse_block` turns a block's inside
    into calls; a block it cannot read (None) stays in the content, tags and all."""

    start: str
    end: str

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools or []
        self._splitter = TagSplitter(self.start, self.end)

    @abstractmethod
    def parse_block(self, inner: str) -> list[ToolCall] | None:
        """A block's inside → its calls; None: not a call (the block stays content)."""

    def push(self, delta: str) -> ChatDelta:
        return self._collect(self._splitter.push(delta))

    def finish(self) -> ChatDelta:
        return self._collect(self._splitter.finish())

    def _collect(self, pieces: list[Piece]) -> ChatDelta:
        out = ChatDelta()
        for p in pieces:
            calls = self.parse_block(p.text) if p.is_block else None
            if calls:
                out.calls.extend(calls)
            else:
                out.content += self.start + p.text + self.end if p.is_block else p.text
        return out

    def param_types(self, name: str) -> dict[str, set[str]]:
        """The JSON-schema types of each parameter of tool `name` ({} for an unknown tool, or a
        schema whose `properties` is no object: the client's schema is not validated)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                props = (function.get("parameters") or {}).get("properties")
                if not isinstance(props, dict):
                    return {}
                return {k: schema_types(v) for k, v in props.items() if isinstance(v, dict)}
        return {}
