"""dsaserve/bench/gaps.py on synthetic Chrome-trace events: the device's idle gaps inside a
window, split into lead / mid / tail, each instant given to the innermost dsaserve frame of the
main thread; the gaps add up to wall − busy."""

from __future__ import annotations

import pytest

from dsaserve.bench import gaps

PID, MAIN, OTHER = 7, 7, 9
STEP = "dsaserve/engine/engine.py(235): step"
LAUNCH = "dsaserve/engine/runner.py(900): _launch"
PREPARE = "/home/u/dsaserve/dsaserve/engine/runner.py(1085): _prepare"  # a full path
BENCH = "dsaserve/bench/profile.py(70): summarize"
ITEM = "<built-in method item of Tensor object at 0x7f10d5290320>"


def py(name: str, ts: float, dur: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "cat": "python_function", "name": name, "pid": PID, "tid": tid,
            "ts": ts, "dur": dur}


def dev(ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "pid": 0, "tid": 7, "ts": ts, "dur": dur}


def trace() -> list[dict]:
    """Window [0, 100) µs (the step frame). Device: [10, 30) ∪ [20, 40) (overlap) as kernels,
    [50, 60) a memcpy, [60, 70) a memset (touching) → busy [10, 40) ∪ [50, 70) = 50 µs;
    gaps: lead [0, 10), mid [40, 50), tail [70, 100).

    Main thread: step [0, 100) > launch [0, 45) > prepare [0, 8) > bench [2, 6) > item [3, 5);
    launch > item [40, 44); nothing below step in [45, 80); step ends at 100 but the frames
    below cover nothing else. Another thread runs dsaserve frames all along (not the main)."""
    return [
        py(STEP, 0, 100), py(LAUNCH, 0, 45), py(PREPARE, 0, 8), py(BENCH, 2, 4), py(ITEM, 3, 2),
        py(ITEM, 40, 4),
        py("dsaserve/serve/api.py(10): loop", 0, 100, tid=OTHER),
        py("threading.py(1000): run", 0, 100, tid=OTHER),
        dev(10, 20), dev(20, 20), dev(50, 10, "gpu_memcpy"), dev(60, 10, "gpu_memset"),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": PID, "tid": MAIN,
         "ts": 9, "dur": 1},
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": MAIN, "args": {}},
    ]


def test_kinds_and_total_is_wall_minus_busy():
    r = gaps.analyze(trace())
    assert r.wall == pytest.approx(100e-6) and r.busy == pytest.approx(50e-6)
    assert r.by_kind == pytest.approx({"lead": 10e-6, "mid": 10e-6, "tail": 30e-6})
    assert r.num_gaps == 3
    assert r.exposed == pytest.approx(r.wall - r.busy)
    assert sum(s for _, s, _ in r.by_function) == pytest.approx(r.wall - r.busy)
    assert sum(s for _, s, _ in r.by_chain) == pytest.approx(r.wall - r.busy)


def test_innermost_dsaserve_frame_wins():
    """Lead [0, 10): prepare [0, 8) (its bench and builtin children count as prepare), then
    launch [8, 10); mid [40, 50): launch [40, 45) (item inside it), step [45, 50); tail
    [70, 100): step."""
    r = gaps.analyze(trace())
    by_function = {f: s for f, s, _ in r.by_function}
    assert by_function == pytest.approx({
        "runner._prepare (engine/runner.py:1085)": 8e-6,
        "runner._launch (engine/runner.py:900)": 7e-6,
        "engine.step (engine/engine.py:235)": 35e-6,
    })
    by_chain = {c: s for c, s, _ in r.by_chain}
    assert by_chain["engine.step > runner._launch > runner._prepare"] == pytest.approx(8e-6)
    assert r.top_chain["runner._launch (engine/runner.py:900)"] == "engine.step > runner._launch"
    # sorted by time, shares of the wall
    assert r.by_function[0][0].startswith("engine.step")
    assert r.by_function[0][2] == pytest.approx(0.35)


def test_no_python_frame_and_non_dsaserve_frames():
    """Window [0, 100) given; main-thread frames only over [0, 20): a torch frame [0, 10)
    with a builtin inside [2, 4); nothing after 20 → "(no python frame)". No device work: the
    whole window is one lead gap."""
    events = [py("torch/cuda/__init__.py(1040): synchronize", 0, 10), py(ITEM, 2, 2),
              py("long_prefill.py(160): prefill", 10, 10)]
    r = gaps.analyze(events, windows=[(0.0, 100.0)])
    assert r.by_kind == pytest.approx({"lead": 100e-6, "mid": 0.0, "tail": 0.0})
    assert r.num_gaps == 1 and r.busy == 0.0
    by_function = {f: s for f, s, _ in r.by_function}
    assert by_function == pytest.approx({
        "__init__.synchronize (torch/cuda/__init__.py:1040)": 8e-6,
        "<built-in method item of Tensor object>": 2e-6,  # the address dropped: one row
        "long_prefill.prefill (long_prefill.py:160)": 10e-6,
        gaps.NO_FRAME: 80e-6,
    })


