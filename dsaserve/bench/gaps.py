"""Where a step's exposed host time goes: the device's idle gaps inside the profiled steps,
attributed to the host Python code that was running while the device waited.

Input: the "traceEvents" of a Chrome trace written by
`torch.profiler.profile(..., with_stack=True).export_chrome_trace(path)`. Facts relied on
(torch 2.13):

  - complete events have "ph": "X", "ts" and "dur" in µs on one clock for host and device;
  - device work is "cat" "kernel", "gpu_memcpy" or "gpu_memset" (any pid/tid: a stream);
  - Python frames are "cat" "python_function" on the thread that ran them ("pid"/"tid" the
    process/thread ids), named "<file>(<first line of the def>): <function>", the file trimmed
    of its sys.path / site-packages prefix ("dsaserve/engine/engine.py(235): step", or the
    full path when the package is not under a sys.path entry, e.g. an editable install) or
    "<built-in method item of Tensor object at 0x7f...>"; a thread's frames nest.

      window  |<------------------------------------------------------------>|
      device      [k1====]   [k2==][k3===]            [k4=====]
      gaps    |lead|      |mid|              |--mid--|          |--tail--|

Each instant of a gap goes to the innermost frame of the main thread whose file is in the
dsaserve package outside dsaserve/bench (with its chain of such frames, outer → inner), else to
the innermost Python frame, else to "(no python frame)". Attribution is exact interval
arithmetic over the frames' nesting, not sampling.
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
NO_FRAME = "(no python frame)"
KINDS = ("lead", "mid", "tail")

_FRAME = re.compile(r"^(?P<file>.+?\.py)\((?P<line>\d+)\): (?P<func>.+)$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<built-in method item of Tensor object at 0x..>"
# Top-level names of the dsaserve package: a path's part after its last "dsaserve/" is the
# package's only if it starts with one of them (a checkout named dsaserve/ holds benchmarks/ too).
_PACKAGE_PARTS = frozenset(p.stem for p in Path(__file__).resolve().parents[1].iterdir()
                           if p.name != "__pycache__")

Interval = tuple[float, float]


@dataclass(frozen=True)
class Frame:
    """A python_function event: [start, end) in µs, its name as the trace gives it."""

    start: float
    end: float
    name: str


@dataclass(frozen=True)
class GapResult:
    """The windows' exposed host time. Seconds throughout; `share` is of `wall`. The kinds
    and the attributions each sum to wall − busy."""

    wall: float  # the windows' total length
    busy: float  # the device-busy time inside them (union of device events)
    by_kind: dict[str, float]  # "lead" / "mid" / "tail" → seconds
    num_gaps: int
    by_function: tuple[tuple[str, float, float], ...]  # (innermost function, s, share), desc
    by_chain: tuple[tuple[str, float, float], ...]  # (chain outer > inner, s, share), desc
    top_chain: dict[str, str]  # innermost function → the chain it had most of its time under

    @property
    def exposed(self) -> float:
        return sum(self.by_kind.values())


def dsaserve_module(file: str) -> str | None:
    """A frame's file → its path inside the dsaserve package ("engine/runner.py"), or None
    when it is not the package's or is dsaserve/bench (the benchmark's own harness)."""
    head, sep, rel = file.rpartition("dsaserve/")
    if not sep or (head and not head.endswith("/")):
        return None
    first = rel.split("/", 1)[0].removesuffix(".py")
    return rel if first in _PACKAGE_PARTS and first != "bench" else None


def frame_label(name: str) -> tuple[str, str, bool]:
    """A python_function name → (function label, short label for chains, is dsaserve's).
    "dsaserve/engine/runner.py(1085): _prepare" → ("runner._prepare (engine/runner.py:1085)",
    "runner._prepare", True)."""
    m = _FRAME.match(name)
    if m is None:
        short = _ADDRESS.sub("", name)
        return short, short, False
    rel = dsaserve_module(m["file"])
    if rel is None:
        short = f"{Path(m['file']).stem}.{m['func']}"
        return f"{short} ({m['file']}:{m['line']})", short, False
    short = f"{Path(rel).stem}.{m['func']}"
    return f"{short} ({rel}:{m['line']})", short, True


ENGINE_STEP = r"dsaserve/engine/engine\.py\(\d+\): step$"  # an engine's step frame


def profiled_gaps(run: Callable[[], object], on_device: bool, step: str = ENGINE_STEP,
                  contiguous: bool = False) -> GapResult:
    """run() under torch.profiler with Python stacks (its own run: the stack tracer slows the
    host it watches) → its windows' idle gaps by host function. The windows: each frame
    matching `step`, to the end of the synchronisation after it, or with `contiguous` (steps
    timed back to back, pipelined) one span from the first to the last. On a CPU there is no
    device activity: the whole of every window is gap."""
    import torch  # the analysis itself needs no torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        run()
    events = profiler_events(prof)
    thread = main_thread(events)
    windows = step_windows(thread_frames(events, thread), step=step, contiguous=contiguous)
    return analyze(events, windows, thread)


def profiler_events(prof) -> list[dict]:
    """A finished torch.profiler.profile's complete events, through its Chrome trace (the
    Python frames of `with_stack=True` are in the trace, not in `prof.events()`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return complete(json.loads(path.read_text())["traceEvents"])


def complete(events: list[dict]) -> list[dict]:
    """The trace's complete ("X") events that have a time and a duration."""
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def main_thread(events: list[dict]) -> tuple[object, object] | None:
    """(pid, tid) of the thread that ran the steps: the one whose frames include
    dsaserve/engine/engine.py, else the one with the most frames; None without frames."""
    counts: Counter[tuple[object, object]] = Counter()
    engine: Counter[tuple[object, object]] = Counter()
    for e in events:
        if e.get("cat") == "python_function":
            key = (e.get("pid"), e.get("tid"))
            counts[key] += 1
            engine[key] += "dsaserve/engine/engine.py" in e.get("name", "")
    if not counts:
        return None
    best = engine.most_common(1)[0]
    return best[0] if best[1] else counts.most_common(1)[0][0]


def thread_frames(events: list[dict], thread: tuple[object, object] | None) -> list[Frame]:
    return [Frame(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", ""))
            for e in events if e.get("cat") == "python_function"
            and (e.get("pid"), e.get("tid")) == thread]


def step_windows(frames: list[Frame], step: str = ENGINE_STEP,
                 sync: str = r"\): synchronize$", contiguous: bool = False) -> list[Interval]:
    """The steps' windows (µs): each frame matching `step`, extended to the end of the first
    frame matching `sync` that starts after it and before the next step (the benchmark's
    torch.cuda.synchronize after a step, which its wall includes). `contiguous`: one window
    from the first step's start to the last one's end (a pipelined run times the steps back
    to back)."""
    step_rx, sync_rx = re.compile(step), re.compile(sync)
    steps = sorted((f for f in frames if step_rx.search(f.name)), key=lambda f: f.start)
    syncs = sorted((f for f in frames if sync_rx.search(f.name)), key=lambda f: f.start)
    windows = []
    for i, f in enumerate(steps):
        nxt = steps[i + 1].start if i + 1 < len(steps) else float("inf")
        end = next((s.end for s in syncs if f.end <= s.start < nxt), f.end)
        windows.append((f.start, end))
    if contiguous and windows:
        return [(windows[0][0], windows[-1][1])]
    return windows


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint cover of the intervals (overlapping or touching ones merged)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def idle_gaps(busy: list[Interval], window: Interval) -> list[tuple[str, float, float]]:
    """(kind, start, end) of the window's idle gaps, given the device's disjoint sorted busy
    intervals. A window with no device work is one "lead" gap."""
    lo, hi = window
    inside = [(max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi]
    if not inside:
        return [("lead", lo, hi)] if hi > lo else []
    gaps = [("lead", lo, inside[0][0])]
    gaps += [("mid", a[1], b[0]) for a, b in zip(inside, inside[1:], strict=False)]
    gaps.append(("tail", inside[-1][1], hi))
    return [g for g in gaps if g[2] > g[1]]


def stack_segments(frames: list[Frame], lo: float, hi: float
                   ) -> list[tuple[float, float, tuple[str, ...]]]:
    """Partition [lo, hi) into (start, end, active frame names outer → inner). A child
    running past its parent (rounding) is clipped to it."""
    out: list[tuple[float, float, tuple[str, ...]]] = []
    stack: list[Frame] = []
    cursor = lo

    def advance(to: float) -> None:
        nonlocal cursor
        to = min(to, hi)
        if to > cursor:
            out.append((cursor, to, tuple(f.name for f in stack)))
            cursor = to

    for f in sorted(frames, key=lambda f: (f.start, -f.end)):
        if f.end <= lo or f.start >= hi:
            continue
        while stack and stack[-1].end <= f.start:
            advance(stack[-1].end)  # the segment up to a frame's end is still inside it
            stack.pop()
        advance(f.start)
        end = min(f.end, stack[-1].end) if stack else f.end
        stack.append(Frame(f.start, end, f.name))
    while stack:
        advance(stack[-1].end)
        stack.pop()
    advance(hi)
    return out


def attribute(stack: tuple[str, ...]) -> tuple[str, str]:
    """Active frames → (function, chain): the innermost dsaserve frame and the chain of
    dsaserve frames, else the innermost frame (its own chain), else NO_FRAME."""
    labels = [frame_label(name) for name in stack]
    ours = [lab for lab in labels if lab[2]]
    if ours:
        return ours[-1][0], " > ".join(lab[1] for lab in ours)
    if labels:
        return labels[-1][0], labels[-1][1]
    return NO_FRAME, NO_FRAME


def analyze(events: list[dict], windows: list[Interval] | None = None,
            thread: tuple[object, object] | None = None) -> GapResult:
    """Trace events → the windows' idle gaps and the host code they went to. `windows` in
    the trace's µs (default: the main thread's steps, `step_windows`, else the span of its
    frames); `thread` (pid, tid) (default: `main_thread`)."""
    events = complete(events)
    thread = thread if thread is not None else main_thread(events)
    frames = thread_frames(events, thread)
    if windows is None:
        windows = step_windows(frames) or (
            [(min(f.start for f in frames), max(f.end for f in frames))] if frames else [])
    windows = union(windows)
    busy = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("cat") in DEVICE_CATS])
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_function: Counter[str] = Counter()
    by_chain: Counter[str] = Counter()
    by_pair: Counter[tuple[str, str]] = Counter()
    num_gaps, busy_us, wall_us = 0, 0.0, 0.0
    cache: dict[tuple[str, ...], tuple[str, str]] = {}
    # One pass over the frames for all windows (a long prompt has tens of steps and millions
    # of frames); the windows and their gaps are sorted and disjoint, so one cursor walks them.
    segments = stack_segments(frames, windows[0][0], windows[-1][1]) if windows else []
    ends = [b for _, b in busy]
    j = 0
    for lo, hi in windows:
        wall_us += hi - lo
        first = bisect.bisect_right(ends, lo)  # busy intervals ending after the window starts
        gaps = idle_gaps(busy[first:bisect.bisect_left(ends, hi, lo=first) + 1], (lo, hi))
        busy_us += (hi - lo) - sum(b - a for _, a, b in gaps)
        num_gaps += len(gaps)
        for kind, a, b in gaps:
            by_kind[kind] += b - a
            while j < len(segments) and segments[j][1] <= a:
                j += 1
            k = j  # segments are sorted and disjoint: walk those overlapping [a, b)
            while k < len(segments) and segments[k][0] < b:
                s0, s1, stack = segments[k]
                overlap = min(s1, b) - max(s0, a)
                if overlap > 0:
                    if stack not in cache:
                        cache[stack] = attribute(stack)
                    function, chain = cache[stack]
                    by_function[function] += overlap
                    by_chain[chain] += overlap
                    by_pair[function, chain] += overlap
                k += 1
    wall = wall_us / 1e6

    def ranked(c: Counter[str]) -> tuple[tuple[str, float, float], ...]:
        return tuple((name, us / 1e6, us / 1e6 / wall if wall else 0.0)
                     for name, us in c.most_common())

    top_chain: dict[str, str] = {}
    for (function, chain), _ in by_pair.most_common():
        top_chain.setdefault(function, chain)
    return GapResult(wall, busy_us / 1e6, {k: v / 1e6 for k, v in by_kind.items()}, num_gaps,
                     ranked(by_function), ranked(by_chain), top_chain)


def gaps_table(result: GapResult, top: int) -> str:
    """Markdown: the gap totals by kind, then the `top` innermost dsaserve functions by
    exposed host time, each with its most common chain."""
    r = result
    share = 100 * r.exposed / r.wall if r.wall else 0.0
    lines = [f"exposed host time {1e3 * r.exposed:.3f} ms of {1e3 * r.wall:.3f} ms wall "
             f"({share:.1f} %; GPU busy {1e3 * r.busy:.3f} ms): lead {1e3 * r.by_kind['lead']:.3f}"
             f" ms, mid {1e3 * r.by_kind['mid']:.3f} ms, tail {1e3 * r.by_kind['tail']:.3f} ms "
             f"in {r.num_gaps} gaps", "",
             "| exposed host ms | share of wall | innermost dsaserve function | chain |",
             "|---:|---:|---|---|"]
    for function, seconds, frac in r.by_function[:top]:
        lines.append(f"| {1e3 * seconds:.3f} | {100 * frac:.1f} % | {_cell(function)} | "
                     f"{_cell(r.top_chain.get(function, ''))} |")
    lines += ["", "| exposed host ms | share of wall | chain (dsaserve frames, outer > inner) |",
              "|---:|---:|---|"]
    for chain, seconds, frac in r.by_chain[:top]:
        lines.append(f"| {1e3 * seconds:.3f} | {100 * frac:.1f} % | {_cell(chain)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
