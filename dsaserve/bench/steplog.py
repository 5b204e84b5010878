"""The engine's step log (--step-log, engine/step_log.py) summarised as benchmarks/decode.py's
table: decode-only steps grouped by (batch, MTP, graph, async), each group's median step wall
time (the interval between steps' results) against the median GPU time of its forward, and
tokens per step and per second for one user.

    python -m dsaserve.bench.steplog steps.jsonl

Steps with prefill rows are left out (a decode table), and so is the first step of a log (it
has no interval). "graph" is the target forward replayed from a CUDA graph: the step that
captures a size's graph runs eager and counts under "no". The GPU column is the forward's
stream time between CUDA events: for an eager forward it includes the GPU's waits for the
host's launches, so its wall / forward ratio reads lower than wall / kernels; off CUDA it is
unknown (–).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepRow:
    batch: int  # requests in the step
    mtp: bool  # the step verified drafts
    graph: bool
    async_: bool
    num_steps: int
    wall_ms: float  # median interval between steps' results
    gpu_forward_ms: float | None  # median GPU forward time (None: not measured)
    tokens_per_step: float  # mean tokens emitted per sampling request per step

    @property
    def tokens_per_s_user(self) -> float:
        return self.tokens_per_step / (self.wall_ms / 1e3)


def read(path: Path) -> list[dict[str, Any]]:
    """The log's lines, in order."""
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()]


def summarise(lines: list[dict[str, Any]]) -> list[StepRow]:
    """Decode-only steps with an interval, grouped; rows ordered by their key."""
    groups: dict[tuple[int, bool, bool, bool], list[dict[str, Any]]] = {}
    for line in lines:
        if line["num_prefill_rows"] or line["interval_ms"] is None or not line["num_sampled"]:
            continue
        key = (line["num_reqs"], line["num_drafts"] > 0, line["graph"], line["async"])
        groups.setdefault(key, []).append(line)
    rows = []
    for (batch, mtp, graph, async_), steps in sorted(groups.items()):
        gpu = [s["gpu_forward_ms"] for s in steps if s["gpu_forward_ms"] is not None]
        rows.append(StepRow(
            batch, mtp, graph, async_, len(steps),
            wall_ms=statistics.median(s["interval_ms"] for s in steps),
            gpu_forward_ms=statistics.median(gpu) if gpu else None,
            tokens_per_step=statistics.fmean(s["num_sampled"] / s["num_sampling_reqs"]
                                             for s in steps)))
    return rows


def table(rows: list[StepRow], title: str) -> list[str]:
    """A markdown table, benchmarks/decode.py's columns as far as the log has them."""
    lines = [title, "",
             "| batch | MTP | graph | async | steps | step wall (ms) | GPU forward (ms) | "
             "wall / forward | tokens / step / user | tokens/s/user |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    for r in rows:
        gpu = "–" if r.gpu_forward_ms is None else f"{r.gpu_forward_ms:.3f}"
        ratio = ("–" if not r.gpu_forward_ms else f"{r.wall_ms / r.gpu_forward_ms:.2f}")
        lines.append(f"| {r.batch} | {yes(r.mtp)} | {yes(r.graph)} | {yes(r.async_)} | "
                     f"{r.num_steps} | {r.wall_ms:.2f} | {gpu} | {ratio} | "
                     f"{r.tokens_per_step:.2f} | {r.tokens_per_s_user:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", type=Path, help="a file written by --step-log")
    args = p.parse_args(argv)
    lines = read(args.log)
    print("\n".join(table(summarise(lines), f"{args.log}: {len(lines)} steps")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
