"""The tiny tokenizer, the HF-directory loader, chat rendering and streaming detokenization."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from dsaserve.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    build_tiny_tokenizer,
    detect_content_format,
)

MULTILINGUAL = (
    "Hello, world! The ferry leaves at 7:30.\n"
    "Grüße aus Köln — naïve café, façade.\n"
    "日本語のテキストと中文文本。\n"
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم\n"
    "Emoji: 🙂🚀👩‍💻 🇫🇷 and tabs\tand  double  spaces.\n"
)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_build_is_deterministic_across_builds_and_processes(tok_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_tokenizer(tmp_path / "again")
    # A fresh interpreter: nothing may depend on per-process hash seeds.
    other = tmp_path / "other"
    code = f"import dsaserve.tokenizer as t; t.build_tiny_tokenizer({str(other)!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(_files(tok_dir)) == {"tokenizer.json", "tokenizer_config.json"}
    assert _files(again) == _files(tok_dir)
    assert _files(other) == _files(tok_dir)


def test_vocabulary_layout(tok: Tokenizer, tok_dir: Path) -> None:
    assert tok.vocab_size == 512
    assert [tok.token_to_id(t) for t in TINY_SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token_id == 0 and tok.bos_token_id == 0
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["bos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 4096
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE
    # The merges were learned: common English words take fewer tokens than bytes.
    text = "the water in the village"
    assert len(tok.encode(text)) < len(text.encode()) // 2


def test_round_trip_multilingual(tok: Tokenizer) -> None:
    ids = tok.encode(MULTILINGUAL)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert 0 not in ids  # no special token appears in plain text
    assert tok.decode(ids) == MULTILINGUAL


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>\nhi<|endoftext|>")
    assert ids[0] == 2 and ids[-1] == 0
    assert tok.decode(ids) == "\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>\nhi<|endoftext|>"


def test_chat_template_renders(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Plan a walk."},
        {"role": "assistant", "content": "Go to the lake."},
        {"role": "tool", "content": "sunny"},
        {"role": "user",
         "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "back?"}]},
    ]
    expected = (
        "<|system|>\nBe brief.<|user|>\nPlan a walk.<|assistant|>\nGo to the lake.<|endoftext|>"
        "<|user|>\ntool: sunny<|user|>\nAnd \nback?"  # text parts joined by newlines, as in vLLM
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    prompt = tok.apply_chat_template(messages)
    assert prompt == expected + "<|assistant|>\n"
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids[-2:] == [3, tok.encode("\n")[0]]
    assert ids.count(2) == 3 and ids.count(0) == 1  # user, tool (as user), user; one eos


# GLM-5's template (zai-org/GLM-5 chat_template.jinja, trimmed to its content handling): the
# loop over parts is inside a macro that is passed the content, so vLLM reads it as "string".
GLM_CONTENT = (
    "{%- macro visible_text(content) -%}{%- if content is string -%}{{- content }}"
    "{%- elif content is iterable and content is not mapping -%}{%- for item in content -%}"
    "{%- if item is mapping and item.type == 'text' -%}{{- item.text }}"
    "{%- elif item is string -%}{{- item }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{- content }}{%- endif -%}{%- endmacro -%}"
    "{% for m in messages %}<|{{ m.role }}|>{{ visible_text(m.content) }}{% endfor %}"
)
# A template that walks the parts itself (the shape of Qwen2-VL's and Llama-4's).
PARTS = (
    "{% set msgs = messages %}{% for message in msgs %}[{{ message['role'] }}]"
    "{% if message['content'] is string %}S:{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}P:{{ part['text'] }};{% endfor %}"
    "{% endif %}{% endfor %}"
)


def test_content_format_is_detected_as_vllm_does() -> None:
    assert detect_content_format(DEFAULT_CHAT_TEMPLATE) == "string"  # a filter, no loop
    assert detect_content_format(GLM_CONTENT) == "string"
    assert detect_content_format(PARTS) == "openai"
    assert detect_content_format(
        "{% for m in messages[1:] %}{% for p in m.content | list %}{{ p.text }}{% endfor %}"
        "{% endfor %}") == "openai"  # a slice of messages, a filtered content
    assert detect_content_format(  # a loop over something else's content
        "{% for t in tools %}{% for p in t.content %}{{ p }}{% endfor %}{% endfor %}") == "string"
    assert detect_content_format("{% for %}") == "string"  # unparsable: vLLM's default


def test_content_parts_reach_the_template_as_vllm_passes_them(tok: Tokenizer) -> None:
    two_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": two_parts},
                {"role": "assistant", "content": None},
                {"role": "tool", "content": two_parts}]
    # "string": every content a string, parts joined by newlines, null empty.
    assert tok.apply_chat_template(messages, add_generation_prompt=False,
                                   chat_template=GLM_CONTENT) == \
        "<|system|>S<|user|>a\nb<|assistant|><|tool|>a\nb"
    # "openai": every content a list of text parts (a string is one, null none), except a tool
    # message's, which is its text.
    assert tok.apply_chat_template(messages, add_generation_prompt=False,
                                   chat_template=PARTS) == \
        "[system]P:S;[user]P:a;P:b;[assistant][tool]S:a\nb"


def test_chat_template_errors(tok: Tokenizer) -> None:
    # All are jinja2.TemplateErrors too: a server maps every rendering failure to a 400.
    with pytest.raises(ChatTemplateError, match="unsupported role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(jinja2.TemplateError, match=r"messages\[0\]\.content\[0\].*image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\].*role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"content": "y"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        tok.apply_chat_template([], chat_template="{% for %}")


def test_matches_transformers(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    for text in [MULTILINGUAL, "<|system|>\nx<|user|>\ny<|assistant|>\n", " lead and trail  ", ""]:
        assert hf(text)["input_ids"] == tok.encode(text), text
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.eos_token_id
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    for gen in (True, False):
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert rendered == tok.apply_chat_template(messages, add_generation_prompt=gen)


def test_missing_tokenizer_and_template(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        Tokenizer.from_pretrained(tmp_path)
    # tokenizer.json alone: loads, but has no chat template (and no eos).
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.eos_token_id is None and bare.chat_template is None
    with pytest.raises(TokenizerError, match="no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    # The server's fallback.
    out = bare.apply_chat_template([{"role": "user", "content": "hi"}],
                                   chat_template=DEFAULT_CHAT_TEMPLATE)
    assert out == "<|user|>\nhi<|assistant|>\n"
    # Newer HF versions save the template as chat_template.jinja.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "hi"}]) == "hi!"
    # An eos token the vocabulary does not know.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(TokenizerError, match="eos_token '<eos>'"):
        Tokenizer.from_pretrained(tmp_path)


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return "".join(pieces), pieces


def test_incremental_detokenizer_multilingual(tok: Tokenizer) -> None:
    prompt = tok.encode("<|user|>\nSay something.<|assistant|>\n")
    ids = tok.encode(MULTILINGUAL)
    text, pieces = _stream(tok, prompt, ids)
    assert text == tok.decode(ids) == MULTILINGUAL
    assert not any("\ufffd" in p for p in pieces)  # no character was ever split
    assert pieces.count("") > 10  # multi-byte characters did span several tokens
    assert pieces[-1] == ""  # everything was already complete


def test_incremental_detokenizer_random_ids(tok: Tokenizer) -> None:
    """Random ids (invalid UTF-8, special tokens) still concatenate to decode(ids)."""
    rng = random.Random(0)
    for trial in range(20):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        text, _ = _stream(tok, prompt, ids)
        assert text == tok.decode(ids), trial
