"""logprobs, stop strings and usage against the text returned, over HTTP, on scripted engine
outputs (several tokens per output, as MTP steps give; special tokens; the byte pieces of one
character): a stop string keeps the text, the entries and the usage count of the tokens up to
the one that completes it, as generating one token at a time would (vLLM's behaviour), however
the tokens are grouped in outputs; a streamed entry goes out only with its token's text; and
text_offset is where each token's text starts in the returned text. Checked against brute-force
references built from the tokenizer alone, in both endpoints, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from os.path import commonprefix
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME

from dsaserve.core import RequestOutput, SamplingParams, TokenLogprob
from dsaserve.serve.api import ServerConfig, create_app
from dsaserve.serve.async_engine import AsyncEngine, RequestStream
from dsaserve.tokenizer import Tokenizer


class ScriptedEngine:
    """The module's engine (config, tokenizer, stats) whose requests emit `script`: one
    RequestOutput per inner list of token ids, each token with an entry whose log-probability
    tells its position (−1 − i / 100); the last one ends as `end` says (finish_reason,
    stop_token_id)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.script: list[list[int]] = []
        self.end: tuple[str, int | None] = ("length", None)
        self.aborted: list[str] = []
        self.max_stream_buffer = 1024

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, **_: Any) -> RequestStream:
        stream = RequestStream(request_id, self, asyncio.get_running_loop())  # type: ignore[arg-type]
        n = 0
        for k, ids in enumerate(self.script):
            last = k == len(self.script) - 1
            entries = tuple(TokenLogprob(t, _lp(n + i), ((t, _lp(n + i)),))
                            for i, t in enumerate(ids))
            n += len(ids)
            stream.queue.put_nowait(RequestOutput(
                request_id, tuple(ids), last, self.end[0] if last else None,
                num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=0,
                num_output_tokens=n, logprobs=entries,
                stop_token_id=self.end[1] if last else None))
        return stream

    def _abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _lp(i: int) -> float:
    return -1.0 - i / 100


@pytest.fixture(scope="module")
def scripted(engine: AsyncEngine) -> ScriptedEngine:
    return ScriptedEngine(engine)


@pytest.fixture(autouse=True)
def _ends_on_length(scripted: ScriptedEngine) -> None:
    scripted.end = ("length", None)


@pytest.fixture(scope="module")
def client(scripted: ScriptedEngine):
    app = create_app(scripted, ServerConfig(served_model_name=MODEL_NAME))  # type: ignore[arg-type]
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def tok(engine: AsyncEngine) -> Tokenizer:
    assert engine.tokenizer is not None
    return engine.tokenizer


# ---- the references: the tokenizer alone, one token at a time --------------------------------
def released(tok: Tokenizer, ids: list[int], n: int) -> str:
    """The text after n tokens, one at a time: a trailing U+FFFD (maybe an unfinished character)
    is released with the token after it, or at the end."""
    if n == len(ids):
        return tok.decode(ids)
    return tok.decode(ids[:max(m for m in range(n + 1)
                               if not tok.decode(ids[:m]).endswith("\ufffd"))])


def kept(tok: Tokenizer, ids: list[int], stop: list[str], min_tokens: int = 0
         ) -> tuple[list[int], str, str, str | None]:
    """The tokens a request keeps, its text, finish_reason and stop_reason: generating one token
    at a time, it stops after the first token past min_tokens whose text completes a stop
    string, and its text ends before the stop string that token completed first (of those ending
    at one place, the first listed: vLLM's check_stop_strings). A stop string that the first
    min_tokens tokens complete does not count."""
    floor = len(released(tok, ids, min(min_tokens, len(ids))))
    for n in range(min_tokens + 1, len(ids) + 1):
        text = released(tok, ids, n)
        # (end, list position, start): no stop string that counts was in the text before
        found = [(i + len(s), k, i) for k, s in enumerate(stop)
                 if (i := text.find(s, max(floor - len(s) + 1, 0))) >= 0]
        if found:
            end, k, start = min(found)
            return ids[:n], text[:start], "stop", stop[k]
    return ids, tok.decode(ids), "length", None


