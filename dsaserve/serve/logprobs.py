"""Engine logprob entries → OpenAI's two response formats (docs/serving.md).

A token's text is the tokenizer's decode of its id alone (special tokens included), as vLLM
shows it. A log-probability of −inf (a token outside a top-k filter keeps its raw value, but
fp32 may still underflow) is not JSON: it is written as −9999.0, vLLM's floor.

`LogprobSpans` ties the entries to the returned text: which tokens a stop string leaves, when a
stream may send an entry, and each token's `text_offset`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from os.path import commonprefix

from dsaserve.core import RequestError, SamplingParams, TokenLogprob
from dsaserve.serve.protocol import (
    ChatLogprob,
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprob,
)
from dsaserve.tokenizer import Tokenizer

_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR) if not math.isnan(logprob) else _FLOOR


def requested(field: str, value: int | None, max_logprobs: int) -> int | None:
    """A request's `logprobs` / `top_logprobs` checked against --max-logprobs (RequestError
    naming `field`)."""
    if value is not None and not 0 <= value <= max_logprobs:
        raise RequestError(f"{field}: must be in [0, {max_logprobs}] (--max-logprobs), "
                           f"got {value}")
    return value


@dataclass(frozen=True)
class PlacedLogprob:
    """An entry and where its token's text starts in the returned completion text."""

    entry: TokenLogprob
    offset: int


class LogprobSpans:
    """One response's entries, each tied to the span of the detokenized output its token's text
    fills, so that the entries sent describe the tokens whose text is returned.

    A token's span is known once the detokenizer releases its text. A token that releases
    nothing (a byte piece of an unfinished character, a skipped special token) joins the next
    token that releases text: the group shares one end. Within a group, a token starts after
    the characters that the tokens before it decode to on their own (the common prefix of their
    decode and the group's): a special token adds 0, the bytes of one character all start at
    that character, a lone invalid byte's U+FFFD counts one.

        tokens:  "is"  " S"  "TO"  "P"  " and"        stop = ["STOP"]
        ends:     2     4     6     7    11           text returned: "is " (3 characters)
        "STOP" spans 3..7: kept through "P", the first token whose end reaches 7

    A stop string keeps the entries of the tokens up to the one whose text completes it, as
    vLLM does: it checks stop strings after each token and returns the token that completed
    one (its token_ids and logprobs keep it, though its text is cut). Tokens after it exist
    only where one step emits several (MTP drafts); Generation never pushes them, as they would
    never have been generated. The kept tokens' offsets are clamped to the returned text's end
    ("TO" and "P" above: 3). A stream sends an entry only once its span is released (a stop
    string can only start in held-back text, so a sent entry is always kept); at the end, the
    rest.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._num_chars = 0  # characters of the detokenized output so far (before any cut)
        self._open: list[TokenLogprob] = []  # tokens whose text the detokenizer has not released
        self._placed: list[tuple[TokenLogprob, int, int]] = []  # (entry, start, end), not taken

    def push(self, entry: TokenLogprob, piece: str) -> None:
        """One generated token, in order, and the text its push into the detokenizer released."""
        self._open.append(entry)
        if piece:
            self._place(piece)

    def flush(self, piece: str) -> None:
        """The output ended: the detokenizer's last text (maybe empty) ends the open group."""
        if self._open:
            self._place(piece)

    def _place(self, piece: str) -> None:
        start, self._num_chars = self._num_chars, self._num_chars + len(piece)
        starts = [start] * len(self._open)
        if len(self._open) > 1:  # rare: byte pieces, special tokens
            ids = [e.token_id for e in self._open]
            whole = self._tokenizer.decode(ids)
            for j in range(1, len(ids)):
                same = len(commonprefix([self._tokenizer.decode(ids[:j]), whole]))
                starts[j] = start + min(same, len(piece))
        self._placed += [(e, s, self._num_chars) for e, s in zip(self._open, starts, strict=True)]
        self._open = []

    def take(self, released: int, *, final: bool) -> list[PlacedLogprob]:
        """The entries whose text lies within the first `released` characters (the text sent so
        far); `final`: all that are left, offsets clamped to `released` (the text's length)."""
        n = len(self._placed) if final else sum(1 for _, _, end in self._placed if end <= released)
        taken, self._placed = self._placed[:n], self._placed[n:]
        return [PlacedLogprob(e, min(start, released)) for e, start, _ in taken]


class LogprobFormatter:
    """One response's entries in OpenAI's formats (a stream's chunks call it in order)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._num_top = params.logprobs or 0
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if (text := self._texts.get(token_id)) is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def completion(self, placed: Sequence[PlacedLogprob]) -> CompletionLogprobs:
        """/v1/completions: `logprobs: N`. text_offset: where each token's text starts in the
        returned text (LogprobSpans; no `echo`, so the completion's text alone)."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for p in placed:
            e = p.entry
            text = self.text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(e.logprob))
            top = {self.text(t): _finite(lp) for t, lp in e.top[: self._num_top]}
            # the chosen token's too, as vLLM reports it; its value wins where another token
            # decodes to the same text (byte pieces of one character all read "\ufffd")
            top[text] = _finite(e.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(p.offset)
        return out

    def chat(self, placed: Sequence[PlacedLogprob]) -> ChatLogprobs:
        """/v1/chat/completions: `logprobs: true, top_logprobs: N`."""
        return ChatLogprobs(content=[ChatLogprob(
            token=self.text(e.token_id), logprob=_finite(e.logprob),
            bytes=list(self.text(e.token_id).encode()),
            top_logprobs=[TopLogprob(token=self.text(t), logprob=_finite(lp),
                                     bytes=list(self.text(t).encode()))
                          for t, lp in e.top[: self._num_top]])
            for e in (p.entry for p in placed)])
