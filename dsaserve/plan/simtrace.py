"""Agentic sessions for the simulator, read from Weka traces (the format the AgentX harness
replays, written by `dsaserve.bench.traces`), with token ids made up the way the harness makes
up text: one deterministic run of tokens per (trace, hash id) block, so turns that share hash
ids share tokens and the engines' prefix caches see exactly the reuse the trace describes.

    hash_ids   [ 0 | 1 | 2 | 3 ]  [ 0 | 1 | 2 | 3 | 4 | 5 ]      turn k, turn k+1 of one trace
    tokens     [ b0| b1| b2| b3]  [ b0| b1| b2| b3| b4| b5]      b_h = block_tokens(trace, h)

`hash_id_scope: "local"` (dsaserve's traces, and the harness's reading of any trace) keys blocks
by trace; "global" shares equal hash ids across traces.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from dsaserve.config import ConfigError


@dataclass(frozen=True)
class TraceTurn:
    input_tokens: int  # prompt length (Weka `in`)
    output_tokens: int  # tokens generated (Weka `out`; the harness sends ignore_eos)
    hash_ids: tuple[int, ...]
    think_time_s: float  # idle time after the previous turn ends (0 for the first)


@dataclass(frozen=True)
class TraceSession:
    id: str
    block_size: int  # tokens per hash id
    scope: str  # "local" | "global"
    turns: tuple[TraceTurn, ...]

    def prompt(self, turn: int, vocab_size: int) -> list[int]:
        """Turn `turn`'s prompt token ids: its blocks' tokens, cut or padded to `in` tokens."""
        t = self.turns[turn]
        key = self.id if self.scope == "local" else ""
        ids: list[int] = []
        for h in t.hash_ids:
            ids += block_tokens(key, h, self.block_size, vocab_size)
            if len(ids) >= t.input_tokens:
                break
        if len(ids) < t.input_tokens:  # a trace whose `in` outruns its hash ids: fresh tokens
            ids += block_tokens(key, -1 - turn, t.input_tokens - len(ids), vocab_size)
        return ids[: t.input_tokens]

    @property
    def longest(self) -> int:
        """The longest context of the session (prompt + output of its last turn)."""
        return max((t.input_tokens + t.output_tokens for t in self.turns), default=0)


def block_tokens(key: str, hash_id: int, n: int, vocab_size: int) -> list[int]:
    """n token ids for block `hash_id` of trace `key`: a run from a hashed start, so distinct
    blocks differ and equal blocks are equal. Token 0 is avoided (often BOS/EOS in presets)."""
    start = zlib.crc32(f"{key}/{hash_id}".encode())
    return [1 + (start + 7919 * i) % (vocab_size - 1) for i in range(n)]


def load_traces(path: str | Path) -> list[TraceSession]:
    """Every `*.json` Weka trace of a directory (or its `weka/` subdirectory), by file name."""
    root = Path(path)
    if (root / "weka").is_dir():
        root = root / "weka"
    files = sorted(root.glob("*.json")) if root.is_dir() else []
    if not files:
        raise ConfigError(f"--workload: no Weka traces (*.json) in {path} (write some with "
                          "`python -m dsaserve.bench.traces DIR`)")
    return [_session(f) for f in files]


def _session(file: Path) -> TraceSession:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        turns = tuple(
            TraceTurn(input_tokens=int(r["in"]), output_tokens=max(1, int(r["out"])),
                      hash_ids=tuple(int(h) for h in r.get("hash_ids", ())),
                      think_time_s=float(r.get("think_time", 0.0)) if i else 0.0)
            for i, r in enumerate(raw["requests"]))
        session = TraceSession(id=str(raw.get("id", file.stem)),
                               block_size=int(raw.get("block_size", 64)),
                               scope=str(raw.get("hash_id_scope", "local")), turns=turns)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--workload: {file} is not a Weka trace ({e!r})") from None
    if not turns or any(t.input_tokens < 1 for t in turns) or session.block_size < 1:
        raise ConfigError(f"--workload: {file}: every request needs in >= 1 and a block size")
    return session
