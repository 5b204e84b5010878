"""What the server refuses before a request reaches the engine: text that is not valid Unicode,
fields it does not implement, and lengths beyond the model.

Pure checks, each naming the offending field, so a hostile or careless body is a 4xx and never an
exception inside the tokenizer or the engine (where it would be a 500, or fail a shared step).
The body-size limit, which must act before a body is parsed, is ASGI middleware
(`dsaserve.serve.middleware`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field


def _has_lone_surrogate(text: str) -> bool:
    # JSON's "\ud800" decodes to a str that UTF-8 cannot encode; the tokenizer (Rust) rejects it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_lone_surrogate(value: Any, where: str = "body") -> str | None:
    """The path of the first string (key or value) in a decoded JSON body holding a lone surrogate,
    e.g. `messages[0].content`, or None."""
    if isinstance(value, str):
        return where if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key)
            if _has_lone_surrogate(name):
                return f"a key in {where}"
            path = name if where == "body" else f"{where}.{name}"
            if (found := find_lone_surrogate(item, path)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := find_lone_surrogate(item, f"{where}[{i}]")) is not None:
                return found
    return None


# ------------------------------------------------------------------------------------------------
# Declared but unimplemented fields: only their defaults pass
# ------------------------------------------------------------------------------------------------
UNSUPPORTED_KEY = "x-dsaserve-unsupported"  # marks such a field in the pydantic model (and schema)


def unsupported(*allowed: Any, why: str) -> Any:
    """A pydantic Field for an OpenAI or vLLM request field the server does not implement.

    Omitted, null or one of `allowed` (the values that ask for nothing) pass; any other value is a
    400 from `check_supported`, so a client never gets output that silently ignores its request.
    The schema lists exactly the accepted values, so generated "valid" requests stay valid.
    """
    return Field(default=None, json_schema_extra={
        "enum": [None, *allowed], "description": f"Not supported ({why}); only "
        + ", ".join(json.dumps(v) for v in (None, *allowed)) + " accepted.",
        UNSUPPORTED_KEY: why})


def check_supported(body: BaseModel) -> None:
    """Raise RequestLimitError naming the first unsupported field set to a value that asks for
    something (declared with `unsupported`)."""
    for name, field in type(body).model_fields.items():
        extra = field.json_schema_extra
        if not isinstance(extra, dict) or not extra.get(UNSUPPORTED_KEY):
            continue
        value = getattr(body, name)
        # `==` alone would let 0 stand for False and 1.0 for 1: compare JSON forms instead.
        if json.dumps(value, sort_keys=True) not in {json.dumps(v, sort_keys=True)
                                                     for v in extra["enum"]}:
            raise RequestLimitError(400, f"{name}: not supported by this server "
                                    f"({extra[UNSUPPORTED_KEY]}); accepted: "
                                    f"{_allowed_text(extra['enum'])}", name)


def _allowed_text(values: list[Any]) -> str:
    return ", ".join("omitted" if v is None else json.dumps(v) for v in values)


# ------------------------------------------------------------------------------------------------
# Lengths against the model
# ------------------------------------------------------------------------------------------------
class RequestLimitError(Exception):
    """A request beyond what this server accepts; → OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def check_lengths(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                  prompt_field: str, max_tokens_field: str) -> None:
    """Prompt + requested output must fit in max_model_len; each error names the field to change.

    The prompt must hold a token and leave room for one output token (the engine's own rules,
    checked here first so the error can name the field). `max_tokens` is checked only when the
    client sent it: a default is capped to the context instead.
    """
    if num_prompt_tokens == 0:
        raise RequestLimitError(400, f"{prompt_field}: the prompt is empty (0 tokens)",
                                prompt_field)
    if num_prompt_tokens >= max_model_len:
        raise RequestLimitError(400, f"{prompt_field}: prompt has {num_prompt_tokens} tokens; "
                                f"max_model_len is {max_model_len}", prompt_field)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise RequestLimitError(
            400, f"{max_tokens_field}: {max_tokens} output tokens after a {num_prompt_tokens}-token"
            f" prompt exceed max_model_len {max_model_len} (at most "
            f"{max_model_len - num_prompt_tokens})", max_tokens_field)
