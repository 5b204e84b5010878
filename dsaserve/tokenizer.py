"""Tokenizer: the built-in tiny tokenizer and a loader for any Hugging Face tokenizer directory.

Only `tokenizers` and `jinja2` are used at run time (transformers is a test-only dependency).
The tiny tokenizer is a byte-level BPE with exactly 512 entries, trained offline on the English
text below; the same bytes come out of every build, so tiny checkpoints are reproducible.

    id 0 <|endoftext|>  eos, also pad and bos
    id 1 <|system|>     role markers used by the chat template
    id 2 <|user|>
    id 3 <|assistant|>
    ids 4..259          the 256 byte-level symbols
    ids 260..511        252 merges learned from _CORPUS
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

TINY_VOCAB_SIZE = 512
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")
TINY_EOS_TOKEN = "<|endoftext|>"

# The built-in chat template: one role marker per message, the assistant's turns closed by eos so
# that a model learns to stop. `tool` results are shown to the model as user turns (the tiny
# vocabulary has no tool role). It is also the server's fallback for tokenizers without a template.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unsupported role ' + message['role'] + "
    "'; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- set content = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') -%}"
    "{%- if message['role'] == 'tool' -%}<|user|>\ntool: {{ content }}"
    "{%- else -%}<|{{ message['role'] }}|>\n{{ content }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{ '\\n' }}{%- endif -%}"
)

# A few KB of plain English (written for this module). Changing one byte changes the merges, and
# with them every tiny checkpoint's token ids: treat it as frozen.
_CORPUS = """\
The harbour town woke early. Before the sun cleared the hills, the fishing boats were already out
past the breakwater, and the bakers on the main street had lit their ovens. By seven the smell of
bread drifted down to the water, where the ferry waited for its first passengers of the day.

Maria ran the small library near the station. She liked to open the doors herself, to let in the
cold air and the sound of the gulls. People came in for many reasons: to read the newspaper, to
print a letter, to ask where the post office had moved, or simply to sit somewhere warm for an
hour. She answered every question as well as she could, and when she did not know the answer she
wrote it down and found it by the afternoon.

A good question is worth more than a quick answer. When someone asks how a machine works, the
first step is to find out what they already know. A student who has built a radio needs a
different explanation from a child who has only seen one. Start with the parts that can be seen
and touched, then describe what happens inside, and finally explain why it was designed that way.

Consider a simple water clock. A vessel with a small hole in the bottom is filled with water. As
the water runs out, the level falls at a steady rate, and marks on the inside of the vessel show
how much time has passed. The ancient builders learned that the rate was not quite steady: water
flows faster when the vessel is full, because the pressure at the hole is higher. To correct for
this they shaped the vessel like a cone, wider at the top, so that the level would fall evenly
through the hours.

The same patient method works for programs. A program is a list of instructions that a computer
follows one after another. Each instruction is small: add two numbers, compare them, store the
result, jump to another place in the list. The power comes from putting many small steps together.
When a program fails, read the error message carefully, find the first line where things went
wrong, and check what the program believed at that moment against what was really true.

"Could you help me plan a trip to the mountains?" the user asked.
"Of course," the assistant replied. "How many days do you have, and do you prefer walking or
cycling?"
"Four days, and I would like to walk. I am not very fast, but I can walk for most of the day."
"Then a loop of three valleys would suit you. On the first day you walk from the village to the
lake, about twelve kilometres with a gentle climb. On the second day you cross the pass, which is
the hardest part, so start early and carry enough water. The third day follows the river down
through the forest, and on the fourth you return to the village along the old road."

Weather in the mountains changes quickly. A clear morning can turn into a storm by noon, so check
the forecast each evening and again before you leave. Carry a warm layer, a rain jacket, a map,
and a little more food than you think you will need. Tell someone where you are going and when you
expect to return. These rules are simple, and they have kept many travellers safe.

Numbers tell their own stories. In 1990 the town had 4,200 people; in 2000 it had 5,100; by 2020
the count had reached 7,350. The school added two classrooms, the clinic doubled its staff, and
the ferry began to run every thirty minutes instead of every hour. Growth brought new problems
too: the roads were crowded in summer, and the price of a small flat rose faster than wages.

