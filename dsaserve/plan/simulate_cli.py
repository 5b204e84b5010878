"""`dsaserve simulate`: AgentX-style replays of a deployment on a simulated clock (simulate.py).

    dsaserve simulate --workload TRACE_DIR --deployment 'dp8xep router=prefix' \
        --deployment 'tp8' --concurrency 8,16,32 [--model glm-5.3] [--gpu h200] \
        [--parts FILE] [--duration S] [--json] [--plot FILE]

One row per (deployment, concurrency): AgentX's headline numbers (throughput per GPU, P90
interactivity, P90 E2E-normalised interactivity, TTFT), the prefix-cache hit rate, the part of
the step that bounds it, and the longest context a replica can hold. docs/simulate.md says what
is measured and what is assumed. --parts FILE takes the kernel rates measured on another GPU
(`benchmarks/kernels.py --parts FILE` on it) in place of --gpu's; the figures the file lacks
stay --gpu's (stderr names them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from tqdm import tqdm

from dsaserve.config import ConfigError
from dsaserve.plan.cli import _positive_float
from dsaserve.plan.deployment import Deployment, parse_deployment
from dsaserve.plan.hardware import GIB
from dsaserve.plan.hosttime import H200_HOST
from dsaserve.plan.parts import H200, Curve, Measured, Parts
from dsaserve.plan.simtrace import load_traces
from dsaserve.plan.simulate import SimResult, Simulator

PARTS = {"h200": H200}
COLUMNS = (  # (summary key, header, format)
    ("concurrency", "c", "{}"),
    ("requests", "reqs", "{}"),
    ("rejected", "rej", "{}"),
    ("throughput_per_gpu", "tok/s/GPU", "{:,.0f}"),
    ("output_per_gpu", "out tok/s/GPU", "{:,.1f}"),
    ("p90_interactivity", "P90 tok/s/user", "{:.1f}"),
    ("p90_e2e_interactivity", "P90 E2E tok/s/user", "{:.1f}"),
    ("ttft_median", "TTFT med s", "{:.3f}"),
    ("ttft_p90", "TTFT P90 s", "{:.3f}"),
    ("cache_hit_rate", "hit rate", "{:.1%}"),
    ("host_hit_rate", "from host", "{:.1%}"),
    ("acceptance_length", "MTP accept", "{:.2f}"),
    ("kv_transfer_median", "KV xfer med s", "{:.3f}"),
    ("bottleneck", "bound", "{}"),
    ("max_context", "max ctx", "{:,}"),
)


def _concurrencies(text: str) -> tuple[int, ...]:
    """Positive integers joined by ',' (argparse names the flag)."""
    from dsaserve.plan.cli import _positive_int

    return tuple(_positive_int(v) for v in text.split(","))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="simulate a deployment on agentic traces",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True,
                   help="a directory of Weka traces (python -m dsaserve.bench.traces writes one)")
    p.add_argument("--deployment", action="append", required=True,
                   help="a layout and options, e.g. 'dp8xep router=prefix' (repeatable)")
    p.add_argument("--model", default="glm-5.3",
                   help="a preset (glm-5.3, deepseek-v3.2, tiny-glm5, tiny-dsv32) or a config.json")
    p.add_argument("--gpu", default="h200", choices=sorted(PARTS))
    p.add_argument("--parts", default=None, metavar="FILE",
                   help="kernel rates measured on your GPU (benchmarks/kernels.py --parts FILE) "
                        "in place of --gpu's")
    p.add_argument("--hbm-gib", type=_positive_float, default=None,
                   help="GPU memory to plan with (default: the GPU's)")
    p.add_argument("--concurrency", type=_concurrencies, default=(8,),
                   help="session slots, e.g. 8,16,32 (default: 8)")
    p.add_argument("--duration", type=_positive_float, default=None,
                   help="stop starting turns after S simulated seconds (default: whole workload)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="write interactivity against throughput per GPU as a PNG")
    p.set_defaults(func=run)


def simulate_all(args: argparse.Namespace) -> tuple[list[SimResult], Parts]:
    from dsaserve.plan.cli import load_model  # the same --model resolution as `plan`

    _, model = load_model(args.model)
    parts = PARTS[args.gpu]
    if args.parts is not None:
        base, parts = parts, Parts.load(args.parts, parts)
        print(f"parts from {args.parts} ({parts.name}); {base.name}'s: "
              f"{', '.join(parts.kept(base)) or 'none'}", file=sys.stderr)
    if args.hbm_gib is not None:
        parts = dataclasses.replace(parts, hbm_bytes=int(args.hbm_gib * GIB))
    deployments = [parse_deployment(spec) for spec in args.deployment]
    sessions = load_traces(args.workload)
    runs = [(d, c) for d in deployments for c in args.concurrency]
    results = []
    for d, c in tqdm(runs, desc="simulate", unit="run", file=sys.stderr, disable=len(runs) < 2):
        results.append(Simulator(model, d, parts, sessions, c, args.duration).run())
    return results, parts


def render_table(results: list[SimResult]) -> str:
    lines = []
    for spec in dict.fromkeys(r.deployment.spec for r in results):
        rows = [r for r in results if r.deployment.spec == spec]
        gpus = rows[0].deployment.num_gpus
        engines = ", ".join(
            f"{'' if name == 'engine' else name + ': '}{e.kv_blocks:,} KV blocks"
            + (f", {e.max_num_seqs} seqs" if e.max_num_seqs != _default_seqs(rows[0], name)
               else "")
            for name, e in rows[0].engines.items())
        lines.append(f"{spec}  ({gpus} GPUs; per replica {engines})")
        table = [[h for _, h, _ in COLUMNS]]
        for r in rows:
            s = {"concurrency": r.concurrency, **r.summary()}
            table.append([fmt.format(s[k]) if k in s else "-" for k, _, fmt in COLUMNS])
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
        for row in table:
            lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths,
                                                                           strict=True)))
        for r in rows:
            for session, turn, why in r.rejected[:3]:
                lines.append(f"  c{r.concurrency}: {session} turn {turn} rejected: {why}")
        lines.append("")
    return "\n".join(lines)


def _default_seqs(result: SimResult, engine: str) -> int:
    """The spec's max-num-seqs for `engine` (the header names admission that lowered it)."""
    d = result.deployment
    spec = d if isinstance(d, Deployment) else getattr(d, engine)
    return spec.max_num_seqs


def render_json(results: list[SimResult], parts: Parts) -> str:
    def figure(v: Measured | Curve) -> dict[str, Any]:
        return dataclasses.asdict(v)

    out = {
        "parts": {k: figure(v) for k, v in parts.figures().items()},
        "host_time": H200_HOST.figures(),
        "runs": [{"deployment": r.deployment.spec, "gpus": r.deployment.num_gpus,
                  "concurrency": r.concurrency,
                  "engines": {name: {"kv_blocks": e.kv_blocks, "max_num_seqs": e.max_num_seqs,
                                     "max_context": e.max_context,
                                     "busy_seconds": dataclasses.asdict(e.busy)}
                              for name, e in r.engines.items()},
                  **r.summary()} for r in results],
    }
    return json.dumps(out, indent=1) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        results, parts = simulate_all(args)
        if args.plot:
            from dsaserve.plan.plot import plot_interactivity  # matplotlib only when asked

            try:
                plot_interactivity(results, args.plot)
            except OSError as e:
                raise ConfigError(f"--plot {args.plot}: {e.strerror or e}") from None
    except ConfigError as e:
        print(f"dsaserve simulate: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_json(results, parts) if args.json else render_table(results))
    return 0
