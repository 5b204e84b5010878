"""Request → prompt token ids, shared by the server and the router: the router hashes the very ids
the engine will see, so both must render and tokenize identically (one function, not two copies).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2

from dsaserve.config import ConfigError
from dsaserve.serve.chat_dsv32 import render_dsv32, thinking_requested
from dsaserve.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplateError,
    Tokenizer,
    check_chat_template,
)

logger = logging.getLogger(__name__)

TOKENIZER_MODES = ("auto", "deepseek_v32")  # --tokenizer-mode (vLLM's names)


class PromptError(ValueError):
    """The client's prompt cannot be turned into token ids; `param` names the field (→ 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# Variables the renderer sets itself: a request may not override them through its kwargs.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                    "chat_template", "tools"})


@dataclass(frozen=True)
class ChatFormat:
    """How a server (and the router in front of it) writes chat messages as prompt text."""

    # jinja: a chat template; deepseek_v32: DeepSeek-V3.2's encoder (serve/chat_dsv32.py)
    renderer: Literal["jinja", "deepseek_v32"] = "jinja"
    # --chat-template's text; None: the tokenizer's template, else DEFAULT_CHAT_TEMPLATE
    template: str | None = None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template (vLLM's): a file's path, or the template itself when it is no file and
    looks like one (has braces or a newline). Raises ConfigError naming the flag for a missing
    file or a template that does not parse."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template: cannot read {value}: {e}") from e
        where = value
    elif any(c in value for c in "{}\n"):
        text, where = value, "the inline template"
    else:
        raise ConfigError(f"--chat-template: no such file: {value} (pass a file's path or the "
                          "template's text)")
    try:
        check_chat_template(text)
    except ChatTemplateError as e:
        raise ConfigError(f"--chat-template: {where}: {e}") from e
    return text


def check_chat_flags(tokenizer_mode: str, chat_template: str | None) -> None:
    """--tokenizer-mode is one of TOKENIZER_MODES, and --chat-template is not given with
    DeepSeek-V3.2's encoder, which would ignore it. Raises ConfigError naming the flag."""
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ConfigError(f"--tokenizer-mode: {tokenizer_mode!r} is not one of "
                          f"{', '.join(TOKENIZER_MODES)}")
    if tokenizer_mode == "deepseek_v32" and chat_template is not None:
        raise ConfigError("--chat-template: not used with --tokenizer-mode deepseek_v32 "
                          "(DeepSeek-V3.2's encoder writes the prompt)")


def chat_format_for(model_dir: str | Path, tokenizer: Tokenizer, tokenizer_mode: str = "auto",
                    chat_template: str | None = None) -> ChatFormat:
    """--tokenizer-mode and --chat-template (its text) resolved for one model. `auto` picks
    DeepSeek-V3.2's encoder, as vLLM needs `--tokenizer-mode deepseek_v32` for, when the
    checkpoint is `deepseek_v32` and has no chat template of its own (nor --chat-template)."""
    check_chat_flags(tokenizer_mode, chat_template)
    if tokenizer_mode == "deepseek_v32":
        return ChatFormat("deepseek_v32")
    if chat_template is None and tokenizer.chat_template is None \
            and _model_type(model_dir) == "deepseek_v32":
        logger.info("%s: deepseek_v32 without a chat template: chat prompts use DeepSeek-V3.2's "
                    "encoding (--tokenizer-mode deepseek_v32)", model_dir)
        return ChatFormat("deepseek_v32")
    return ChatFormat("jinja", chat_template)


def _model_type(model_dir: str | Path) -> str | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None,
                chat_format: ChatFormat = ChatFormat()) -> list[int]:
    """The chat prompt with the generation prompt, tokenized: by DeepSeek-V3.2's encoder, or by
    the chat template (--chat-template, else the model's, else DEFAULT_CHAT_TEMPLATE).
    `template_kwargs` are the request's `chat_template_kwargs` (vLLM's field: extra template
    variables, e.g. GLM's `enable_thinking`, V3.2's `thinking`); `tools` the request's function
    tools (the template's `tools` variable, None without any)."""
    kwargs = template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise PromptError("chat_template_kwargs: expected an object of template variables",
                          "chat_template_kwargs")
    if chat_format.renderer == "deepseek_v32":
        try:
            text = render_dsv32(messages, tools, thinking_requested(kwargs))
        except ChatTemplateError as e:
            raise PromptError(str(e), "messages") from e
        return tokenizer.encode(text)
    template = chat_format.template
    if template is None and not tokenizer.chat_template:
        template = DEFAULT_CHAT_TEMPLATE
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise PromptError(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not by "
                          "the request", "chat_template_kwargs")
    if tools:
        kwargs = {**kwargs, "tools": tools}
    messages = tool_call_arguments_as_objects(messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             chat_template=template, **kwargs)
    except ChatTemplateError as e:  # already names the message or the template's complaint
        raise PromptError(str(e), "messages") from e
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        # The template failed on these messages' shape: GLM's `'<tool_call>' + tc.name` with a
        # name that is no string is a TypeError (vLLM's 400 too).
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
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise PromptError(f"messages[{i}].tool_calls: expected a list of calls", "messages")
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