The system should answer clearly, admit what it does not know, and keep its promises. It should
read the whole question before it replies, and it should never pretend that a guess is a fact.
When the answer is long, it should begin with the main point and then give the details in order.
"""


class TokenizerError(ValueError):
    """A tokenizer directory lacks a file or holds an unusable value; the message says which."""


class ChatTemplateError(TokenizerError, jinja2.TemplateError):
    """The messages cannot be rendered (bad role or content part, `raise_exception` in a template).

    Also a jinja2.TemplateError, like every other rendering failure, so a caller can map all of
    them to "bad request" with one except clause.
    """


# ------------------------------------------------------------------------------------------------
# The tiny tokenizer
# ------------------------------------------------------------------------------------------------
def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` entries trained on `texts`; the special tokens first, so
    they get ids 0..3. Deterministic: the same texts in the same order give the same merges."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # the corpus ran out of pairs to merge
        raise TokenizerError(f"BPE: trained {tok.get_vocab_size()} entries, expected {vocab_size}")
    for expected_id, token in enumerate(TINY_SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise TokenizerError(f"BPE: {token} got id {tok.token_to_id(token)}")
    return tok


def _train_tiny() -> HFTokenizer:
    """Byte-level BPE trained on _CORPUS."""
    return train_bpe(_CORPUS.splitlines(keepends=True), TINY_VOCAB_SIZE)


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path, *, model_max_length: int = 4096) -> Path:
    """Write `tok` as `tokenizer.json` + `tokenizer_config.json` (eos `<|endoftext|>`, the built-in
    chat template) into `out_dir`. Byte-identical for the same tokenizer: sorted, fixed JSON."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": TINY_EOS_TOKEN,
        "eos_token": TINY_EOS_TOKEN,
        "pad_token": TINY_EOS_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    return out


def build_tiny_tokenizer(out_dir: str | Path, *, model_max_length: int = 4096) -> Path:
    """Write the tiny tokenizer (`tokenizer.json`, `tokenizer_config.json`) into `out_dir`.

    Byte-identical on every call with the same arguments: the training is deterministic and the JSON
    is written with sorted, fixed formatting.
    """
    return save_tokenizer(_train_tiny(), out_dir, model_max_length=model_max_length)


# ------------------------------------------------------------------------------------------------
# Loading any Hugging Face tokenizer directory
# ------------------------------------------------------------------------------------------------
def _token_str(value: Any, field: str) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"tokenizer_config.json: {field} must be a string, got {value!r}")


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """`chat_template` from tokenizer_config.json (a string, or a list of named templates of which
    'default' is used), else a `chat_template.jinja` file (what newer HF versions save)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError("tokenizer_config.json: chat_template must be a string")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def text_content(message: dict[str, Any], index: int) -> str:
    """The text of an OpenAI message: a string, or the text parts of a content-part list joined
    with newlines (vLLM's reading for templates and encoders that take string content)."""
    return "\n".join(_text_parts(message, index))


def _text_parts(message: dict[str, Any], index: int) -> list[str]:
    """The texts of a message's content: one for a string, none for null, one per part of a list
    (parts other than text are a ChatTemplateError: no model served here reads them)."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}].content: expected a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(
                f"messages[{index}].content[{j}]: unsupported part type {kind!r}"
            )
        if not isinstance(text := part.get("text"), str):
            got = "none" if text is None else type(text).__name__
            raise ChatTemplateError(f"messages[{index}].content[{j}].text: expected a string, "
                                    f"got {got}")
        texts.append(text)
    return texts


ContentFormat = Literal["string", "openai"]


def template_content(message: dict[str, Any], index: int, content_format: ContentFormat) -> Any:
    """A message's content as vLLM hands it to a chat template of `content_format`: "string", the
    text (`text_content`); "openai", a list of `{"type": "text", "text": ...}` parts (a string is
    one part, null none), except that a tool message's is its text, since most templates write
    tool results as strings."""
    if content_format == "string" or message.get("role") == "tool":
        return text_content(message, index)
    return [{"type": "text", "text": text} for text in _text_parts(message, index)]


def detect_content_format(template: str) -> ContentFormat:
    """vLLM's detection: "openai" when the template loops over a message's content
    (`{% for part in message['content'] %}`, `message` a loop variable over `messages` or over a
    variable set from it), else "string". A loop inside a macro that is passed the content (GLM's
    `visible_text(m.content)`) is not one, so GLM-5's template reads strings, as in vLLM."""
    try:
        ast = _jinja_env().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = list(ast.find_all(jinja2.nodes.For))
    messages_vars = {"messages"}
    grew = True
    while grew:  # variables set from `messages` (`{% set msgs = messages[1:] %}`), transitively
        grew = False
        for assign in ast.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (isinstance(target, jinja2.nodes.Name) and target.name not in messages_vars
                    and any(_reads(assign.node, v) for v in messages_vars)):
                messages_vars.add(target.name)
                grew = True
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, jinja2.nodes.Name)
                    and any(_reads(loop.iter, v) for v in messages_vars)}
    if any(_reads(loop.iter, v, "content") for loop in loops for v in message_vars):
        return "openai"
    return "string"


