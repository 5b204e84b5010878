"""The OpenAI-compatible HTTP front: chat and text completions (streaming or not), models, health,
metrics. One app serves one model through one AsyncEngine.

A request's life here:
    1. authenticate (all but /health), limit the body size (→ 413), parse and type-check the
       body (pydantic; bad input or an unimplemented field → 400);
    2. render the chat template / tokenize off the event loop; build SamplingParams (→ 400);
    3. admission by the engine core (prompt too long → 400; engine dead → 503);
    4. outputs → incremental detokenization → stop strings → (chat, with --reasoning-parser or
       parsed tools) reasoning / content / tool calls (serve/tools) → SSE chunks or one JSON body;
    5. leaving early (client gone, stop string) aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsaserve.config import ConfigError
from dsaserve.core import KVTransferParams, RequestError, SamplingParams
from dsaserve.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestStream,
    StreamOverflowError,
)
from dsaserve.serve.auth import APIKeyMiddleware
from dsaserve.serve.drain import DrainMiddleware, DrainState
from dsaserve.serve.guard_metrics import GuardCollector
from dsaserve.serve.limits import RequestLimitError, check_lengths, check_supported
from dsaserve.serve.logprobs import LogprobFormatter, LogprobSpans, PlacedLogprob, requested
from dsaserve.serve.metrics import RequestTracker, ServerMetrics
from dsaserve.serve.middleware import BodySizeLimitMiddleware
from dsaserve.serve.prompt import (
    ChatFormat,
    PromptError,
    chat_format_for,
    completion_prompt,
    render_chat,
)
from dsaserve.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    KVInfo,
    ModelCard,
    ModelList,
    ToolCallOut,
    Usage,
    new_id,
    template_tools,
)
from dsaserve.serve.tools.base import ChatDelta
from dsaserve.serve.tools.output import ChatOutputParser
from dsaserve.serve.tools.registry import ToolRequestError, chat_output_parser
from dsaserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `dsaserve serve` (the engine has its own EngineConfig)."""

    served_model_name: str
    api_key: str | None = None  # when set, all but /health need `Authorization: Bearer <key>`
    host: str = "127.0.0.1"
    port: int = 8000
    # Agent sessions idle between turns for minutes; a short keep-alive would cut their connections.
    timeout_keep_alive_s: int = 3600
    # ZMQ endpoints publishing KV events (one per DP replica; empty when disabled), for /kv_info.
    kv_events_endpoints: tuple[str, ...] = ()
    # Larger bodies get a 413 before they are parsed. 32 MiB holds a 1M-token prompt as token ids
    # (~7 bytes each in JSON) or as text.
    max_request_body_bytes: int = 32 * 2**20
    # Chat output parsing (vLLM's flags; serve/tools): requests with tools and tool_choice "auto"
    # need both of the first two, else they get vLLM's 400.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a serve.tools.TOOL_PARSERS name
    reasoning_parser: str | None = None  # a serve.tools.REASONING_PARSERS name
    # Chat prompts (serve/prompt.py chat_format_for): --tokenizer-mode, --chat-template's text
    tokenizer_mode: str = "auto"
    chat_template: str | None = None


