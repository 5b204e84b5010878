"""Deterministic synthetic agentic workloads: multi-turn sessions whose prompts grow every turn.

A session is what a coding agent sends. Turn 0 is a system message (system prompt + tool schemas,
the prefix every later turn re-sends) and the task; every later turn re-sends the whole history
plus the previous assistant reply and a tool result. Prompts grow every turn, and all of a prompt
but its newest part is a prefix the server has seen before.

One Workload is written in two forms (`write_workload`):
  (a) `DIR/weka/<session>.json`: the Weka trace format the AgentX harness replays
      (`--custom-dataset-type weka_trace --input-file DIR/weka`);
  (b) `DIR/workload.json`: the same sessions as typed dataclasses with their full text, for the
      in-process replay of dsaserve.bench.agentx (no harness needed).

Token accounting, in content tokens of the generating tokenizer (chat-template tokens excluded);
both forms agree exactly:

    turn 0:  [system+tools][task]                                    in_0 = P + U
    turn 1:  [system+tools][task][reply_0][tool_1]                   in_1 = in_0 + R_0 + X_1
    turn 2:  [system+tools][task][reply_0][tool_1][reply_1][tool_2]  in_2 = in_1 + R_1 + X_2
             |<--- P --->|                      R_k = ceil(out_k / B) * B

Every length is a whole number of B-token blocks (B = block_size): P, U and each tool result X_k
by validation, each reply R_k by rounding the turn's output length up. The replies in the history
are recorded stand-ins, not the server's output, exactly as the harness replays them (it discards
live responses), so every run sends the same prompts. Whole blocks make each turn's Weka
`hash_ids` the previous turn's plus new ids, so the harness's reconstruction (a reply gets
ceil(out / B) blocks, the rest of the new region is user content) only ever appends: it never
truncates or re-sends history.

What the Weka form cannot say: hash ids are scoped per trace (`hash_id_scope: "local"`; the harness
synthesizes each block's text from (trace id, hash id)), so a system prompt shared across sessions
is shared only in the typed form; under the harness each session has its own prefix. The harness
also ignores the trace's `block_size` and always tiles 64-token blocks (agentx-harness 1.0.12
refuses `--isl-block-size` for Weka traces), hence HARNESS_BLOCK_SIZE.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsaserve.config import ConfigError
from dsaserve.tokenizer import Tokenizer

HARNESS_BLOCK_SIZE = 64  # the only block size agentx-harness 1.0.12 tiles Weka traces with
WORKLOAD_FILE = "workload.json"
WEKA_DIR = "weka"
WORKLOAD_FORMAT = "dsaserve-agentic-workload/1"

ROLES = ("system", "user", "assistant")
KINDS = ("prefix", "task", "reply", "tool_result")


# ------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths are content tokens; ranges are inclusive and sampled per turn."""

    num_sessions: int = 4
    num_turns: int = 3
    block_size: int = HARNESS_BLOCK_SIZE
    system_tokens: int = 192  # system prompt; system + tool tokens form the shared prefix
    tool_tokens: int = 64  # tool schemas
    task_tokens: int = 128  # the user's task in turn 0
    tool_result_tokens: tuple[int, int] = (64, 128)  # inserted before every turn after the first
    output_tokens: tuple[int, int] = (16, 32)  # max_completion_tokens, sent with ignore_eos
    think_time_s: tuple[float, float] = (0.5, 2.0)  # client idle time before turns 1..n-1
    shared_prefix: bool = True  # one system + tools text for every session (typed form only)
    seed: int = 0
    model: str = "dsaserve-synthetic"  # the trace's model name (the harness maps it to --model)

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        bs = self.block_size
        if self.system_tokens < 0 or self.tool_tokens < 0:
            raise ConfigError("system_tokens / tool_tokens: must be >= 0")
        prefix = self.system_tokens + self.tool_tokens
        if prefix % bs:
            raise ConfigError(f"system_tokens + tool_tokens: {prefix} is not a multiple of "
                              f"block_size {bs}")
        if self.task_tokens < bs or self.task_tokens % bs:
            raise ConfigError(f"task_tokens: {self.task_tokens} is not a positive multiple of "
                              f"block_size {bs}")
        lo, hi = self.tool_result_tokens
        if not bs <= lo <= hi or lo % bs or hi % bs:
            raise ConfigError(f"tool_result_tokens: ({lo}, {hi}) must be multiples of block_size "
                              f"{bs} with {bs} <= low <= high")
        lo, hi = self.output_tokens
        if not 1 <= lo <= hi:
            raise ConfigError(f"output_tokens: ({lo}, {hi}) must satisfy 1 <= low <= high")
        lo_s, hi_s = self.think_time_s
        if not 0.0 <= lo_s <= hi_s:
            raise ConfigError(f"think_time_s: ({lo_s}, {hi_s}) must satisfy 0 <= low <= high")

    @property
    def prefix_tokens(self) -> int:
        return self.system_tokens + self.tool_tokens


