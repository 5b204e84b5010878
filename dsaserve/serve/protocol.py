"""OpenAI request and response bodies (pydantic), plus vLLM's extensions that benchmarks send.

Requests accept unknown fields (clients send many we do not use) but type-check every field we read;
values are range-checked once, by `SamplingParams`, so the messages match offline use. A field sent
as null is omitted (OpenAI's fields are nullable: `"n": null`, `"stream": null` ask for the default,
which vLLM's Optional fields give too). No string in a body may hold a lone UTF-16 surrogate (valid
JSON, invalid Unicode: tokenizers cannot encode it).
Responses mirror OpenAI's JSON so the official client parses them unmodified.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dsaserve.serve.limits import find_lone_surrogate, unsupported


def _one_of(expected: str) -> WrapValidator:
    """A union field's type error as one message at the field: "expected <expected>" (pydantic
    names each branch it tried: `prompt.str: Input should be a valid string; prompt.list[int]:
    ...`, with param "prompt.str")."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "expected {expected}",
                                      {"expected": expected}) from None

    return WrapValidator(validate)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := find_lone_surrogate(data)) is not None:
            raise PydanticCustomError("lone_surrogate", "{where}: a lone UTF-16 surrogate is not "
                                      "valid Unicode text", {"where": where})
        return data


class StreamOptions(_Request):
    include_usage: bool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk's usage so far


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # optional, as in vLLM: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    # The range a torch generator takes: a larger seed must be a 400, not a failed engine step.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: Annotated[str | list[str] | None, _one_of("a string or a list of strings")] = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    cache_salt: str | None = None  # vLLM extension: isolates this tenant's prefix-cache entries
    # vLLM extension: P/D disaggregation (docs/disagg.md), checked by KVTransferParams.from_json
    kv_transfer_params: dict[str, Any] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Accepted and ignored: they ask nothing of generation.
    user: str | None = None  # OpenAI: an end-user id for abuse monitoring
    metadata: dict[str, Any] | None = None  # OpenAI: tags for stored completions
    service_tier: str | None = None  # OpenAI: a billing tier
    # Declared so the schema lists them; anything but "off" is a 400 (dsaserve.serve.limits).
    logit_bias: Any = unsupported({}, why="no logit processors")
    best_of: Any = unsupported(1, why="one sequence per request")
    store: Any = unsupported(False, why="nothing is stored")
    priority: Any = unsupported(0, why="first-come, first-served scheduling")
    response_format: Any = unsupported({"type": "text"}, why="no structured output")
    structured_outputs: Any = unsupported(why="no structured output")  # vLLM's, and its guided_*
    guided_json: Any = unsupported(why="no structured output")
    guided_regex: Any = unsupported(why="no structured output")
    guided_choice: Any = unsupported(why="no structured output")
    guided_grammar: Any = unsupported(why="no structured output")
    min_p: Any = unsupported(0, why="sampling has temperature, top_p and top_k")
    repetition_penalty: Any = unsupported(1, why="no penalties")
    use_beam_search: Any = unsupported(False, why="no beam search")
    length_penalty: Any = unsupported(1, why="no beam search")
    bad_words: Any = unsupported([], why="no logit processors")
    allowed_token_ids: Any = unsupported(why="no logit processors")
    prompt_logprobs: Any = unsupported(why="no prompt logprobs; the generated tokens' "
                                       "logprobs are (logprobs, top_logprobs)")
    include_stop_str_in_output: Any = unsupported(False, why="stop strings are always cut")
    skip_special_tokens: Any = unsupported(True, why="special tokens are always skipped")
    spaces_between_special_tokens: Any = unsupported(True, why="special tokens are skipped")
    truncate_prompt_tokens: Any = unsupported(why="a prompt beyond the context is a 400")