def test_windows_clip_device_work_and_frames():
    """Two windows [0, 30) and [60, 100); a kernel [20, 70) straddles both; frames outside the
    windows are not counted."""
    events = [py(STEP, 0, 30), py(STEP, 60, 40), py(LAUNCH, 35, 20), dev(20, 50)]
    r = gaps.analyze(events)  # the windows: the steps (no synchronize frames here)
    assert r.wall == pytest.approx(70e-6) and r.busy == pytest.approx(20e-6)
    assert r.by_kind == pytest.approx({"lead": 20e-6, "mid": 0.0, "tail": 30e-6})
    assert {f for f, _, _ in r.by_function} == {"engine.step (engine/engine.py:235)"}


def test_step_windows_extend_to_the_synchronize_after():
    sync = "torch/cuda/__init__.py(1040): synchronize"
    frames = gaps.thread_frames(
        [py(sync, 0, 5), py(STEP, 10, 20), py(sync, 32, 8), py(STEP, 50, 10), py(sync, 61, 4)],
        (PID, MAIN))
    # the sync before the first step is not part of it
    assert gaps.step_windows(frames) == [(10.0, 40.0), (50.0, 65.0)]
    assert gaps.step_windows(frames, contiguous=True) == [(10.0, 65.0)]


def test_main_thread_and_labels():
    assert gaps.main_thread(trace()) == (PID, MAIN)
    # without engine frames: the thread with the most frames
    events = [py("a.py(1): f", 0, 1, tid=OTHER), py("a.py(1): f", 1, 1, tid=OTHER),
              py("a.py(1): f", 0, 1)]
    assert gaps.main_thread(events) == (PID, OTHER)
    assert gaps.dsaserve_module("dsaserve/engine/runner.py") == "engine/runner.py"
    assert gaps.dsaserve_module("/x/dsaserve/dsaserve/kv/pool.py") == "kv/pool.py"
    assert gaps.dsaserve_module("dsaserve/bench/profile.py") is None
    assert gaps.dsaserve_module("/x/dsaserve/benchmarks/long_prefill.py") is None
    assert gaps.dsaserve_module("/x/notdsaserve/engine/runner.py") is None


def test_nesting_rounding_clipped():
    """A child ending a hair after its parent (float rounding) does not outlive it."""
    events = [py(STEP, 0, 10), py(LAUNCH, 2, 8.0001)]
    segments = gaps.stack_segments(gaps.thread_frames(events, (PID, MAIN)), 0.0, 12.0)
    assert segments == [(0.0, 2.0, (STEP,)), (2.0, 10.0, (STEP, LAUNCH)), (10.0, 12.0, ())]


def test_table():
    text = gaps.gaps_table(gaps.analyze(trace()), top=2)
    assert "lead 0.010 ms, mid 0.010 ms, tail 0.030 ms in 3 gaps" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert rows[0] == "| 0.035 | 35.0 % | engine.step (engine/engine.py:235) | engine.step |"
    assert len(rows) == 4  # two functions, two chains


def test_matches_sampling_reference():
    """Random nested frames, kernels and windows on integer µs: the exact attribution equals
    sampling every instant (t + 0.5) and taking the innermost dsaserve frame."""
    import random

    rng = random.Random(0)
    names = [STEP, LAUNCH, PREPARE, BENCH, ITEM, "torch/nn/modules/module.py(1): _call_impl"]

    def nest(lo: int, hi: int, depth: int) -> list[dict]:
        out, t = [], lo
        while depth < 5 and t < hi - 1 and rng.random() < 0.7:
            a = rng.randint(t, hi - 1)
            b = rng.randint(a + 1, hi)
            out += [py(rng.choice(names), a, b - a), *nest(a, b, depth + 1)]
            t = b
        return out

    for _ in range(20):
        events = nest(0, 400, 0)
        events += [dev(a, rng.randint(1, 30)) for a in rng.sample(range(400), 15)]
        cuts = sorted(rng.sample(range(1, 400), 6))
        windows = [(float(a), float(b)) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
        r = gaps.analyze(events, windows=windows, thread=(PID, MAIN))
        busy = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "kernel"]
        frames = [e for e in events if e["cat"] == "python_function"]
        expect: dict[str, float] = {}
        for lo, hi in windows:
            for t in range(int(lo), int(hi)):
                x = t + 0.5
                if any(a <= x < b for a, b in busy):
                    continue
                active = sorted((f for f in frames if f["ts"] <= x < f["ts"] + f["dur"]),
                                key=lambda f: (f["ts"], -f["dur"]))
                function, _ = gaps.attribute(tuple(f["name"] for f in active))
                expect[function] = expect.get(function, 0.0) + 1e-6
        got = {f: s for f, s, _ in r.by_function}
        assert got == pytest.approx(expect)
        assert r.exposed == pytest.approx(sum(expect.values()))
