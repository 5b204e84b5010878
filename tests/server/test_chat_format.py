"""Chat prompts over HTTP: `--tokenizer-mode` (DeepSeek-V3.2's encoder, picked by `auto` for a
deepseek_v32 checkpoint without a chat template) and `--chat-template` (a file or the template
itself), on a real engine over the tiny deepseek_v32 checkpoint; the router renders the ids the
server renders. The tiny tokenizer lacks DeepSeek's special tokens, so the prompt a request
reaches the engine with is compared, as ids, with the tiny tokenizer's encoding of the expected
text (the renderer's exact text is tested in tests/unit/test_chat_dsv32.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import MODEL_NAME, server_engine_config
from test_logprob_text import ScriptedEngine

from dsaserve.config import ConfigError
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.router import cli as router_cli
from dsaserve.router.app import Router
from dsaserve.router.config import RouterConfig
from dsaserve.serve import cli as serve_cli
from dsaserve.serve.api import ServerConfig, create_app
from dsaserve.serve.async_engine import AsyncEngine, RequestStream
from dsaserve.serve.chat_dsv32 import render_dsv32
from dsaserve.serve.prompt import ChatFormat
from dsaserve.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ROUND = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
TEMPLATE = "T:{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def dsv32_dir(model_dirs: dict[str, Path], tmp_path_factory) -> Path:
    """The tiny deepseek_v32 checkpoint as DeepSeek ships V3.2: no chat template."""
    out = tmp_path_factory.mktemp("dsv32") / "tiny-dsv32-notemplate"
    shutil.copytree(model_dirs["tiny-dsv32"], out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v32"
    return out


class RecordingEngine(ScriptedEngine):
    """ScriptedEngine remembering each request's prompt ids."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.prompts: list[list[int]] = []

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, **kw: Any) -> RequestStream:
        self.prompts.append(list(prompt_token_ids))
        return await super().add_request(request_id, prompt_token_ids, params, **kw)


@pytest.fixture(scope="module")
def engines(dsv32_dir: Path, model_dirs: dict[str, Path]) -> Iterator[dict[str, RecordingEngine]]:
    """Engines over the template-less deepseek_v32 checkpoint and over tiny-glm5 (which has one)."""
    # The tools section alone is ~1.2k tiny-tokenizer tokens: a longer context than the tests'.
    long = ("--max-model-len", "2048", "--max-num-batched-tokens", "2048")
    built = {"dsv32": AsyncEngine(LLMEngine.from_config(server_engine_config(dsv32_dir, *long))),
             "glm5": AsyncEngine(LLMEngine.from_config(
                 server_engine_config(model_dirs["tiny-glm5"])))}
    yield {name: RecordingEngine(e) for name, e in built.items()}
    for e in built.values():
        e.shutdown()


# How V3.2 is served: its tool-call and reasoning parsers (serve/tools)
PARSERS = {"enable_auto_tool_choice": True, "tool_call_parser": "deepseek_v32",
           "reasoning_parser": "deepseek_v3"}


def _client(engine: RecordingEngine, **config: Any) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(  # type: ignore[arg-type]
        served_model_name=MODEL_NAME, **PARSERS | config)))


def _prompt_ids(engine: RecordingEngine, **body: Any) -> list[int]:
    engine.script = [engine.tokenizer.encode("ok")]
    engine.end = ("stop", None)
    with _client(engine, **body.pop("server", {})) as client:
        r = client.post("/v1/chat/completions", json={"max_tokens": 8} | body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(engine.prompts[-1])
    return engine.prompts[-1]


@pytest.mark.parametrize("thinking", [False, True])
def test_auto_renders_a_template_less_deepseek_v32_with_its_encoding(engines, caplog,
                                                                     thinking) -> None:
    engine = engines["dsv32"]
    with caplog.at_level(logging.INFO, logger="dsaserve.serve.prompt"):
        ids = _prompt_ids(engine, messages=ROUND, tools=TOOLS,
                          chat_template_kwargs={"thinking": thinking})
    assert "DeepSeek-V3.2's encoding" in caplog.text  # the startup line says which renderer
    expected = render_dsv32(ROUND, TOOLS, thinking=thinking)
    assert expected.endswith("</function_results>\n\n" + ("<think>" if thinking else "</think>"))
    assert ids == engine.tokenizer.encode(expected)


def test_the_app_says_which_renderer_it_picked(engines) -> None:
    """`serve` prints a start-up line from it."""
    def picked(engine: RecordingEngine, **config: Any) -> ChatFormat:
        return create_app(engine, ServerConfig(  # type: ignore[arg-type]
            served_model_name=MODEL_NAME, **config)).state.chat_format

    assert picked(engines["dsv32"]) == ChatFormat("deepseek_v32")
    assert picked(engines["glm5"]) == ChatFormat("jinja")
    assert picked(engines["glm5"], tokenizer_mode="deepseek_v32") == ChatFormat("deepseek_v32")
    assert picked(engines["dsv32"], chat_template=TEMPLATE) == ChatFormat("jinja", TEMPLATE)


def test_vllm_s_enable_thinking_spelling_turns_thinking_on_too(engines) -> None:
    engine = engines["dsv32"]
    ids = _prompt_ids(engine, messages=ROUND[:2], chat_template_kwargs={"enable_thinking": True})
    assert ids == engine.tokenizer.encode(render_dsv32(ROUND[:2], thinking=True))


def test_a_shape_the_encoding_cannot_write_is_a_400(engines) -> None:
    with _client(engines["dsv32"]) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "tool", "content": "orphan"}], "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "must follow an assistant message" in error["message"]