def _reads(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """`node` is `var` (or `var[key]` / `var.key`), possibly filtered, tested or sliced; the
    variable under `[key]` is plain, as in vLLM (`(m | f).content` is not `m.content`)."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, var, key)
    if key is None:
        return _is_name(node, var)
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
                and _is_name(node.node, var))
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == key and _is_name(node.node, var)


def _is_name(node: jinja2.nodes.Node, var: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == var


def check_chat_template(template: str) -> None:
    """Raises ChatTemplateError (with the line) when `template` is not valid Jinja."""
    try:
        _jinja_env().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"syntax error at line {e.lineno}: {e}") from e


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """Sandboxed, with the whitespace rules and helpers HF chat templates are written against."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter: its keywords too (GLM's templates render tools with
    `tool | tojson(ensure_ascii=False)`)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class Tokenizer:
    """Text ↔ token ids and chat rendering for one model directory.

    `encode` matches HF `AutoTokenizer` on the same directory: special tokens written in the text
    (e.g. `<|user|>` from a rendered chat template) become their ids; `add_special_tokens` only adds
    what the tokenizer.json post-processor adds (nothing for the tiny tokenizer).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        eos_token: str | None,
        bos_token: str | None,
        chat_template: str | None,
        model_max_length: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.eos_token_id: int | None = self._id_of(eos_token, "eos_token")
        self.bos_token_id: int | None = self._id_of(bos_token, "bos_token")
        self._env = _jinja_env()
        # template text → (compiled, the content format it reads)
        self._compiled: dict[str, tuple[jinja2.Template, ContentFormat]] = {}

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"tokenizer_config.json: {field} {token!r} is not in the vocabulary"
            )
        return token_id

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, optional) from a model directory."""
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(
                f"no tokenizer in {model_dir}: tokenizer.json not found "
                "(only the fast tokenizer format is supported)"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust error type is not exported
            raise TokenizerError(f"{tok_path}: cannot be parsed ({e})") from e
        cfg_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_path}: invalid JSON ({e})") from e
        max_len = config.get("model_max_length")
        return Tokenizer(
            tok,
            eos_token=_token_str(config.get("eos_token"), "eos_token"),
            bos_token=_token_str(config.get("bos_token"), "bos_token"),
            chat_template=_read_chat_template(model_dir, config),
            model_max_length=int(max_len) if isinstance(max_len, int | float) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Entries including added tokens (the model's embedding may be larger, never smaller)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **template_vars: Any,
    ) -> str:
        """Render OpenAI-style messages to prompt text (encode it with add_special_tokens=False).

        `chat_template` overrides the directory's template (the server passes DEFAULT_CHAT_TEMPLATE
        for tokenizers without one). Contents reach the template as vLLM passes them
        (`template_content`), in the format the template reads (`detect_content_format`).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise TokenizerError(
                "tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                "pass chat_template=DEFAULT_CHAT_TEMPLATE to use the built-in one"
            )
        if template not in self._compiled:
            try:
                compiled = self._env.from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"chat_template: syntax error at line {e.lineno}: {e}"
                ) from e
            self._compiled[template] = (compiled, detect_content_format(template))
        compiled, content_format = self._compiled[template]
        normalized = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"messages[{i}]: expected an object with a string 'role'")
            normalized.append({**message,
                               "content": template_content(message, i, content_format)})
        return compiled.render(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_vars,
        )


# ------------------------------------------------------------------------------------------------
# Streaming detokenization
# ------------------------------------------------------------------------------------------------
_REPLACEMENT = "\ufffd"
_PREFIX_WINDOW = 5  # prompt tokens decoded as context (decoders that strip a leading space need it)


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces that never split a UTF-8 character.

    A byte-level BPE token can end in the middle of a multi-byte character; decoding such a
    prefix yields a trailing U+FFFD. Text is therefore released only when the decoded window does
    not end in U+FFFD; `flush` releases whatever is left. Invariant: the pieces returned by `push`
    and `flush`, concatenated, equal `decode(generated ids)` (if the prompt ends on a character
    boundary).

        ids:   ... prompt ... | g0 g1 g2 g3 ...
                   ^prefix_offset   ^read_offset
        prefix_text = decode(ids[prefix_offset:read_offset])   (already released)
        new piece   = decode(ids[prefix_offset:])[len(prefix_text):]
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _PREFIX_WINDOW, 0)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is pending)."""
        self._ids.append(token_id)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        piece = text[len(self._prefix_text):]
        # Slide the window: the released text becomes the context for the next piece.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return piece

    def flush(self) -> str:
        """Release the pending text (incomplete characters become U+FFFD, as `decode` does)."""
        text = self._decode(self._prefix_offset, len(self._ids))
        piece = text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return piece