class APIError(Exception):
    """A failure reported to the client as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowed", 408: "RequestTimeout", 413: "RequestTooLarge",
                500: "InternalServerError", 503: "ServiceUnavailable"}


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    kind = _ERROR_TYPES.get(status, "Error")
    # Messages may quote client text; a lone surrogate in it would make the error body unencodable.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


# ------------------------------------------------------------------------------------------------
# Stop strings (pure): matched on the detokenized text, never released to the client
# ------------------------------------------------------------------------------------------------
def find_stop(text: str, stop: Sequence[str], num_new: int | None = None) -> int:
    """Start of the stop string that completes first in `text`, or -1; `num_new`: only those
    ending in its last `num_new` characters (the text before them was searched already).
    `first_stop` also names the string.

    The earliest end, not the earliest start, is what one token at a time finds: the text stops
    growing at the first stop string it completes, whatever longer one started before it. Of
    several ending at one place, the first in `stop` wins (vLLM's check_stop_strings: earliest
    end, then list order). So the answer does not depend on how tokens were grouped in outputs:

        text = "xABCD"   stop = ["ABCD", "C"]   → 3 ("C" ends at 4, "ABCD" at 5)
        text = "xAB"     stop = ["AB", "B"]     → 1 (both end at 3: "AB" is listed first)
    """
    found = first_stop(text, stop, num_new)
    return -1 if found is None else found[0]


def first_stop(text: str, stop: Sequence[str], num_new: int | None = None
               ) -> tuple[int, str] | None:
    """find_stop's stop string and where it starts; None where none completes."""
    best: tuple[int, str] | None = None
    best_end = len(text) + 1
    for s in stop:
        i = text.find(s, 0 if num_new is None else max(len(text) - num_new - len(s) + 1, 0))
        if i >= 0 and i + len(s) < best_end:
            best, best_end = (i, s), i + len(s)
    return best


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string: they are held
    back until the next output shows whether the stop string completes.

        text = "... the answer is ST"   stop = ["STOP"]   → 2 ("ST" may become "STOP")
        text = "... the answer is"      stop = ["STOP"]   → 0

    Whichever stop string later completes first (find_stop), it starts within these characters:
    the part of it already generated is a suffix of `text` and a proper prefix of it.
    """
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


# ------------------------------------------------------------------------------------------------
# One generation: engine outputs → text deltas
# ------------------------------------------------------------------------------------------------
class Generation:
    """Consumes one request's outputs and yields its text in pieces, applying stop strings.

    Invariant: the pieces concatenate to what generating one token at a time returns, however
    the tokens were grouped in outputs (an MTP step emits several): stop strings are searched
    after each token, for those ending in the text that token released, joined with the text
    held back (searched already), so a stop string that straddles two steps is found:

        step k:    "... is ST"      → release "... is ",  hold "ST"
        step k+1:  "ST" + "OP now"  → "STOP" found at 0 after "OP": release nothing, finish
                                       with "stop"; the step's tokens after "OP" are dropped

    The tokens after the one completing a stop string would never have been generated: they
    count in no usage and carry no logprob entry, so usage.completion_tokens is the number of
    tokens returned (that of the entries, when logprobs are asked).

    `min_tokens` (vLLM's): stop strings are searched only from the token that makes the output
    longer than min_tokens on, in the text it completes (a stop string may start in the earlier
    tokens' text, but one they complete does not count). The engine never samples EOS (unless
    ignore_eos) or a stop_token_ids entry before min_tokens: it masks them out of sampling, as
    vLLM's MinTokensLogitsProcessor does.

    `stop_reason` (vLLM's): the stop string that cut the text, or the stop_token_ids entry that
    ended the request (RequestOutput.stop_token_id); None for EOS, length or an abort. The token
    that ended a request (EOS or a stop id) counts in usage and has its logprob entry, but its
    text is not returned, as in vLLM.

    The logprob entries (SamplingParams.logprobs) follow the text: `take_logprobs` gives those
    whose text has been yielded, and the rest once the generation ended (serve/logprobs.py,
    LogprobSpans: each token's text offset).

    `close()` is idempotent and runs on every exit path: it aborts the request in the engine if it
    has not finished (client gone, stop string) and records the request's metrics.
    """

    def __init__(self, stream: RequestStream, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: tuple[str, ...], tracker: RequestTracker, min_tokens: int = 0) -> None:
        self.stream = stream
        self.stop = stop
        self.min_tokens = min_tokens
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0  # tokens returned: through the one completing a stop string
        self.kv_transfer_params: dict[str, Any] | None = None  # P/D: from the final output
        self.error: str | None = None  # the engine failed this request (e.g. its remote KV)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._tracker = tracker
        self._held = ""  # text that may be the start of a stop string
        self._num_released = 0  # characters of text yielded so far
        self._ended = False  # deltas() has returned: no more text will come
        self._closed = False
        # the logprob entries (SamplingParams.logprobs) of the tokens received, tied to their text
        self._logprobs = LogprobSpans(tokenizer)

    def take_logprobs(self) -> list[PlacedLogprob]:
        """The logprob entries not taken yet whose text has been yielded, in token order; once
        deltas() has returned, all that are left (the tokens up to the one that completed a
        stop string), so a stream's last piece of text never carries the entries of text it
        withholds: the finishing chunk does."""
        return self._logprobs.take(self._num_released, final=self._ended)

    @property
    def usage(self) -> Usage:
        return Usage.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    async def deltas(self) -> AsyncIterator[str]:
        try:
            async for out in self.stream:
                # The engine's work, as vLLM's generation_tokens counts it: every token of the
                # output, those past a stop string included (usage counts the tokens returned).
                self._tracker.on_output(out)
                self.num_prompt_tokens = out.num_prompt_tokens
                self.num_cached_tokens = max(out.num_cached_tokens, 0)  # -1: never scheduled
                text, found = self._held, None
                # an EOS or stop_token_ids entry that ended the request counts, but its text is
                # not returned (vLLM's, without include_stop_str_in_output)
                last = (len(out.new_token_ids) - 1 if out.finished and out.finish_reason == "stop"
                        else -1)
                for k, t in enumerate(out.new_token_ids):
                    text += (piece := self._detok.push(t) if k != last else "")
                    self.num_output_tokens += 1
                    if out.logprobs is not None:
                        self._logprobs.push(out.logprobs[k], piece)
                    if (found := self._find_stop(text, piece)) is not None:
                        break  # the later tokens would never have been generated
                if out.finished:
                    if found is None:
                        text += (piece := self._detok.flush())
                        self._logprobs.flush(piece)
                        found = self._find_stop(text, piece)
                    self.finish_reason = out.finish_reason
                    self.stop_reason = out.stop_token_id
                    self.error = out.error
                    if out.kv_transfer_params is not None:
                        self.kv_transfer_params = out.kv_transfer_params.to_json()
                if found is not None:
                    text = text[:found[0]]
                    self.finish_reason, self.stop_reason = "stop", found[1]
                    self.stream.abort()  # the engine would otherwise keep generating
                keep = 0 if self.finish_reason is not None else held_back(text, self.stop)
                self._held = text[len(text) - keep:]
                if piece := text[:len(text) - keep]:
                    self._num_released += len(piece)
                    yield piece
                if self.finish_reason is not None:
                    return
        finally:
            self._ended = True
            self.close()

    def _find_stop(self, text: str, piece: str) -> tuple[int, str] | None:
        """The stop string completed by `piece`, the end of `text`, and where it starts; None
        when none is, or while the output is not longer than min_tokens."""
        if not (self.stop and piece) or self.num_output_tokens <= self.min_tokens:
            return None
        return first_stop(text, self.stop, len(piece))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Ended by EngineDeadError (an overflow is an abort: the client's doing, not the engine's).
        dead = self.finish_reason is None and self.stream.finished and not self.stream.overflowed
        self.stream.abort()
        reason = self.finish_reason or ("error" if dead else "abort")
        self._tracker.on_finish(reason, self.num_prompt_tokens)


# ------------------------------------------------------------------------------------------------
# Request → prompt ids + SamplingParams
# ------------------------------------------------------------------------------------------------
def _render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                 template_kwargs: dict[str, Any] | None,
                 tools: list[dict[str, Any]] | None, chat_format: ChatFormat) -> list[int]:
    try:
        return render_chat(tokenizer, messages, template_kwargs, tools, chat_format)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param) from e


def _completion_prompt(tokenizer: Tokenizer, prompt: str | list[Any], vocab_size: int) -> list[int]:
    try:
        return completion_prompt(tokenizer, prompt, vocab_size)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param) from e


def _logprobs(body: ChatCompletionRequest | CompletionRequest, max_logprobs: int) -> int | None:
    """SamplingParams.logprobs from the request: chat's `logprobs: true` + `top_logprobs`,
    completions' `logprobs: N`; a 400 naming the field beyond --max-logprobs."""
    if isinstance(body, CompletionRequest):
        field, value = "logprobs", body.logprobs
    else:
        field, value = "top_logprobs", body.top_logprobs
        if value and not body.logprobs:  # 0 asks for nothing
            raise APIError(400, "top_logprobs: needs logprobs set to true", param=field)
        value = (value or 0) if body.logprobs else None
    try:
        return requested(field, value, max_logprobs)
    except RequestError as e:
        raise APIError(400, str(e), param=field) from e


def _sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                     num_prompt_tokens: int, max_model_len: int,
                     default_max_tokens: int | None = None,
                     max_logprobs: int = 20) -> SamplingParams:
    """`max_tokens` as the client sent it (None: absent); `default_max_tokens` replaces an absent
    one, capped to the context (None: the rest of the context)."""
    check_supported(body)
    chat = isinstance(body, ChatCompletionRequest)
    max_tokens_field = "max_completion_tokens" if chat and body.max_completion_tokens is not None \
        else "max_tokens"
    if max_tokens is not None and max_tokens < 1:  # before the checks that compare with it
        raise APIError(400, f"{max_tokens_field}: must be at least 1, got {max_tokens}",
                       param=max_tokens_field)
    check_lengths(num_prompt_tokens, max_tokens, max_model_len,
                  prompt_field="messages" if chat else "prompt", max_tokens_field=max_tokens_field)
    if body.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name}: penalties are not supported (must be 0)", param=name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true",
                       param="stream_options")
    if max_tokens is None:  # the rest of the context, as vLLM does, or the default if shorter
        max_tokens = min(max_model_len - num_prompt_tokens, default_max_tokens or max_model_len)
    if not 0 <= body.min_tokens <= max_tokens:  # an absent max_tokens: the one it defaults to
        raise APIError(400, f"min_tokens: must be in [0, {max_tokens_field} = {max_tokens}], "
                       f"got {body.min_tokens}", param="min_tokens")
    logprobs = _logprobs(body, max_logprobs)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
        )
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from e


