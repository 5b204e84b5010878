"""Request → prompt token ids, shared by the server and the router: the router hashes the very ids
the engine will see, so both must render and tokenize identically (one function, not two copies).
"""

from __future__ import annotations

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
                                    "chat_template"})


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template (the model's, else DEFAULT_CHAT_TEMPLATE) with the generation prompt,
    tokenized. `template_kwargs` are the request's `chat_template_kwargs` (vLLM's field: extra
    template variables, e.g. GLM's `enable_thinking`)."""
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    kwargs = template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise PromptError("chat_template_kwargs: expected an object of template variables",
                          "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise PromptError(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not by "
                          "the request", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             chat_template=template, **kwargs)
    except ChatTemplateError as e:  # already names the message or the template's complaint
        raise PromptError(str(e), "messages") from e
    except jinja2.TemplateError as e:  # the template failed on these messages' shape
        raise PromptError(f"messages: the chat template failed: {e}", "messages") from e
    return tokenizer.encode(text)


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