# Messages stay plain dicts (the chat template validates them, with messages that name the
# offending message); the schema documents what the template understands.
_CONTENT_PART = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGES_SCHEMA = {
    "type": "array", "minItems": 1, "title": "Messages",
    "items": {"type": "object", "required": ["role"], "additionalProperties": True, "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART},
                              {"type": "null"}]},
        "name": {"type": "string"},
        # an assistant turn's calls (arguments: a JSON object as text) and the result's id
        "tool_calls": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "string"}, "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
        "tool_call_id": {"type": "string"},
        "reasoning_content": {"type": "string"},  # an earlier turn's reasoning (GLM renders it)
    }},
}


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; its property types guide parsing


class ChatTool(_Request):
    """An OpenAI function tool; rendered by the chat template (its `tools` variable)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (its `tools` variable), as vLLM dumps them: the
    declared fields in order (null where unset), then any others the client sent (`strict`, …),
    so a template renders the prompt vLLM would. The router renders with the same, so its prefix
    hashes match the server's."""
    return None if tools is None else [t.model_dump() for t in tools]


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[dict[str, Any]], WithJsonSchema(_MESSAGES_SCHEMA)] = Field(
        min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's successor of max_tokens
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int | None = None  # and that many most likely tokens' (needs logprobs)
    # Tool calling (docs/serving.md): parsed by --tool-call-parser with --enable-auto-tool-choice
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call is returned
    functions: Any = unsupported([], why="no tool calling")
    function_call: Any = unsupported("none", why="no tool calling")
    modalities: Any = unsupported(["text"], why="text only")
    audio: Any = unsupported(why="text only")
    prediction: Any = unsupported(why="no predicted outputs")
    reasoning_effort: Any = unsupported(why="the chat template takes no options")
    web_search_options: Any = unsupported(why="no tools")
    chat_template: Any = unsupported(why="the model's template is used")
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's)
    add_generation_prompt: Any = unsupported(True, why="the assistant turn is always opened")
    continue_final_message: Any = unsupported(False, why="the assistant turn is always opened")
    documents: Any = unsupported(why="the chat template takes no options")
    echo: Any = unsupported(False, why="the prompt is never echoed")


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      _one_of("a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids")]
    echo: bool = False
    logprobs: int | None = None  # the chosen tokens' and this many most likely (0 asks too)
    suffix: Any = unsupported("", why="no insertion")


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int  # every prompt token, cached ones included
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the output was all reasoning or tool calls
    # vLLM's fields (with --reasoning-parser): the text inside <think>…</think>; `reasoning` is
    # newer vLLM's name for the same text
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatLogprob(BaseModel):
    """One generated token (OpenAI's ChatCompletionTokenLogprob)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]  # the top_logprobs most likely tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    # vLLM's: the stop string or stop_token_ids entry that ended the output; None otherwise
    # (EOS, length)
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # P/D: what the decode request needs


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int  # the call's position in the message's tool_calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (and `reasoning`, the same)
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_set_extras(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Chunks without reasoning or calls keep the plain {role?, content} shape."""
        out = handler(self)
        for key in ("reasoning_content", "reasoning", "tool_calls"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's (ChatChoice), on the finishing chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D: on the chunk with finish_reason


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format: per generated token its text, log-probability, the
    `logprobs` most likely tokens' (text → log-probability, the chosen token's included) and
    where the token starts in the completion's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's (ChatChoice); on a stream's last chunk


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D: what the decode request needs


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "dsaserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class KVInfo(BaseModel):
    """GET /kv_info: how this server's prefix cache names blocks (a dsaserve extension; the router
    reads it to hash prompts exactly as the engine does)."""

    model: str
    block_size: int  # tokens per hashed block: the scheduler block B·DCP
    hash_algo: str = "sha256-dsaserve.block.v1"  # dsaserve.kv.prefix_cache
    enable_prefix_caching: bool
    data_parallel_size: int
    kv_events_endpoints: list[str]  # ZMQ PUB endpoints, replica order; empty when disabled


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