# ------------------------------------------------------------------------------------------------
# The typed form
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    kind: str  # one of KINDS: what the message stands for in the agent loop
    content: str
    num_tokens: int  # len(tokenizer.encode(content)) for the generating tokenizer

    def to_openai(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Turn:
    """One request of a session. Its prompt is the history: every earlier turn's new_messages."""

    index: int
    t_s: float  # dispatch time from session start if the server answered instantly (Weka `t`)
    think_time_s: float  # idle time after the previous turn ends (0 for turn 0)
    new_messages: tuple[Message, ...]  # turn 0: prefix + task; later: previous reply + tool result
    input_tokens: int  # content tokens of the whole prompt (Weka `in`)
    output_tokens: int  # max_completion_tokens (Weka `out`)
    hash_ids: tuple[int, ...]  # the prompt's blocks; a prefix of the next turn's


@dataclass(frozen=True)
class Session:
    id: str
    turns: tuple[Turn, ...]

    def prompt(self, turn_index: int) -> list[dict[str, str]]:
        """The OpenAI `messages` of one turn: all new_messages up to and including that turn."""
        return [m.to_openai() for t in self.turns[: turn_index + 1] for m in t.new_messages]


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    tokenizer: str  # the tokenizer the token counts refer to (as given to `generate`'s caller)
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def to_dict(self) -> dict[str, Any]:
        return {"format": WORKLOAD_FORMAT, **asdict(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Workload:
        if data.get("format") != WORKLOAD_FORMAT:
            raise ValueError(f"format: expected {WORKLOAD_FORMAT!r}, got {data.get('format')!r}")
        raw = dict(data["spec"])
        for name in ("tool_result_tokens", "output_tokens", "think_time_s"):
            raw[name] = tuple(raw[name])
        sessions = tuple(
            Session(id=s["id"], turns=tuple(
                Turn(index=t["index"], t_s=t["t_s"], think_time_s=t["think_time_s"],
                     new_messages=tuple(Message(**m) for m in t["new_messages"]),
                     input_tokens=t["input_tokens"], output_tokens=t["output_tokens"],
                     hash_ids=tuple(t["hash_ids"]))
                for t in s["turns"]))
            for s in data["sessions"]
        )
        return Workload(spec=WorkloadSpec(**raw), tokenizer=data["tokenizer"], sessions=sessions)


# ------------------------------------------------------------------------------------------------
# Text of an exact token length
# ------------------------------------------------------------------------------------------------
# Lower-case words only: a byte-level BPE splits text into pre-tokens at spaces, so a word with its
# leading space tokenizes the same wherever it stands and the length estimate below is exact.
_WORDS: dict[str, tuple[str, ...]] = {
    "prefix": tuple("""you are a careful coding agent working in a software repository read the
        task plan small steps call one tool at a time and check every result before the next step
        never guess a file path list the directory first keep answers short and state what you
        changed tools read file write file run command search code list directory each tool takes
        a path or a pattern and returns text or an error message""".split()),
    "task": tuple("""please fix the failing test in the parser module the error appears when the
        input file is empty and the line count is zero make the change small and run the tests
        again then explain the cause in two sentences""".split()),
    "reply": tuple("""i will read the file first then run the tests the error comes from the loop
        that reads lines next i open the module and change the check so an empty file returns an
        empty list""".split()),
    "tool_result": tuple("""def parse lines return result for line in text if not line continue
        error index out of range test passed failed assert value equals expected file path module
        import from class self open read write close count zero one two three none true false
        output status exit code""".split()),
}
_WORDS_PER_LINE = 12


class TextSynth:
    """Writes text that one tokenizer encodes to an exact number of tokens.

    Words are drawn from the pool of the message kind; a newline every few words keeps the text
    readable. The length is estimated per word, checked by encoding the whole text once, then
    corrected: whole words are dropped from the end while too long, and a one-token filler word
    (" the" for the tiny tokenizer) is appended while too short. Exact whenever some pool word
    encodes to a single token with its leading space, which holds for English byte-level BPEs.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cost: dict[str, int] = {}
        words = sorted({w for pool in _WORDS.values() for w in pool})
        self._filler = min(words, key=lambda w: (self._piece_cost(" " + w), len(w), w))
        self._filler_exact = self._piece_cost(" " + self._filler) == 1

    def _piece_cost(self, piece: str) -> int:
        if piece not in self._cost:
            self._cost[piece] = len(self._tok.encode(piece))
        return self._cost[piece]

    def count(self, text: str) -> int:
        return len(self._tok.encode(text))

    def text(self, rng: random.Random, kind: str, num_tokens: int) -> tuple[str, int]:
        """(text, its token count); the count equals num_tokens whenever the filler is exact."""
        pool = _WORDS[kind]
        pieces: list[str] = []
        estimate = 0
        while estimate < num_tokens:
            sep = "" if not pieces else "\n" if len(pieces) % _WORDS_PER_LINE == 0 else " "
            pieces.append(sep + rng.choice(pool))
            estimate += self._piece_cost(pieces[-1])
        n = self.count("".join(pieces))
        while n > num_tokens and pieces:
            pieces.pop()
            n = self.count("".join(pieces))
        while n < num_tokens:
            pieces.append(" " + self._filler)
            n = n + 1 if self._filler_exact else self.count("".join(pieces))
        text = "".join(pieces)
        return text, self.count(text)


# ------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------
def round_up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def _rng(spec: WorkloadSpec, *key: object) -> random.Random:
    """An independent stream per purpose: changing one session's draws never moves another's."""
    return random.Random("/".join(str(k) for k in (spec.seed, *key)))


def generate(spec: WorkloadSpec, tokenizer: Tokenizer, tokenizer_name: str = "") -> Workload:
    """Build the workload; the same spec and tokenizer always give the same text and numbers."""
    synth = TextSynth(tokenizer)
    bs = spec.block_size

    def message(role: str, kind: str, num_tokens: int, *key: object) -> Message:
        text, n = synth.text(_rng(spec, *key, kind), kind, num_tokens)
        if n != num_tokens:  # the block accounting (hash_ids, Weka `in`) needs exact lengths
            raise ValueError(f"{kind}: the tokenizer encodes the synthetic text to {n} tokens, "
                             f"not {num_tokens} (it has no one-token word to pad with)")
        return Message(role=role, kind=kind, content=text, num_tokens=n)

    shared = message("system", "prefix", spec.prefix_tokens, "shared") if spec.shared_prefix \
        else None
    sessions: list[Session] = []
    for s in range(spec.num_sessions):
        sid = f"agentic-{spec.seed}-{s:03d}"
        draws = _rng(spec, sid, "lengths")
        prefix = shared or message("system", "prefix", spec.prefix_tokens, sid)
        # Hash ids: the prefix blocks first (the same ids in every trace), then one new id per
        # block in order of first appearance. Invariant: len(hash_ids) * bs == input_tokens.
        hash_ids = list(range(spec.prefix_tokens // bs))
        turns: list[Turn] = []
        t_s = 0.0
        prev_out = 0
        for k in range(spec.num_turns):
            out = draws.randint(*spec.output_tokens)
            if k == 0:
                new = (prefix, message("user", "task", spec.task_tokens, sid, k))
                think = 0.0
            else:
                tool = draws.randrange(spec.tool_result_tokens[0], spec.tool_result_tokens[1] + 1,
                                       bs)
                reply = message("assistant", "reply", round_up(prev_out, bs), sid, k)
                new = (reply, message("user", "tool_result", tool, sid, k))
                think = round(draws.uniform(*spec.think_time_s), 3)
            t_s = round(t_s + think, 3)
            added = sum(m.num_tokens for m in new) if k else new[1].num_tokens
            hash_ids.extend(range(len(hash_ids), len(hash_ids) + added // bs))
            input_tokens = (turns[-1].input_tokens if turns else spec.prefix_tokens) + added
            turns.append(Turn(index=k, t_s=t_s, think_time_s=think, new_messages=new,
                              input_tokens=input_tokens, output_tokens=out,
                              hash_ids=tuple(hash_ids)))
            prev_out = out
        sessions.append(Session(id=sid, turns=tuple(turns)))
    return Workload(spec=spec, tokenizer=tokenizer_name, sessions=tuple(sessions))


# ------------------------------------------------------------------------------------------------
# The Weka form
# ------------------------------------------------------------------------------------------------
def weka_trace(session: Session, spec: WorkloadSpec) -> dict[str, Any]:
    """One session as a Weka trace object (the schema of the harness's WekaTrace).

    `t` accumulates think times only and `api_time` is left out: the harness dispatches turn k at
    `t_k - (t_{k-1} + api_time_{k-1})` after turn k-1 completes, so each turn waits exactly its
    think time, whatever the server's speed. `think_time` carries the same delay for
    `--use-think-time-only`.
    """
    last = len(session.turns) - 1
    requests: list[dict[str, Any]] = []
    for turn in session.turns:
        req: dict[str, Any] = {
            "t": turn.t_s,
            "type": "s",  # a streaming API call
            "model": spec.model,
            "in": turn.input_tokens,
            "out": turn.output_tokens,
            "hash_ids": list(turn.hash_ids),
            "input_types": ["text"] if turn.index == 0 else ["tool_result"],
            "output_types": ["text"] if turn.index == last else ["tool_use"],
            "stop": "end_turn" if turn.index == last else "tool_use",
        }
        if turn.index > 0:
            req["think_time"] = turn.think_time_s
        requests.append(req)
    return {
        "id": session.id,
        "models": [spec.model],
        "block_size": spec.block_size,
        "hash_id_scope": "local",
        "tool_tokens": spec.tool_tokens,
        "system_tokens": spec.system_tokens,
        "requests": requests,
    }


def write_workload(workload: Workload, out_dir: str | Path) -> Path:
    """Write DIR/weka/<session>.json (one trace per session) and DIR/workload.json.

    The Weka directory holds nothing but traces: the harness validates every *.json in it. Files
    are written with fixed formatting, so equal workloads give byte-identical directories.
    """
    out = Path(out_dir)
    weka = out / WEKA_DIR
    weka.mkdir(parents=True, exist_ok=True)
    for old in weka.glob("*.json"):  # a smaller workload written over a larger one
        old.unlink()
    for session in workload.sessions:
        text = json.dumps(weka_trace(session, workload.spec), separators=(",", ":"))
        (weka / f"{session.id}.json").write_text(text + "\n", encoding="utf-8")
    text = json.dumps(workload.to_dict(), indent=1, ensure_ascii=False)
    (out / WORKLOAD_FILE).write_text(text + "\n", encoding="utf-8")
    return out


def load_workload(trace_dir: str | Path) -> Workload:
    """Read the typed form written by `write_workload` (DIR/workload.json)."""
    path = Path(trace_dir) / WORKLOAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--trace: {path} not found (write it with "
                                "`python -m dsaserve.bench.traces DIR`)")
    return Workload.from_dict(json.loads(path.read_text(encoding="utf-8")))


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _range(cast: type, example: str) -> Callable[[str], tuple]:
    """argparse type for 'X' or 'LOW:HIGH' (inclusive), each part parsed by `cast`."""

    def parse(text: str) -> tuple:
        lo, _, hi = text.partition(":")
        try:
            return cast(lo), cast(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {example} or LOW:HIGH, got {text!r}") from None

    return parse


_int_range = _range(int, "N")
_float_range = _range(float, "X")


def _parser() -> argparse.ArgumentParser:
    d = WorkloadSpec()
    p = argparse.ArgumentParser(prog="python -m dsaserve.bench.traces", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="directory to write (weka/*.json and workload.json)")
    p.add_argument("--sessions", type=int, default=d.num_sessions)
    p.add_argument("--turns", type=int, default=d.num_turns)
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per block (the harness only tiles %(default)s)")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--tool-tokens", type=int, default=d.tool_tokens)
    p.add_argument("--task-tokens", type=int, default=d.task_tokens)
    p.add_argument("--tool-result-tokens", type=_int_range, default=d.tool_result_tokens,
                   metavar="LOW:HIGH")
    p.add_argument("--output-tokens", type=_int_range, default=d.output_tokens,
                   metavar="LOW:HIGH")
    p.add_argument("--think-time", type=_float_range, default=d.think_time_s, metavar="LOW:HIGH",
                   help="seconds of client idle time before each turn after the first")
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="give every session its own system prompt + tool schemas")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model-name", default=d.model, help="model name written into the traces")
    p.add_argument("--tokenizer", default="tiny-glm5",
                   help="model directory or preset whose tokenizer counts the tokens "
                        "(default: %(default)s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from dsaserve.engine.args import resolve_model  # deferred: may build a preset (torch)

    try:
        spec = WorkloadSpec(
            num_sessions=args.sessions, num_turns=args.turns, block_size=args.block_size,
            system_tokens=args.system_tokens, tool_tokens=args.tool_tokens,
            task_tokens=args.task_tokens, tool_result_tokens=args.tool_result_tokens,
            output_tokens=args.output_tokens, think_time_s=args.think_time,
            shared_prefix=not args.no_shared_prefix, seed=args.seed, model=args.model_name)
        tokenizer = Tokenizer.from_pretrained(resolve_model(args.tokenizer))
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    workload = generate(spec, tokenizer, tokenizer_name=args.tokenizer)
    out = write_workload(workload, args.out_dir)
    lengths = [t.input_tokens for s in workload.sessions for t in s.turns]
    print(f"wrote {len(workload.sessions)} sessions x {spec.num_turns} turns "
          f"({workload.num_requests} requests, prompts {min(lengths)}..{max(lengths)} tokens) "
          f"to {out}/{WEKA_DIR} and {out}/{WORKLOAD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