def test_tokenizer_mode_deepseek_v32_overrides_a_model_template(engines) -> None:
    engine = engines["glm5"]
    assert engine.tokenizer.chat_template is not None
    messages = ROUND[:2]
    auto = _prompt_ids(engine, messages=messages)
    forced = _prompt_ids(engine, messages=messages, server={"tokenizer_mode": "deepseek_v32"})
    assert forced == engine.tokenizer.encode(render_dsv32(messages))
    assert auto != forced


def test_chat_template_overrides_the_model_s_and_the_auto_pick(engines) -> None:
    messages = ROUND[:2]
    text = "T:[system]You are terse.[user]Weather in Paris?"
    for engine in engines.values():
        ids = _prompt_ids(engine, messages=messages, server={"chat_template": TEMPLATE})
        assert ids == engine.tokenizer.encode(text)


def test_chat_template_with_deepseek_v32_mode_is_refused(engines) -> None:
    with pytest.raises(ConfigError, match="--chat-template: not used with --tokenizer-mode"):
        create_app(engines["dsv32"], ServerConfig(  # type: ignore[arg-type]
            served_model_name=MODEL_NAME, tokenizer_mode="deepseek_v32", chat_template=TEMPLATE))


# ------------------------------------------------------------------------------------------------
# The router renders the ids the server renders
# ------------------------------------------------------------------------------------------------
def _router_hashes(config: RouterConfig, body: dict[str, Any]) -> tuple[Router, list[bytes]]:
    async def run() -> tuple[Router, list[bytes]]:
        router = Router(config)
        try:
            router.pool.backends[0].block_size = 4
            hashes = await router.block_hashes("/v1/chat/completions", body)
        finally:
            await router.client.aclose()
        return router, hashes[4]

    return asyncio.run(run())


@pytest.mark.parametrize("server", [{}, {"chat_template": TEMPLATE}])
def test_the_router_renders_what_the_server_renders(engines, dsv32_dir: Path, server) -> None:
    body = {"messages": ROUND, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}}
    ids = _prompt_ids(engines["dsv32"], server=dict(server), **body)
    router, hashes = _router_hashes(
        RouterConfig(backends=("http://127.0.0.1:9",), tokenizer=str(dsv32_dir), **server), body)
    expected = ChatFormat("jinja", TEMPLATE) if server else ChatFormat("deepseek_v32")
    assert router.chat_format == expected
    assert hashes == request_block_hashes(ids, 4, None) and len(hashes) > 3


# ------------------------------------------------------------------------------------------------
# The flags
# ------------------------------------------------------------------------------------------------
def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsaserve")
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsaserve")
    router_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", "--backend", "http://127.0.0.1:9", *argv])


def test_chat_template_flag_from_a_file_and_inline(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    for value in (str(path), TEMPLATE):
        args = _serve_args("--chat-template", value)
        assert serve_cli.server_config_from_args(args, "m").chat_template == TEMPLATE
        assert router_cli.router_config_from_args(
            _router_args("--chat-template", value)).chat_template == TEMPLATE
    args = _serve_args()
    config = serve_cli.server_config_from_args(args, "m")
    assert (config.tokenizer_mode, config.chat_template) == ("auto", None)
    config = serve_cli.server_config_from_args(_serve_args("--tokenizer-mode", "deepseek_v32"), "m")
    assert config.tokenizer_mode == "deepseek_v32"


@pytest.mark.parametrize(("value", "complaint"), [
    ("missing/chat.jinja", "no such file: missing/chat.jinja"),
    ("{% if %}", "the inline template: syntax error at line 1"),
    ("{{ x | no_such_filter }}", "the inline template: syntax error at line 1"),
])
@pytest.mark.parametrize("parse", [_serve_args, _router_args])
def test_chat_template_flag_errors_name_the_flag(parse, value, complaint, capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--chat-template", value)
    err = capsys.readouterr().err
    assert "argument --chat-template:" in err and complaint in err, err


def test_a_bad_template_file_names_the_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text(DEFAULT_CHAT_TEMPLATE + "{% endfor %}")
    with pytest.raises(SystemExit):
        _serve_args("--chat-template", str(path))
    assert f"{path}: syntax error" in capsys.readouterr().err


def test_chat_template_with_deepseek_v32_mode_is_a_flag_error() -> None:
    args = _serve_args("--tokenizer-mode", "deepseek_v32", "--chat-template", TEMPLATE)
    with pytest.raises(ConfigError, match="--chat-template: not used with --tokenizer-mode"):
        serve_cli.check_tool_flags(args)
    with pytest.raises(ConfigError, match="--chat-template: not used with --tokenizer-mode"):
        router_cli.router_config_from_args(
            _router_args("--tokenizer-mode", "deepseek_v32", "--chat-template", TEMPLATE))


def test_tokenizer_from_a_template_less_directory(dsv32_dir: Path) -> None:
    assert Tokenizer.from_pretrained(dsv32_dir).chat_template is None