def offsets(tok: Tokenizer, ids: list[int], text: str) -> list[int]:
    """Where token i's text starts in `text`: the characters of `text` that the tokens before it
    already decode to (a special token adds none, the bytes of one character share its start)."""
    return [len(commonprefix([tok.decode(ids[:i]), text])) for i in range(len(ids))]


def _body(chat: bool, stop: list[str], stream: bool, min_tokens: int = 0) -> dict[str, Any]:
    if chat:
        body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                "top_logprobs": 1}
    else:
        body = {"prompt": [5, 6, 7], "logprobs": 1}
    body |= {"max_tokens": 64, "stop": stop, "stream": stream}
    if min_tokens:
        body["min_tokens"] = min_tokens
    return body | {"stream_options": {"include_usage": True}} if stream else body


def _request(client: TestClient, chat: bool, stop: list[str], min_tokens: int = 0
             ) -> tuple[str, list[dict], dict]:
    """The whole response's text and entries (chat's content or completions' lists zipped),
    and the response."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = client.post(path, json=_body(chat, stop, stream=False, min_tokens=min_tokens))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if chat:
        return choice["message"]["content"], choice["logprobs"]["content"], r.json()
    lp = choice["logprobs"]
    return choice["text"], [{"token": t, "logprob": v, "text_offset": o} for t, v, o in zip(
        lp["tokens"], lp["token_logprobs"], lp["text_offset"], strict=True)], r.json()


def _stream(client: TestClient, chat: bool, stop: list[str], min_tokens: int = 0
            ) -> tuple[list[tuple[str, list[dict], str | None, str | int | None]], dict]:
    """Each streamed chunk's (text, entries, finish_reason, stop_reason), and the usage chunk's
    usage."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(chat, stop, stream=True, min_tokens=min_tokens)
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines()
                 if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    *chunks, last = (json.loads(line) for line in lines[:-1])
    assert last["choices"] == [] and all(c["usage"] is None for c in chunks)
    out = []
    for c in chunks:
        choice = c["choices"][0]
        lp = choice["logprobs"]
        if chat:
            text, entries = choice["delta"].get("content") or "", (lp or {}).get("content", [])
        else:
            text = choice["text"]
            entries = [] if lp is None else [
                {"token": t, "logprob": v, "text_offset": o} for t, v, o in zip(
                    lp["tokens"], lp["token_logprobs"], lp["text_offset"], strict=True)]
        out.append((text, entries, choice["finish_reason"], choice["stop_reason"]))
    return out, last["usage"]


def _check(client: TestClient, scripted: ScriptedEngine, tok: Tokenizer, chat: bool,
           script: list[list[int]], stop: list[str], min_tokens: int = 0) -> None:
    scripted.script = script
    ids = [t for step in script for t in step]
    want_ids, want_text, want_reason, want_stop = kept(tok, ids, stop, min_tokens)
    if want_stop is None:  # no stop string: the engine's end
        want_reason, want_stop = scripted.end
    text, entries, response = _request(client, chat, stop, min_tokens)
    assert text == want_text and response["choices"][0]["finish_reason"] == want_reason
    assert response["choices"][0]["stop_reason"] == want_stop
    # usage counts the tokens returned: those whose entries are returned
    assert response["usage"]["completion_tokens"] == len(want_ids)
    # exactly the kept tokens' entries, in order (the log-probability tells the position)
    assert [e["logprob"] for e in entries] == [_lp(i) for i in range(len(want_ids))]
    assert [e["token"] for e in entries] == [tok.decode([t], skip_special_tokens=False)
                                             for t in want_ids]
    if not chat:
        assert [e["text_offset"] for e in entries] == offsets(tok, want_ids, text)
    # streamed: the same entries joined; none sent before its token's text (and the text of
    # every token before it) was
    chunks, usage = _stream(client, chat, stop, min_tokens)
    assert "".join(t for t, _, _, _ in chunks) == text
    assert [r for _, _, r, _ in chunks if r is not None] == [want_reason]
    # stop_reason on the finishing chunk alone
    assert [s for _, _, _, s in chunks] == [None] * (len(chunks) - 1) + [want_stop]
    assert usage["completion_tokens"] == len(want_ids)
    assert [e for _, es, _, _ in chunks for e in es] == entries
    released, sent = "", 0
    for piece, es, finish_reason, _ in chunks:
        released += piece
        sent += len(es)
        if finish_reason is None:
            assert released.startswith(tok.decode(want_ids[:sent])), (released, sent)


