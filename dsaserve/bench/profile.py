"""What a torch.profiler trace of some engine steps says, for the benchmarks that time steps
(benchmarks/long_prefill.py, prefill_host.py, decode.py): kernels by category, the time the
device was busy (the union of its kernels' intervals), the kernels launched, the host's CPU
time outside synchronisation calls, and the host-side operators that took it.

On a CPU (no device activity) the "kernels" are the top-level CPU operators, classified by the
same rules.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
from collections import Counter
from dataclasses import dataclass, field

from torch.autograd import DeviceType

# Kernel (or CPU operator) name → category; first match wins, so specific rules come first.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("workspace dequant", r"dequantize_pages"),
    ("top-k", r"topk|threshold_kernel|compact_kernel|finish_kernel|merge_best|radix|sort"),
    ("indexer logits", r"indexer_logits|indexer_gluon|_logits_kernel"),
    # (not "pingpong": PyTorch's grouped GEMM is a CUTLASS Pingpong kernel)
    ("sparse MLA", r"sparse_mla|mla_work|position_slots|merge_splits"),
    ("norms + rotary", r"norm|rotary|rope|rms|silu|softmax"),
    ("copies", r"memcpy|memset|copy|cat|index_select|gather|scatter|index_put|fill|"
               r"write_mla|write_index|index_cache|mla_cache"),
    # (W8A8's activation quantization with its GEMMs: the path's cost, as its tables count it)
    ("MoE + GEMMs", r"gemm|xmma|cutlass|nvjet|cublas|matmul|\bmm\b|addmm|bmm|linear|"
                    r"aten::mm|einsum|grouped|moe|expert|w8a8|act_quant"),
)
ORDER = [name for name, _ in CATEGORIES] + ["other"]
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]
_SYNC = re.compile(r"cuda(Device|Stream|Event)Synchronize|cudaMemcpy$", re.IGNORECASE)


# GEMM libraries' kernels, by the start of their names: their template arguments may name
# anything (a CUTLASS grouped GEMM's epilogue holds a "...Copy..." type, which the copies rule
# would take: 3.6 ms of a 16-layer step's experts were once counted as copies)
_GEMM_LIBRARY = re.compile(r"^(_ZN\d+|void )?(cutlass|nvjet|cublas|sm90_xmma)", re.IGNORECASE)


def classify(name: str) -> str:
    """A kernel's (or CPU operator's) category by its name."""
    if _GEMM_LIBRARY.search(name):
        return "MoE + GEMMs"
    return next((cat for cat, rx in _COMPILED if rx.search(name)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals (start, end): time the device was busy."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True)
class Profile:
    """Profiled steps: seconds per category, device-busy seconds, host CPU seconds (wall less
    synchronisation calls), kernels launched, and CPU seconds per top-level host operator
    (aten ops and the runtime's launch calls, by name)."""

    by_category: dict[str, float]
    busy: float
    host_cpu: float
    kernels: int = 0
    host_ops: Counter[str] = field(default_factory=Counter)


def summarize(events, wall: float, on_device: bool) -> Profile:
    """torch.profiler events of steps that took `wall` seconds (profiled) → Profile. On a
    device: its kernels and copies; on the CPU: top-level operators."""
    by_cat = dict.fromkeys(ORDER, 0.0)
    spans: list[tuple[float, float]] = []
    sync = 0.0
    host: Counter[str] = Counter()
    for e in events:
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
        if on_device and e.device_type != DeviceType.CPU:
            by_cat[classify(e.name)] += end - start
            spans.append((start, end))
            continue
        if e.device_type != DeviceType.CPU or e.cpu_parent is not None:
            continue
        host[e.name] += end - start
        if on_device and _SYNC.search(e.name):
            sync += end - start
        elif not on_device:
            by_cat[classify(e.name)] += end - start
            spans.append((start, end))
    return Profile(by_cat, union_length(spans), max(wall - sync, 0.0), len(spans), host)


def cprofile_top(profiler: cProfile.Profile, lines: int = 30, focus: str | None = None) -> str:
    """A cProfile run's functions by cumulative time, then by their own time, `lines` each,
    then those whose file or name matches the regex `focus` whatever their rank (the part a
    benchmark is about can fall below the top lines on a slower host), then who called its
    waits and sleeps (a wait says little without its caller); the benchmarks' `--profile` of
    host work (pd_e2e.py, hisparse_engine.py, pd_overlap.py)."""
    buf = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(lines)
    if focus is not None:
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(focus)
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_callers(
        r"\(wait\)|\(_wait\)|sleep|acquire")
    return "\n".join(x for x in buf.getvalue().splitlines() if x.strip())
