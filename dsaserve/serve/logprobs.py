"""Engine logprob entries → OpenAI's two response formats (docs/serving.md).

A token's text is the tokenizer's decode of its id alone (special tokens included), as vLLM
shows it. A log-probability of −inf (a token outside a top-k filter keeps its raw value, but
fp32 may still underflow) is not JSON: it is written as −9999.0, vLLM's floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


class LogprobFormatter:
    """One response's entries in OpenAI's formats; streamed chunks call it in order (the
    completions format's text offsets continue across chunks)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._num_top = params.logprobs or 0
        self._texts: dict[int, str] = {}
        self._offset = 0  # characters of the completion's token texts so far

    def text(self, token_id: int) -> str:
        if (text := self._texts.get(token_id)) is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def completion(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """/v1/completions: `logprobs: N`."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for e in entries:
            text = self.text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(e.logprob))
            top = {self.text(t): _finite(lp) for t, lp in e.top[: self._num_top]}
            # the chosen token's too, as vLLM reports it; its value wins where another token
            # decodes to the same text (byte pieces of one character all read "\ufffd")
            top[text] = _finite(e.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        """/v1/chat/completions: `logprobs: true, top_logprobs: N`."""
        return ChatLogprobs(content=[ChatLogprob(
            token=self.text(e.token_id), logprob=_finite(e.logprob),
            bytes=list(self.text(e.token_id).encode()),
            top_logprobs=[TopLogprob(token=self.text(t), logprob=_finite(lp),
                                     bytes=list(self.text(t).encode()))
                          for t, lp in e.top[: self._num_top]])
            for e in entries])