def _ids(tok: Tokenizer, *pieces: str) -> list[list[int]]:
    return [tok.encode(p) for p in pieces]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("steps", [
    ("the answer is STOP and more",),  # one output: tokens after the stop string
    ("the answer", " is S", "TOP and", " more"),  # the stop string straddles outputs
    ("the answer is S", "T", "O", "P"),  # one token per output at the end
    ("STOP now",),  # at the very start: no text
], ids=["one-output", "straddling", "one-per-output", "at-start"])
def test_a_stop_string_keeps_the_tokens_through_the_one_completing_it(client, scripted, tok,
                                                                     chat, steps) -> None:
    _check(client, scripted, tok, chat, _ids(tok, *steps), ["STOP", "never"])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_held_back_text_that_is_no_stop_string_is_released_with_its_entries(
        client, scripted, tok, chat) -> None:
    _check(client, scripted, tok, chat, _ids(tok, "the S", "T", "AR is", " out"), ["STOP"])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stop", [[], ["fé"], ["y"]], ids=["no-stop", "stop-in-char", "stop"])
def test_special_tokens_and_byte_pieces_in_the_text(client, scripted, tok, chat, stop) -> None:
    """<|user|> (skipped in the text: adds 0 to the offsets), the two byte pieces of "é" in
    separate outputs, a lone byte (U+FFFD in the text) and eos at the end."""
    user, eos = tok.token_to_id("<|user|>"), tok.eos_token_id
    e1, e2 = tok.encode("é")
    script = [tok.encode("x"), [user] + tok.encode(" ca") + [tok.encode("f")[0], e1], [e2],
              tok.encode(" y") + [e1], tok.encode("z") + [eos]]
    _check(client, scripted, tok, chat, script, stop)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stop,want", [
    (["ABCD", "C"], "x AB"),  # "C" completes before "ABCD", which starts first
    (["AB", "B"], "x "),  # both end at one place: the first listed
    (["B", "AB"], "x A"),
])
@pytest.mark.parametrize("one_output", [True, False], ids=["one-output", "one-per-output"])
def test_the_stop_string_completed_first_cuts_the_text(client, scripted, tok, chat, stop, want,
                                                       one_output) -> None:
    """Whether the tokens come in one output (an MTP step) or one per output."""
    ids = tok.encode("x ABCD yz")
    _check(client, scripted, tok, chat, [ids] if one_output else [[t] for t in ids], stop)
    assert _request(client, chat, stop)[0] == want


TEXT = "AB C"  # few characters: stop strings overlap, repeat and straddle tokens often


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(data=st.data(), text=st.text(TEXT, min_size=1, max_size=14))
def test_stop_strings_equal_one_token_at_a_time_for_every_grouping(client, scripted, tok, chat,
                                                                   data, text) -> None:
    """Text, finish_reason, logprob entries and usage, whole and streamed, against the reference
    of one token at a time, for random texts, stop lists (parts of the text or not) and
    groupings of the tokens into outputs."""
    ids = tok.encode(text)
    part = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4)).map(
        lambda a: text[a[0]:a[0] + a[1]])
    stop = data.draw(st.lists(part | st.text(TEXT, min_size=1, max_size=4), min_size=1,
                              max_size=3), "stop")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1)), "cuts")) if len(ids) > 1 \
        else []
    bounds = [0, *cuts, len(ids)]
    script = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    _check(client, scripted, tok, chat, script, stop)