def _output_parser(body: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                   config: ServerConfig) -> ChatOutputParser | None:
    """The request's tool-call / reasoning parser (serve/tools); a 400 for tool fields it cannot
    honour."""
    choice = body.tool_choice
    try:
        return chat_output_parser(
            tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice, tools=tools,
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice,
            parallel_tool_calls=body.parallel_tool_calls,
            template_kwargs=body.chat_template_kwargs)
    except ToolRequestError as e:
        raise APIError(400, str(e), param=e.param) from e


def _delta_message(delta: ChatDelta, first_index: int) -> DeltaMessage:
    """A parsed delta as a chunk's delta: each call whole (id, name and all its arguments) in one
    entry, numbered from `first_index`."""
    calls = [DeltaToolCall(index=first_index + k, id=c.id, type="function",
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for k, c in enumerate(delta.calls)]
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        reasoning=delta.reasoning or None, tool_calls=calls or None)


def _parsed_message(delta: ChatDelta) -> ChatMessage:
    """The whole parsed output as the response message: content None when empty (or only
    whitespace around calls), as vLLM returns it."""
    content = delta.content if delta.content.strip() or not delta.calls else ""
    calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in delta.calls]
    return ChatMessage(content=content or None, reasoning_content=delta.reasoning or None,
                       reasoning=delta.reasoning or None, tool_calls=calls)


