"""The seed's 16-GPU table, simulated: GLM-5.3 on 16 H200s, the reference P/D deployment against
its baselines, on synthetic AgentX-like sessions (dsaserve.bench.traces), with `dsaserve
simulate`'s engine (docs/simulate.md has the table and the comparison).

    python benchmarks/seed_table.py [--sessions 64] [--turns 6] [--concurrency 8,16,32,64]
                                    [--async-scheduling] [--reference-weights fp8-dsaserve]

--async-scheduling runs every engine of every deployment with the engine flag (a step's host
work overlaps the previous step's kernels: `plan/steptime.py`), the reference and the baselines
alike. --reference-weights prices the reference's matrices in another weight mode (default
fp8, W8A8 as vLLM and SGLang run the checkpoints, as the baselines are priced; fp8-dsaserve: as
dsaserve's engine runs them on CUDA, each product on the kernel its rows take).

Prints, per deployment and concurrency, the simulate table; then the seed's four comparisons:
the interactivity ratio at equal throughput (the reference's P90 E2E tok/s/user over each
baseline's, interpolated at the reference's throughput per GPU), the TTFT medians, the
reference's c64 point, and the 1M row (the longest context each deployment holds, and how many
1M-token requests it admits at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Sequence

from dsaserve.bench import traces
from dsaserve.config import ConfigError
from dsaserve.plan.cli import load_model
from dsaserve.plan.costmodel import WEIGHT_DTYPES
from dsaserve.plan.deployment import PDDeployment, parse_deployment
from dsaserve.plan.parts import H200
from dsaserve.plan.simengine import engine_capacity
from dsaserve.plan.simtrace import load_traces
from dsaserve.plan.simulate import SimResult, Simulator
from dsaserve.plan.simulate_cli import render_table

# The seed's configurations and memory budgets (DESIGN §1): prefill PCP8 × DCP8 × EP8 with a
# 512 GiB host KV tier; decode 8 DP ranks with a 48 GiB HiSparse pool and 16 GiB of host KV tier
# each, MTP3 at 2.99. The decode engine's max-model-len bounds what its pool admits (whole
# windows, kv/hisparse/admission.py): 120K tokens lets 48 GiB admit 8 requests per rank (c64).
REFERENCE = ("prefill=pcp8xdcp8xep8 offload=512GiB; decode=dp8xep hisparse host=48GiB "
             "offload=16GiB mtp=3 acceptance=2.99 max-model-len=122880; router=prefix")
BASELINES = (
    "prefill=dp8xep offload=64GiB; decode=dp8xep offload=64GiB; router=prefix",
    "dp2xtp8 router=prefix",
)
ONE_M = 1_048_576


def _workload(directory: str, sessions: int, turns: int) -> None:
    """Coding-agent sessions: a 20K-token shared prefix, tool results of 1-8K tokens, replies
    of 200-800 tokens (prompts from ~21K growing to ~60-70K tokens)."""
    traces.main([directory, "--sessions", str(sessions), "--turns", str(turns),
                  "--system-tokens", "12288", "--tool-tokens", "8192", "--task-tokens", "1024",
                  "--tool-result-tokens", "1024:8192", "--output-tokens", "200:800"])


def with_engine_flag(spec: str, flag: str) -> str:
    """`spec` with `flag` on each of its engines (a P/D spec's prefill= and decode= parts, or
    the one engine of an aggregated spec), not on its router part."""
    parts = [part.strip() for part in spec.split(";")]
    if len(parts) == 1:
        return f"{spec} {flag}"
    return "; ".join(f"{part} {flag}" if part.startswith(("prefill=", "decode=")) else part
                     for part in parts)


def _curve(results: Sequence[SimResult], spec: str) -> list[tuple[float, float]]:
    """(throughput per GPU, P90 E2E interactivity) of `spec`, in order of concurrency."""
    rows = sorted((r for r in results if r.deployment.spec == spec), key=lambda r: r.concurrency)
    return [(s["throughput_per_gpu"], s["p90_e2e_interactivity"])  # type: ignore[misc]
            for s in (r.summary() for r in rows) if s["requests"]]


def _at(curve: list[tuple[float, float]], x: float) -> float | None:
    """The best interactivity the baseline offers at throughput x: the highest of its segments
    (consecutive concurrencies, linear between them) that span x and of its points with at
    least x throughput (running there gives x and more); None above its highest throughput.

    A deployment past its knee can lose throughput as concurrency rises (c64 below c32), and
    its curve then passes x twice: once on the way up, once collapsed. Sorting the points by
    throughput would join the collapsed point to a low-concurrency one and read the baseline's
    interactivity off that made-up segment."""
    best = None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if min(x0, x1) <= x <= max(x0, x1):
            y = max(y0, y1) if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            best = y if best is None else max(best, y)
    for xi, yi in curve:
        if xi >= x:
            best = yi if best is None else max(best, yi)
    return best


def _one_m(spec: str) -> str:
    """Whether each engine of `spec` holds a 1M-token request, and how many at once."""
    _, model = load_model("glm-5.3")
    d = parse_deployment(spec)
    engines = ([d.prefill, d.decode] if isinstance(d, PDDeployment) else [d])
    parts = []
    for e in engines:
        one = dataclasses.replace(e, max_model_len=ONE_M)
        try:
            cap = engine_capacity(model, one, H200)
        except ConfigError:
            cap = None
        longest = engine_capacity(model, dataclasses.replace(e, max_model_len=None), H200)
        if cap is None or cap.max_model_len < ONE_M - 1:
            parts.append(f"longest {min(longest.max_context, model.max_position_embeddings):,}: "
                         "no 1M request")
        else:
            at_once = e.replicas * min(cap.max_num_seqs, cap.kv_blocks * e.block_size
                                       * e.parallel.decode_context_parallel_size // ONE_M)
            parts.append(f"1M: {at_once} at once")
    return " | ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", default="8,16,32,64")
    p.add_argument("--async-scheduling", action="store_true",
                   help="every engine with --async-scheduling (host work under the kernels)")
    p.add_argument("--reference-weights", choices=WEIGHT_DTYPES, default="fp8",
                   help="the reference's weight mode (default %(default)s, as the baselines; "
                        "fp8-dsaserve: as dsaserve's engine runs the FP8 checkpoint)")
    args = p.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    _, model = load_model("glm-5.3")
    reference = REFERENCE
    if args.reference_weights != "fp8":
        reference = with_engine_flag(REFERENCE, f"weights={args.reference_weights}")
    specs = [reference, *BASELINES]
    if args.async_scheduling:
        specs = [with_engine_flag(s, "async-scheduling") for s in specs]
    reference, baselines = specs[0], specs[1:]
    results: list[SimResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        _workload(tmp, args.sessions, args.turns)
        sessions = load_traces(tmp)
        for spec in specs:
            for c in concurrencies:
                print(f"simulating c{c}: {spec}", file=sys.stderr, flush=True)
                results.append(Simulator(model, parse_deployment(spec), H200, sessions,
                                         c).run())
    print(render_table(results))
    ref = _curve(results, reference)
    print("## Interactivity at equal throughput (reference P90 E2E tok/s/user / baseline's)")
    for base in baselines:
        curve = _curve(results, base)
        ratios = [(x, y / b) for x, y in ref if (b := _at(curve, x))]
        text = ", ".join(f"{r:.2f}x at {x:,.0f} tok/s/GPU" for x, r in ratios)
        print(f"- vs {base}: {text or 'no overlap in throughput'}")
    print("## TTFT medians (s) by concurrency")
    for spec in specs:
        rows = [r for r in results if r.deployment.spec == spec]
        medians = ", ".join(f"c{r.concurrency} {r.summary()['ttft_median']:.2f}" for r in rows)
        print(f"- {spec}: {medians}")
    top = [r for r in results if r.deployment.spec == reference][-1].summary()
    print(f"## The reference at c{concurrencies[-1]}: {top['throughput_per_gpu']:,.0f} logical "
          f"tok/s/GPU at {top['p90_e2e_interactivity']:.1f} tok/s/user (P90 E2E), "
          f"{top['p90_interactivity']:.1f} (P90 ITL)")
    print("## The 1M row (per engine: the longest context, or 1M requests admitted at once)")
    for spec in specs:
        print(f"- {spec}: {_one_m(spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