def _generation_tokens(client: TestClient) -> float:
    text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:generation_tokens_total")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_generation_tokens_count_the_engine_s_tokens_usage_those_returned(client, scripted, tok,
                                                                         stream) -> None:
    """vllm:generation_tokens_total counts what the engine generated, as vLLM's does (its
    output processor counts an output's tokens before checking stop strings): an MTP step's
    tokens after a stop string count there, though not in usage."""
    ids = tok.encode("the answer is STOP and more")
    scripted.script = [ids]
    want_ids = kept(tok, ids, ["STOP"])[0]
    assert len(want_ids) < len(ids)
    before = _generation_tokens(client)
    if stream:
        usage = _stream(client, False, ["STOP"])[1]
    else:
        usage = _request(client, False, ["STOP"])[2]["usage"]
    assert usage["completion_tokens"] == len(want_ids)
    assert _generation_tokens(client) - before == len(ids)


# ---- stop_reason and min_tokens (vLLM's) -------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("end", ["stop-string", "stop-token", "eos", "length"])
def test_stop_reason_names_what_ended_the_output(client, scripted, tok, chat, end) -> None:
    """The stop string that cut the text; the stop_token_ids entry the engine stopped on (its
    RequestOutput.stop_token_id); null for EOS and length: on the whole response's choice and
    on the finishing chunk alone (_check), both endpoints."""
    ids = tok.encode("the answer is STOP and more")
    user, eos = tok.token_to_id("<|user|>"), tok.eos_token_id
    script, stop = {
        "stop-string": ([ids[:3], ids[3:]], ["never", "STOP"]),
        "stop-token": ([ids[:3], ids[3:] + [user]], ["never"]),
        "eos": ([ids[:3], ids[3:] + [eos]], ["never"]),
        "length": ([ids[:3], ids[3:]], ["never"]),
    }[end]
    scripted.end = {"stop-token": ("stop", user), "eos": ("stop", None)}.get(end, ("length", None))
    _check(client, scripted, tok, chat, script, stop)
    want = {"stop-string": "STOP", "stop-token": user}.get(end)
    stop_reason = _request(client, chat, stop)[2]["choices"][0]["stop_reason"]
    assert stop_reason == want and type(stop_reason) is type(want)  # a token id stays an int


def _first_completing(tok: Tokenizer, ids: list[int], s: str) -> int:
    """How many tokens it takes for the text to hold `s`."""
    return next(n for n in range(len(ids) + 1) if s in released(tok, ids, n))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("one_output", [True, False], ids=["one-output", "one-per-output"])
def test_a_stop_string_the_first_min_tokens_complete_does_not_end_the_output(
        client, scripted, tok, chat, one_output) -> None:
    """min_tokens = the tokens through the first "STOP": the output goes on to the second; one
    token fewer, and the first "STOP", completed past min_tokens, cuts the text; min_tokens past
    the last token: no stop string counts (the engine ends on length)."""
    ids = tok.encode("STOP then STOP end")
    script = [ids] if one_output else [[t] for t in ids]
    n = _first_completing(tok, ids, "STOP")
    assert 1 < n < len(ids) - 1
    for min_tokens, want in [(n, "STOP then "), (n - 1, ""), (len(ids), "STOP then STOP end")]:
        _check(client, scripted, tok, chat, script, ["STOP"], min_tokens)
        assert _request(client, chat, ["STOP"], min_tokens)[0] == want, min_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(data=st.data(), text=st.text(TEXT, min_size=2, max_size=14))
def test_min_tokens_stop_strings_equal_one_token_at_a_time(client, scripted, tok, chat, data,
                                                           text) -> None:
    """As the test above over random texts, stop lists, groupings and min_tokens: a stop string
    counts only when a token past min_tokens completes it (vLLM's detokenizer)."""
    ids = tok.encode(text)
    stop = data.draw(st.lists(st.text(TEXT, min_size=1, max_size=3), min_size=1, max_size=3),
                     "stop")
    min_tokens = data.draw(st.integers(1, len(ids)), "min_tokens")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1)), "cuts")) if len(ids) > 1 \
        else []
    bounds = [0, *cuts, len(ids)]
    script = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    _check(client, scripted, tok, chat, script, stop, min_tokens)