def _continuous_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far (it
    needs include_usage, as in vLLM)."""
    options = body.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


# Stop strings are searched after every token on the event loop that serves every stream: 200k of
# them (a 3 MB body) held a concurrent 5-token request for 14 s. OpenAI takes 4.
MAX_STOP_STRINGS = 128


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                       param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop: stop strings must be non-empty", param="stop")
    return stops


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
def _sse(obj: BaseModel) -> str:
    """A streamed chunk; `kv_transfer_params` only on the one P/D set it on."""
    unset = "kv_transfer_params" in type(obj).model_fields and obj.kv_transfer_params is None
    return f"data: {obj.model_dump_json(exclude={'kv_transfer_params'} if unset else None)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _dump(response: BaseModel) -> dict[str, Any]:
    """A response as JSON; `kv_transfer_params` only where P/D set it (vLLM's field)."""
    out = response.model_dump()
    if out.get("kv_transfer_params") is None:
        out.pop("kv_transfer_params", None)
    return out


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (→ None).

    Streaming responses are cancelled by Starlette itself; a non-streaming handler is not, so this
    watches the connection to free the KV blocks of a request nobody waits for.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    await asyncio.wait({task})  # a cancelled task finishes cancelling (its cleanup runs) here
    return None if task.cancelled() else task.result()


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app for one AsyncEngine; the caller owns the engine (and shuts it down)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ConfigError(f"--model: {engine.config.model_path} has no tokenizer.json; "
                          "the server needs a tokenizer")
    chat_format = chat_format_for(engine.config.model_path, tokenizer, config.tokenizer_mode,
                                  config.chat_template)
    model_name = config.served_model_name
    max_model_len = engine.config.scheduler.max_model_len
    max_logprobs = engine.config.scheduler.max_logprobs
    metrics = ServerMetrics(model_name, engine.stats, max_model_len)
    guards = GuardCollector(model_name)
    guards.counter("stream_buffer_overflows", "Requests aborted because their client stopped "
                   "reading (more than --max-stream-buffer outputs behind).",
                   lambda: engine.num_stream_overflows)
    metrics.registry.register(guards)
    app = FastAPI(title="dsaserve", version="0.1.0")
    app.state.chat_format = chat_format  # for the start-up line
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:  # added late: outer, so nothing runs for an unauthorized client
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.state.drain = DrainState()  # started by the serving loop (drain.DrainingServer)
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    guards.gauge("draining", "1 while the server drains for shutdown.",
                 lambda: app.state.drain.draining)
    guards.counter("requests_refused_draining", "Requests refused (503) while draining.",
                   lambda: app.state.drain.num_refused)

    # ---- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestLimitError)
    async def _limit_error(_: Request, e: RequestLimitError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        parts: list[str] = []
        param = None
        for err in e.errors():
            if err["type"] == "json_invalid":
                reason = err.get("ctx", {}).get("error", err["msg"])
                return error_response(400, f"malformed JSON body: {reason}")
            if err["loc"] == ("body",) and err["type"] == "missing":
                return error_response(400, "the body is empty: expected a JSON object")
            if err["loc"] == ("body",) and isinstance(err.get("input"), bytes):
                # FastAPI reads JSON only under a JSON Content-Type (`curl -d` sends a form's)
                kind = request.headers.get("content-type")
                return error_response(400, "the body must be a JSON object sent with "
                                      f"Content-Type: application/json, not {kind}")
            loc = ".".join(str(p) for p in err["loc"][1:]) or "body"
            param = param or loc
            part = f"{loc}: {err['msg']}"
            if part not in parts:
                parts.append(part)
        return error_response(400, "; ".join(parts[:4]), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    # ---- plain endpoints -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        return error_response(503, f"engine is not running: {engine.dead_reason}")

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        card = ModelCard(id=model_name, root=engine.config.model_path, max_model_len=max_model_len)
        return ModelList(data=[card])

    @app.get("/kv_info")
    async def kv_info() -> KVInfo:
        """What a router needs to hash prompts as this engine does and to follow its cache."""
        cache, parallel = engine.config.cache, engine.config.parallel
        return KVInfo(model=model_name, block_size=cache.block_size
                      * parallel.decode_context_parallel_size,
                      enable_prefix_caching=cache.enable_prefix_caching,
                      data_parallel_size=parallel.data_parallel_size,
                      kv_events_endpoints=list(config.kv_events_endpoints))

    # ---- completions ---------------------------------------------------------------------------
    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                           f"'{model_name}').", param="model")

    async def start(request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stops: tuple[str, ...], body: ChatCompletionRequest | CompletionRequest
                    ) -> Generation:
        tracker = metrics.track(max_tokens=params.max_tokens, n=body.n)
        try:
            kv_params = (None if body.kv_transfer_params is None
                         else KVTransferParams.from_json(body.kv_transfer_params))
            stream = await engine.add_request(request_id, prompt_ids, params,
                                              cache_salt=body.cache_salt,
                                              kv_transfer_params=kv_params)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        except EngineDeadError as e:
            raise APIError(503, f"engine is not running: {e}") from e
        return Generation(stream, tokenizer, prompt_ids, stops, tracker, params.min_tokens)

    def streaming(gen: Generation, frames: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for frame in frames:
                    yield frame
                if gen.error is not None:  # the engine failed this request (only this one)
                    yield _sse(error_body(500, gen.error))
            except EngineDeadError as e:
                yield _sse(error_body(500, f"engine failed: {e}"))
            except StreamOverflowError as e:
                yield _sse(error_body(408, str(e)))
            except Exception as e:  # a bug: this stream ends with its error (and [DONE]), as the
                # 500 of a non-streaming request would, and the request is aborted (background)
                logger.exception("unhandled error in a stream")
                yield _sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
            yield _SSE_DONE

        # Starlette cancels the body when the client disconnects, then runs the background task.
        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(gen.close))

    async def collect(gen: Generation) -> str:
        return "".join([piece async for piece in gen.deltas()])

    async def complete(request: Request, gen: Generation) -> str | None:
        try:
            text = await unless_disconnected(request, collect(gen))
            if gen.error is not None:
                raise APIError(500, gen.error)
            return text
        except EngineDeadError as e:
            raise APIError(500, f"engine failed: {e}") from e
        except StreamOverflowError as e:
            raise APIError(408, str(e)) from e
        finally:
            gen.close()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        stops = _stop_strings(body.stop)
        tools = template_tools(body.tools)
        parser = _output_parser(body, tools, config)
        prompt_ids = await asyncio.to_thread(_render_chat, tokenizer, body.messages,
                                             body.chat_template_kwargs, tools, chat_format)
        max_tokens = body.max_tokens if body.max_completion_tokens is None \
            else body.max_completion_tokens
        params = _sampling_params(body, max_tokens, len(prompt_ids), max_model_len,
                                  max_logprobs=max_logprobs)
        request_id = new_id("chatcmpl")
        gen = await start(request_id, prompt_ids, params, stops, body)
        lps = LogprobFormatter(tokenizer, params) if params.logprobs is not None else None
        continuous_usage = _continuous_usage(body)

        def chunk(delta: DeltaMessage, finish_reason: str | None = None,
                  kv_transfer_params: dict[str, Any] | None = None,
                  stop_reason: str | int | None = None) -> str:
            # the entries of the tokens received since the last chunk
            taken = gen.take_logprobs()
            logprobs = lps.chat(taken) if lps is not None and taken else None
            choice = ChatChunkChoice(delta=delta, logprobs=logprobs,
                                     finish_reason=finish_reason, stop_reason=stop_reason)
            return _sse(ChatCompletionChunk(id=request_id, model=model_name, choices=[choice],
                                            kv_transfer_params=kv_transfer_params,
                                            usage=gen.usage if continuous_usage else None))

        async def frames() -> AsyncIterator[str]:
            yield chunk(DeltaMessage(role="assistant", content=""))
            async for piece in gen.deltas():
                if parser is None:
                    yield chunk(DeltaMessage(content=piece))
                elif delta := parser.push(piece):  # else held back: its entries wait too
                    yield chunk(_delta_message(delta, parser.num_calls - len(delta.calls)))
            if parser is not None and (delta := parser.finish()):
                yield chunk(_delta_message(delta, parser.num_calls - len(delta.calls)))
            called = parser is not None and parser.num_calls > 0
            # P/D: the params a decode request needs, known once the prefill finished
            yield chunk(DeltaMessage(), "tool_calls" if called else gen.finish_reason,
                        gen.kv_transfer_params, gen.stop_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield _sse(ChatCompletionChunk(id=request_id, model=model_name, choices=[],
                                               usage=gen.usage))

        if body.stream:
            return streaming(gen, frames())
        text = await complete(request, gen)
        if text is None:
            return Response(status_code=499)  # the client left; nobody reads this
        message = ChatMessage(content=text)
        if parser is not None:
            parsed = parser.push(text)
            parsed.extend(parser.finish())
            message = _parsed_message(parsed)
        choice = ChatChoice(message=message, stop_reason=gen.stop_reason,
                            finish_reason="tool_calls" if message.tool_calls else gen.finish_reason,
                            logprobs=lps.chat(gen.take_logprobs()) if lps is not None else None)
        return JSONResponse(_dump(ChatCompletionResponse(
            id=request_id, model=model_name, choices=[choice], usage=gen.usage,
            kv_transfer_params=gen.kv_transfer_params)))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo: not supported", param="echo")
        stops = _stop_strings(body.stop)
        prompt_ids = await asyncio.to_thread(_completion_prompt, tokenizer, body.prompt,
                                             engine.config.model.vocab_size)
        params = _sampling_params(body, body.max_tokens, len(prompt_ids), max_model_len,
                                  COMPLETION_DEFAULT_MAX_TOKENS, max_logprobs)
        request_id = new_id("cmpl")
        gen = await start(request_id, prompt_ids, params, stops, body)
        lps = LogprobFormatter(tokenizer, params) if params.logprobs is not None else None
        continuous_usage = _continuous_usage(body)

        def chunk(text: str, finish_reason: str | None = None,
                  kv_transfer_params: dict[str, Any] | None = None,
                  stop_reason: str | int | None = None) -> str:
            taken = gen.take_logprobs()
            logprobs = lps.completion(taken) if lps is not None and taken else None
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason,
                                      stop_reason=stop_reason)
            return _sse(CompletionResponse(id=request_id, model=model_name, choices=[choice],
                                           kv_transfer_params=kv_transfer_params,
                                           usage=gen.usage if continuous_usage else None))

        async def frames() -> AsyncIterator[str]:
            async for piece in gen.deltas():
                yield chunk(piece)
            # P/D: the params a decode request needs, known once the prefill finished
            yield chunk("", gen.finish_reason, gen.kv_transfer_params, gen.stop_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield _sse(CompletionResponse(id=request_id, model=model_name, choices=[],
                                              usage=gen.usage))

        if body.stream:
            return streaming(gen, frames())
        text = await complete(request, gen)
        if text is None:
            return Response(status_code=499)
        choice = CompletionChoice(
            text=text, finish_reason=gen.finish_reason, stop_reason=gen.stop_reason,
            logprobs=lps.completion(gen.take_logprobs()) if lps is not None else None)
        return JSONResponse(_dump(CompletionResponse(
            id=request_id, model=model_name, choices=[choice], usage=gen.usage,
            kv_transfer_params=gen.kv_transfer_params)))

    return app
