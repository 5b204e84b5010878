"""Request → prompt token ids, shared by the server and the router: the router hashes the very ids
the engine will see, so both must render and tokenize identically (one function, not two copies).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from dsaserve.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer


class PromptError(ValueError):
    """The client's prompt cannot be turned into token ids; `param` names the field (→ 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# Variables the renderer sets itself: a request may not override them through its kwargs.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                    "chat_template", "tools"})


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template (the model's, else DEFAULT_CHAT_TEMPLATE) with the generation prompt,
    tokenized. `template_kwargs` are the request's `chat_template_kwargs` (vLLM's field: extra
    template variables, e.g. GLM's `enable_thinking`); `tools` the request's function tools (the
    template's `tools` variable, None without any)."""
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    kwargs = template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise PromptError("chat_template_kwargs: expected an object of template variables",
                          "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise PromptError(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not by "
                          "the request", "chat_template_kwargs")
    if tools:
        kwargs = {**kwargs, "tools": tools}
    try:
        text = tokenizer.apply_chat_template(tool_call_arguments_as_objects(messages),
                                             add_generation_prompt=True,
                                             chat_template=template, **kwargs)
    except ChatTemplateError as e:  # already names the message or the template's complaint
        raise PromptError(str(e), "messages") from e
    except jinja2.TemplateError as e:  # the template failed on these messages' shape
        raise PromptError(f"messages: the chat template failed: {e}", "messages") from e
    return tokenizer.encode(text)


def tool_call_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose assistant `tool_calls` carry `function.arguments` as objects, not the JSON
    text of OpenAI's wire form: chat templates iterate them (GLM's `tc.arguments.items()`), as
    vLLM prepares them; absent or empty arguments are {}. Other messages are passed as they are.
    """
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(calls, list):
            out.append(m)
            continue
        fixed = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise PromptError(f"messages[{i}].tool_calls[{j}]: expected an object with a "
                                  "'function' object", "messages")
            args = function.get("arguments")
            if isinstance(args, str) and args.strip():
                try:
                    args = json.loads(args)
                except ValueError as e:
                    raise PromptError(f"messages[{i}].tool_calls[{j}].function.arguments: not "
                                      f"JSON: {e}", "messages") from e
            elif not args:
                args = {}
            fixed.append({**call, "function": {**function, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def completion_prompt(tokenizer: Tokenizer, prompt: str | list[Any], vocab_size: int) -> list[int]:
    """A /v1/completions prompt: text, token ids, or a batch of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if all(isinstance(t, int) for t in prompt):
        # Client-supplied ids index the embedding table: an id outside it would fail a whole step.
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise PromptError(f"prompt: token id {bad} is outside the vocabulary "
                              f"[0, {vocab_size})", "prompt")
        return list(prompt)
    raise PromptError(f"prompt: batches of {len(prompt)} prompts are not supported; "
                      "send one request per prompt", "prompt")
